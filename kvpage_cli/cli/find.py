"""`kvpage find PATH QUESTION`: the lines of a document that answer a question, without an answer."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ..errors import UsageError
from ..tasks import SCHEMA_VERSION
from ..tasks.find import FIND_SPANS, Finder
from . import render
from .options import MODEL, OUTPUT, RUN, Options, Password, shared_options
from .output import Sink, check_out_path, choose_format
from .session import Session, document_label

FORMATS = ("text", "markdown", "json")


@shared_options(MODEL, OUTPUT, RUN)
def find(
    path: Annotated[str, typer.Argument(metavar="PATH", show_default=False,
                                        help="A file (PDF, DOCX, text, code), a directory (a repository) or - for stdin.")],
    question: Annotated[str, typer.Argument(metavar="QUESTION", show_default=False,
                                            help="What to find, in quotes: a question or a description.")],
    count: Annotated[int, typer.Option("-n", "--count", min=1, max=100, rich_help_panel=OUTPUT,
                                       help="How many places to print, best first.")] = FIND_SPANS,
    password: Password = None,
    *,
    opts: Options,
) -> None:
    """Find the lines of a document or repository that answer a question: a grep by meaning.

    The same search `kvpage ask` reads by, without an answer: the passages chosen for the
    question (retrieval's block selection), then inside them the lines (a sentence in running
    text) that the model's attention over the question and the question's words pick out, each
    printed with its place (`src/app/config.py:12-14`, `page 3`) and its exact text, best first.
    Nothing is generated.

    It reads the document's saved index (`kvpage index PATH` builds all of it): over a saved index
    only the question is computed. Where the index does not yet hold the windows the question's
    passages lie in, find indexes those first and says so on stderr (what `kvpage ask` would do);
    they join the saved index, so the next find or ask reads them at once.

    Examples:

    ```
    kvpage find samples/repo "Where is the VAT rate configured?"
    kvpage find ~/src/urllib3 "how many times does a request retry by default" -n 3
    kvpage find contract.pdf "termination for convenience" --json | jq -r '.spans[0].where'
    kvpage index ~/src/werkzeug && kvpage find ~/src/werkzeug "maximum size of a form upload"
    ```
    """
    if not question.strip():
        raise UsageError("the question is empty")
    fmt = choose_format(opts.json_out, opts.fmt, opts.out, FORMATS)
    check_out_path(opts.out)
    sink = Sink(opts.out, opts.no_color)
    with Session(opts) as session:
        doc = session.read_document(path, password=password, allow_directory=True)
        engine = session.load_engine()
        with session.model_checked():
            finder = Finder(engine, doc, on_event=session.reporter, label=document_label(path))
            spans = finder.find(question.strip(), count)
        session.reporter.stop_bars()
        computed = engine.stats().prefill_tokens
        index = finder.asker.retriever.index
        if index.computed_tokens:
            session.say(f"indexed {index.computed_tokens:,} tokens of {doc.source} for this question "
                        f"({finder.indexed_tokens:,} of {finder.total_tokens:,} now indexed; "
                        f"`kvpage index {path}` indexes all of it)")
        session.reporter.note("read: " + "; ".join(s["where"] for s in finder.sources))
        if fmt == "json":
            sink.write(json.dumps({
                "schema_version": SCHEMA_VERSION, "source": doc.source, "question": question.strip(),
                "model": engine.name, "spans": [e.to_dict() for e in spans], "sources": finder.sources,
                "indexed_tokens": finder.indexed_tokens, "index_total_tokens": finder.total_tokens,
                "prefill_tokens": computed, "warnings": list(doc.warnings),
            }, ensure_ascii=False, indent=2) + "\n")
        elif fmt == "markdown":
            sink.write(render.ask_markdown_head(question.strip()) + render.spans_markdown(spans))
        else:
            sink.write(render.spans_text(spans))
        if not spans:
            session.warn("nothing found: the passages read hold no line of text")
        sink.commit()
        read = (f"{len(finder.selection.blocks):,} of {finder.selection.total:,} blocks read" if finder.selection.total
                else render.ALL_READ)
        session.print_stats(engine, f"retrieval: {read}, {len(spans)} place{'' if len(spans) == 1 else 's'}")
