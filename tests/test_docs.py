"""docs/cli.md is what `--help` prints now."""

from __future__ import annotations

import subprocess
import sys

from .conftest import REPO


def test_the_cli_reference_is_what_help_prints_now():
    result = subprocess.run([sys.executable, str(REPO / "docs" / "make_cli.py"), "--check"], capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_the_cli_reference_covers_every_command():
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for command in ("kvpage review", "kvpage ask", "kvpage info", "kvpage cache ls", "kvpage cache rm",
                    "kvpage cache clear"):
        assert f"## `{command}`" in text
        assert f"Usage: {command} [OPTIONS]" in text
    assert "\x1b[" not in text  # no colour codes
    assert all(len(line) <= 100 for line in text.splitlines() if line.startswith((" ", "│", "╭", "╰")))
