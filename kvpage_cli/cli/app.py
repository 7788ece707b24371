"""The `kvpage` command: the Typer app, its commands, and one-line usage errors.

A command module exposes a function decorated with `options.shared_options(...)`; it is added in
`register()`. A group of subcommands is a Typer app added there with `app.add_typer(...)`
(e.g. `kvpage cache ls|rm|clear`).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import typer
from typer.core import TyperGroup

from .. import __version__
from . import ask, cache, find, index, info, review, serve
from .progress import message
from .session import interrupt_said, stderr_console


class KvpageGroup(TyperGroup):
    """Click's usage errors (unknown option, bad value, missing argument) as one line, exit 2."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        interrupt_said()  # a command before this one's (a test's, in one process) says nothing of this one
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = code if isinstance(code, int) else 0
            if code == 130 and not interrupt_said():  # typer's own, for a Ctrl-C before any command
                message(stderr_console(), "interrupted", "stopped before the command began", "bold yellow")
        except typer.TyperException as exc:  # click's errors (vendored by typer)
            if type(exc).__name__ == "NoArgsIsHelpError":
                exc.show()  # `kvpage` alone: the help
            else:
                hint = _help_hint(exc)
                text = exc.format_message() if hasattr(exc, "format_message") else str(exc)
                message(stderr_console(), "error", text + hint, "bold red")
            code = getattr(exc, "exit_code", 2)
        except typer.Abort:
            message(stderr_console(), "interrupted", "aborted", "bold yellow")
            code = 130
        if not standalone_mode:
            return code
        sys.exit(code)


def _help_hint(exc: Exception) -> str:
    ctx = getattr(exc, "ctx", None)
    if ctx is None or getattr(exc, "exit_code", 0) != 2:
        return ""
    return f" (see '{ctx.command_path} --help')"


app = typer.Typer(
    name="kvpage",
    cls=KvpageGroup,
    help="Read very long documents with a small local language model on a paged KV cache.\n\n"
         "`kvpage review FILE` reviews a contract clause by clause; `kvpage ask PATH QUESTION` answers a "
         "question over a file, a repository or stdin, with the lines the answer rests on; `kvpage find PATH "
         "QUESTION` prints those lines without an answer; `kvpage index PATH` indexes a long document ahead of "
         "its questions; `kvpage info` shows what a model costs. Data goes to "
         "stdout; progress, warnings and statistics to stderr. Exit codes: 0 ok, 1 error, 2 usage, "
         "3 `--fail-on` reached, 130 Ctrl-C.",
    rich_markup_mode="markdown",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvpage {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    pass


def register(app: typer.Typer) -> None:
    """Adds every command: one line per command, or per group of subcommands
    (`app.add_typer(cache.app, name="cache")` for `kvpage cache ls|rm|clear`)."""
    app.command("review")(review.review)
    app.command("ask")(ask.ask)
    app.command("find")(find.find)
    app.command("index")(index.index)
    app.command("info")(info.info)
    app.command("serve")(serve.serve)
    app.add_typer(cache.app, name="cache")


register(app)


def main() -> None:
    """The console script `kvpage`."""
    app()
