"""A contract's text cut into the paragraphs a reader sees, for the formats that lay it out again
(a new DOCX, the HTML report).

A DOCX's or a text file's lines are its paragraphs already. A PDF's lines are where the page
wrapped them: there a paragraph ends at a clause's start, at a blank line, before a line that
opens with an item mark ("(a)", "2.", "iii)") and after a line clearly shorter than the page's
full lines; the section titles a clause opens with ("4. TERM AND RENEWAL") are headings.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from ...ingest import Document, split_clauses

_ITEM = re.compile(r"^\s*(?:\(?[a-z]{1,2}\)|\(?[ivxlc]{1,5}\)|\(?\d{1,3}(?:\.\d{1,3})*[.)]|[A-Z][.)]"
                   r"|[\u2022\u25cf\u25aa\-*])\s")
_SHORT_LINE = 0.75  # of the page's typical line length: a line that ends its paragraph


@dataclass(frozen=True)
class Paragraph:
    """doc.text[start:end] (no white space at either end); a heading or body text."""

    start: int
    end: int
    heading: bool = False


def paragraphs(doc: Document) -> list[Paragraph]:
    """The document's paragraphs in order; together they hold every word of its text."""
    text = doc.text
    clauses = sorted(split_clauses(doc), key=lambda c: c.start)
    bounds = [(0, clauses[0].start if clauses else len(text), "")] + [(c.start, c.end, c.heading) for c in clauses]
    breaks = _wrap_breaks(doc) if doc.kind == "pdf" else None
    out: list[Paragraph] = []
    for start, end, heading in bounds:
        pos = start
        for a, b in _title_lines(text, start, end, heading):
            out += _blocks(text, pos, a, breaks)
            out += _trimmed(text, a, b, True)
            pos = b
        out += _blocks(text, pos, end, breaks)
    return out


def is_title(line: str) -> bool:
    """A section title line: short, with letters and none of them lower case ("4. TERM AND RENEWAL")."""
    letters = [c for c in line if c.isalpha()]
    return 0 < len(line) <= 80 and len(letters) >= 3 and not any(c.islower() for c in letters)


def _title_lines(text: str, start: int, end: int, heading: str, most: int = 4):
    """The title lines a clause opens with, before the line its own text starts on."""
    for n, m in enumerate(re.finditer(r"[^\n]+", text[start:end])):
        line = m.group().strip()
        if n >= most or (heading and heading in line and line != heading):
            return
        if line and (line == heading or is_title(line)):
            yield start + m.start(), start + m.end()


def _blocks(text: str, start: int, end: int, breaks: set[int] | None) -> list[Paragraph]:
    """Paragraphs of text[start:end]: at blank lines, and for a PDF at the breaks its lines show."""
    cuts = [m.span() for m in re.finditer(r"\n[ \t]*\n\s*", text[start:end])]
    if breaks is not None:
        cuts += [(b - start, b - start + 1) for b in breaks if start < b < end]
    out: list[Paragraph] = []
    pos = start
    for a, b in sorted(cuts):
        if start + a < pos:
            continue
        out += _trimmed(text, pos, start + a, False)
        pos = start + b
    out += _trimmed(text, pos, end, False)
    return out


def _trimmed(text: str, start: int, end: int, heading: bool) -> list[Paragraph]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return [Paragraph(start, end, heading)] if start < end else []


def _wrap_breaks(doc: Document) -> set[int]:
    """Offsets of the line breaks of a PDF's text that end a paragraph (the others are wraps)."""
    text = doc.text
    breaks: set[int] = set()
    for span in doc.spans:
        lines = [(m.start() + span.start, m.end() + span.start)
                 for m in re.finditer(r"[^\n]+", text[span.start:span.end])]
        lengths = [b - a for a, b in lines if b - a > 20]
        full = statistics.median(lengths) if lengths else 0
        for (a, b), nxt in zip(lines, lines[1:]):
            line = text[a:b].rstrip()
            # an item mark after a line that ends a sentence or a list entry ("thirty\n(30) days" wraps)
            item = _ITEM.match(text[nxt[0]:nxt[1]]) and (line.endswith((":", ";", ".")) or
                                                           line.endswith((" and", " or")))
            if len(line) < _SHORT_LINE * full or item or is_title(line) or is_title(text[nxt[0]:nxt[1]].strip()):
                breaks.add(b)
    return breaks
