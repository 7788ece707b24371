"""PDF files: per-page text via pypdf, running headers and footers removed."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import warnings as py_warnings
from collections import defaultdict
from typing import TYPE_CHECKING

from kvpage_cli.ingest.document import Document, Span, check_text_size, read_source
from kvpage_cli.ingest.errors import (
    BrokenDocument,
    EmptyDocument,
    EncryptedDocument,
    NoTextLayer,
)

if TYPE_CHECKING:  # pypdf is imported when a PDF is read (40 ms at every start otherwise)
    import pypdf

_ZONE_LINES = 3  # lines at the top and at the bottom of a page that may be header or footer
_NUMBER = re.compile(r"\d+")
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u3000]+")
# A line that is only a page number: "7", "- 7 -", "Page 7", "Page 7 of 30", "A-7", "[7]".
_PAGE_NUMBER = re.compile(
    r"^(?:page\s*)?[-\u2013\u2014(\[]?\s*(?:[A-Z]{1,3}\s?-\s?)?\d{1,4}\s*[-\u2013\u2014)\]]?"
    r"(?:\s*(?:of|/)\s*\d{1,4})?$",
    re.IGNORECASE,
)
_ROMAN_PAGE = re.compile(r"^[-\u2013(\[]?\s*[ivxl]{1,6}\s*[-\u2013)\]]?$")
_WORD = re.compile(r"[^\W\d_]+(?:-[^\W\d_]+)*")
# A word broken by a hyphen at the end of a line; tried from word starts only (possessive), so a
# megabyte line of letters is not retried from every one of them.
_HYPHENATED_END = re.compile(r"(?<![^\W\d_])([^\W\d_]++)-$")


def read_pdf(
    source: str | os.PathLike | bytes,
    password: str | None = None,
    display: str | None = None,
) -> Document:
    """Read a PDF into a Document with one span per page.

    Encrypted files are opened with the empty password, then with `password`. Running headers and
    footers and bare page numbers are removed; words hyphenated across lines are joined where the
    document itself shows the joined form. A page that cannot be read is skipped with a warning.
    Raises EncryptedDocument, BrokenDocument, NoTextLayer (scans) or EmptyDocument.
    """
    if display is None:
        display = "-" if isinstance(source, (bytes, bytearray)) else os.fspath(source)
    with _quiet_pypdf():
        reader = _open(source, display)
        _unlock(reader, display, password)
        page_lines, warnings = _extract_pages(reader, display)
    _strip_running_lines(page_lines)
    vocabulary = _vocabulary(page_lines)
    parts: list[str] = []
    spans: list[Span] = []
    pos = 0
    for number, lines in enumerate(page_lines, start=1):
        page_text = "\n".join(_join_hyphenated(_trim_blank(lines), vocabulary))
        if not page_text.strip():
            continue
        if parts:
            parts.append("\n")
            pos += 1
        parts.append(page_text)
        spans.append(Span(pos, pos + len(page_text), display, page=number))
        pos += len(page_text)
    if not spans:
        raise EmptyDocument(display)
    return Document(source=display, kind="pdf", text="".join(parts), spans=spans,
                    warnings=warnings)


@contextlib.contextmanager
def _quiet_pypdf():
    """pypdf logs and warns about every quirk it repairs; a user cannot act on those."""
    logger = logging.getLogger("pypdf")
    old_level = logger.level
    logger.setLevel(logging.CRITICAL + 1)  # children (pypdf._reader, ...) inherit it: nothing is emitted
    try:
        with py_warnings.catch_warnings():
            py_warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(old_level)


def _open(source, display: str) -> pypdf.PdfReader:
    data = read_source(source, display)
    if not data:
        raise BrokenDocument(display, "the file is empty")
    if b"%PDF" not in data[:1024]:
        raise BrokenDocument(display, "it is not a PDF file")
    import pypdf

    try:
        return pypdf.PdfReader(io.BytesIO(data), strict=False)
    except Exception as e:  # pypdf raises many exception types on damaged files
        raise BrokenDocument(display, _short(e)) from None


def _unlock(reader: pypdf.PdfReader, display: str, password: str | None) -> None:
    from pypdf.errors import DependencyError

    try:
        encrypted = reader.is_encrypted
    except Exception as e:
        raise BrokenDocument(display, _short(e)) from None
    if not encrypted:
        return
    try:
        if reader.decrypt(""):
            return
        if password and reader.decrypt(password):
            return
    except DependencyError:
        # pypdf needs the cryptography package for AES; without it no password can be tried
        raise EncryptedDocument(
            display, bool(password), reason="pip install cryptography: pypdf needs it for AES"
        ) from None
    except Exception as e:
        raise EncryptedDocument(display, bool(password), reason=_short(e)) from None
    raise EncryptedDocument(display, password_given=bool(password))


def _extract_pages(reader: pypdf.PdfReader, display: str) -> tuple[list[list[str]], list[str]]:
    """Each page's cleaned lines, and warnings; raises when no page has text."""
    try:
        pages = list(reader.pages)
    except Exception as e:
        raise BrokenDocument(display, _short(e)) from None
    if not pages:
        raise EmptyDocument(display)
    page_lines: list[list[str]] = []
    failures: list[str] = []
    textless: list[int] = []
    chars = 0
    for number, page in enumerate(pages, start=1):
        try:
            raw = page.extract_text() or ""
        except Exception as e:  # fuzzed files make pypdf raise anything, not only PdfReadError
            failures.append(f"could not read page {number}: {_short(e)}")
            page_lines.append([])
            continue
        chars += len(raw)
        check_text_size(chars, display)
        lines = [_clean_line(line) for line in raw.splitlines()]
        if not any(lines):
            textless.append(number)
        page_lines.append(lines)
    if all(not any(lines) for lines in page_lines):
        if failures:
            raise BrokenDocument(display, failures[0])
        raise NoTextLayer(display)
    warnings = _summarise(failures)
    # Blank pages are normal; pages that only hold images are scans whose text is missing.
    scanned = [n for n in textless if _has_images(pages[n - 1])]
    if scanned:
        listed = ", ".join(str(n) for n in scanned[:10]) + (" ..." if len(scanned) > 10 else "")
        noun = "page" if len(scanned) == 1 else "pages"
        warnings.append(f"{noun} {listed} of {display} hold only images (they need OCR); "
                        "their text is missing")
    return page_lines, warnings


def _summarise(messages: list[str], keep: int = 3) -> list[str]:
    if len(messages) <= keep + 1:
        return messages
    return messages[:keep] + [f"... and {len(messages) - keep} more pages could not be read"]


def _has_images(page) -> bool:
    try:
        resources = page.get("/Resources")
        xobjects = resources.get_object().get("/XObject") if resources else None
        if not xobjects:
            return False
        for ref in xobjects.get_object().values():
            if ref.get_object().get("/Subtype") in ("/Image", "/Form"):
                return True
    except Exception:
        return False
    return False


def _clean_line(line: str) -> str:
    return _SPACES.sub(" ", line).strip()


def _trim_blank(lines: list[str]) -> list[str]:
    """Drop blank lines at the ends and keep at most one blank line in a row."""
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def _strip_running_lines(page_lines: list[list[str]]) -> None:
    """Blank out running headers and footers and bare page numbers, in place.

    A line near the top or bottom of a page is running text when the same line (case and spacing
    aside) sits there on at least half the pages, or when a line that differs only in its numbers
    sits there on 3+ consecutive pages with a number counting up by one ("Page 7 of 30", "- 7 -").
    """
    num_pages = sum(1 for lines in page_lines if any(lines))
    zones = [_zones(lines) for lines in page_lines]
    drop: list[set[int]] = [set() for _ in page_lines]

    if num_pages >= 2:
        threshold = max(2, math.ceil(0.5 * num_pages))
        seen: dict[tuple[str, str], set[int]] = defaultdict(set)
        for p, zone in enumerate(zones):
            for side, indices in zone.items():
                for i in indices:
                    seen[side, _key(page_lines[p][i])].add(p)
        # "Page 2 of 3 Initials: ___" on a few pages: numbered, and says it is about the page.
        numbered: dict[tuple[str, str], set[int]] = defaultdict(set)
        for p, zone in enumerate(zones):
            for side, indices in zone.items():
                for i in indices:
                    shape = _NUMBER.sub("#", _key(page_lines[p][i]))
                    if "page#" in shape:
                        numbered[side, shape].add(p)
        first_page = next(p for p, lines in enumerate(page_lines) if any(lines))
        for p, zone in enumerate(zones):
            for side, indices in zone.items():
                for i in indices:
                    key = _key(page_lines[p][i])
                    repeated = len(seen[side, key]) >= threshold
                    # A title repeated as a running head stays where the document starts.
                    if repeated and side == "top" and p == first_page and not _NUMBER.search(key):
                        continue
                    if repeated or len(numbered[side, _NUMBER.sub("#", key)]) >= 2:
                        drop[p].add(i)

    run_length = min(3, num_pages)
    if run_length >= 2:
        for side in ("top", "bottom"):
            _drop_counting_lines(page_lines, zones, side, run_length, drop)

    for p, lines in enumerate(page_lines):
        edge = [i for i, line in enumerate(lines) if line and i not in drop[p]]
        if edge and _is_bare_page_number(lines[edge[-1]], len(page_lines)):
            drop[p].add(edge[-1])
        for i in drop[p]:
            lines[i] = ""


def _zones(lines: list[str]) -> dict[str, list[int]]:
    filled = [i for i, line in enumerate(lines) if line]
    return {"top": filled[:_ZONE_LINES], "bottom": filled[-_ZONE_LINES:]}


def _key(line: str) -> str:
    return line.casefold().replace(" ", "")


def _drop_counting_lines(page_lines, zones, side, run_length, drop) -> None:
    # per page: normalised line -> (line index, its numbers)
    shapes = []
    for p, zone in enumerate(zones):
        found = {}
        for i in zone[side]:
            line = page_lines[p][i]
            if len(line) > 120:  # before int(): a run of 4,300+ digits is a ValueError
                continue
            numbers = [int(n) for n in _NUMBER.findall(line)]
            if numbers:
                found.setdefault(_NUMBER.sub("#", _key(line)), (i, numbers))
        shapes.append(found)
    pages_of: dict[str, list[int]] = defaultdict(list)  # shape -> the pages it is on (not every page)
    for p, found in enumerate(shapes):
        for shape in found:
            pages_of[shape].append(p)
    for shape, pages in pages_of.items():
        run: list[tuple[int, int]] = []
        for p in pages + [len(shapes)]:
            current = shapes[p].get(shape) if p < len(shapes) else None
            if current and run and _counts_up(shapes[run[-1][0]][shape][1], current[1]) \
                    and run[-1][0] == p - 1:
                run.append((p, current[0]))
                continue
            if len(run) >= run_length:
                for q, i in run:
                    drop[q].add(i)
            run = [(p, current[0])] if current else []


def _counts_up(before: list[int], after: list[int]) -> bool:
    if len(before) != len(after):
        return False
    steps = [b - a for a, b in zip(before, after)]
    return 1 in steps and all(s in (0, 1) for s in steps)


def _is_bare_page_number(line: str, num_pages: int) -> bool:
    if _ROMAN_PAGE.match(line):
        return True
    if not _PAGE_NUMBER.match(line):
        return False
    return int(_NUMBER.findall(line)[0]) <= num_pages + 5


def _vocabulary(page_lines: list[list[str]]) -> set[str]:
    words: set[str] = set()
    for lines in page_lines:
        for line in lines:
            words.update(w.casefold() for w in _WORD.findall(line))
    return words


def _join_hyphenated(lines: list[str], vocabulary: set[str]) -> list[str]:
    """Join a word broken across lines when that is safe.

    A soft hyphen at a line end always marks a break inside one word. A hard hyphen is removed
    only if the document spells the joined word elsewhere and never the hyphenated one; it is
    kept (the line break dropped) if the document uses the hyphenated word elsewhere.
    """
    out: list[str] = []
    for line in lines:
        previous = out[-1] if out else ""
        if previous and line and line[0].islower():
            if previous.endswith("\u00ad"):
                out[-1] = previous[:-1] + line
                continue
            match = _HYPHENATED_END.search(previous)
            head = match.group(1) if match else ""
            tail_match = _WORD.match(line)
            if head and tail_match:
                tail = tail_match.group(0).split("-")[0]
                joined = (head + tail).casefold()
                hyphenated = f"{head}-{tail}".casefold()
                if hyphenated in vocabulary:
                    out[-1] = previous + line
                    continue
                if joined in vocabulary:
                    out[-1] = previous[:-1] + line
                    continue
        out.append(line)
    return [line.replace("\u00ad", "") for line in out]


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text or type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."
