"""`kvpage ask PATH QUESTION`: questions over a file, a code repository or stdin."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import UsageError
from ..tasks import Asker, AskResult
from . import render
from .options import GENERATION, MODEL, OUTPUT, RUN, Options, Password, shared_options
from .output import Sink, check_out_path, choose_format
from .session import Interrupted, Session, document_label, stats_dict

FORMATS = ("text", "markdown", "json", "jsonl")
DEFAULT_ANSWER_TOKENS = 256


@shared_options(MODEL, GENERATION, OUTPUT, RUN, taken=("-q",))
def ask(
    path: Annotated[str, typer.Argument(metavar="PATH", show_default=False,
                                        help="A file (PDF, DOCX, text, code), a directory (a repository) or - for stdin.")],
    question: Annotated[str | None, typer.Argument(metavar="[QUESTION]", show_default=False,
                                                   help="The question, in quotes.")] = None,
    more: Annotated[list[str] | None, typer.Option("--question", "-q", metavar="QUESTION", show_default=False,
                                                   help="A question; repeat for several, answered together over "
                                                        "one reading of the document.")] = None,
    jsonl: Annotated[bool, typer.Option("--jsonl", rich_help_panel=OUTPUT,
                                        help="One JSON line per answer, as each is complete.")] = False,
    temperature: Annotated[float, typer.Option("--temperature", "-t", min=0.0, rich_help_panel=GENERATION,
                                               help="0 decodes greedily; higher samples more freely.")] = 0.0,
    no_evidence: Annotated[bool, typer.Option("--no-evidence", rich_help_panel=OUTPUT,
                                              help="Print the answer alone, without the lines it rests on (and "
                                                   "skip the scoring pass that finds them).")] = False,
    password: Password = None,
    *,
    opts: Options,
) -> None:
    """Ask questions about a document, a code repository or stdin; answers stream to stdout.

    PATH is a file, a directory (a code repository: .gitignore is honoured, binary files are
    skipped) or `-` to read stdin. The document is prefilled once, then the answer is decoded
    and printed as it comes, so `kvpage ask ... | cat` streams. Under the answer, its evidence:
    the one to three spans of the document (a few lines of a file, a sentence of a page) that
    carried the model's attention while it wrote the answer, quoted exactly with their place
    (`src/app/config.py:12-14`, `page 3`); `--no-evidence` leaves them out. Check an answer
    against them: the model can be wrong, the quoted lines are the document's own.

    A document longer than the model's context is answered in retrieval mode: indexed window by
    window into the saved-KV cache, each question reading the passages chosen for it. A first
    question indexes only the windows its best passages lie in (the answer says how much of the
    document was indexed when it was given); later questions reuse them and add their own.
    `kvpage index PATH` indexes all of it ahead of time.

    Several questions (`-q` again and again) are answered together over that one prefill: each
    answer is printed under its question, in order. `--json` prints one JSON document at the end
    (a list for several questions), with `evidence` as a list of {text, where, start, end,
    score}, best first, and `sources`, every passage read; `--jsonl` one line per answer. `-v`
    also lists on stderr every passage read. Here `-q` is a question: quiet is `--quiet`.

    Examples:

    ```
    kvpage ask samples/repo "Where is the VAT rate configured and what is it?"
    kvpage ask samples/contract.pdf "When does the initial term end?"
    kvpage ask contract.pdf -q "Who can terminate?" -q "What law governs?" -q "Is liability capped?"
    git log -p -20 | kvpage ask - "Which commit changed the rounding?"
    kvpage ask report.docx "Summarise the findings" --json --max-new-tokens 400
    kvpage ask ~/src/urllib3 "What is the default retry count?" --json | jq '.evidence[0]'
    ```
    """
    questions = ([question] if question is not None else []) + list(more or [])
    if not questions:
        raise UsageError("give a question (QUESTION, or -q QUESTION for each of several)")
    if any(not q.strip() for q in questions):
        raise UsageError("the question is empty")
    fmt = choose_format(opts.json_out, opts.fmt, opts.out, FORMATS, jsonl=jsonl)
    check_out_path(opts.out)
    sink = Sink(opts.out, opts.no_color)
    with Session(opts) as session:
        doc = session.read_document(path, password=password, allow_directory=True)
        engine = session.load_engine()
        with session.model_checked():
            asker = Asker(engine, doc, questions, max_new_tokens=opts.max_new_tokens or DEFAULT_ANSWER_TOKENS,
                          temperature=temperature, on_event=session.reporter, label=document_label(path),
                          evidence=not no_evidence)
        printer = _Printer(sink, fmt, asker.questions)
        answers = [""] * len(questions)
        try:
            for index, piece in asker.answers():
                if printer.streams and not any(answers) and sink.is_terminal:
                    session.reporter.pin_status()  # the bars give way to the answer; the decode line stays
                answers[index] += piece
                printer.piece(index, piece)
                if asker.complete[index]:
                    printer.done(index, answers[index], _result(asker, engine, doc, index, answers[index], session))
        except KeyboardInterrupt:
            printer.interrupted()
            sink.discard()
            where = f"{opts.out} was not written" if opts.out is not None else "the answers printed are partial"
            words = sum(len(a.split()) for a in answers)
            raise Interrupted(f"stopped after {words} words; {where}") from None
        session.reporter.stop_bars()
        results = [_result(asker, engine, doc, i, answers[i], session) for i in range(len(questions))]
        for i, result in enumerate(results):
            if not result.answer:
                found = "; the evidence is what its reading of the question attended" if result.evidence else ""
                session.warn((f"the model gave an empty answer to {asker.questions[i]!r}" if len(questions) > 1
                              else "the model gave an empty answer") + found)
            printer.done(i, answers[i], result)
            if result.sources:
                label = f"Q{i + 1} " if len(questions) > 1 else ""
                session.reporter.note(f"{label}read: " + "; ".join(_places(doc, result.sources)))
        printer.finish(results, engine.name, doc.source)
        sink.commit()
        session.print_stats(engine, _mode_line(results))


def _places(doc, sources: list[dict]) -> list[str]:
    """The sources' places for a reader, less a place that adds nothing to the one before
    ("pages 45-46; page 46" reads "pages 45-46": two passages, one place)."""
    places: list[str] = []
    first = None
    for source in sources:
        if places and doc.where(first, source["end"]) == places[-1]:
            continue
        places.append(source["where"])
        first = source["start"]
    return places


def _result(asker: Asker, engine, doc, index: int, answer: str, session: Session) -> AskResult:
    selection = asker.selections[index]
    index_total = len(asker.retriever.index.tokens) if asker.retriever is not None else None
    return AskResult(
        source=doc.source, question=asker.questions[index], answer=answer.strip(), model=engine.name,
        mode=asker.mode, document_tokens=asker.document_tokens, cached_tokens=asker.cached_tokens,
        complete=asker.complete[index], warnings=list(doc.warnings), stats=stats_dict(engine, session.elapsed()),
        question_index=index, attended_blocks=len(selection.blocks) if selection else None,
        total_blocks=selection.total if selection else None, sources=asker.sources[index],
        evidence=list(asker.evidence[index]), indexed_tokens=asker.indexed[index],
        index_total_tokens=index_total if asker.indexed[index] is not None else None,
    )


class _Printer:
    """Writes answers as they come: the answer being shown streams; answers to later questions
    that finish first wait for their turn, so the output reads in question order."""

    def __init__(self, sink: Sink, fmt: str, questions: list[str]) -> None:
        self.sink = sink
        self.fmt = fmt
        self.questions = questions
        self.several = len(questions) > 1
        self.streams = fmt in ("text", "markdown")
        self.shown = 0  # the question whose answer is being streamed
        self.started = False
        self.pending: dict[int, str] = {}  # answers (so far) of later questions
        self.finished: set[int] = set()
        self.emitted: set[int] = set()  # --jsonl lines written
        self.results: dict[int, AskResult] = {}

    def piece(self, index: int, piece: str) -> None:
        if not self.streams:
            return
        if index == self.shown:
            self._open()
            self.sink.write(piece)
        else:
            self.pending[index] = self.pending.get(index, "") + piece

    def done(self, index: int, answer: str, result: AskResult) -> None:
        if self.fmt == "jsonl":
            if index not in self.emitted:
                self.emitted.add(index)
                self.sink.write(render.ask_jsonl(result))
            return
        if not self.streams or index in self.finished:
            return
        self.finished.add(index)
        self.results[index] = result
        while self.shown in self.finished and self.shown < len(self.questions):
            self._open()
            self.sink.write("\n")
            evidence = self.results[self.shown].evidence
            self.sink.write(render.evidence_markdown(evidence) if self.fmt == "markdown" else render.evidence_text(evidence))
            self.shown += 1
            self.started = False
            if self.shown < len(self.questions):
                self._open()
                self.sink.write(self.pending.pop(self.shown, ""))

    def _open(self) -> None:
        """The question's heading, once, before its answer."""
        if self.started:
            return
        self.started = True
        question = self.questions[self.shown]
        if self.fmt == "markdown":
            self.sink.write(render.ask_markdown_head(question, first=self.shown == 0))
        elif self.several:
            self.sink.write(("\n" if self.shown else "") + f"Q{self.shown + 1}: {question}\n")

    def interrupted(self) -> None:
        if self.streams and self.started:
            self.sink.write("\n")

    def finish(self, results: list[AskResult], model: str, source: str) -> None:
        if self.fmt == "json":
            self.sink.write(render.ask_json(results[0]) if len(results) == 1 else render.asks_json(results))
        elif self.fmt == "markdown":
            first = results[0]
            self.sink.write(render.ask_markdown_tail(model, first.mode, source, first.attended_blocks, first.total_blocks,
                                                     render.selective_decode(first), render.indexed_share(first)))


def _mode_line(results: list[AskResult]) -> str:
    """How the answers were made, for the statistics line."""
    first = results[0]
    if first.mode != "retrieval":
        return render.mode_note(first.mode)
    attended = sum(r.attended_blocks or 0 for r in results) // len(results)
    each = " each (on average)" if len(results) > 1 else ""
    return render.mode_note("retrieval", attended, first.total_blocks, render.selective_decode(first), each,
                            render.indexed_share(results[-1]))
