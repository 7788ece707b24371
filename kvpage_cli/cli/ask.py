"""`kvpage ask PATH QUESTION`: a question over a file, a code repository or stdin."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import ModelError, UsageError
from ..tasks import Asker, AskResult
from . import render
from .options import GENERATION, MODEL, OUTPUT, RUN, Options, Password, shared_options
from .output import Sink, check_out_path, choose_format
from .session import Interrupted, Session, document_label, stats_dict

FORMATS = ("text", "markdown", "json")
DEFAULT_ANSWER_TOKENS = 256


@shared_options(MODEL, GENERATION, OUTPUT, RUN)
def ask(
    path: Annotated[str, typer.Argument(metavar="PATH", show_default=False,
                                        help="A file (PDF, DOCX, text, code), a directory (a repository) or - for stdin.")],
    question: Annotated[str, typer.Argument(metavar="QUESTION", show_default=False, help="The question, in quotes.")],
    temperature: Annotated[float, typer.Option("--temperature", "-t", min=0.0, rich_help_panel=GENERATION,
                                               help="0 decodes greedily; higher samples more freely.")] = 0.0,
    password: Password = None,
    *,
    opts: Options,
) -> None:
    """Ask a question about a document, a code repository or stdin; the answer streams to stdout.

    PATH is a file, a directory (a code repository: .gitignore is honoured, binary files are
    skipped) or `-` to read stdin. The document is prefilled once, then the answer is decoded
    and printed as it comes, so `kvpage ask ... | cat` streams. `--json` prints one JSON
    document at the end instead.

    Examples:

    ```
    kvpage ask samples/repo "Where is the VAT rate configured and what is it?"
    kvpage ask samples/contract.pdf "When does the initial term end?"
    git log -p -20 | kvpage ask - "Which commit changed the rounding?"
    kvpage ask report.docx "Summarise the findings" --json --max-new-tokens 400
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
        try:
            asker = Asker(engine, doc, question, max_new_tokens=opts.max_new_tokens or DEFAULT_ANSWER_TOKENS,
                          temperature=temperature, on_event=session.reporter, label=document_label(path))
        except ValueError as exc:  # a model without a tokenizer
            raise ModelError(f"{opts.model}: {exc}") from None
        streaming = fmt != "json"
        pieces: list[str] = []
        try:
            for piece in asker.answer():
                if streaming and not pieces:
                    if sink.is_terminal:  # the answer itself shows the progress now
                        session.reporter.stop_bars()
                    if fmt == "markdown":
                        sink.write(render.ask_markdown_head(doc.source, asker.question))
                pieces.append(piece)
                if streaming:
                    sink.write(piece)
        except KeyboardInterrupt:
            if streaming and pieces and opts.out is None:
                sink.write("\n")
            sink.discard()
            where = f"{opts.out} was not written" if opts.out is not None else "the answer printed is partial"
            raise Interrupted(f"stopped after {len(''.join(pieces).split())} words; {where}") from None
        answer = "".join(pieces)
        session.reporter.stop_bars()
        if not answer.strip():
            session.warn("the model gave an empty answer")
        if streaming:
            if fmt == "markdown" and not pieces:
                sink.write(render.ask_markdown_head(doc.source, asker.question))
            sink.write("\n")
            if fmt == "markdown":
                sink.write(render.ask_markdown_tail(engine.name, engine.config.mode, doc.source))
        else:
            result = AskResult(
                source=doc.source, question=asker.question, answer=answer.strip(), model=engine.name,
                mode=engine.config.mode, document_tokens=asker.document_tokens, cached_tokens=asker.cached_tokens,
                complete=asker.complete, warnings=list(doc.warnings), stats=stats_dict(engine, session.elapsed()),
            )
            sink.write(render.ask_json(result))
        sink.commit()
        session.print_stats(engine)
