"""Writes docs/cli.md: every kvpage command's `--help`, as it prints 100 columns wide, no colour.

    python docs/make_cli.py            # rewrites docs/cli.md
    python docs/make_cli.py --check    # exit 1, with a diff, where docs/cli.md is not what it renders now

Run it after changing a command's docstring or options; tests/test_docs.py runs the check. The help
is rendered in this process with the terminal's settings fixed below, so the page does not depend
on the terminal, the colour settings or the KVPAGE_* variables of whoever runs it.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import sys
from pathlib import Path

WIDTH = 100
PAGE = Path(__file__).resolve().parent / "cli.md"

# Before typer and rich are imported: typer reads TERMINAL_WIDTH and FORCE_COLOR when it loads,
# rich reads COLUMNS and NO_COLOR when a console is made.
for name in [n for n in os.environ if n.startswith("KVPAGE_")] + [
        "FORCE_COLOR", "PY_COLORS", "CLICOLOR_FORCE", "GITHUB_ACTIONS", "TTY_COMPATIBLE", "TTY_INTERACTIVE"]:
    os.environ.pop(name, None)
os.environ.update({"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH), "LINES": "50", "NO_COLOR": "1",
                   "TERM": "dumb", "_TYPER_FORCE_DISABLE_TERMINAL": "1"})
sys.path.insert(0, str(PAGE.parents[1]))  # this checkout's kvpage_cli, whatever is installed

import typer  # noqa: E402
import typer.main  # noqa: E402

from kvpage_cli.cli.app import app  # noqa: E402

HEAD = f"""# Command-line reference

Every command's `--help`, as `kvpage` prints it {WIDTH} columns wide without colour. This page is
generated: `python docs/make_cli.py` writes it, and `tests/test_docs.py` fails when it differs
from what the commands print now. To change it, change the command's docstring or options.
"""


def command_paths() -> list[list[str]]:
    """[], ["review"], ..., ["cache"], ["cache", "ls"], ...: every command and group, in the order
    `kvpage --help` lists them."""
    root = typer.main.get_command(app)
    paths: list[list[str]] = []

    def walk(command, path: list[str]) -> None:
        paths.append(path)
        commands = getattr(command, "commands", None)
        if commands is not None:
            ctx = command.make_context("kvpage", [], resilient_parsing=True)
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), path + [name])

    walk(root, [])
    return paths


def help_text(path: list[str]) -> str:
    """What `kvpage PATH --help` prints, its lines' trailing blanks and its blank edges removed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = app([*path, "--help"], prog_name="kvpage", standalone_mode=False)
    if code not in (0, None):
        raise SystemExit(f"kvpage {' '.join(path)} --help exited with {code}")
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")


def render() -> str:
    parts = [HEAD]
    paths = command_paths()
    parts.append("\n".join(f"- [`{' '.join(['kvpage', *p])}`](#{'-'.join(['kvpage', *p])})" for p in paths) + "\n")
    for path in paths:
        parts.append(f"## `{' '.join(['kvpage', *path])}`\n\n```text\n{help_text(path)}\n```\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current == text:
            return 0
        diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "docs/cli.md", "--help now",
                                    lineterm="", n=1)
        print("\n".join(list(diff)[:80]), file=sys.stderr)
        print("docs/cli.md is not what --help prints now: run python docs/make_cli.py", file=sys.stderr)
        return 1
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
