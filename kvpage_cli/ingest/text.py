"""Plain-text files (.txt, .md, source code): decoding and line spans."""

from __future__ import annotations

import codecs
import os
import re

import charset_normalizer

from kvpage_cli.ingest.document import Document, Span, check_text_size, read_source
from kvpage_cli.ingest.errors import BinaryDocument, EmptyDocument

_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
# What Western European text holds beyond ASCII when read as cp1252: accented letters and the
# usual typographic punctuation. Text in another single-byte code page read as cp1252 shows
# other symbols, or letters that are nearly all non-ASCII (Cyrillic, Greek).
_WESTERN = set(
    "ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÑÒÓÔÕÖØÙÚÛÜÝß"
    "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿ"
    "ŒœŠšŽžŸ\u00a0«»“”‘’‚„–—…•€£§©®°·¿¡™†‡‰½¼"
)
_ALLOWED_CONTROLS = set("\t\n\r\f\v\x1b")
# Unicode's control (Cc), surrogate (Cs) and private-use (Co) characters, less _ALLOWED_CONTROLS:
# one regex pass instead of a category lookup per character (0.11 s for packaging's 58 files under a profiler)
_CONTROL = re.compile("[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f-\x9f\ud800-\udfff\ue000-\uf8ff"
                      "\U000f0000-\U000ffffd\U00100000-\U0010fffd]")


def read_text(source: str | os.PathLike | bytes, display: str | None = None) -> Document:
    """Read a text file (or its bytes) into a Document with one span per non-blank line.

    UTF-8 (with or without BOM) and UTF-16/32 with BOM are read as such; other encodings are
    guessed, with a warning naming the guess. Binary data raises BinaryDocument, a file with no
    text EmptyDocument.
    """
    if not display:
        display = "-" if isinstance(source, (bytes, bytearray)) else os.fspath(source)
    data = read_source(source, display)
    text, encoding = decode_text(data, display)
    check_text_size(len(text), display)
    warnings = []
    if encoding is not None:
        warnings.append(f"{display} is not UTF-8; read it as {encoding} (a guess)")
    if not text.strip():
        raise EmptyDocument(display)
    return Document(
        source=display,
        kind="text",
        text=text,
        spans=line_spans(text, display),
        warnings=warnings,
    )


def decode_text(data: bytes, display: str) -> tuple[str, str | None]:
    """Decode bytes to text with newlines normalised to "\\n".

    Returns (text, encoding) where encoding is None for UTF-8 (or a BOM-marked Unicode encoding)
    and the name of the guessed encoding otherwise. Raises BinaryDocument for binary data.
    """
    text, encoding = _decode(data)
    if text is None or _looks_binary(text):
        raise BinaryDocument(display)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text, encoding


def line_spans(text: str, file: str, first_line: int = 1, offset: int = 0,
               show_file: bool = False) -> list[Span]:
    """One span per non-blank line of `text` (which starts at `offset` in the document)."""
    spans = []
    pos = 0
    for number, line in enumerate(text.split("\n"), start=first_line):
        stripped = line.rstrip()
        if stripped.strip():
            spans.append(Span(offset + pos, offset + pos + len(stripped), file,
                              line=number, show_file=show_file))
        pos += len(line) + 1
    return spans


def _decode(data: bytes) -> tuple[str | None, str | None]:
    for bom, codec in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec), None
            except UnicodeDecodeError:
                return None, None
    if b"\x00" in data:
        codec = _bomless_utf16(data)
        if codec is None:
            return None, None
        try:
            return data.decode(codec), codec
        except UnicodeDecodeError:
            return None, None
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        pass
    try:
        text = data.decode("cp1252")
    except UnicodeDecodeError:
        text = None
    if text is not None and _plausibly_western(text):
        return text, "cp1252"
    best = charset_normalizer.from_bytes(data).best()
    if best is None:
        return None, None
    return str(best), best.encoding


def _bomless_utf16(data: bytes) -> str | None:
    """UTF-16 without a BOM: mostly-ASCII text has a NUL in every other byte."""
    sample = data[:4096]
    if len(sample) < 4 or len(sample) % 2:
        return None
    even_nuls = sample[0::2].count(0)
    odd_nuls = sample[1::2].count(0)
    half = len(sample) // 2
    if odd_nuls > 0.7 * half and even_nuls == 0:
        return "utf-16-le"
    if even_nuls > 0.7 * half and odd_nuls == 0:
        return "utf-16-be"
    return None


def _plausibly_western(text: str) -> bool:
    non_ascii = [c for c in text if ord(c) > 127]
    if not non_ascii:
        return True
    if sum(c in _WESTERN for c in non_ascii) < 0.95 * len(non_ascii):
        return False
    letters = sum(c.isalpha() for c in text)
    return sum(c.isalpha() for c in non_ascii) <= 0.3 * max(letters, 1)


def _looks_binary(text: str) -> bool:
    sample = text[:65536]
    if not sample:
        return False
    return len(_CONTROL.findall(sample)) > max(2, len(sample) // 200)
