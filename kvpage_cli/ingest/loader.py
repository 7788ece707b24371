"""Choosing the reader for a path, a directory or stdin."""

from __future__ import annotations

import io
import os
import sys
import zipfile
from pathlib import Path

from kvpage_cli.errors import IngestError
from kvpage_cli.ingest.document import Document, read_stream
from kvpage_cli.ingest.docx import read_docx
from kvpage_cli.ingest.markdown import read_markdown
from kvpage_cli.ingest.errors import (
    BrokenDocument,
    DirectoryNotAllowed,
    DocumentNotFound,
    UnsupportedDocument,
)
from kvpage_cli.ingest.pdf import read_pdf
from kvpage_cli.ingest.repo import read_repo
from kvpage_cli.ingest.text import read_text

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".text", ".rst"}
MARKDOWN_SUFFIXES = {".md", ".markdown"}
DOCX_SUFFIXES = {".docx", ".docm", ".dotx", ".dotm"}
_CONVERT = "save it as PDF or DOCX first"
_UNSUPPORTED = {
    ".doc": _CONVERT, ".dot": _CONVERT, ".rtf": _CONVERT, ".odt": _CONVERT, ".pages": _CONVERT,
    ".wpd": _CONVERT, ".epub": "", ".xls": "", ".xlsx": "", ".xlsm": "", ".ods": "",
    ".ppt": "", ".pptx": "", ".odp": "", ".key": "", ".numbers": "",
    ".png": "OCR it first", ".jpg": "OCR it first", ".jpeg": "OCR it first",
    ".gif": "", ".bmp": "", ".tif": "OCR it first", ".tiff": "OCR it first", ".webp": "",
    ".heic": "", ".svg": "", ".zip": "", ".gz": "", ".tar": "", ".7z": "", ".rar": "",
    ".mp3": "", ".mp4": "", ".wav": "", ".mov": "", ".exe": "", ".dll": "", ".so": "",
}
_MAGIC = (
    (b"\x89PNG", "image"), (b"\xff\xd8\xff", "image"), (b"GIF8", "image"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "legacy Office file"), (b"PK\x03\x04", "zip archive"),
    (b"\x7fELF", "program"), (b"MZ", "program"), (b"Rar!", "archive"), (b"7z\xbc\xaf", "archive"),
    (b"\x1f\x8b", "archive"), (b"{\\rtf", "RTF"),
)


def load(
    path: str,
    *,
    password: str | None = None,
    stdin: bytes | None = None,
    allow_directory: bool = True,
) -> Document:
    """Read `path` into a Document: a PDF, a DOCX, a text file, a directory (a repo) or "-".

    "-" reads `stdin` (or the process's standard input when None) and tells PDF and DOCX from text
    by their first bytes. A directory is read as a repository unless `allow_directory` is False.
    Raises an IngestError subclass with a one-line message for anything that cannot be read.
    """
    if path == "-":
        data = stdin if stdin is not None else read_stream(sys.stdin.buffer, "stdin")
        try:
            return _load_bytes(data, password)
        except IngestError as e:
            # "- is empty" reads badly; the spans still say "-"
            if e.args and isinstance(e.args[0], str) and e.args[0].startswith("- "):
                e.args = ("stdin " + e.args[0][2:],) + e.args[1:]
            raise
    p = Path(path)
    if p.is_dir():
        if not allow_directory:
            raise DirectoryNotAllowed(path)
        return read_repo(p, display=path)
    if not p.exists():
        raise DocumentNotFound(path)
    if not p.is_file():
        raise BrokenDocument(path, "it is not a regular file")
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise BrokenDocument(path, e.strerror or str(e)) from None
    suffix = p.suffix.lower()
    if suffix == ".pdf" or _is_pdf(head):
        return read_pdf(p, password=password, display=path)
    if suffix in DOCX_SUFFIXES or (head.startswith(b"PK\x03\x04") and _is_docx(p)):
        return read_docx(p, display=path)
    if suffix in _UNSUPPORTED:
        raise UnsupportedDocument(path, _UNSUPPORTED[suffix])
    if suffix not in TEXT_SUFFIXES:
        for magic, what in _MAGIC:
            if head.startswith(magic):
                raise UnsupportedDocument(path, f"it is a {what}")
    if suffix in MARKDOWN_SUFFIXES:
        return read_markdown(p, display=path)
    return read_text(p, display=path)


def _load_bytes(data: bytes, password: str | None) -> Document:
    if _is_pdf(data[:4096]):
        return read_pdf(data, password=password, display="-")
    if data.startswith(b"PK\x03\x04") and _is_docx(io.BytesIO(data)):
        return read_docx(data, display="-")
    for magic, what in _MAGIC:
        if data.startswith(magic):
            raise UnsupportedDocument("-", f"it is a {what}")
    return read_text(data, display="-")


def _is_pdf(head: bytes) -> bool:
    return head.lstrip()[:5] == b"%PDF-"


def _is_docx(source: os.PathLike | io.BytesIO) -> bool:
    try:
        with zipfile.ZipFile(source) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
    return "word/document.xml" in names
