"""A review as Word comments.

For a DOCX contract: a copy of the file, unchanged but for one comment per finding anchored on the
runs of its quote (a run that a quote starts or ends inside is split in two, both halves keeping
its formatting) and a comment on the title with the key terms. Every other part of the package
(styles, numbering, headers, footers, tracked changes) is written back as it was read.

For any other contract (PDF, text, Markdown): a new DOCX holding the contract's text clause by
clause, with the same comments.
"""

from __future__ import annotations

import copy
import io
import zipfile

import docx
from docx.document import Document as WordDocument
from docx.oxml import OxmlElement
from docx.oxml.ns import qn
from docx.text.paragraph import Paragraph
from docx.text.run import Run
from lxml import etree

from ...ingest import Document
from ...ingest.docx import follow_field
from ..schema import Finding, ReviewResult
from . import FormatError
from .paragraphs import paragraphs
from .quotes import find_all, nth_place
from .wording import by_risk, finding_note, term_value

AUTHOR = "kvpage"
INITIALS = "kv"

_W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
_MC = "http://schemas.openxmlformats.org/markup-compatibility/2006"
_SKIPPED = {qn("w:del"), qn("w:moveFrom"), qn("w:pPr"), qn("w:rPr"), f"{{{_MC}}}AlternateContent"}
_CONTAINERS = {qn("w:ins"), qn("w:moveTo"), qn("w:hyperlink"), qn("w:smartTag"), qn("w:customXml"),
               qn("w:fldSimple"), qn("w:sdtContent"), qn("w:bdo"), qn("w:dir")}


def commented_docx(result: ReviewResult, doc: Document, source: bytes | None = None) -> bytes:
    """The DOCX of `result`: a commented copy of `source` (the DOCX that `doc` was read from), or,
    for a contract of another kind, a new document of its text with the same comments."""
    if doc.kind == "docx":
        if source is None:
            raise FormatError(f"{doc.source}: a commented copy needs the DOCX file itself")
        return _Copy(result, doc, source).write()
    return _NewDocument(result, doc).write()


def check_source(source: bytes, doc: Document) -> None:
    """Raises FormatError, before any review work, when `source` cannot be copied with comments."""
    _open(source, doc.source)


def _open(source: bytes, display: str) -> WordDocument:
    try:
        return docx.Document(io.BytesIO(source))
    except (ValueError, KeyError, zipfile.BadZipFile, etree.XMLSyntaxError) as exc:
        raise FormatError(f"{display} cannot be copied with comments: {_short(exc)}") from None


def comment_text(f: Finding) -> str:
    """A finding's comment: its title line, then its reasons, values and source (one paragraph each)."""
    return "\n".join(finding_note(f))


def summary_text(result: ReviewResult) -> str:
    """The comment on the title: one line of summary, then a line per key term."""
    groups = ", ".join(f"{len(group)} {level}" for level, group in by_risk(result.findings))
    n, clauses = len(result.findings), result.clauses_total
    lines = [f"kvpage review: {n} finding{'s' * (n != 1)}" + (f" ({groups})" if groups else "")
             + f" in {clauses} clause{'s' * (clauses != 1)}; model {result.model}, {result.mode} mode."]
    if not result.complete:
        lines[0] += f" Incomplete: {result.clauses_reviewed} of {result.clauses_total} clauses reviewed."
    lines += [f"{t.label}: {term_value(t)} (clause {t.clause_id})" for t in result.terms]
    return "\n".join(lines)


def _add_comment(word: WordDocument, first: Run, last: Run, text: str) -> None:
    """One comment from `first` to `last` (inclusive); its first paragraph in bold."""
    head, _, rest = text.partition("\n")
    comment = word.add_comment([first, last], text="", author=AUTHOR, initials=INITIALS)
    comment.paragraphs[0].add_run(head).bold = True
    for line in rest.split("\n") if rest else []:
        comment.add_paragraph(line)


# -- a copy of a DOCX ----------------------------------------------------------------------------

class _Copy:
    def __init__(self, result: ReviewResult, doc: Document, source: bytes) -> None:
        self.result = result
        self.doc = doc
        self.word = _open(source, doc.source)
        self.paragraphs = list(self.word.element.iter(qn("w:p")))
        self.body = self.word._body

    def write(self) -> bytes:
        for f in self.result.findings:
            text = comment_text(f)
            anchor = self._anchor(f.start, f.end)
            if anchor is None:  # a quote in a footnote, or not in the runs: on the paragraph it belongs to
                anchor = self._paragraph_anchor(f.start)
                text += f"\nOn the whole paragraph: the quote's words are not in its text here. The quote: {f.quote}"
            if anchor is not None:
                _add_comment(self.word, *anchor, text)
        title = next((s for s in self.doc.spans if s.xml_paragraph is not None), None)
        if title is not None:
            runs = _Runs(self.paragraphs[title.xml_paragraph]).runs()
            if runs:
                _add_comment(self.word, self._run(runs[0]), self._run(runs[-1]), summary_text(self.result))
        out = io.BytesIO()
        self.word.save(out)
        return out.getvalue()

    def _run(self, r) -> Run:
        p = next(r.iterancestors(qn("w:p")))
        return Run(r, Paragraph(p, self.body))

    def _anchor(self, start: int, end: int) -> tuple[Run, Run] | None:
        """The runs from the first to the last character of doc.text[start:end], split where needed;
        None when some part of it cannot be found in its paragraph."""
        pieces = []
        for span in self.doc.locate(start, end):
            lo, hi = max(start, span.start), min(end, span.end)
            if span.xml_paragraph is None or not self.doc.text[lo:hi].strip():
                if self.doc.text[lo:hi].strip():
                    return None
                continue
            found = _Runs(self.paragraphs[span.xml_paragraph]).find(self.doc.text, span, lo, hi)
            if found is None:
                return None
            pieces.append(found)
        if not pieces:
            return None
        # the end is split before the start: splitting the start of the same run keeps the end's run
        last = pieces[-1].split_after()
        first = pieces[0].split_before()
        if len(pieces) == 1 and first is not last and pieces[0].same_run:
            last = first  # start and end in one run: after both splits the quote is the middle run
        return self._run(first), self._run(last)

    def _paragraph_anchor(self, start: int) -> tuple[Run, Run] | None:
        """A whole paragraph for a quote that is in no run of the body: the paragraph the quote
        starts in, else the one its footnote is attached to, else the title."""
        spans = self.doc.locate(start, start + 1)
        candidates = [s.xml_paragraph for s in spans if s.xml_paragraph is not None]
        numbers = {s.paragraph for s in spans if s.paragraph is not None}
        candidates += [s.xml_paragraph for s in self.doc.spans
                       if s.paragraph in numbers and s.xml_paragraph is not None]
        candidates += [s.xml_paragraph for s in self.doc.spans if s.xml_paragraph is not None][:1]
        for index in candidates:
            runs = _Runs(self.paragraphs[index]).runs()
            if runs:
                return self._run(runs[0]), self._run(runs[-1])
        return None


class _Place:
    """Where a quote starts and ends among a paragraph's runs: (run, child, offset) each."""

    def __init__(self, start: tuple, end: tuple) -> None:
        self.start, self.end = start, end
        self.same_run = start[0] is end[0]

    def split_after(self):
        """The run that ends with the quote's last character (split off what follows it)."""
        run, child, offset = self.end
        return _split(run, child, offset + 1 if offset is not None else None, keep="before")

    def split_before(self):
        """The run that starts with the quote's first character (split off what precedes it)."""
        run, child, offset = self.start
        return _split(run, child, offset if offset is not None else 0, keep="after", atomic=offset is None)


class _Runs:
    """The visible text of one w:p (what ingest read from it), character by character, with the
    run and the run child each character is in."""

    def __init__(self, p) -> None:
        self.p = p
        self.chars: list[tuple[str, object, object, int | None]] = []  # (char, w:r, child, offset in w:t)
        self.fields: list[str] = []  # open fields, "code" until their separator, then "result"
        self._walk(p)

    def runs(self) -> list:
        seen = []
        for _, r, _, _ in self.chars:
            if not seen or seen[-1] is not r:
                seen.append(r)
        return seen

    def find(self, text: str, span, lo: int, hi: int) -> _Place | None:
        """Where text[lo:hi] (inside `span`) is among the runs; None where it is not there. What
        ingest put in the span's text around the runs' own (an automatic number such as "2.1" in
        front, " |" after a table cell) is left out."""
        own = "".join(c for c, *_ in self.chars)
        begins, ends = self._own_range(text, span, own)
        lo, hi = max(lo, begins), min(hi, ends)
        part = text[lo:hi]
        if not part.strip():
            return None
        place = nth_place(own, part, len(find_all(text[begins:hi], part)) - 1, len(find_all(text[begins:ends], part)))
        if place is None:
            return None
        a, b = place
        while a < b and self.chars[a][0].isspace():
            a += 1
        while b > a and self.chars[b - 1][0].isspace():
            b -= 1
        if a >= b:
            return None
        return _Place(self.chars[a][1:], self.chars[b - 1][1:])

    @staticmethod
    def _own_range(text: str, span, own: str) -> tuple[int, int]:
        """The part of the span's text that the runs hold: after a list label, before a cell's " |"."""
        begins, ends = span.start, span.end
        if text[begins:ends].endswith(" |"):
            ends -= 2
        head = own.strip()[:48]
        if head:
            found = find_all(text[begins:ends], head)
            if found:
                begins += found[0][0]
        return begins, ends

    def _walk(self, element) -> None:
        for child in element:
            tag = child.tag
            if tag == qn("w:r"):
                self._run(child)
            elif tag == qn("w:sdt"):
                content = child.find(qn("w:sdtContent"))
                if content is not None:
                    self._walk(content)
            elif tag in _CONTAINERS:
                self._walk(child)

    def _run(self, r) -> None:
        for child in r:
            tag = child.tag
            if tag == qn("w:fldChar"):  # a field's code is not shown, its result is (as ingest reads it)
                follow_field(self.fields, child.get(qn("w:fldCharType")))
                continue
            if "code" in self.fields:
                continue
            if tag == qn("w:t"):
                for i, ch in enumerate(child.text or ""):
                    self.chars.append((ch, r, child, i))
            elif tag == qn("w:tab"):
                self.chars.append(("\t", r, child, None))
            elif tag in (qn("w:br"), qn("w:cr")):
                self.chars.append(("\n", r, child, None))
            elif tag == qn("w:noBreakHyphen"):
                self.chars.append(("-", r, child, None))


def _split(run, child, offset: int | None, keep: str, atomic: bool = False):
    """Splits `run` at `offset` characters into `child` (None: after the whole child). Returns the
    part holding the quote: keep="before" the run up to the split, keep="after" the run from it.
    A side with nothing in it is not made: the run itself is returned."""
    children = [c for c in run if c.tag != qn("w:rPr")]
    index = children.index(child)
    is_text = child.tag == qn("w:t")
    length = len(child.text or "") if is_text else 1
    if offset is None:
        offset = length
    if atomic:
        offset = 0
    before_empty = index == 0 and offset == 0
    after_empty = index == len(children) - 1 and offset >= length
    if before_empty or after_empty:
        return run
    tail = OxmlElement("w:r")
    for name, value in run.attrib.items():  # rsid attributes: the same edit session made both halves
        tail.set(name, value)
    props = run.find(qn("w:rPr"))
    if props is not None:
        tail.append(copy.deepcopy(props))
    moved = children[index + 1:]
    if is_text and 0 < offset < length:
        text = child.text
        rest = OxmlElement("w:t")
        rest.text = text[offset:]
        rest.set(qn("xml:space"), "preserve")
        child.text = text[:offset]
        child.set(qn("xml:space"), "preserve")
        tail.append(rest)
    elif offset == 0:
        moved = children[index:]
    for c in moved:
        tail.append(c)  # lxml moves the element
    run.addnext(tail)
    return run if keep == "before" else tail


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


# -- a new DOCX of any contract's text -----------------------------------------------------------

class _NewDocument:
    """The contract's text in Word paragraphs (formats/paragraphs.py: a PDF's wrapped lines joined,
    a text file's line breaks kept), section titles as headings. Runs are cut at every quote's
    ends, so comments anchor exactly."""

    def __init__(self, result: ReviewResult, doc: Document) -> None:
        self.result = result
        self.doc = doc
        self.word = docx.Document()
        self.word.core_properties.title = doc.name
        self.word.core_properties.author = AUTHOR
        self.word.core_properties.comments = "kvpage review"

    def write(self) -> bytes:
        text = self.doc.text
        cuts = {0, len(text)}
        for f in self.result.findings:
            cuts.update((f.start, f.end))
        runs: list[tuple[int, int, Run]] = []  # (start, end, run) in document order
        first: list[Run] = []  # the first paragraph's runs: the summary comment's anchor
        for block in paragraphs(self.doc):
            start, end = block.start, block.end
            paragraph = self.word.add_paragraph(style="Heading 2" if block.heading else None)
            points = sorted(c for c in cuts if start < c < end)
            for a, b in zip([start] + points, points + [end]):
                runs.append((a, b, self._add(paragraph, text[a:b])))
            first = first or list(paragraph.runs)
        for f in self.result.findings:
            inside = [r for a, b, r in runs if a >= f.start and b <= f.end and text[a:b].strip()]
            if inside:
                _add_comment(self.word, inside[0], inside[-1], comment_text(f))
        if first:
            _add_comment(self.word, first[0], first[-1], summary_text(self.result))
        out = io.BytesIO()
        self.word.save(out)
        return out.getvalue()

    def _add(self, paragraph, piece: str) -> Run:
        if self.doc.kind == "pdf":
            return paragraph.add_run(piece.replace("\n", " "))
        lines = piece.split("\n")
        run = paragraph.add_run(lines[0])
        for line in lines[1:]:
            run.add_break()
            run.add_text(line)
        return run
