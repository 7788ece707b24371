"""One run of a command: the stderr console, progress, reading the input, loading the model,
the final statistics line, and turning every error into one line and an exit code."""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console

from .. import ingest
from ..engine import Engine, EngineStats
from ..errors import KvpageError, ModelError
from . import ranks
from .options import PASSWORD_ENV, Options
from .progress import Reporter, duration, message

EXIT_INTERRUPTED = 130
MIB = 2**20


class Interrupted(KvpageError):
    """Ctrl-C: the message says what was done and what was not written."""

    exit_code = EXIT_INTERRUPTED


_interrupt_said: list[bool] = []  # the interrupted line was printed (`guarded`), for app.KvpageGroup


def interrupt_said() -> bool:
    """Whether a command printed its interrupted line since the last call: typer turns a Ctrl-C that
    comes before any command (while the arguments are read) into exit 130 without a word, and
    app.KvpageGroup says one then."""
    said = bool(_interrupt_said)
    _interrupt_said.clear()
    return said


def stderr_console(no_color: bool = False) -> Console:
    # no_color=None leaves rich to honour NO_COLOR / FORCE_COLOR itself
    return Console(stderr=True, no_color=no_color or None, highlight=False)


def guarded(opts: Options, body: Callable[[], Any]) -> Any:
    """Runs a command; known errors become `kvpage: error: ...` and their exit code, Ctrl-C exits
    130, anything else is one line asking for --debug. With --debug the exception propagates."""
    debug = bool(opts.get("debug"))
    console = stderr_console(bool(opts.get("no_color")))
    if not debug:
        quiet_library_logs()
    try:
        return body()
    except (typer.Exit, typer.Abort):
        raise
    except Interrupted as exc:
        if debug:
            raise
        message(console, "interrupted", str(exc), "bold yellow")
        _interrupt_said.append(True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        if debug:
            raise
        message(console, "interrupted", "stopped before the end; nothing was written as if complete", "bold yellow")
        _interrupt_said.append(True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except KvpageError as exc:
        if debug:
            raise
        message(console, "error", str(exc), "bold red")
        raise typer.Exit(exc.exit_code) from None
    except BrokenPipeError:
        # the reader of stdout went away (`| head`): stop quietly
        _silence_stdout()
        raise typer.Exit(141) from None
    except Exception as exc:
        if debug:
            raise
        message(console, "unexpected error", f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
                "bold red")
        raise typer.Exit(1) from None


def quiet_library_logs() -> None:
    """Log records and Python warnings of libraries (pypdf's repairs, transformers' notices) are
    for their developers; on a user's stderr they would break the one-line messages. --debug
    keeps them."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("pypdf", "transformers", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class Session:
    """What one command run shares: options, the stderr console, the progress reporter."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.console = stderr_console(bool(opts.get("no_color")))
        self.reporter = Reporter(self.console, verbose=bool(opts.get("verbose")), quiet=bool(opts.get("quiet")))
        self.started = time.perf_counter()

    def __enter__(self) -> "Session":
        self.reporter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.reporter.__exit__(*exc)

    def warn(self, text: str) -> None:
        self.reporter.warn(text)

    def say(self, text: str) -> None:
        """A line on stderr for the user (not with -q)."""
        if not self.opts.get("quiet"):
            self.console.print("kvpage: " + text, soft_wrap=True, highlight=False, markup=False)

    def read_document(self, path: str, password: str | None = None, allow_directory: bool = True) -> ingest.Document:
        """The document at `path` ("-": stdin bytes), with its warnings shown on stderr. An
        encrypted PDF without a password asks for one (hidden) when stdin and stderr are terminals.
        Tensor-parallel: rank 0 reads it and the other ranks receive it."""
        doc = ranks.from_rank_zero(lambda: self._read_document(path, password, allow_directory))
        for warning in doc.warnings:
            self.warn(warning)
        return doc

    def _read_document(self, path: str, password: str | None, allow_directory: bool) -> ingest.Document:
        name = "stdin" if path == "-" else path
        data = None
        try:
            with self.reporter.stage("reading", f"reading {name}"):
                if path == "-":
                    if sys.stdin.isatty():
                        self.warn("reading the document from the terminal; end it with Ctrl-D")
                    data = ingest.read_stream(sys.stdin.buffer, "stdin")
                doc = ingest.load(path, password=password, stdin=data, allow_directory=allow_directory)
        except ingest.EncryptedDocument as exc:
            if exc.password_given:
                raise
            if not _interactive():
                raise KvpageError(f"{exc}, or set {PASSWORD_ENV}") from None
            self.reporter.stop_bars()
            password = typer.prompt(f"{exc.name} is encrypted; password", hide_input=True, err=True)
            with self.reporter.stage("reading", f"reading {name}"):
                doc = ingest.load(path, password=password, stdin=data, allow_directory=allow_directory)
        return doc

    def load_engine(self) -> Engine:
        opts = self.opts
        config = opts.engine_config()
        with self.reporter.stage("loading", f"loading model {opts.model}"):
            engine = Engine.load(opts.model, config, on_event=self.reporter)
        self.reporter.note(f"model {engine.name}: {engine.spec.arch}, context {engine.max_context:,} tokens, "
                           f"{config.mode} mode, {engine.backend.name} backend, kv path {engine.kv_path}")
        return engine

    @contextmanager
    def model_checked(self):
        """Around a task's start over the loaded model: what the task refuses of the model (no
        tokenizer; one that turns plain text into control tokens) as the model's error, named."""
        try:
            yield
        except ValueError as exc:
            raise ModelError(f"{self.opts.model}: {exc}") from None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def print_stats(self, engine: Engine, mode: str | None = None) -> None:
        """The final statistics line on stderr (not with -q); `mode` says how the output was made."""
        if self.opts.get("quiet"):
            return
        self.console.print(stats_line(engine, self.elapsed(), mode), soft_wrap=True, highlight=False, markup=False)


def _interactive() -> bool:
    """Whether a question can be asked: stdin and stderr are a terminal (not a pipe, not a file)."""
    return sys.stdin.isatty() and sys.stderr.isatty()


def document_label(path: str) -> str:
    """How a document is named in the saved-KV cache: its absolute path ("stdin" for -)."""
    return "stdin" if path == "-" else str(Path(path).resolve())


def pool_capacity_bytes(engine: Engine) -> int:
    pool = engine.pool
    return pool.num_layers * pool.num_slots * pool.slot_bytes


def stats_dict(engine: Engine, wall_seconds: float | None = None) -> dict:
    """engine.stats() with the derived figures a reader wants: tok/s and MiB."""
    stats: EngineStats = engine.stats()
    data = asdict(stats)
    data.update(
        prefill_tokens_per_s=round(stats.prefill_tokens_per_s, 1),
        decode_tokens_per_s=round(stats.decode_tokens_per_s, 1),
        pool_mib=round(pool_capacity_bytes(engine) / MIB, 2),
        pool_allocated_mib=round(stats.pool_bytes / MIB, 2),
        store_mib=round(stats.store_reserved_bytes / MIB, 2),
        store_in_use_mib=round(stats.store_bytes / MIB, 2),
        weights_mib=round(stats.weight_bytes / MIB, 1),
        device=str(engine.device),
    )
    if wall_seconds is not None:
        data["wall_seconds"] = round(wall_seconds, 2)
    return data


def stats_line(engine: Engine, wall_seconds: float, mode: str | None = None) -> str:
    s = engine.stats()
    pool_mib = pool_capacity_bytes(engine) / MIB
    pool_note = "" if s.pool_bytes else " (not used: blocks read in place)"
    cached = f" ({s.cached_tokens:,} from saved KV)" if s.cached_tokens else ""
    # a review scores its answers and decodes nothing (unless --explain): no decode rate to show
    decode = f" | decode {s.decode_tokens:,} tok at {s.decode_tokens_per_s:,.1f} tok/s" if s.decode_tokens else ""
    # nothing computed (a review whose findings needed no question): no rate to show
    rate = f" at {s.prefill_tokens_per_s:,.1f} tok/s" if s.prefill_tokens else ""
    return (
        f"kvpage: prefill {s.prefill_tokens:,} tok{rate}{cached}{decode}"
        f" | pool {pool_mib:,.1f} MiB{pool_note}"
        f" | store {s.store_reserved_bytes / MIB:,.1f} MiB"
        f" | blocks moved {s.blocks_moved:,}"
        f" | {mode or s.mode + ' mode'}, {s.backend} on {engine.device.type}, {duration(wall_seconds)}"
    )
