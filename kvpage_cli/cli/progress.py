"""Engine and task events -> progress bars on stderr (only when stderr is a terminal), plus the
verbose lines and warnings. The engine never prints; this is the only place its events show."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from ..engine.events import DecodeProgress, EngineWarning, IndexProgress, ModelLoading, PrefillProgress
from ..tasks.events import ReviewProgress


PROGRESS_LINE_S = 30.0
"""With -v and no bars (stderr is not a terminal: a log file, a scheduler's job output), a stage
that runs long writes a line of its progress every PROGRESS_LINE_S seconds of it, and a last one
when it ends: `kvpage: indexing 24,576/102,272 tok, 318 tok/s, 1 min 17 s`."""


def duration(seconds: float) -> str:
    """Seconds as a reader wants them: "42.3 s", "5 min 07 s"."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest:02d} s"


def message(console: Console, kind: str, text: str, style: str) -> None:
    """One `kvpage: <kind>: <text>` line on stderr, never wrapped."""
    line = Text.assemble(("kvpage: ", "bold"), (f"{kind}: ", style), text.replace("\n", " "))
    console.print(line, soft_wrap=True, highlight=False)


STATUS_EVERY_S = 0.1  # the pinned status line is redrawn at most this often


class StatusLine:
    """One line of status pinned to the terminal's last row while data streams to the rows above
    it: the rows above are made the terminal's scroll region (DECSTBM, as apt's progress line
    does), so the streamed answer scrolls there and the status line is redrawn in place (cursor
    saved and restored around it, so the answer's own cursor never moves). `close` gives the
    terminal its whole height back and clears the line. stderr only, and only on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.rows = 0
        self.text = ""
        self._drawn_at = 0.0

    def open(self) -> None:
        rows = self._rows()
        if rows < 3:
            return
        # a line below the cursor first (scrolling the screen when the cursor is on its last row),
        # then the region above the last row, and the cursor back where it was, inside it
        self._write("\n\x1b7" + f"\x1b[1;{rows - 1}r" + "\x1b8\x1b[1A")
        self.rows = rows

    def show(self, text: str, force: bool = False) -> None:
        """Redraws the line with `text` (at most every STATUS_EVERY_S unless `force`)."""
        self.text = text
        now = time.monotonic()
        if not self.rows or (not force and now - self._drawn_at < STATUS_EVERY_S):
            return
        self._drawn_at = now
        rows = self._rows()
        if rows != self.rows and rows >= 3:  # the terminal was resized: the region follows it
            self._write("\x1b7" + f"\x1b[1;{rows - 1}r" + "\x1b8")
            self.rows = rows
        width = max(1, _columns(self.stream) - 1)
        self._write(f"\x1b7\x1b[{self.rows};1H\x1b[2K" + text[:width] + "\x1b8")

    def close(self) -> None:
        if not self.rows:
            return
        self._write(f"\x1b7\x1b[r\x1b8\x1b7\x1b[{self.rows};1H\x1b[2K\x1b8")
        self.rows = 0

    def _rows(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).lines
        except (OSError, ValueError, AttributeError):
            return 0

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 80


class Reporter:
    """The event callback of a run. Bars show only while `bars` is on (stderr is a terminal);
    `-v` adds model-loading stages and per-clause lines, and without bars a long stage's
    progress (PROGRESS_LINE_S); `-q` hides bars and warnings."""

    def __init__(self, console: Console, bars: bool | None = None, verbose: bool = False, quiet: bool = False) -> None:
        self.console = console
        self.bars = (sys.stderr.isatty() and not quiet) if bars is None else bars
        self.verbose = verbose
        self.quiet = quiet
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._finished: set[str] = set()
        self._rate = ""  # the latest decode throughput
        self._line_at: dict[str, float] = {}  # without bars: a stage's seconds at its last progress line
        self._status: StatusLine | None = None  # while an answer streams to the terminal: the decode line

    # -- lifetime ------------------------------------------------------------------------------

    def __enter__(self) -> "Reporter":
        if self.bars:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description:<10}"),
                BarColumn(bar_width=30),
                TextColumn("{task.fields[count]}"),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
                redirect_stdout=False,  # stdout is data: never route it through the live display
                redirect_stderr=False,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_bars()

    def next_document(self) -> None:
        """A run's next document (a review of several): its prefill is the document's again, not
        questions appended after the last one: the prefill bar and -v lines follow it."""
        self._finished.clear()
        self._line_at.clear()

    def stop_bars(self) -> None:
        """Ends the live display (before data is streamed to the same terminal) and the pinned
        status line."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._status is not None:
            self._status.close()
            self._status = None

    def pin_status(self) -> None:
        """Data is about to stream to the terminal the bars are on: the bars end, and the decode
        progress goes on in a status line pinned to the terminal's last row (StatusLine)."""
        bars = self._progress is not None
        self.stop_bars()
        if bars and not self.quiet:
            self._status = StatusLine(self.console.file)
            self._status.open()

    # -- events --------------------------------------------------------------------------------

    def __call__(self, event) -> None:
        if isinstance(event, PrefillProgress):
            if "prefill" in self._finished:  # questions appended after the document (ask, review)
                if "clauses" in self._tasks and event.elapsed_s > 0:  # a review: the clause bar shows the model's pace
                    self._rate = f"{event.done / event.elapsed_s:,.0f} tok/s read"
                    self._progress.update(self._tasks["clauses"], rate=self._rate)
                return
            rate = (event.done - event.cached) / event.elapsed_s if event.elapsed_s > 0 else 0.0
            cached = f", {event.cached:,} cached" if event.cached else ""
            self._update("prefill", event.done, event.total, f"{event.done:,}/{event.total:,} tok{cached}",
                         f"{rate:,.0f} tok/s", event.elapsed_s)
            if event.done >= event.total:
                self._finished.add("prefill")
        elif isinstance(event, IndexProgress):
            computed = event.done - event.cached
            rate = computed / event.elapsed_s if event.elapsed_s > 0 and computed else 0.0
            cached = f" ({event.cached:,} from saved KV)" if event.cached else ""
            self._update("indexing", event.done, event.total, f"{event.done:,}/{event.total:,} tok{cached}",
                         f"{rate:,.0f} tok/s" if rate else "", event.elapsed_s)
        elif isinstance(event, DecodeProgress):
            rate = event.generated / event.elapsed_s if event.elapsed_s > 0 else 0.0
            together = f", {event.sequences} at once" if event.sequences > 1 else ""
            self._rate = f"{rate:,.1f} tok/s{together}"
            if "clauses" in self._tasks:  # a review: its clause bar shows how fast it decodes
                self._progress.update(self._tasks["clauses"], rate=self._rate)
            elif self._status is not None:
                self._status.show(f"decode {event.generated:,} tok  {self._rate}  {duration(event.elapsed_s)}")
            else:
                self._update("decode", event.generated, None, f"{event.generated:,} tok", self._rate, event.elapsed_s)
        elif isinstance(event, ReviewProgress):
            self._update("clauses", event.done, event.total, f"{event.done}/{event.total}", self._rate)
        elif isinstance(event, ModelLoading):
            self.note(f"{event.source}: {event.stage}")
            if self._progress is not None and "load" in self._tasks:
                self._progress.update(self._tasks["load"], description="loading", count=event.stage)
        elif isinstance(event, EngineWarning):
            self.warn(event.message)

    def _update(self, name: str, done: int, total: int | None, count: str, rate: str,
                elapsed_s: float | None = None) -> None:
        if self._progress is None:
            if elapsed_s is not None:
                self._line(name, total is not None and done >= total, count, rate, elapsed_s)
            return
        if name not in self._tasks:
            self._tasks[name] = self._progress.add_task(name, total=total, count=count, rate=rate)
        self._progress.update(self._tasks[name], completed=done, total=total, count=count, rate=rate)

    def _line(self, name: str, ended: bool, count: str, rate: str, elapsed_s: float) -> None:
        """Without bars, with -v: a stage's progress line every PROGRESS_LINE_S seconds of it, and
        its last where it wrote one before."""
        if not self.verbose or self.quiet:
            return
        if elapsed_s - self._line_at.get(name, 0.0) >= PROGRESS_LINE_S or (ended and name in self._line_at):
            self.note(f"{name} {count}" + (f", {rate}" if rate else "") + f", {duration(elapsed_s)}")
            self._line_at[name] = elapsed_s
        if ended:
            self._line_at.pop(name, None)  # a later stage of the same name starts afresh

    # -- stages and lines ----------------------------------------------------------------------

    @contextmanager
    def stage(self, name: str, what: str) -> Iterator[None]:
        """A spinner while something without its own progress runs (reading a file, loading a model)."""
        self.note(what)
        if self._progress is None:
            yield
            return
        task = self._progress.add_task(name, total=None, count=what, rate="")
        self._tasks[name] = task
        try:
            yield
        finally:
            if self._progress is not None:
                self._progress.update(task, total=1, completed=1, count=what)

    def note(self, text: str) -> None:
        """A -v line on stderr."""
        if self.verbose and not self.quiet:
            self.console.print(Text("kvpage: " + text), soft_wrap=True, highlight=False)

    def warn(self, text: str) -> None:
        if not self.quiet:
            message(self.console, "warning", text, "bold yellow")
