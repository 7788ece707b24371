"""Ingest: files, directories and stdin become text with a source span for every piece.

Never imports typer, rich or tqdm: the CLI reports warnings and errors.
"""

from kvpage_cli.ingest.clauses import Clause, split_clauses
from kvpage_cli.ingest.document import MAX_SOURCE_BYTES, MAX_TEXT_CHARS, Document, Span, read_stream
from kvpage_cli.ingest.docx import read_docx
from kvpage_cli.ingest.errors import (
    BinaryDocument,
    BrokenDocument,
    DirectoryNotAllowed,
    DocumentNotFound,
    DocumentTooLarge,
    EmptyDocument,
    EncryptedDocument,
    NothingReadable,
    NoTextLayer,
    UnsupportedDocument,
)
from kvpage_cli.ingest.loader import load
from kvpage_cli.ingest.pdf import read_pdf
from kvpage_cli.ingest.repo import read_repo
from kvpage_cli.ingest.text import read_text

__all__ = [
    "BinaryDocument",
    "BrokenDocument",
    "Clause",
    "DirectoryNotAllowed",
    "Document",
    "DocumentNotFound",
    "DocumentTooLarge",
    "EmptyDocument",
    "EncryptedDocument",
    "MAX_SOURCE_BYTES",
    "MAX_TEXT_CHARS",
    "NoTextLayer",
    "NothingReadable",
    "Span",
    "UnsupportedDocument",
    "load",
    "read_docx",
    "read_pdf",
    "read_repo",
    "read_stream",
    "read_text",
    "split_clauses",
]
