"""`kvpage index PATH`: a document's whole index, built ahead of the questions."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from ..errors import UsageError
from ..tasks import SCHEMA_VERSION, Asker
from .options import MODEL, OUTPUT, RUN, Options, Password, shared_options
from .output import Sink, check_out_path, choose_format
from .progress import duration
from .session import Session, document_label

FORMATS = ("text", "json")


@shared_options(MODEL, OUTPUT, RUN)
def index(
    path: Annotated[str, typer.Argument(metavar="PATH", show_default=False,
                                        help="A file (PDF, DOCX, text, code) or a directory (a repository).")],
    password: Password = None,
    *,
    opts: Options,
) -> None:
    """Index a document or repository into the saved-KV cache, all of it, with progress.

    `kvpage ask` and `kvpage find` index a long document lazily: a question indexes only the
    windows its passages lie in, so a first answer does not wait for the whole document, and the
    index grows as later questions need more. `kvpage index` builds the whole index ahead of time (minutes
    for a repository of 150K tokens on a small CPU), so that every later question reads only
    what it chooses. Windows already saved are mapped, not computed again. A document that fits
    the model's context is prefilled whole instead, as `kvpage ask` reads it.

    Nothing is printed on stdout but with `--json` (what was indexed); progress and the summary
    go to stderr. The cache lives under KVPAGE_HOME/kv (`kvpage cache ls` lists it); give it room
    with `--cache-mib`.

    Examples:

    ```
    kvpage index ~/src/urllib3
    kvpage index manual.pdf --cache-mib 40000
    kvpage index ~/src/werkzeug --json | jq .computed_tokens
    ```
    """
    if path == "-":
        raise UsageError("kvpage index saves a document for later questions: give a file or a directory, not stdin")
    if opts.get("no_cache"):
        raise UsageError("kvpage index saves the document's KV for later questions; it cannot run with --no-cache")
    fmt = choose_format(opts.json_out, opts.fmt, opts.out, FORMATS)
    check_out_path(opts.out)
    sink = Sink(opts.out, opts.no_color)
    with Session(opts) as session:
        doc = session.read_document(path, password=password, allow_directory=True)
        engine = session.load_engine()
        started = time.perf_counter()
        with session.model_checked():
            # the prompt `kvpage ask` builds: its head and windows are the keys later questions look up
            asker = Asker(engine, doc, "index", max_new_tokens=1, on_event=session.reporter, label=document_label(path),
                          evidence=False, lazy=False)
        if asker.mode == "retrieval":
            built = asker.index().index
            total, computed, windows = len(built.tokens), built.computed_tokens, len(built.windows)
            what = f"indexed {total:,} tokens of {doc.source} in {windows:,} windows"
        else:
            ctx = engine.prefill(asker.prefix_ids, on_event=session.reporter, label=document_label(path))
            total, computed, windows = len(asker.prefix_ids), len(asker.prefix_ids) - ctx.cached_prefix, 0
            engine.release(ctx)
            what = f"prefilled {doc.source} whole ({total:,} tokens: it fits the model's context)"
        session.reporter.stop_bars()
        seconds = time.perf_counter() - started
        saved = "" if computed == total else f", {total - computed:,} of them already saved"
        session.say(f"{what}{saved}, in {duration(seconds)}")
        if fmt == "json":
            sink.write(json.dumps({"schema_version": SCHEMA_VERSION, "source": doc.source, "model": engine.name,
                                   "mode": asker.mode, "tokens": total, "computed_tokens": computed,
                                   "windows": windows, "seconds": round(seconds, 2), "warnings": list(doc.warnings)},
                                  indent=2) + "\n")
        sink.commit()
        session.print_stats(engine, f"{asker.mode} index")
