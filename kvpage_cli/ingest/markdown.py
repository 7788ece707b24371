"""Markdown files (.md): the text a reader sees, each block with its source lines.

Parsed with markdown-it-py (CommonMark, tables on). Markup goes and the words stay: emphasis,
links (their text), inline HTML tags (`<span class="header_3" id="1.2">` around a heading: its
words are kept, the tag is not), HTML blocks (their text), entities decoded. Each block (a
heading, a paragraph, a list item's paragraph, a table row) becomes one line of the document's
text, blank lines between paragraphs; an ordered list item keeps its number ("3." before the
item's first line). Headings are marked as such for the clause splitter. A block's span names
its first source line.
"""

from __future__ import annotations

import functools
import html
import os
import re

from kvpage_cli.ingest.document import Document, Span, check_text_size, read_source
from kvpage_cli.ingest.errors import EmptyDocument
from kvpage_cli.ingest.text import decode_text

_TAG = re.compile(r"<[^>]*>")


@functools.cache
def _parser():
    """CommonMark with tables; markdown_it imported on first use, not at every start."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table")


def read_markdown(source: str | os.PathLike | bytes, display: str | None = None) -> Document:
    """A Markdown file (or its bytes) as the text a reader sees, with a span per block."""
    if not display:
        display = "-" if isinstance(source, (bytes, bytearray)) else os.fspath(source)
    data = read_source(source, display)
    markdown, encoding = decode_text(data, display)
    check_text_size(len(markdown), display)
    warnings = [f"{display} is not UTF-8; read it as {encoding} (a guess)"] if encoding is not None else []
    text, spans = _render(markdown, display)
    if not text.strip():
        raise EmptyDocument(display)
    return Document(source=display, kind="text", text=text, spans=spans, warnings=warnings)


def _render(markdown: str, file: str) -> tuple[str, list[Span]]:
    tokens = _parser().parse(markdown)
    parts: list[str] = []
    spans: list[Span] = []
    pos = 0
    numbers: list[str] = []  # the number of each open list item ("" in bullet lists)
    pending = ""  # an ordered item's number, written before its first block
    row: list[str] = []
    row_line = 0

    def add(words: str, line: int, kind: str) -> None:
        nonlocal pos
        words = " ".join(words.split())
        if not words:
            return
        if parts:
            parts.append("\n\n")
            pos += 2
        parts.append(words)
        spans.append(Span(pos, pos + len(words), file, line=line, kind=kind))
        pos += len(words)

    heading = False
    for i, token in enumerate(tokens):
        line = token.map[0] + 1 if token.map else 0
        if token.type == "list_item_open":
            number = f"{token.info}{token.markup}" if token.info else ""
            numbers.append(number)
            pending = number
        elif token.type == "list_item_close":
            numbers.pop()
            pending = ""
        elif token.type == "heading_open":
            heading = True
        elif token.type == "heading_close":
            heading = False
        elif token.type == "inline" and tokens[i - 1].type in ("heading_open", "paragraph_open"):
            words = _inline_text(token)
            if pending:
                words, pending = f"{pending} {words}", ""
            add(words, line or (tokens[i - 1].map[0] + 1 if tokens[i - 1].map else 0), "heading" if heading else "text")
        elif token.type == "inline" and tokens[i - 1].type in ("th_open", "td_open"):
            row.append(_inline_text(token))
        elif token.type == "tr_open":
            row, row_line = [], line
        elif token.type == "tr_close":
            add(" | ".join(cell for cell in row if cell.strip()), row_line, "text")
        elif token.type in ("html_block", "code_block", "fence"):
            content = _html_text(token.content) if token.type == "html_block" else token.content
            for n, piece in enumerate(re.split(r"\n\s*\n", content)):
                add(piece, line, "text")
    return "".join(parts), spans


def _inline_text(token) -> str:
    out = []
    for child in token.children or []:
        if child.type in ("text", "code_inline"):
            out.append(child.content)
        elif child.type in ("softbreak", "hardbreak"):
            out.append(" ")
        elif child.type == "image":
            out.append(child.content)  # its alt text
        elif child.type == "html_inline":
            continue  # a tag: its words are the text tokens around it
    return "".join(out)


def _html_text(content: str) -> str:
    return html.unescape(_TAG.sub(" ", content))
