"""`kvpage review FILE`: a clause-by-clause risk review of a contract."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from ..engine import PrefillProgress
from ..errors import ModelError
from ..tasks import RISK_LEVELS, Finding, Reviewer, ReviewProgress, ReviewResult
from . import render
from .options import GENERATION, MODEL, OUTPUT, RUN, Options, Password, shared_options
from .output import Sink, check_out_path, choose_format
from .session import Interrupted, Session, document_label, stats_dict

FORMATS = ("table", "text", "markdown", "json", "jsonl")
DEFAULT_REASON_TOKENS = 40
EXIT_FAIL_ON = 3


@shared_options(MODEL, GENERATION, OUTPUT, RUN)
def review(
    file: Annotated[str, typer.Argument(metavar="FILE", show_default=False,
                                        help="The contract: a PDF, DOCX, TXT or MD file; - reads stdin.")],
    jsonl: Annotated[bool, typer.Option("--jsonl", rich_help_panel=OUTPUT,
                                        help="One JSON finding per line as each clause is done, then a summary line.")] = False,
    fail_on: Annotated[Literal["high", "medium", "low"] | None, typer.Option(
        "--fail-on", rich_help_panel=OUTPUT, metavar="LEVEL",
        help="Exit with code 3 when a finding reaches this risk level (high, medium, low).")] = None,
    password: Password = None,
    *,
    opts: Options,
) -> None:
    """Review a contract clause by clause: category, risk, reason and the exact quote.

    Every clause gets a category (indemnification, liability cap, auto-renewal, ...), a risk level
    (high, medium, low, none), a one-sentence reason, and the exact quote with its source: the
    page of a PDF, the paragraph of a DOCX, the line of a text file. The document is prefilled
    once; each clause is a question on a fork of it. The output says which engine mode produced
    it. On a terminal the review is a table grouped by risk; in a pipe it is plain text.

    Examples:

    ```
    kvpage review samples/contract.pdf
    kvpage review contract.docx --format markdown --out review.md
    kvpage review contract.pdf --json | jq '.findings[] | select(.risk == "high")'
    kvpage review contract.txt --jsonl --fail-on high      # exit 3 on a high-risk clause
    cat contract.txt | kvpage review - --mode selective --pool-mib 16
    KVPAGE_PDF_PASSWORD=secret kvpage review locked.pdf   # or: asked for on a terminal
    ```
    """
    fmt = choose_format(opts.json_out, opts.fmt, opts.out, FORMATS, jsonl=jsonl)
    check_out_path(opts.out)
    sink = Sink(opts.out, opts.no_color)
    with Session(opts) as session:
        doc = session.read_document(file, password=password, allow_directory=False)
        engine = session.load_engine()
        clause_bar = _ClauseBarAfterPrefill(session)
        try:
            reviewer = Reviewer(engine, doc, max_reason_tokens=opts.max_new_tokens or DEFAULT_REASON_TOKENS,
                                on_event=clause_bar, label=document_label(file))
        except ValueError as exc:  # a model without a tokenizer
            raise ModelError(f"{opts.model}: {exc}") from None
        total = clause_bar.total = len(reviewer.clauses)
        session.reporter.note(f"{doc.source}: {total} clauses, {reviewer.document_tokens:,} tokens with the instructions")
        findings: list[Finding] = []
        try:
            for finding in reviewer.findings():
                findings.append(finding)
                session.reporter.note(f"clause {finding.clause_id} ({len(findings)}/{total}): {finding.risk} risk, "
                                      f"{finding.category}")
                if fmt == "jsonl":
                    if sink.is_terminal:
                        session.reporter.stop_bars()
                    sink.write(render.finding_jsonl(finding))
        except KeyboardInterrupt:
            sink.discard()
            raise Interrupted(_interrupted_note(len(findings), total, fmt, opts)) from None
        result = ReviewResult(
            document=doc.source, document_kind=doc.kind, model=engine.name,
            mode="exact" if engine.config.mode == "auto" else engine.config.mode,
            findings=findings, complete=True, document_tokens=reviewer.document_tokens, clauses_total=total,
            warnings=list(doc.warnings), stats=stats_dict(engine, session.elapsed()),
        )
        session.reporter.stop_bars()
        if fmt == "jsonl":
            sink.write(render.summary_jsonl(result))
        elif fmt == "json":
            sink.write(render.review_json(result))
        elif fmt == "markdown":
            sink.write(render.review_markdown(result))
        elif fmt == "table":
            sink.render(render.review_table(result))
        else:
            sink.write(render.review_text(result))
        sink.commit()
        session.print_stats(engine)
        if fail_on is not None:
            _check_fail_on(findings, fail_on, session)


class _ClauseBarAfterPrefill:
    """Passes events on, and shows the clause bar (0 of N) as soon as the document is prefilled."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.total = 0
        self.shown = False

    def __call__(self, event) -> None:
        self.session.reporter(event)
        if not self.shown and isinstance(event, PrefillProgress) and event.done >= event.total:
            self.shown = True
            self.session.reporter(ReviewProgress(0, self.total, ""))


def _interrupted_note(done: int, total: int, fmt: str, opts: Options) -> str:
    note = f"{done} of {total} clauses reviewed"
    if opts.out is not None:
        return f"{note}; {opts.out} was not written"
    if fmt == "jsonl":
        return f"{note}; the {done} lines printed are partial (no summary line)"
    return f"{note}; no review printed"


def _check_fail_on(findings: list[Finding], level: str, session: Session) -> None:
    worst = RISK_LEVELS.index(level)  # RISK_LEVELS runs high -> none
    hits = [f for f in findings if f.risk in RISK_LEVELS and RISK_LEVELS.index(f.risk) <= worst]
    if hits:
        if not session.opts.quiet:
            ids = ", ".join(f.clause_id for f in hits[:8]) + (", ..." if len(hits) > 8 else "")
            session.console.print(f"kvpage: {len(hits)} finding(s) at {level} risk or above (--fail-on {level}): {ids}",
                                  soft_wrap=True, highlight=False, markup=False)
        raise typer.Exit(EXIT_FAIL_ON)
