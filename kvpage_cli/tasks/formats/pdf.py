"""A review as highlights in the PDF itself.

The copy is the original file with an incremental update appended (PDF 32000-1 section 7.5.6):
the original bytes come first, unchanged, so every page keeps its content streams byte for byte;
the update adds one Highlight annotation per finding over its quote's words (a note with the
category, risk, reason and values) and summary pages of key terms and findings at the end.

A quote is highlighted only where its words were found with confidence: matched in the text of
the page's glyphs (pdf_glyphs) at the same occurrence as in the reviewed text, every glyph of
it measured with its font's widths and inside the page. Any other quote is listed on the summary
page with its words, never placed on a guess.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import pypdf
from pypdf import PdfReader, PdfWriter
from pypdf.annotations import Highlight
from pypdf.errors import PdfReadError
from pypdf.generic import ArrayObject, ContentStream, DecodedStreamObject, DictionaryObject, FloatObject, \
    NameObject, TextStringObject

from ...ingest import Document
from ..schema import Finding, ReviewResult
from . import FormatError
from .pdf_glyphs import Font, Glyph, page_glyphs
from .quotes import find_all, nth_place
from .text_pages import Line, font_resources, lay_out
from .wording import (
    by_risk, clauses_note, counts, finding_note, finding_title, one_line, reasons, review_mode, term_source,
    term_value, values_found,
)

AUTHOR = "kvpage"
COLORS = {"high": "ff8a80", "medium": "ffd54f", "low": "90caf9", "none": "d9d9d9"}  # highlighter pens
COLOR_NAMES = {"high": "red", "medium": "amber", "low": "blue", "none": "grey"}
_GAP = 0.12  # of the font size: a gap between glyphs wider than this separates words


@dataclass
class HighlightedPdf:
    """The highlighted copy, and the findings whose quote it could not place (listed on its summary page)."""

    data: bytes
    placed: list[Finding] = field(default_factory=list)
    unplaced: list[Finding] = field(default_factory=list)


@dataclass(frozen=True)
class Placement:
    """A quote's place: per page it is on (0-based index), one quadrilateral per line of it."""

    pages: tuple[tuple[int, tuple[tuple[float, ...], ...]], ...]


def highlighted_pdf(result: ReviewResult, doc: Document, source: bytes) -> HighlightedPdf:
    """A copy of the PDF `doc` was read from (`source`, its bytes) with the review's highlights and
    its summary pages."""
    check_source(source, doc)
    reader = _open(source, doc.source)
    locator = Locator(reader, doc)
    placements = {id(f): locator.place(f.start, f.end) for f in result.findings}
    writer = PdfWriter(reader, incremental=True)
    placed, unplaced = [], []
    for number, f in enumerate(result.findings):
        placement = placements[id(f)]
        if placement is None:
            unplaced.append(f)
            continue
        placed.append(f)
        for part, (index, quads) in enumerate(placement.pages, start=1):
            name = f"kvpage-{number + 1}-{f.clause_id}" + (f"-{part}" if len(placement.pages) > 1 else "")
            writer.add_annotation(index, _highlight(f, quads, name))
    _append_summary(writer, reader, result, placements)
    out = io.BytesIO()
    writer.write(out)
    return HighlightedPdf(out.getvalue(), placed, unplaced)


def check_source(source: bytes, doc: Document) -> None:
    """Raises FormatError, before any review work, when `source` cannot be copied with highlights."""
    if doc.kind != "pdf":
        raise FormatError(f"{doc.source} is not a PDF: highlights need one (use --format docx or html)")
    _open(source, doc.source)
    if Font is None:
        raise FormatError(f"--format pdf needs pypdf 7 (this is pypdf {pypdf.__version__}): pip install 'pypdf>=7'")


def _open(source: bytes, display: str) -> PdfReader:
    try:
        reader = PdfReader(io.BytesIO(source), strict=False)
        if reader.is_encrypted:
            raise FormatError(f"{display} is encrypted: kvpage does not write a highlighted copy of an encrypted "
                              "PDF (its additions would not be encrypted); use --format html or docx")
        return reader
    except (PdfReadError, OSError, ValueError) as exc:
        raise FormatError(f"{display} cannot be copied with highlights: {exc}") from None


class Locator:
    """Finds quotes of the reviewed text on the PDF's pages."""

    def __init__(self, reader: PdfReader, doc: Document) -> None:
        self.reader = reader
        self.doc = doc
        self.pages: dict[int, _PageText] = {}

    def place(self, start: int, end: int) -> Placement | None:
        """Where doc.text[start:end] is on the pages; None unless every part of it was found with confidence."""
        parts = []
        for span in self.doc.locate(start, end):
            lo, hi = max(start, span.start), min(end, span.end)
            part = self.doc.text[lo:hi]
            if not part.strip():
                continue
            if span.page is None or not 0 < span.page <= len(self.reader.pages):
                return None
            page = self._page(span.page - 1)
            quads = page.find(part, len(find_all(self.doc.text[span.start:hi], part)) - 1,
                              len(find_all(self.doc.text[span.start:span.end], part)))
            if quads is None:
                return None
            parts.append((span.page - 1, quads))
        return Placement(tuple(parts)) if parts else None

    def _page(self, index: int) -> _PageText:
        if index not in self.pages:
            page = self.reader.pages[index]
            try:
                glyphs = page_glyphs(page)
            except Exception:  # a content stream pypdf cannot walk: nothing on it is placed
                glyphs = []
            box = page.cropbox
            self.pages[index] = _PageText(glyphs, (float(box.left), float(box.bottom), float(box.right),
                                                   float(box.top)))
        return self.pages[index]


class _PageText:
    """A page's glyphs as text (spaces where words are apart, a line break between lines), each
    character of it knowing its glyph; and the same text with words hyphenated across lines joined."""

    def __init__(self, glyphs: list[Glyph], box: tuple[float, float, float, float]) -> None:
        self.glyphs = glyphs
        self.box = box
        self.texts = [self._text(joined) for joined in (False, True)]

    def _text(self, join_hyphens: bool) -> tuple[str, list[int]]:
        chars: list[str] = []
        where: list[int] = []  # per character: its glyph, or -1 for a space or line break put in
        glyphs = self.glyphs
        joined = False  # the last line ended with a hyphen that was dropped: no line break
        for i, g in enumerate(glyphs):
            if i:
                prev = glyphs[i - 1]
                if g.line != prev.line:
                    if not joined:
                        chars.append("\n")
                        where.append(-1)
                    joined = False
                elif _gap(prev, g) > _GAP * g.size and prev.text.strip() and g.text.strip():
                    chars.append(" ")
                    where.append(-1)
            if join_hyphens and g.text == "-" and _ends_line(glyphs, i):
                joined = True
                continue
            for ch in g.text:
                chars.append(ch)
                where.append(i)
        return "".join(chars), where

    def find(self, part: str, index: int, expected: int) -> tuple[tuple[float, ...], ...] | None:
        """The quadrilaterals of `part`, the `index`-th of its `expected` occurrences on the page."""
        for text, where in self.texts:
            place = nth_place(text, part, index, expected)
            if place is None:
                continue
            chosen = sorted({where[k] for k in range(*place) if where[k] >= 0})
            if chosen and all(self._sure(self.glyphs[i]) for i in chosen):
                return self._quads(chosen)
        return None

    def _sure(self, g: Glyph) -> bool:
        if not g.text.strip():
            return True
        left, bottom, right, top = self.box
        xs, ys = g.quad[0::2], g.quad[1::2]
        inside = min(xs) >= left - 1 and max(xs) <= right + 1 and min(ys) >= bottom - 1 and max(ys) <= top + 1
        return g.measured and inside

    def _quads(self, chosen: list[int]) -> tuple[tuple[float, ...], ...]:
        lines: dict[int, list[Glyph]] = {}
        for i in chosen:
            g = self.glyphs[i]
            if g.text.strip():
                lines.setdefault(g.line, []).append(g)
        quads = []
        for glyphs in lines.values():
            first, last = glyphs[0], glyphs[-1]
            q0, q1 = first.quad, last.quad
            # upper left and lower left of the first glyph, upper right and lower right of the last
            quads.append((q0[0], q0[1], q1[2], q1[3], q0[4], q0[5], q1[6], q1[7]))
        return tuple(quads)


def _gap(a: Glyph, b: Glyph) -> float:
    (x0, y0), (x1, y1) = a.end, b.start
    return ((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5


def _ends_line(glyphs: list[Glyph], i: int) -> bool:
    """Glyph i is the last one of its line, and the next line starts with a lower-case letter."""
    g = glyphs[i]
    rest = glyphs[i + 1:]
    nxt = next((h for h in rest if h.text.strip()), None)
    if nxt is None or nxt.line == g.line:
        return False
    return nxt.text[:1].islower()


def _highlight(f: Finding, quads: tuple[tuple[float, ...], ...], name: str) -> Highlight:
    xs = [v for q in quads for v in q[0::2]]
    ys = [v for q in quads for v in q[1::2]]
    annotation = Highlight(rect=(min(xs) - 1, min(ys) - 1, max(xs) + 1, max(ys) + 1),
                           quad_points=ArrayObject(FloatObject(round(v, 3)) for q in quads for v in q),
                           highlight_color=COLORS.get(f.risk, COLORS["none"]), printing=True)
    annotation[NameObject("/Contents")] = TextStringObject("\n".join(finding_note(f)))
    annotation[NameObject("/T")] = TextStringObject(AUTHOR)
    annotation[NameObject("/Subj")] = TextStringObject(finding_title(f))
    annotation[NameObject("/NM")] = TextStringObject(name)  # unique in the file: finding, clause, part
    return annotation


# -- the summary pages ---------------------------------------------------------------------------

def summary_lines(result: ReviewResult, placements: dict[int, Placement | None]) -> list[Line]:
    """What the summary pages say: the review, the key terms, every finding (with its quote where
    it is not highlighted)."""
    lines = [Line(f"kvpage review: {result.document}", "title"),
             Line(f"{clauses_note(result)}; {counts(result)}; model {result.model}, {review_mode(result)}",
                  space_before=4),
             Line("Each finding's quote is highlighted on its page ("
                  + ", ".join(f"{level} {COLOR_NAMES[level]}" for level in ("high", "medium", "low"))
                  + "); the highlight's note gives the category, risk, reason and values found.")]
    if not result.complete:
        lines.append(Line(f"Incomplete: {result.clauses_reviewed} of {result.clauses_total} clauses were reviewed."))
    if result.terms:
        lines.append(Line("Key terms", "heading", space_before=10))
        for t in result.terms:
            lines.append(Line(f"{t.label}: {term_value(t)} (clause {t.clause_id}, {term_source(t)})", indent=2))
    for level, group in by_risk(result.findings):
        lines.append(Line(f"{level.capitalize()} risk ({len(group)})", "heading", space_before=10))
        for f in group:
            lines.append(Line(f"{f.clause_id} {f.heading} - {f.category or 'no category'} - {f.source}".strip(),
                              indent=2, space_before=3))
            lines += [Line(reason, indent=4) for reason in reasons(f)]
            found = values_found(f)
            if found:
                lines.append(Line("Values found: " + "; ".join(found), indent=4))
            if placements.get(id(f)) is None:
                lines.append(Line(f"Not highlighted: its words could not be located on the page with "
                                  f"confidence. The quote ({f.source}):", indent=4))
                lines.append(Line(one_line(f.quote), "quote", indent=6))
    return lines


def _append_summary(writer: PdfWriter, reader: PdfReader, result: ReviewResult,
                    placements: dict[int, Placement | None]) -> None:
    first = reader.pages[0]
    width, height = float(first.mediabox.width), float(first.mediabox.height)
    if (first.get("/Rotate") or 0) % 180:
        width, height = height, width
    streams, missing = lay_out(summary_lines(result, placements), width, height)
    if missing:
        lines = summary_lines(result, placements) + [
            Line(f"{missing} character(s) that this page's font (Courier, Windows-1252) cannot show are "
                 "printed as ?; the highlights' notes have them all.", space_before=10)]
        streams, missing = lay_out(lines, width, height)
    fonts = font_resources()
    for data in streams:
        page = writer.add_blank_page(width, height)
        page[NameObject("/Resources")] = DictionaryObject({NameObject("/Font"): fonts})
        page.replace_contents(ContentStream(None, None) if not data else _stream(data))


def _stream(data: bytes) -> DecodedStreamObject:
    stream = DecodedStreamObject()
    stream.set_data(data)
    return stream
