"""Clauses: a contract's text cut where its own structure says a new provision starts.

The splitter looks for the marks a drafter uses ("ARTICLE IV", "Section 5.", "1.1 Heading.",
"A. HEADING", "(a)", headings in capitals, DOCX heading paragraphs, exhibits, the signature
block), keeps only the numbered marks that form a consistent sequence (so cross references and
page numbers are not taken for sections), and cuts the text at the marks that start a
provision. Sub-clauses stay with their parent unless it grows past `max_chars`.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from kvpage_cli.ingest.document import Document


@dataclass(frozen=True)
class Clause:
    """One provision of a contract: an id as the contract numbers it, a heading and its text."""

    id: str
    heading: str
    text: str
    start: int
    end: int


# ----- what marks look like -----

_SMALL_WORDS = {
    "a", "an", "and", "as", "at", "by", "for", "from", "in", "into", "of", "on", "or", "over",
    "per", "the", "to", "under", "upon", "with", "without", "vs", "vs.", "its", "their", "not",
    "after", "before", "between", "during", "than", "that", "this", "other", "all", "any", "via",
    "de", "no", "be", "is", "are", "certain",
}
_ROMAN = re.compile(r"^(?=[IVXLC])M*(C[MD]|D?C{0,3})(X[CL]|L?X{0,3})(I[XV]|V?I{0,3})$")
_ARTICLE = re.compile(r"^(ARTICLE|Article)\s+([IVXLC]+|\d{1,3})\b\.?:?\s*(.*)$")
_SECTION = re.compile(r"^(SECTION|Section)\s+(\d{1,3}(?:\.\d{1,3}){0,4})\b\.?\s*(.*)$")
_DECIMAL = re.compile(r"^(?:§\s*)?(\d{1,3}(?:\.\d{1,3}){0,4})(\.?)(?:[\s\u00a0]+(.*)|$)")
_LETTER = re.compile(r"^([A-Z])\.\s+(.*)$")
_LOWER_ITEM = re.compile(r"^([a-z]{1,2}|[ivx]{1,5})[.)]\s+(.*)$")
_PAREN = re.compile(r"^\(([a-z]{1,2}|[ivxl]{1,6}|[A-Z]{1,2}|\d{1,2})\)(?:\s+(.*)|$)")
_EXHIBIT = re.compile(
    r"^(EXHIBIT|Exhibit|SCHEDULE|Schedule|ANNEX|Annex|APPENDIX|Appendix|ATTACHMENT|Attachment"
    r"|ADDENDUM|Addendum)\s+(\d{1,3}(?:\.\d{1,3})*|[A-Z](?:-?\d{1,3})?|[IVX]{1,5})(?![\w])"
    r"\s*[:.\-\u2013\u2014]?\s*(.*)$"
)
_WITNESS = re.compile(r"IN\s+WITNESS\s+W\s?HERE\s?OF", re.IGNORECASE)
_SIGNATURE_LINE = re.compile(
    r"^(By:|By\s*_|BY:|Name:|NAME:|Title:|TITLE:|Its:|ITS:|/s/|Signature\b|Print(ed)? Name"
    r"|By\s*$)"
)
# Lines that belong to a signature block but also occur elsewhere (underlines, dates).
_SIGNATURE_EXTRA = re.compile(r"^(Date:|DATE:|Title\s*(\||$)|Date\s*(\||$)|_{5,}|-{5,}|Witness"
                              r"|WITNESS|Attest|ATTEST|Signed\b)")
_SIGNATURE_LEAD = re.compile(
    r"^(By signing|ACCEPTED AND AGREED|AGREED AND ACCEPTED|Accepted and agreed|Agreed and accepted"
    r"|\[Signature|\[SIGNATURE)"
)
_PREAMBLE_HEADINGS = re.compile(
    r"^(RECITALS?|BACKGROUND|PREAMBLE|WITNESSETH|W\s?I\s?T\s?N\s?E\s?S\s?S\s?E\s?T\s?H"
    r"|NOW,? THEREFORE|AGREEMENT|TERMS AND CONDITIONS|STANDARD TERMS)\b",
    re.IGNORECASE,
)
_LIST_TITLE = re.compile(r"^(EXHIBITS|SCHEDULES|ANNEXES|APPENDICES|ATTACHMENTS|Exhibits|Schedules"
                         r"|Annexes|Appendices|Attachments)\b")
_TOC_TITLE = re.compile(r"^(TABLE OF CONTENTS|CONTENTS|INDEX)\b", re.IGNORECASE)
# Whitespace runs are entered only at their first character and never backtracked into: a
# document may hold a run of a million spaces, and a pattern that retries it from every position
# takes hours (the (?<!\s) and possessive \s++ below keep these searches linear).
_PAGE_REF_END = re.compile(r"(?:(?<!\s)\s|\.\s?\.|\u2026)\s*+(\d{1,3}|[ivx]{1,5})\s*$")
_SENTENCE = re.compile(r"[a-z\]\)]{2}\.\s+[A-Z(]")
_DOT_LEADERS = re.compile(r"(?:(?<!\s)\s++)?\.(?:\s*+\.){2,}|\u2026+")
_INLINE_DECIMAL = re.compile(
    r"(?<![\w.,/$%§\-\u2013])(?:(SECTION|Section)\s+)?(\d{1,3}(?:\.\d{1,3}){0,3})(\.?)[ \t\u00a0]++"
    r"(?=[A-Z\"\u201c(\[])"
)
_INLINE_PAREN = re.compile(
    r"(?:(?<=[:;.])|(?<=; and)|(?<=; or)|(?<=, and)|(?<=, or))\s++"
    r"\(([a-z]{1,2}|[ivxl]{1,6}|[A-Z]|\d{1,2})\)\s++(?=\S)"
)
_FIRST_WORD = re.compile(r"\s*+(\S+)")
_HEADING_WINDOW = 1000  # characters after an inline label that may hold its heading
_LINE_START = re.compile(r"\n[ \t]*+(?=\S)")
_REFERENCE_WORDS = {
    "section", "sections", "article", "articles", "clause", "clauses", "paragraph",
    "paragraphs", "schedule", "exhibit", "annex", "appendix", "and", "or", "to", "of", "in",
    "under", "with", "through", "see", "per", "pursuant", "than", "rule", "item", "form",
    "version", "v", "no", "no.", "nos", "number", "page", "pages", "chapter", "part", "title",
    "regulation", "s-k", "usc", "u.s.c.", "cfr", "c.f.r.", "§",
}


# A heading does not end with these: "1.3 Subject to Section 1.4 below" is a sentence.
_DANGLING = {"section", "sections", "article", "articles", "clause", "clauses", "paragraph",
             "paragraphs", "schedule", "exhibit", "annex", "appendix"}


@dataclass
class _Mark:
    """A place in the text where a provision may start."""

    pos: int
    kind: str  # article | decimal | letter | sub | caps | heading | exhibit | signature
    label: str = ""
    number: tuple[int, ...] = ()
    heading: str = ""
    word: str = ""  # "Section" when the label is written with that word
    weight: float = 1.0
    line_start: bool = True
    head_end: int = 0  # where the label and heading end: text after it is the body
    primary: bool = False
    scope: int = 0
    parent: _Mark | None = None  # for the later parts of a provision cut in pieces


@dataclass
class _Line:
    start: int
    end: int
    text: str  # stripped of leading/trailing whitespace
    offset: int  # start of the stripped text in the document


@dataclass
class _Piece:
    start: int
    end: int
    mark: _Mark | None
    parts: list[_Mark] = field(default_factory=list)  # the marks inside it, in no particular order


def split_clauses(doc: Document, max_chars: int = 4000, min_chars: int = 40) -> list[Clause]:
    """Cut a contract into clauses: preamble, numbered sections, signatures, exhibits.

    Ids are the contract's own numbers ("1", "1.1", "5(a)", "IV", "Section 5", "Exhibit A");
    text before the first provision is "preamble", the signature block "signatures", and a
    clause without a number of its own gets a running id ("c12"). A table of contents is left
    out. Clauses are in order, do not overlap, and their text is `doc.text[start:end]`.
    Sub-clauses ((a), (i), 1.1.1) stay with their parent unless the parent would pass
    `max_chars`; fragments shorter than `min_chars` join a neighbour.
    """
    text = doc.text
    if not text.strip():
        return []
    lines = _lines(text)
    heading_lines = _heading_lines(doc, lines)
    marks = _find_marks(text, lines, heading_lines)
    toc = _find_toc(text, lines, marks)
    marks = [m for m in marks if not _inside(m.pos, toc)]
    signatures = _find_signatures(text, lines, marks)
    marks = [m for m in marks if m.kind in ("exhibit", "signature")
             or not any(s < m.pos < e for s, e in signatures)]
    _choose_primary(marks, text)
    pieces = _cut(text, marks, toc)
    pieces = _merge_small(text, pieces, min_chars)
    pieces = _split_large(text, pieces, max_chars)
    return _name(text, pieces)


# ----- lines and marks -----

def _lines(text: str) -> list[_Line]:
    lines = []
    pos = 0
    for raw in text.split("\n"):
        stripped = raw.strip()
        offset = pos + (len(raw) - len(raw.lstrip()))
        lines.append(_Line(pos, pos + len(raw), stripped, offset))
        pos += len(raw) + 1
    return lines


def _heading_lines(doc: Document, lines: list[_Line]) -> set[int]:
    """Indices of lines that the source marks as headings (DOCX heading styles)."""
    starts = [line.offset for line in lines]
    found = set()
    for span in doc.spans:
        if span.kind == "heading" and not span.show_file:
            i = bisect.bisect_right(starts, span.start) - 1
            if i >= 0 and lines[i].offset == span.start:
                found.add(i)
    return found


def _find_marks(text: str, lines: list[_Line], heading_lines: set[int]) -> list[_Mark]:
    marks: list[_Mark] = []
    consumed: set[int] = set()  # lines used as the heading of the line above
    for i, line in enumerate(lines):
        if not line.text or i in consumed:
            continue
        mark = _line_mark(line, lines, i, i in heading_lines)
        if mark is not None and i in heading_lines and mark.kind == "decimal":
            mark.weight += 0.5  # the source itself styles it as a heading
        if mark is not None:
            if mark.kind in ("article", "exhibit") and not mark.heading:
                mark.heading, used = _heading_below(lines, i)
                if used is not None:
                    consumed.update(range(i + 1, used + 1))
                    mark.head_end = lines[used].offset + len(lines[used].text)
            marks.append(mark)
        marks.extend(_inline_marks(line))
    for match in _WITNESS.finditer(text):
        start = match.start()
        line_start = text.rfind("\n", 0, start) + 1
        before = text[max(line_start, start - 3):start]
        if not text[line_start:start].strip() or re.search(r"[.;:)\]]\s*$", before):
            marks.append(_Mark(start, "signature", heading="Signatures", head_end=start))
    marks.sort(key=lambda m: (m.pos, m.kind != "signature"))
    deduped: list[_Mark] = []
    for mark in marks:
        if deduped and deduped[-1].pos == mark.pos:
            continue
        deduped.append(mark)
    return deduped


def _line_mark(line: _Line, lines: list[_Line], i: int, is_heading: bool) -> _Mark | None:
    t = line.text
    pos = line.offset
    end = pos + len(t)
    m = _EXHIBIT.match(t)
    if m and len(t) <= 120 and _after_break(lines, i):
        title = _clean_heading(m.group(3))
        # "Exhibit A, is due upon ..." is a sentence that wrapped, not the start of an exhibit
        if not title or _is_caps(title) or _is_title(title):
            label = f"{m.group(1).capitalize()} {m.group(2)}"
            return _Mark(pos, "exhibit", label=label, heading=title, head_end=end)
    m = _ARTICLE.match(t)
    continues = bool(m and m.group(3)[:1] and (m.group(3)[0].islower() or m.group(3)[0] in "(,"))
    if m and _after_break(lines, i) and not continues:  # not "Article 3 of the Agreement"
        label = m.group(2)
        number = _roman_value(label) if not label.isdigit() else int(label)
        if number:
            heading = _heading_of(m.group(3))
            return _Mark(pos, "article", label=label, number=(number,), heading=heading,
                         head_end=pos + len(t) - len(m.group(3)) + len(heading))
    m = _SECTION.match(t)
    if m and _after_break(lines, i):
        rest = m.group(3)
        if not rest or not (rest[0].islower() or rest[0] in "(,;"):
            number = tuple(int(n) for n in m.group(2).split("."))
            heading = _heading_of(rest)
            return _Mark(pos, "decimal", label=m.group(2), number=number, heading=heading,
                         word="Section", weight=1.5 + (0.5 if heading else 0),
                         head_end=pos + len(t) - len(rest) + len(heading))
    m = _DECIMAL.match(t)
    if m:
        label, dot, rest = m.group(1), m.group(2), m.group(3) or ""
        number = tuple(int(n) for n in label.split("."))
        plausible = number[0] <= 150 and all(n <= 200 for n in number[1:])
        if plausible and (len(number) > 1 or dot) and not _looks_like_quantity(rest):
            heading = _heading_of(rest)
            head_end = pos + len(t) - len(rest) + len(heading)
            if not rest:  # "1." alone, its heading on the next line
                heading, used = _heading_below(lines, i)
                if used is not None:
                    head_end = lines[used].offset + len(lines[used].text)
            return _Mark(pos, "decimal", label=label, number=number, heading=heading,
                         weight=1.0 + (0.5 if heading else 0), head_end=head_end)
    m = _LETTER.match(t)
    if m and not m.group(2).upper().startswith("WHEREAS"):  # lettered recitals stay recitals
        rest = m.group(2)
        heading = _caps_prefix(rest) or _run_in_heading(rest)
        if heading:
            return _Mark(pos, "letter", label=m.group(1), number=(ord(m.group(1)) - 64,),
                         heading=heading, head_end=pos + len(t) - len(rest) + len(heading))
    m = _PAREN.match(t) or _LOWER_ITEM.match(t)
    if m:
        return _Mark(pos, "sub", label=f"({m.group(1)})", head_end=pos)
    if is_heading and _is_short_heading(t):
        return _Mark(pos, "heading", heading=_clean_heading(t), head_end=end)
    if _SIGNATURE_LEAD.match(t):
        return None
    if _is_caps_heading_line(lines, i):
        return _Mark(pos, "caps", heading=_clean_heading(t), head_end=end)
    return None


def _inline_marks(line: _Line) -> list[_Mark]:
    """Numbered provisions that start inside a line (text whose paragraphs were run together)."""
    found = []
    t = line.text
    for match in _INLINE_DECIMAL.finditer(t):
        if match.start() == 0:
            continue
        word, label, dot = match.group(1), match.group(2), match.group(3)
        number = tuple(int(n) for n in label.split("."))
        if len(number) == 1 and not (dot or word):
            continue
        if number[0] > 150 or any(n > 200 for n in number[1:]):
            continue
        last_char, last_word = _before(t, match.start())
        previous_word = last_word.lower()
        if previous_word.strip("(") in _REFERENCE_WORDS:
            continue
        rest = t[match.end():match.end() + _HEADING_WINDOW]  # not the rest of a megabyte line for each match
        if _looks_like_quantity(rest):
            continue
        heading = _heading_of(rest)
        if last_char in ".;:!?)]\"\u201d":
            weight = 0.8
        elif _is_caps(previous_word.upper()) and previous_word.upper() == last_word:
            weight = 0.6  # "GOVERNANCE 3.1 Joint Steering Committee."
        elif heading and previous_word[:1].isalpha():
            weight = 0.5  # "2. Exclusivity 2.1 The Reseller's right"
        else:
            continue
        if not heading and weight < 0.8:
            if len(number) == 1:
                continue
        pos = line.offset + match.start()
        found.append(_Mark(pos, "decimal", label=label, number=number, heading=heading,
                           word="Section" if word else "", weight=weight + (0.5 if heading else 0),
                           line_start=False, head_end=line.offset + match.end() + len(heading)))
    for match in _INLINE_PAREN.finditer(t):
        pos = line.offset + match.start() + (len(match.group(0)) - len(match.group(0).lstrip()))
        found.append(_Mark(pos, "sub", label=f"({match.group(1)})", line_start=False,
                           head_end=pos))
    return found


def _before(t: str, pos: int) -> tuple[str, str]:
    """The last character and the last word of t[:pos] ("" when there is none), found by walking
    back from pos (slicing t[:pos] for every match of a long line would be quadratic)."""
    end = pos
    while end > 0 and t[end - 1].isspace():
        end -= 1
    begin = end
    while begin > 0 and not t[begin - 1].isspace():
        begin -= 1
    return t[end - 1:end], t[begin:end]


def _after_break(lines: list[_Line], i: int) -> bool:
    """The line before ends a sentence or is short: line i does not continue a paragraph."""
    if i > 0 and not lines[i - 1].text:
        return True  # a blank line ends a paragraph
    previous = next((ln.text for ln in reversed(lines[max(0, i - 3):i]) if ln.text), "")
    return not previous or previous[-1] in ".:;!?)]\"\u201d" or len(previous) < 60


def _heading_below(lines: list[_Line], i: int) -> tuple[str, int | None]:
    """A heading written on the line after a bare label ("ARTICLE 2" / "GRANT OF RIGHTS")."""
    for j in range(i + 1, min(i + 3, len(lines))):
        t = lines[j].text
        if not t:
            continue
        if len(t) <= 100 and (_is_caps(t) or _is_title(t)) and not _DECIMAL.match(t):
            heading, last = _clean_heading(t), j
            # a heading in capitals may take two or three lines
            while _is_caps(t) and last + 1 < len(lines) and last < j + 2:
                more = lines[last + 1].text
                if not (more and len(more) <= 100 and _is_caps(more)) or _DECIMAL.match(more) \
                        or _ARTICLE.match(more) or _SECTION.match(more) or _EXHIBIT.match(more):
                    break
                heading, last = f"{heading} {_clean_heading(more)}", last + 1
            return heading, last
        head = _caps_prefix(t)
        if len(head.split()) >= 2:
            return head, None
        return "", None
    return "", None


def _looks_like_quantity(rest: str) -> bool:
    first = _FIRST_WORD.match(rest)
    word = first.group(1).lower() if first else ""
    return word.strip(",.;") in {
        "percent", "%", "million", "billion", "days", "months", "years", "hours", "x", "times",
        "mg", "kg", "g", "ml", "cm", "mm", "m", "km", "inches", "feet", "lbs", "per",
    }


def _caps_prefix(rest: str) -> str:
    """The run of capitals a heading is written in: "INDEMNIFICATION. Each party" -> ..."""
    m = re.match(r"^([A-Z0-9][A-Z0-9 ,;:&'\u2019/\-\u2013()]*[A-Z)])(?=[.:]?(\s|$))", rest.strip())
    if not m:
        return ""
    head = m.group(1).strip()
    letters = [c for c in head if c.isalpha()]
    if len(letters) < 3 or len(head.split()) > 14:
        return ""
    if head.split()[-1].lower() in _SMALL_WORDS:
        return ""  # the first line of a paragraph in capitals, not a heading
    # a lone capital word followed by ordinary text is just the sentence's first word
    after = rest.strip()[len(head):].lstrip(".: ")
    if len(head.split()) == 1 and after[:1].islower():
        return ""
    return head


def _run_in_heading(rest: str) -> str:
    """A title-case heading before the body: "Limitation of Liability. EXCEPT ..." -> ..."""
    rest = rest.strip()
    if rest.startswith("[***]"):
        return "[***]"  # a redacted heading is still a heading
    if not rest or rest[0] in "\"\u201c\u2018'(" or not rest[0].isupper():
        return ""
    m = re.match(r"^(.{1,110}?)(?:[.:](?=\s|$)|(?<!\s)\s++(?=\d{1,3}\.\d)|$)", rest)
    if not m:
        return ""
    head = m.group(1).strip().rstrip(".:;,")
    last = head.split()[-1].lower() if head else ""
    if not head or not _is_title(head) or last in _DANGLING or last in _SMALL_WORDS:
        return ""  # "Subject to Section" 1.4 below, ...
    return head


def _heading_of(rest: str) -> str:
    """The heading written after a label, in capitals or in title case, or ""."""
    caps, run_in = _caps_prefix(rest), _run_in_heading(rest)
    return run_in if len(run_in) > len(caps) else caps


def _is_title(t: str) -> bool:
    words = [w for w in re.split(r"\s+", t.strip()) if w]
    if not words or len(words) > 12:
        return False
    for k, w in enumerate(words):
        core = w.strip("()[]\"'\u201c\u201d\u2018\u2019,;:.")
        if not any(c.isalnum() for c in core):
            continue  # "&", "-", "/"
        if core.lower() in _SMALL_WORDS and k > 0:
            continue
        if not (core[0].isupper() or core[0].isdigit() or core.startswith("***")):
            return False
    return words[0][0].isupper() or words[0][0].isdigit()


def _is_caps(t: str) -> bool:
    letters = [c for c in t if c.isalpha()]
    return len(letters) >= 3 and sum(c.isupper() for c in letters) >= 0.9 * len(letters)


def _is_short_heading(t: str) -> bool:
    return len(t) <= 120 and len(t.split()) <= 15 and not t.rstrip().endswith((":", ",", ";")) \
        and not re.search(r"[a-z]\.\s+[A-Z]", t) and not t.endswith(".")


def _is_caps_heading_line(lines: list[_Line], i: int) -> bool:
    t = lines[i].text
    if len(t) > 80 or len(t.split()) > 10 or t[0] in "([" or "***" in t or not _is_caps(t):
        return False
    if t.rstrip(".:").endswith((" OF", " THE", " AND", " OR", " TO", " IN", " FOR", ",")):
        return False
    if t.endswith(".") and len(t.split()) > 6:
        return False
    previous = next((ln.text for ln in reversed(lines[max(0, i - 3):i]) if ln.text), "")
    if previous and not (previous[-1] in ".:;!?)]\"\u201d" or len(previous) < 50):
        return False  # a line inside a paragraph written in capitals
    following = next((ln.text for ln in lines[i + 1:i + 3] if ln.text), "")
    if following[:1].islower():
        return False
    # a heading introduces text; a column of short names ("IWC / Cartier / Prada") is a list
    return not following or len(following) >= 30 or _is_caps(following) \
        or bool(_DECIMAL.match(following) or _PAREN.match(following))


def _clean_heading(t: str) -> str:
    return " ".join(t.split()).strip(" .:;-\u2013\u2014")


def _roman_value(label: str) -> int:
    if not _ROMAN.match(label):
        return 0
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for a, b in zip(label, label[1:] + " "):
        v = values[a]
        total += -v if b != " " and values.get(b, 0) > v else v
    return total


# ----- table of contents and signature block -----

def _find_toc(text: str, lines: list[_Line], marks: list[_Mark]) -> list[tuple[int, int]]:
    """Regions that list headings with page numbers: many short marked lines ending in a number."""
    line_starts = [ln.start for ln in lines]

    def line_of(pos: int) -> _Line:
        return lines[bisect.bisect_right(line_starts, pos) - 1]

    def toc_like(mark: _Mark) -> bool:
        line = line_of(mark.pos)
        rest = text[mark.pos:line.end].strip()
        rest = _DOT_LEADERS.sub(" ", rest)
        return bool(_PAGE_REF_END.search(rest)) and not _SENTENCE.search(rest) \
            and len(rest) <= 2000 and " means " not in rest

    regions: list[tuple[int, int]] = []
    structural = [m for m in marks if m.line_start and m.kind in
                  ("article", "decimal", "letter", "exhibit", "caps", "heading")]
    run: list[_Mark] = []
    for k, mark in enumerate(structural + [None]):
        if mark is not None and toc_like(mark):
            run.append(mark)
            continue
        following = structural[k + 1] if k + 1 < len(structural) else None
        if mark is not None and run and following is not None and toc_like(following) \
                and following.pos - mark.pos < 400:
            run.append(mark)  # an entry whose title wrapped onto the next line
            continue
        if mark is not None and mark.kind == "caps" and run and \
                not _SENTENCE.search(text[mark.pos:line_of(mark.pos).end]):
            run.append(mark)  # "PAGE", "TABLE OF CONTENTS (CONTINUED)" between entries
            continue
        entries = [m for m in run if toc_like(m)]
        if len(entries) >= 4:
            start = run[0].pos
            k = bisect.bisect_right(line_starts, start) - 1
            for j in range(k - 1, max(-1, k - 6), -1):
                if _TOC_TITLE.match(lines[j].text):
                    start = lines[j].offset
                    break
            k = bisect.bisect_right(line_starts, entries[-1].pos) - 1
            # the list of exhibits and schedules that often follows the contents
            while k + 1 < len(lines):
                t = lines[k + 1].text
                if t and not (len(t) <= 120 and (_EXHIBIT.match(t) or _LIST_TITLE.match(t))):
                    break
                k += 1
            regions.append((start, lines[k].end))
        run = []
    return regions


def _inside(pos: int, regions: list[tuple[int, int]]) -> bool:
    return any(s <= pos < e for s, e in regions)


def _find_signatures(text: str, lines: list[_Line], marks: list[_Mark]) -> list[tuple[int, int]]:
    """Signature blocks: from "IN WITNESS WHEREOF" (or a run of By:/Name:/Title: lines) to the
    last signature line near it. Marks found inside are dropped, and a mark is added at the
    start of a block that has none."""
    sig_lines = [i for i, ln in enumerate(lines) if ln.text and _SIGNATURE_LINE.match(ln.text)]
    extra_lines = [i for i, ln in enumerate(lines)
                   if ln.text and _SIGNATURE_EXTRA.match(ln.text)]
    starts = [m.pos for m in marks if m.kind == "signature"]
    line_starts = [ln.start for ln in lines]
    # clusters of signature lines without a witness clause before them
    clusters: list[list[int]] = []
    for i in sig_lines:
        if clusters and i - clusters[-1][-1] <= 6:
            clusters[-1].append(i)
        else:
            clusters.append([i])
    for cluster in clusters:
        if len(cluster) < 2:
            continue
        extra = [i for i in extra_lines if cluster[0] - 3 <= i <= cluster[-1] + 3]
        if len(cluster) + len(extra) < 3:
            continue
        first = cluster[0]
        k = first
        for j in range(first - 1, max(-1, first - 4), -1):
            if lines[j].text and _SIGNATURE_LEAD.match(lines[j].text):
                k = j
        pos = lines[k].offset
        if any(s <= pos and pos - s < 3000 for s in starts):
            continue
        marks.append(_Mark(pos, "signature", heading="Signatures", head_end=pos))
        starts.append(pos)
    marks.sort(key=lambda m: (m.pos, m.kind != "signature"))
    regions = []
    exhibits = sorted(m.pos for m in marks if m.kind == "exhibit")
    for start in sorted(starts):
        k = bisect.bisect_right(line_starts, start) - 1
        end_line = k
        for i in sorted(sig_lines + extra_lines):
            if i > k and i - end_line <= 12:
                end_line = i
        # the printed names under the last signature line
        for j in range(end_line + 1, min(end_line + 4, len(lines))):
            t = lines[j].text
            if t and (len(t) > 80 or _SENTENCE.search(t) or _EXHIBIT.match(t)):
                break
            end_line = j
        end = lines[end_line].end
        later = [p for p in exhibits if p > start]
        if later:
            end = min(end, later[0])
        regions.append((start, end))
    return regions


# ----- choosing where provisions start -----

def _choose_primary(marks: list[_Mark], text: str) -> None:
    """Mark the marks that start a provision; the rest can only split an oversized one."""
    # exhibits (after the body has begun) open a new scope: numbering starts again
    first_body = next((m.pos for m in marks if m.kind in ("article", "decimal", "letter")
                       and m.line_start), len(text))
    exhibits = [m for m in marks if m.kind == "exhibit" and m.pos > first_body]
    for m in marks:
        if m.kind == "exhibit" and m.pos <= first_body:
            m.kind = "ignored"
    # a list of exhibits ("EXHIBIT A - Brand Features / EXHIBIT B - ...") is not the exhibits
    listed = [a for a, b in zip(exhibits, exhibits[1:])
              if len(re.sub(r"\s|\d", "", text[a.head_end:b.pos])) < 3]
    for m in listed:
        m.kind = "ignored"
    listed_ids = set(map(id, listed))
    exhibits = [m for m in exhibits if id(m) not in listed_ids]
    bounds = [m.pos for m in exhibits]
    by_scope: list[list[_Mark]] = [[] for _ in range(len(bounds) + 1)]
    for m in marks:
        m.scope = bisect.bisect_right(bounds, m.pos)
        by_scope[m.scope].append(m)
    for m in exhibits:
        m.primary = True

    for scope, scoped in enumerate(by_scope):
        letters = _chain([m for m in scoped if m.kind == "letter"], _letter_follows)
        articles = _chain([m for m in scoped if m.kind == "article"], _letter_follows)
        # lettered sections ("A. AUTHORITY") number their items from 1 again
        decimals = _chain([m for m in scoped if m.kind == "decimal"], _decimal_follows,
                          restart_at=[m.pos for m in letters])
        chained = set(map(id, letters + articles + decimals))
        for m in scoped:
            if m.kind in ("letter", "article", "decimal") and id(m) not in chained:
                m.kind = "ignored"  # a cross reference, a quantity, a wrapped line
        if scope > 0:
            continue  # inside an exhibit everything belongs to it; it is cut only by size
        for m in articles + letters:
            m.primary = True
        top_numbers = {m.number[0] for m in decimals if len(m.number) == 1}
        for m in decimals:
            if len(m.number) == 1:
                m.primary = not letters or bool(m.heading and _is_caps(m.heading))
            elif len(m.number) == 2:
                # "7.3 Limitation of Liability." starts a provision; "1.3 "Term" means ..." is
                # part of its article, unless there is no "1." to belong to
                m.primary = bool(m.heading) or m.number[0] not in top_numbers
                top_numbers.add(m.number[0])
        first_numbered = min((m.pos for m in scoped if m.primary and m.kind != "exhibit"),
                             default=None)
        for m in scoped:
            if m.kind in ("caps", "heading"):
                m.primary = first_numbered is None or (
                    m.pos > first_numbered and not _PREAMBLE_HEADINGS.match(m.heading))
            elif m.kind == "signature":
                m.primary = True
    # a document with no numbering: its first heading is the title, part of the preamble
    primary = [m for m in marks if m.primary]
    if primary and all(m.kind in ("caps", "heading", "signature", "exhibit") for m in primary):
        first = primary[0]
        if first.kind in ("caps", "heading") and not text[:first.pos].strip():
            first.primary = False
    provision_before = False  # marks are in document order: a provision (not caps) starts before m
    for m in marks:
        if m.kind in ("caps", "heading") and m.primary and _PREAMBLE_HEADINGS.match(m.heading):
            if not provision_before:
                m.primary = False
        provision_before = provision_before or (m.primary and m.kind != "caps")


def _chain(marks: list[_Mark], follows, restart_at: list[int] | None = None) -> list[_Mark]:
    """The heaviest sequence of marks in which each follows the one before it."""
    if not marks:
        return []
    restart_at = sorted(restart_at or [])
    best: list[float] = []
    back: list[int | None] = []
    window = 80
    for j, m in enumerate(marks):
        best_score, best_prev = m.weight if _can_start(m) else m.weight - 1.5, None
        for i in range(max(0, j - window), j):
            p = marks[i]
            restarted = bisect.bisect_right(restart_at, m.pos) > bisect.bisect_right(
                restart_at, p.pos)
            if follows(p, m) or (restarted and _can_start(m)):
                if best[i] + m.weight > best_score:
                    best_score, best_prev = best[i] + m.weight, i
        best.append(best_score)
        back.append(best_prev)
    j = max(range(len(marks)), key=lambda k: best[k])
    chain = []
    while j is not None:
        chain.append(marks[j])
        j = back[j]
    return chain[::-1]


def _can_start(m: _Mark) -> bool:
    return m.number[0] <= 2 and all(n <= 1 for n in m.number[1:])


def _letter_follows(p: _Mark, m: _Mark) -> bool:
    return 1 <= m.number[0] - p.number[0] <= 2


def _decimal_follows(p: _Mark, m: _Mark) -> bool:
    a, b = p.number, m.number
    for i in range(min(len(a), len(b))):
        if a[i] != b[i]:
            return 1 <= b[i] - a[i] <= 3 and all(n <= 1 for n in b[i + 1:])
    # b extends a: its first child ("4." then "4.1" or "4.1.1"); or the same number again
    extension = b[len(a):]
    return bool(extension) and extension[0] <= 2 and all(n <= 1 for n in extension[1:])


# ----- cutting -----

def _cut(text: str, marks: list[_Mark], toc: list[tuple[int, int]]) -> list[_Piece]:
    """Pieces of text from each provision's start to the next; the contents are left out."""
    starts = [m for m in marks if m.primary]
    inner = [m for m in marks if not m.primary and m.kind != "ignored"]
    inner_pos = [m.pos for m in inner]
    cuts: list[tuple[int, _Mark | None]] = [(0, None)] + [(m.pos, m) for m in starts]
    for s, e in toc:
        cuts.append((s, _Mark(s, "toc")))
        cuts.append((e, None))
    cuts.sort(key=lambda c: (c[0], c[1] is not None))
    pieces: list[_Piece] = []
    for k, (pos, mark) in enumerate(cuts):
        end = cuts[k + 1][0] if k + 1 < len(cuts) else len(text)
        if end <= pos:
            continue
        if mark is not None and mark.kind == "toc":
            continue
        if not text[pos:end].strip():
            continue
        subs = inner[bisect.bisect_right(inner_pos, pos):bisect.bisect_left(inner_pos, end)]
        pieces.append(_Piece(pos, end, mark, subs))
    return pieces


def _is_heading_only(text: str, piece: _Piece) -> bool:
    if piece.mark is None:
        return False
    body = text[max(piece.mark.head_end, piece.start):piece.end].strip()
    return len(body) < 3


def _merge_small(text: str, pieces: list[_Piece], min_chars: int) -> list[_Piece]:
    """Join a bare heading to the provision it introduces, and a fragment shorter than
    min_chars to the provision before it. Exhibits and signature blocks stay as they are."""

    def protected(piece: _Piece) -> bool:
        return piece.mark is not None and piece.mark.kind in ("exhibit", "signature")

    def join(a: _Piece, b: _Piece, mark: _Mark | None) -> _Piece:
        # a is used up: the joined piece takes over its list (a run of small pieces joined one by
        # one would otherwise copy, or sort, a growing list each time)
        a.parts.extend(b.parts)
        a.parts.extend(m for m in (a.mark, b.mark) if m is not None and m is not mark)
        return _Piece(a.start, b.end, mark, a.parts)

    out: list[_Piece] = []
    waiting: _Piece | None = None  # a heading looking for its provision
    for piece in pieces:
        if waiting is not None:
            if protected(piece):
                if out:
                    out[-1] = join(out[-1], waiting, out[-1].mark)
                else:
                    out.append(waiting)
            else:
                piece = join(waiting, piece, piece.mark or waiting.mark)
            waiting = None
        if protected(piece):
            out.append(piece)
            continue
        small = len(text[piece.start:piece.end].strip()) < min_chars
        if _is_heading_only(text, piece):
            waiting = piece
        elif small and out:
            out[-1] = join(out[-1], piece, out[-1].mark)
        elif small:
            waiting = piece
        else:
            out.append(piece)
    if waiting is not None:
        if out:
            out[-1] = join(out[-1], waiting, out[-1].mark)
        else:
            out.append(waiting)
    return out


def _split_large(text: str, pieces: list[_Piece], max_chars: int) -> list[_Piece]:
    out: list[_Piece] = []
    for piece in pieces:
        if piece.end - piece.start <= max_chars:
            out.append(piece)
            continue
        out.extend(_split_piece(text, piece, max_chars))
    return out


def _split_piece(text: str, piece: _Piece, max_chars: int) -> list[_Piece]:
    """Cut an oversized provision at its sub-clauses, else at paragraphs, sentences, words."""
    subs = sorted((m for m in piece.parts if m.kind in ("decimal", "sub", "letter", "article",
                                                       "caps", "heading")),
                  key=lambda m: m.pos)
    # lettered items at the start of a line are the sub-clauses; inside a sentence they
    # usually enumerate conditions, unless the text has lost its line breaks altogether
    own_line = [m for m in subs if m.line_start]
    paths = _sub_paths(own_line if any(m.kind == "sub" for m in own_line) else subs)
    # a list of definitions is cut where it must be; its sub-clause labels name nothing
    body = text[piece.start:piece.end]
    definitions = len(re.findall(r"\n[^\S\n]*+(?:\d[\d.]*\s+)?[\"\u201c][^\"\u201d]{1,80}[\"\u201d]"
                                 r"\s+(?:shall\s+)?(?:mean|has|have|is|includes?)\b", body)) >= 5
    points: list[tuple[int, _Mark | None]] = [(m.pos, m) for m in subs if m.line_start] or \
        [(m.pos, m) for m in subs]
    points += [(p, None) for p in _paragraph_breaks(text, piece.start, piece.end)]
    points.sort(key=lambda pt: (pt[0], pt[1] is None))
    point_positions = [pt[0] for pt in points]
    chunks: list[_Piece] = []
    start, mark = piece.start, piece.mark
    while piece.end - start > max_chars:
        limit = start + max_chars
        candidates = points[bisect.bisect_right(point_positions, start + max_chars // 5):
                            bisect.bisect_right(point_positions, limit)]
        labelled = [pt for pt in candidates if pt[1] is not None]
        if labelled and labelled[-1][0] > start + max_chars // 3:
            cut, next_mark = labelled[-1]
        elif candidates:
            cut, next_mark = candidates[-1]
        else:
            cut, next_mark = _sentence_or_word_break(text, start, limit), None
        chunks.append(_Piece(start, cut, mark))
        start = cut
        if next_mark is None or definitions or next_mark.pos not in paths and \
                next_mark.kind == "sub" or next_mark.kind in ("caps", "heading") or \
                (next_mark.kind == "sub" and piece.mark is not None
                 and piece.mark.kind == "exhibit"):
            mark = _Mark(cut, "continued", number=(len(chunks) + 1,))
        else:
            mark = _Mark(next_mark.pos, next_mark.kind, paths.get(next_mark.pos, next_mark.label),
                         next_mark.number, next_mark.heading, next_mark.word)
    chunks.append(_Piece(start, piece.end, mark))
    for chunk in chunks[1:]:
        if piece.mark is None:
            chunk.mark = None  # more of the preamble
        else:
            chunk.mark.parent = piece.mark
    return chunks


def _sub_paths(subs: list[_Mark]) -> dict[int, str]:
    """The full label of each lettered sub-clause within its provision: "(b)(ii)"."""
    stack: list[tuple[str, int, str]] = []
    paths: dict[int, str] = {}
    for m in subs:
        if m.kind != "sub":
            continue
        family, value = _family(m.label.strip("()"), stack)
        for k, (f, _, _) in enumerate(stack):
            if f == family:
                del stack[k:]
                break
        stack.append((family, value, m.label))
        paths[m.pos] = "".join(label for _, _, label in stack)
    return paths


def _family(core: str, stack: list[tuple[str, int, str]]) -> tuple[str, int]:
    """Which kind of list a label belongs to: (i) is roman unless it follows (h)."""
    if core.isdigit():
        return "digit", int(core)
    lower = core.islower()
    letters_family = "lower" if lower else "upper"
    roman_family = "roman" if lower else "ROMAN"
    roman = _roman_value(core.upper())
    if len(core) == 1:
        letter_value = ord(core.lower()) - 96
        if roman and not any(f == letters_family and v == letter_value - 1 for f, v, _ in stack):
            return roman_family, roman
        return letters_family, letter_value
    if roman:
        return roman_family, roman
    return letters_family, 26 * len(core) + ord(core[0].lower()) - 96


def _paragraph_breaks(text: str, start: int, end: int) -> list[int]:
    """Starts of lines that begin a new paragraph (the line before ends a sentence)."""
    breaks = []
    for m in _LINE_START.finditer(text, start, end):
        newline = m.start()
        last = newline  # walk back over the whitespace before the newline to the text it ends
        while last > start and text[last - 1].isspace():
            last -= 1
        if last > start and (text[last - 1] in ".:;!?)]\"\u201d" or text[newline - 1] == "\n"):
            breaks.append(m.end())
    return breaks


def _sentence_or_word_break(text: str, start: int, limit: int) -> int:
    window = text[start:limit]
    for pattern in (r"[.;:!?][\"\u201d)]?\s++(?=\S)", r"(?<!\s)\s++(?=\S)"):
        found = [m.end() for m in re.finditer(pattern, window)]
        found = [f for f in found if f > len(window) // 3]
        if found:
            return start + found[-1]
    return limit  # a single "word" longer than the limit: nothing better to do


# ----- naming -----

def _name(text: str, pieces: list[_Piece]) -> list[Clause]:
    clauses: list[Clause] = []
    seen: dict[str, int] = {}
    body_started = False
    preamble_parts = 0
    for index, piece in enumerate(pieces, start=1):
        raw = text[piece.start:piece.end]
        start = piece.start + (len(raw) - len(raw.lstrip()))
        end = piece.end - (len(raw) - len(raw.rstrip()))
        if end <= start:
            continue
        mark = piece.mark
        body = text[start:end]
        if mark is None and not body_started:
            preamble_parts += 1
            if preamble_parts == 1:
                cid, heading = "preamble", _title(body) or "Preamble"
            else:
                cid, heading = f"preamble-{preamble_parts}", clauses[-1].heading
        else:
            body_started = True
            cid, heading = _identify(mark, body, index)
        if not re.search(r"[^\W\d_]", heading):
            heading = _first_words(body)
        heading = " ".join(heading.split())
        if cid in seen:
            seen[cid] += 1
            cid = f"{cid}#{seen[cid]}"
        else:
            seen[cid] = 1
        clauses.append(Clause(cid, heading, body, start, end))
    return clauses


def _identify(mark: _Mark | None, body: str, index: int) -> tuple[str, str]:
    """The id and heading a clause starting at `mark` gets."""
    if mark is None:
        return f"c{index}", ""
    if mark.parent is not None:
        return _identify_part(mark, index)
    kind = mark.kind
    if kind == "exhibit":
        return mark.label, mark.heading or mark.label
    if kind == "signature":
        return "signatures", "Signatures"
    if kind == "decimal":
        return (f"Section {mark.label}" if mark.word else mark.label), mark.heading
    if kind in ("article", "letter"):
        return mark.label, mark.heading
    return f"c{index}", mark.heading


def _identify_part(mark: _Mark, index: int) -> tuple[str, str]:
    """Ids for the later pieces of a provision that was cut to size: "5(c)", "Exhibit C 3"."""
    parent = mark.parent
    base, heading = _identify(parent, "", index)
    if mark.kind == "continued":
        return f"{base} (part {mark.number[0]})", heading
    own = mark.label
    if mark.kind not in ("decimal", "sub", "letter", "article") or not own:
        return f"{base} (part {index})", mark.heading or heading
    if parent.kind == "exhibit":
        return f"{base} {own}", mark.heading or heading
    if mark.kind == "decimal" and len(mark.number) > 1:
        return (f"Section {own}" if mark.word else own), mark.heading or heading
    if own.startswith("("):
        return f"{base}{own}", heading
    return f"{base}.{own}", mark.heading or heading


def _first_words(body: str) -> str:
    """The first words of a clause after its label, for a clause without a heading."""
    words = re.sub(r"^\s*+(\(?[\w.]{1,8}\)|§?\s*\d+(\.\d+)*\.?)\s+", "", body).split()
    return " ".join(words[:8])


def _title(preamble: str) -> str:
    """The document's title: a line in capitals near the top, preferably naming an agreement."""
    found = []
    for line in preamble.split("\n")[:15]:
        t = line.strip()
        if _is_caps(t) and len(t.split()) <= 12 and not _EXHIBIT.match(t) \
                and not _PREAMBLE_HEADINGS.match(t):
            found.append(_clean_heading(t))
    for t in found:
        if re.search(r"AGREEMENT|CONTRACT|ADDENDUM|AMENDMENT|LETTER|MEMORANDUM|TERMS|LICENSE", t):
            return t
    if found:
        return found[0]
    first = preamble.strip().split("\n")[0].strip()
    if _EXHIBIT.match(first) or len(first.split()) > 8 or not _is_title(first):
        return ""
    return first
