"""The data sink: stdout (streamed, flushed per write) or an --out file written only when complete.

Everything that is not data (progress, warnings, statistics, errors) goes to a
`Console(stderr=True)`; see `session.py`.
"""

from __future__ import annotations

import io
import os
import secrets
import sys
from pathlib import Path

from rich.console import Console, RenderableType

from ..engine.home import fsync_dir
from ..errors import UsageError

_SUFFIX_FORMATS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".md": "markdown", ".markdown": "markdown",
                   ".html": "html", ".htm": "html", ".docx": "docx", ".pdf": "pdf"}
OUT_WIDTH = 120  # columns of a table rendered into a file or a pipe


def choose_format(json_out: bool, fmt: str | None, out: Path | None, allowed: tuple[str, ...],
                  jsonl: bool = False) -> str:
    """The output format from --json / --jsonl / --format / the --out suffix / whether stdout is a terminal."""
    asked = [(name, "--" + name) for name, on in (("json", json_out), ("jsonl", jsonl)) if on]
    if fmt is not None:
        asked.append((fmt, f"--format {fmt}"))
    if len({name for name, _ in asked}) > 1:
        raise UsageError(f"choose one output format, not {' and '.join(flag for _, flag in asked)}")
    asked = [name for name, _ in asked]
    if asked:
        chosen = asked[0]
    elif out is not None:
        chosen = _SUFFIX_FORMATS.get(out.suffix.lower(), "text")
    else:
        chosen = "table" if sys.stdout.isatty() else "text"
    if chosen not in allowed:
        if not asked:  # a default that this command has no use for
            return "text"
        raise UsageError(f"--format {chosen} is not available here; use one of {', '.join(allowed)}")
    return chosen


def check_out_path(out: Path | None) -> None:
    """Fails before any work when --out cannot be written (missing folder, a directory)."""
    if out is None:
        return
    if out.exists() and out.is_dir():
        raise UsageError(f"--out {out} is a directory")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--out {out}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--out {out}: the folder {parent} is not writable")


def write_file(target: Path, data: bytes) -> None:
    """Writes `target` all at once or not at all: a temp file in the same folder, flushed to disk,
    then a rename. A file it replaces keeps its mode; a new one gets the mode the umask gives."""
    folder = target.parent if str(target.parent) else Path(".")
    tmp = folder / f".{target.name}.{secrets.token_hex(4)}.part"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the kernel applies the umask
    try:
        try:
            os.fchmod(fd, target.stat().st_mode & 0o7777)
        except FileNotFoundError:
            pass
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, target)
        fsync_dir(folder)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class Sink:
    """Where data goes. Without --out: stdout, flushed after each write so pipes stream.
    With --out: a buffer, written to the file atomically by `commit()` and dropped otherwise."""

    def __init__(self, out: Path | None = None, no_color: bool = False) -> None:
        self.out = out
        self.no_color = no_color
        self._buffer = io.StringIO() if out is not None else None
        self._bytes: bytes | None = None  # a binary output (DOCX, PDF), written as it is
        self.written = False

    def write_bytes(self, data: bytes) -> None:
        """A whole binary file: to --out at commit(), or to stdout now."""
        if self._buffer is not None:
            self._bytes = data
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        self.written = True

    @property
    def stream(self):
        return self._buffer if self._buffer is not None else sys.stdout

    @property
    def is_terminal(self) -> bool:
        """True when data lands on a terminal (it then competes with progress bars on the screen)."""
        return self._buffer is None and sys.stdout.isatty()

    def write(self, text: str) -> None:
        if not text:
            return
        self.stream.write(text)
        self.written = True
        if self._buffer is None:
            sys.stdout.flush()

    def line(self, text: str = "") -> None:
        self.write(text + "\n")

    def render(self, renderable: RenderableType) -> None:
        """Prints a rich renderable (a table) as data: styled on a terminal, plain text elsewhere."""
        if self.is_terminal:
            console = Console(file=sys.stdout, no_color=self.no_color or None, highlight=False)
        else:
            console = Console(file=self.stream, width=OUT_WIDTH, color_system=None, force_terminal=False,
                              highlight=False, soft_wrap=False)
        console.print(renderable)
        self.written = True
        if self._buffer is None:
            sys.stdout.flush()

    def commit(self) -> None:
        """Writes --out (all of it, or nothing: see write_file)."""
        if self._buffer is None or self.out is None:
            return
        data = self._bytes if self._bytes is not None else self._buffer.getvalue().encode("utf-8")
        write_file(self.out, data)
        self._buffer = io.StringIO()
        self._bytes = None

    def discard(self) -> None:
        if self._buffer is not None:
            self._buffer = io.StringIO()
            self._bytes = None

