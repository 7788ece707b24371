"""The README and docs/: the CLI reference is what `--help` prints, every relative link and image
resolves (a #anchor to a heading of its page), and the README keeps the commands CI runs."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

from markdown_it import MarkdownIt

from .conftest import REPO

README = REPO / "README.md"
_HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


def pages() -> list[Path]:
    return [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation but hyphens and underscores
    dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (a repeated heading's later ones get -1, -2, ...)."""
    tokens = MarkdownIt().parse(page.read_text(encoding="utf-8"))
    found: set[str] = set()
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            text = "".join(child.content for child in tokens[i + 1].children or [] if child.type in ("text", "code_inline"))
            base, n = slug(text), 0
            name = base
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(page: Path) -> list[str]:
    """Every link and image target of a page: Markdown's, and those of inline HTML."""
    targets = []
    for token in MarkdownIt().parse(page.read_text(encoding="utf-8")):
        for child in [token, *(token.children or [])]:
            if child.type == "link_open":
                targets.append(child.attrs["href"])
            elif child.type == "image":
                targets.append(child.attrs["src"])
            elif child.type in ("html_inline", "html_block"):
                targets += _HTML_LINK.findall(child.content)
    return targets


def broken_links(page: Path, root: Path) -> list[str]:
    """The relative links of `page` that name no file or folder under `root`, or no heading of their page."""
    broken = []
    for target in links(page):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc:
            continue  # a web address: not checked offline
        path = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if not path.exists() or root.resolve() not in path.parents and path != root.resolve():
            broken.append(f"{page.name}: {target} (no such file)")
        elif parts.fragment and path.suffix == ".md" and parts.fragment not in anchors(path):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def test_the_cli_reference_is_what_help_prints_now():
    result = subprocess.run([sys.executable, str(REPO / "docs" / "make_cli.py"), "--check"], capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_with_other_library_versions_the_check_compares_the_words():
    """A fresh machine may get newer typer or rich, which draw the same help otherwise: the check
    then passes on the same words in other boxes and wrapping, and still fails on a changed word."""
    spec = importlib.util.spec_from_file_location("make_cli", REPO / "docs" / "make_cli.py")
    make_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_cli)
    page = ("Rendered with typer 0.29.2, rich 15.0.0, click 8.5.1.\n\n```text\n"
            "╭─ Review ──────────────────────────────────────╮\n"
            "│ --batch   <int range>  Clause questions run     │\n"
            "│                        together. [default: 16] │\n"
            "╰───────────────────────────────────────────────╯\n```\n")
    newer = ("Rendered with typer 0.30.0, rich 15.1.0, click 8.5.1.\n\n```text\n"
             "+- Review -------------------------------------------------+\n"
             "| --batch  INTEGER RANGE  Clause questions run together.    |\n"
             "|                         [default: 16]                     |\n```\n")
    assert make_cli.check(page, page) is None
    assert make_cli.check(page, newer.replace("INTEGER RANGE", "<integer range>")) is None
    assert make_cli.check(page, newer) is not None  # a label written as words is a change of words
    assert make_cli.check(page, newer.replace("<integer range>", "").replace("16]", "8]")) is not None
    same_versions = page.replace("run     │\n│                        together.", "run together.")
    assert make_cli.check(page, same_versions) is not None  # the same versions: the same text exactly


def test_the_cli_reference_covers_every_command():
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for command in ("kvpage review", "kvpage ask", "kvpage info", "kvpage cache ls", "kvpage cache rm",
                    "kvpage cache clear"):
        assert f"## `{command}`" in text
        assert f"Usage: {command} [OPTIONS]" in text
    assert "\x1b[" not in text  # no colour codes
    assert all(len(line) <= 100 for line in text.splitlines() if line.startswith((" ", "│", "╭", "╰")))


def test_every_relative_link_and_image_resolves():
    assert (REPO / "docs").is_dir() and len(pages()) > 5
    broken = [b for page in pages() for b in broken_links(page, REPO)]
    assert broken == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    """The check above can fail: a link to no file and an anchor to no heading are both reported."""
    (tmp_path / "other.md").write_text("# Other page\n\n## The `kvpage ask` command\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-kvpage-ask-command) [gone](missing.md) ![img](pic.svg) "
                    "[bad](other.md#nowhere) [web](https://example.com/x.md) <img src=\"also-missing.png\">\n",
                    encoding="utf-8")
    assert broken_links(page, tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: pic.svg (no such file)",
        "page.md: other.md#nowhere (no such heading)",
        "page.md: also-missing.png (no such file)",
    ]


def test_the_readme_is_short_and_opens_with_the_commands_ci_runs():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300
    for marker in ("<!-- run-command -->", "<!-- test-command -->"):
        at = lines.index(marker)
        assert at < 40, f"{marker} is not on the first screen"
        assert lines[at + 1] == "```sh" and lines[at + 3] == "```", f"{marker} is not followed by a one-line sh fence"
        assert lines[at + 2].startswith("python3 -m venv .venv && ")
    run, test = (lines[lines.index(m) + 2] for m in ("<!-- run-command -->", "<!-- test-command -->"))
    assert run.endswith("kvpage review samples/contract.pdf")
    assert test.endswith("python -m pytest -q")
    # .ci/run takes the line two lines after the test marker
    ci = subprocess.run(["awk", "/<!-- test-command -->/{getline; getline; print; exit}", str(README)],
                        capture_output=True, text=True, check=True)
    assert ci.stdout.strip() == test


def test_the_playbook_page_has_a_row_for_every_key_the_parser_takes():
    """docs/review.md's tables of playbook keys against the key sets in the parser's checks."""
    parser = next(node for node in ast.parse((REPO / "kvpage_cli" / "tasks" / "playbook.py").read_text()).body
                  if isinstance(node, ast.ClassDef) and node.name == "_Parser")
    keys = {element.value for node in ast.walk(parser) if isinstance(node, ast.Set)
            for element in node.elts if isinstance(element, ast.Constant) and isinstance(element.value, str)}
    assert {"format", "terms", "found_by", "needs_with", "not_followed_by", "when"} <= keys  # the sets were found
    rows = re.findall(r"^\| `([^`]+)` \|", (REPO / "docs" / "review.md").read_text(encoding="utf-8"), re.MULTILINE)
    documented = {word for row in rows for word in re.findall(r"\w+", row)}
    assert keys - documented == set()
