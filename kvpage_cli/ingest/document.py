"""The document model: the text a model reads and, for every piece of it, where it came from."""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path

# Characters a quote may spell differently from the document; each maps to its plain form.
_QUOTE_FOLDS = {
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'", "`": "'",
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"',
    "\u00ab": '"', "\u00bb": '"',
    "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\u2015": "-",
    "\u2212": "-",
    "\ufb00": "ff", "\ufb01": "fi", "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl",
    "\ufb05": "st", "\ufb06": "st",
    "\u00ad": "",  # soft hyphen: invisible
    "\u200b": "", "\ufeff": "",
}


@dataclass(frozen=True)
class Span:
    """One piece of `Document.text`, [start, end), and where it came from."""

    start: int
    end: int
    file: str
    page: int | None = None
    paragraph: int | None = None
    line: int | None = None
    kind: str = "text"
    show_file: bool = False  # documents made of many files (a repo) name the file in where()
    xml_paragraph: int | None = None  # DOCX: the paragraph's w:p, as its index among the w:p elements of
    # the main document part in document order (what a copy of the file with comments is anchored on)

    def where(self) -> str:
        """A label for the source: "page 3", "paragraph 12", "line 40", "src/app.py line 7"."""
        parts = []
        if self.show_file:
            parts.append(self.file)
        if self.kind == "footnote" and self.paragraph is not None:
            parts.append(f"footnote to paragraph {self.paragraph}")
        elif self.kind == "footnote":
            parts.append("footnote")
        elif self.page is not None:
            parts.append(f"page {self.page}")
        elif self.paragraph is not None:
            parts.append(f"paragraph {self.paragraph}")
        elif self.line is not None:
            parts.append(f"line {self.line}")
        return " ".join(parts) if parts else self.file


@dataclass
class Document:
    """Text read from a file, a directory or stdin, with source spans and warnings for the user."""

    source: str
    kind: str  # "pdf" | "docx" | "text" | "repo"
    text: str
    spans: list[Span]
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """What a prompt calls the document: its file or folder's own name, whatever path named it
        (an answer or a saved index must not depend on the directory kvpage ran in); stdin's is
        "standard input"."""
        if self.source == "-":
            return "standard input"
        return Path(self.source).resolve().name or self.source

    def locate(self, start: int, end: int) -> list[Span]:
        """The spans overlapping [start, end); an empty range gives the span holding `start`."""
        ends = [s.end for s in self.spans]
        i = bisect.bisect_right(ends, start)
        found = []
        while i < len(self.spans):
            span = self.spans[i]
            if span.start >= max(end, start + 1):
                break
            found.append(span)
            i += 1
        return found

    def where(self, start: int, end: int) -> str:
        """A human label for a range: "page 3", "pages 3-4", "src/app.py lines 7-9"."""
        found = self.locate(start, end)
        # a repo's "==> path <==" header line says less than the lines under it
        spans = [s for s in found if not (s.show_file and s.line is None)] or found
        if not spans:
            return self.source
        first, last = spans[0], spans[-1]
        if first.show_file and first.file != last.file:
            return f"{first.where()} to {last.where()}"
        if "footnote" in (first.kind, last.kind):
            return first.where()
        prefix = f"{first.file} " if first.show_file else ""
        for unit in ("page", "paragraph", "line"):
            a, b = getattr(first, unit), getattr(last, unit)
            if a is not None and b is not None:
                return f"{prefix}{unit} {a}" if a == b else f"{prefix}{unit}s {a}-{b}"
        return first.where()

    def find_quote(self, quote: str) -> tuple[int, int] | None:
        """Where `quote` occurs in the text, as (start, end); None if it does not.

        Runs of whitespace match any run of whitespace, curly quotes match straight ones (and dash
        variants and ligatures their plain forms). If that finds nothing, whitespace is ignored
        altogether, which tolerates line breaks and spaces that PDF extraction adds or drops.
        """
        collapsed, collapsed_map, bare, bare_map = self._quote_index()
        wanted, _ = _fold(quote.strip(), collapse=True)
        wanted = wanted.strip()
        if not wanted:
            return None
        i = collapsed.find(wanted)
        if i >= 0:
            return collapsed_map[i], collapsed_map[i + len(wanted) - 1] + 1
        wanted, _ = _fold(quote, collapse=False)
        if not wanted:
            return None
        i = bare.find(wanted)
        if i >= 0:
            return bare_map[i], bare_map[i + len(wanted) - 1] + 1
        return None

    def _quote_index(self) -> tuple:
        # built on first use and kept outside the dataclass fields (asdict, ==, repr skip it)
        cached = self.__dict__.get("_quote_cache")
        if cached is None or cached[0] is not self.text:
            collapsed, collapsed_map = _fold(self.text, collapse=True)
            bare, bare_map = _fold(self.text, collapse=False)
            cached = (self.text, collapsed, collapsed_map, bare, bare_map)
            self.__dict__["_quote_cache"] = cached
        return cached[1:]


def _fold(text: str, collapse: bool) -> tuple[str, list[int]]:
    """Normalise `text` for quote matching; also return, per output char, its index in `text`.

    collapse=True turns each run of whitespace into one space; collapse=False drops whitespace.
    """
    out: list[str] = []
    where: list[int] = []
    in_space = False
    for i, ch in enumerate(text):
        if ch.isspace():
            if collapse and not in_space and out:
                out.append(" ")
                where.append(i)
            in_space = True
            continue
        in_space = False
        folded = _QUOTE_FOLDS.get(ch, ch)
        for piece in folded:
            out.append(piece)
            where.append(i)
    return "".join(out), where


MAX_SOURCE_BYTES = 256 * 2**20
"""The most bytes read from one file or from stdin; a larger input is refused, not read."""

MAX_TEXT_CHARS = 32 * 2**20
"""The most characters of text one document may hold (a few thousand pages; far more than any
model's context). A DOCX inflates and numbers its paragraphs, so its text is counted as it grows."""


def read_source(source, display: str, limit: int | None = None) -> bytes:
    """The bytes of `source` (a path, or bytes already read from stdin), at most `limit` of them
    (default MAX_SOURCE_BYTES).

    The file is opened once and read to at most limit + 1 bytes, so one that grows after it was
    sized is still bounded. An unreadable file is a BrokenDocument naming `display`, a larger one
    DocumentTooLarge."""
    from .errors import BrokenDocument

    limit = MAX_SOURCE_BYTES if limit is None else limit
    if isinstance(source, (bytes, bytearray)):
        if len(source) > limit:
            raise _too_large(display, limit)
        return bytes(source)
    try:
        with open(os.fspath(source), "rb") as f:
            if os.fstat(f.fileno()).st_size > limit:
                raise _too_large(display, limit)
            return read_stream(f, display, limit)
    except OSError as e:
        raise BrokenDocument(display, e.strerror or str(e)) from None


def read_stream(stream, display: str, limit: int | None = None) -> bytes:
    """Everything a binary stream (stdin) holds, refused with DocumentTooLarge past `limit` bytes
    (default MAX_SOURCE_BYTES)."""
    limit = MAX_SOURCE_BYTES if limit is None else limit
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise _too_large(display, limit)
    return data


def check_text_size(chars: int, display: str) -> None:
    """Raises DocumentTooLarge when a document's text has grown past MAX_TEXT_CHARS."""
    from .errors import DocumentTooLarge

    if chars > MAX_TEXT_CHARS:
        raise DocumentTooLarge(display, f"its text passes {MAX_TEXT_CHARS:,} characters")


def format_size(num_bytes: int) -> str:
    """256 MiB, 64 KiB, 100 bytes: the largest unit that divides the number exactly."""
    if num_bytes >= 2**20 and num_bytes % 2**20 == 0:
        return f"{num_bytes // 2**20} MiB"
    if num_bytes >= 1024 and num_bytes % 1024 == 0:
        return f"{num_bytes // 1024} KiB"
    return f"{num_bytes} bytes"


def _too_large(display: str, limit: int):
    from .errors import DocumentTooLarge

    return DocumentTooLarge(display, f"it is over {format_size(limit)}")
