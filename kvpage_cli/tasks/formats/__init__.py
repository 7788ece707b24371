"""A review in the formats lawyers work in: Word comments (docx), highlights in the PDF (pdf), and
a one-file HTML report (html) with an index page for several contracts.

Each writer takes the ReviewResult and the Document it was made from (its text and source
spans), and returns the file's bytes or text; the CLI chooses and writes. None of them imports
typer or rich.
"""

from __future__ import annotations

from ...errors import KvpageError


class FormatError(KvpageError):
    """A review cannot be written in the format asked for (the input is of another kind, or the file
    cannot be opened for copying)."""
