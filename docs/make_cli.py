"""Writes docs/cli.md: every kvpage command's `--help`, as it prints 100 columns wide, no colour.

    python docs/make_cli.py            # rewrites docs/cli.md
    python docs/make_cli.py --check    # exit 1, with a diff, where docs/cli.md is not what it renders now

Run it after changing a command's docstring or options; tests/test_docs.py runs the check. The help
is rendered in this process with the terminal's settings fixed (`fix_terminal`), so the page does
not depend on the terminal, the colour settings or the KVPAGE_* variables of whoever runs it.

The page names the typer, rich and click versions it was rendered with. Where other versions are
installed (a fresh machine gets the newest), their boxes, wrapping and type labels may differ
while kvpage's help does not, so the check then compares the words of each command's help alone,
less box drawing and `<type>` labels: a changed docstring or option still fails it.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import sys
from importlib.metadata import version
from pathlib import Path

WIDTH = 100
PAGE = Path(__file__).resolve().parent / "cli.md"
LIBRARIES = ("typer", "rich", "click")
_STAMP = re.compile(r"^Rendered with (.+)\.$", re.MULTILINE)
_NOT_WORDS = re.compile(r"[\u2500-\u257f]|<[^<>\n]*>")  # box drawing; typer's type labels ("<int range>")


def fix_terminal() -> None:
    """What the help's look depends on, set before typer and rich are imported: typer reads
    TERMINAL_WIDTH and FORCE_COLOR when it loads, rich reads COLUMNS and NO_COLOR for each console."""
    for name in [n for n in os.environ if n.startswith("KVPAGE_")] + [
            "FORCE_COLOR", "PY_COLORS", "CLICOLOR_FORCE", "GITHUB_ACTIONS", "TTY_COMPATIBLE", "TTY_INTERACTIVE"]:
        os.environ.pop(name, None)
    os.environ.update({"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH), "LINES": "50", "NO_COLOR": "1",
                       "TERM": "dumb", "_TYPER_FORCE_DISABLE_TERMINAL": "1"})
    sys.path.insert(0, str(PAGE.parents[1]))  # this checkout's kvpage_cli, whatever is installed


def stamp() -> str:
    return ", ".join(f"{name} {version(name)}" for name in LIBRARIES)


def command_paths(app) -> list[list[str]]:
    """[], ["review"], ..., ["cache"], ["cache", "ls"], ...: every command and group, in the order
    `kvpage --help` lists them."""
    import typer.main

    paths: list[list[str]] = []

    def walk(command, path: list[str]) -> None:
        paths.append(path)
        if getattr(command, "commands", None) is not None:
            ctx = command.make_context("kvpage", [], resilient_parsing=True)
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), path + [name])

    walk(typer.main.get_command(app), [])
    return paths


def help_text(app, path: list[str]) -> str:
    """What `kvpage PATH --help` prints, its lines' trailing blanks and its blank edges removed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = app([*path, "--help"], prog_name="kvpage", standalone_mode=False)
    if code not in (0, None):
        raise SystemExit(f"kvpage {' '.join(path)} --help exited with {code}")
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")


def render() -> str:
    from kvpage_cli.cli.app import app

    paths = command_paths(app)
    names = [" ".join(["kvpage", *path]) for path in paths]
    parts = [f"""# Command-line reference

Every command's `--help`, as `kvpage` prints it {WIDTH} columns wide without colour. This page is
generated: `python docs/make_cli.py` writes it, and `tests/test_docs.py` fails when it differs
from what the commands print now. To change it, change the command's docstring or options.

Rendered with {stamp()}.
""", "\n".join(f"- [`{name}`](#{name.replace(' ', '-')})" for name in names) + "\n"]
    parts += [f"## `{name}`\n\n```text\n{help_text(app, path)}\n```\n" for name, path in zip(names, paths)]
    return "\n".join(parts)


def words(page: str) -> list[str]:
    """The words of a page, less its stamp, box drawing and type labels: what stays the same when
    only the libraries that draw the help change."""
    return re.findall(r"[A-Za-z0-9][A-Za-z0-9_.]*", _NOT_WORDS.sub(" ", _STAMP.sub("", page)))


def check(current: str, now: str) -> str | None:
    """None where `current` (the page) is what renders `now`, else what differs. With other library
    versions than the page's stamp, only the words are compared."""
    if current == now:
        return None
    stamped = _STAMP.search(current)
    if stamped and stamped.group(1) != _STAMP.search(now).group(1) and words(current) == words(now):
        return None
    diff = difflib.unified_diff(current.splitlines(), now.splitlines(), "docs/cli.md", "--help now", lineterm="", n=1)
    return "\n".join(list(diff)[:80]) + "\ndocs/cli.md is not what --help prints now: run python docs/make_cli.py"


def main(argv: list[str]) -> int:
    if argv[1:] not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        return 2
    fix_terminal()
    now = render()
    if argv[1:] == ["--check"]:
        problem = check(PAGE.read_text(encoding="utf-8") if PAGE.exists() else "", now)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(now, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
