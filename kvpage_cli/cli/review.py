"""`kvpage review FILE...`: the clauses of a contract that matter, their risk, and its key terms."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from ..engine import PrefillProgress
from ..engine.config import default
from ..errors import KvpageError, UsageError
from ..ingest.document import read_source
from ..ingest.loader import DOCX_SUFFIXES, TEXT_SUFFIXES
from ..tasks import RISK_LEVELS, Finding, Reviewer, ReviewProgress, ReviewResult
from ..tasks.formats import FormatError
from ..tasks.formats.html import review_html
from ..tasks.formats.html_index import index_html
from ..tasks.playbook import Playbook
from . import render
from .options import GENERATION, MODEL, OUTPUT, RUN, Options, Password, shared_options
from .output import Sink, check_out_path, choose_format, write_file
from .session import Interrupted, Session, document_label, stats_dict

FORMATS = ("table", "text", "markdown", "json", "jsonl", "html", "docx", "pdf")
FILE_FORMATS = {"html": ".html", "docx": ".docx", "pdf": ".pdf"}  # one file per contract; --out-dir writes them
BINARY_FORMATS = ("docx", "pdf")
INDEX = "index.html"
EXIT_FAIL_ON = 3
CONTRACT_SUFFIXES = {".pdf"} | DOCX_SUFFIXES | (TEXT_SUFFIXES - {".rst"})
_SHARD = re.compile(r"^(\d+)/(\d+)$")


@shared_options(MODEL, GENERATION, OUTPUT, RUN)
def review(
    files: Annotated[list[str], typer.Argument(metavar="FILE...", show_default=False,
                                               help="Contracts: PDF, DOCX, TXT or MD files, folders of them; - reads stdin.")],
    jsonl: Annotated[bool, typer.Option("--jsonl", rich_help_panel=OUTPUT,
                                        help="One JSON finding per line as its clause is done (with its document), "
                                             "then a summary line per document.")] = False,
    fail_on: Annotated[Literal["high", "medium", "low"] | None, typer.Option(
        "--fail-on", rich_help_panel=OUTPUT, metavar="LEVEL",
        help="Exit with code 3 when a finding reaches this risk level (high, medium, low).")] = None,
    playbook: Annotated[Path | None, typer.Option(
        "--playbook", metavar="FILE", dir_okay=False, rich_help_panel="Review",
        help="A TOML playbook to judge the risk with, instead of the default one (prompts/playbook.toml).")] = None,
    all_clauses: Annotated[bool, typer.Option(
        "--all", rich_help_panel="Review", help="Also list the clauses of no category (risk none).")] = False,
    explain: Annotated[bool, typer.Option(
        "--explain", rich_help_panel="Review",
        help="Add the model's own one-sentence commentary to each finding, labelled as such; "
             "a commentary that fails the checks (repetition, no word of the clause or the category) is dropped.")] = False,
    batch: Annotated[int, typer.Option(
        "--batch", min=1, max=1024, rich_help_panel="Review",
        help="Clause questions run together in one forward pass; 1 runs them one at a time.")] = default("max_batch"),
    shard: Annotated[str | None, typer.Option(
        "--shard", metavar="I/N", rich_help_panel="Review",
        help="Review only every N-th document from the I-th (0-based), for job arrays: --shard 0/4 ... 3/4.")] = None,
    out_dir: Annotated[Path | None, typer.Option(
        "--out-dir", metavar="DIR", file_okay=False, rich_help_panel=OUTPUT,
        help="With --format html, docx or pdf: write one file per contract into DIR (made if missing), "
             "CONTRACT.review.html|docx|pdf, and for html an index.html with a row per contract.")] = None,
    password: Password = None,
    *,
    opts: Options,
) -> None:
    """Review contracts: the clauses that matter, their risk from a playbook, and the key terms.

    Each clause gets its categories from a head trained on CUAD's expert labels (governing law,
    cap on liability, renewal term, anti-assignment, ...); a clause of no category is not a
    finding (--all lists it). For each category the playbook's questions are put to the model
    (yes/no, or a value such as a notice period, copied word for word from the clause) and its
    rules give the risk level (high, medium, low) and the reason. Every quote and value is an
    exact piece of the document with its source: the page of a PDF, the paragraph of a DOCX,
    the line of a text file. The review opens with the key terms (parties, dates, renewal,
    governing law, liability cap). A contract longer than the model's context is reviewed
    whole in retrieval mode: each clause's questions read the blocks chosen for it.

    Where lawyers work: --format docx writes a copy of a DOCX contract with a Word comment on
    each finding's quote (category, risk, reason, values) and the key terms on its title (a PDF,
    text or Markdown contract becomes a new DOCX of its text, with the same comments);
    --format pdf writes a copy of a PDF with each quote highlighted (its note says why) and a
    summary page; --format html writes one self-contained report (key terms, findings by risk
    with filters, the full text with each quote highlighted and linked). The format follows
    --out's suffix; several contracts need --out-dir.

    Examples:

    ```
    kvpage review samples/contract.pdf
    kvpage review contract.docx --format markdown --out review.md
    kvpage review contract.pdf --json | jq '.findings[] | select(.risk == "high")'
    kvpage review contract.txt --jsonl --fail-on high      # exit 3 on a high-risk clause
    kvpage review contracts/ other.pdf --jsonl             # several documents; each line names its document
    kvpage review dataroom/ --shard 2/8 --jsonl            # the third of eight jobs of an array
    kvpage review contract.pdf --playbook ours.toml --explain
    kvpage review contract.docx --out contract.review.docx    # Word comments on a copy
    kvpage review contract.pdf --out contract.review.pdf      # highlights and a summary page
    kvpage review contract.pdf --format html --out review.html
    kvpage review dataroom/ --format html --out-dir reviews/  # a report per contract, reviews/index.html
    KVPAGE_PDF_PASSWORD=secret kvpage review locked.pdf   # or: asked for on a terminal
    ```
    """
    fmt = choose_format(opts.json_out, opts.fmt, opts.out, FORMATS, jsonl=jsonl)
    check_out_path(opts.out)
    paths, relative = _documents(files, shard)
    names = _check_file_format(fmt, paths, relative, opts.out, out_dir)
    book = Playbook.load(playbook) if playbook is not None else Playbook.default()
    sink = Sink(opts.out, opts.no_color)
    results: list[ReviewResult] = []
    written: list[tuple[ReviewResult, str]] = []  # --out-dir: each review and its file's name
    failed: list[tuple[str, str]] = []
    with Session(opts) as session:
        engine = None
        for path in paths:
            try:
                doc = session.read_document(path, password=password, allow_directory=False)
                source = _source(fmt, path, doc)
            except KvpageError as exc:
                if len(paths) == 1:
                    raise
                session.reporter.stop_bars()
                session.warn(f"{path} skipped: {exc}")
                failed.append((path, str(exc)))
                continue
            if engine is None:
                engine = session.load_engine()
            try:
                result = _review_one(session, engine, doc, path, book, fmt, sink, opts, batch, all_clauses, explain)
            except Interrupted as exc:
                if written:
                    exc.args = (f"{exc.args[0]}; {len(written)} review(s) written in {out_dir}",)
                raise
            results.append(result)
            if fmt in FILE_FORMATS:
                try:
                    output = _render_file(fmt, result, doc, source, session)
                except FormatError as exc:
                    if len(paths) == 1:
                        raise
                    session.warn(f"{path} not written: {exc}")
                    failed.append((path, str(exc)))
                    continue
                if out_dir is not None:
                    target = out_dir / names[path]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    write_file(target, output if isinstance(output, bytes) else output.encode("utf-8"))
                    written.append((result, names[path]))
                elif isinstance(output, bytes):
                    sink.write_bytes(output)
                else:
                    sink.write(output)
        session.reporter.stop_bars()
        if not results:
            raise KvpageError(f"none of the {len(paths)} documents could be read")
        if fmt == "json":
            sink.write(render.review_json(results[0]) if len(results) == 1 else render.reviews_json(results))
        elif fmt == "markdown":
            sink.write("\n".join(render.review_markdown(r) for r in results))
        elif fmt == "table":
            for result in results:
                sink.render(render.review_table(result))
        elif fmt == "text":
            sink.write("\n".join(render.review_text(r) for r in results))
        if out_dir is not None and fmt == "html":
            write_file(out_dir / INDEX, index_html(written, failed).encode("utf-8"))
        sink.commit()
        if out_dir is not None:
            session.say(f"{len(written)} review(s) written in {out_dir}" + (f", with {out_dir / INDEX}" if fmt == "html"
                                                                              else ""))
        modes = sorted({r.mode for r in results})
        session.print_stats(engine, " and ".join(modes) + " mode")
        if failed:
            raise KvpageError(f"{len(failed)} of {len(paths)} documents could not be reviewed or written "
                              "(see the warnings above)")
        if fail_on is not None:
            _check_fail_on([f for r in results for f in r.findings], fail_on, session)


def _check_file_format(fmt: str, paths: list[str], relative: dict[str, str], out: Path | None,
                       out_dir: Path | None) -> dict[str, str]:
    """Refuses, before any work, what cannot be written; with --out-dir, the file name of each
    document's review (CONTRACT.review.html), made unique, never an input's own path."""
    if out_dir is not None:
        if out is not None:
            raise UsageError("give --out FILE (one contract) or --out-dir DIR (one file per contract), not both")
        if fmt not in FILE_FORMATS:
            raise UsageError(f"--out-dir writes one file per contract: use it with --format html, docx or pdf, "
                             f"not {fmt}")
        if out_dir.exists() and not out_dir.is_dir():
            raise UsageError(f"--out-dir {out_dir} is a file")
    if fmt not in FILE_FORMATS:
        return {}
    if len(paths) > 1 and out_dir is None:
        raise UsageError(f"--format {fmt} writes one file per contract: give --out-dir DIR for these {len(paths)}")
    if fmt in BINARY_FORMATS and out is None and out_dir is None and sys.stdout.isatty():
        raise UsageError(f"--format {fmt} is a binary file: give --out FILE{FILE_FORMATS[fmt]} (or redirect stdout)")
    if fmt == "pdf":
        if "-" in paths:
            raise UsageError("--format pdf copies the PDF it highlights: name the file instead of - (stdin)")
        others = [p for p in paths if not _is_pdf(p)]
        if others:
            what = others[0] if len(others) == 1 else f"{len(others)} of the {len(paths)} contracts (first {others[0]})"
            raise UsageError(f"--format pdf highlights a PDF, and {what} is not one: use --format docx or html")
    if out_dir is None:
        return {}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out-dir {out_dir}: {exc.strerror or exc}") from None
    return _output_names(paths, relative, FILE_FORMATS[fmt], out_dir)


def _output_names(paths: list[str], relative: dict[str, str], suffix: str, out_dir: Path) -> dict[str, str]:
    """CONTRACT.review.html, in the sub-folders the documents were found in; where two contracts would
    get the same name (contract.pdf and contract.docx), the input's suffix is added to each."""
    def name(path: str, with_suffix: bool) -> str:
        rel = Path(relative.get(path, "stdin" if path == "-" else Path(path).name))
        stem = rel.stem + (f"-{rel.suffix.lstrip('.').lower()}" if with_suffix and rel.suffix else "")
        return (rel.parent / f"{stem}.review{suffix}").as_posix()

    first = {p: name(p, False) for p in paths}
    clashing = {n for n in first.values() if list(first.values()).count(n) > 1}
    names = {p: name(p, True) if first[p] in clashing else first[p] for p in paths}
    seen: dict[str, str] = {}
    inputs = {Path(p).resolve() for p in paths if p != "-"}
    for path, chosen in names.items():
        if chosen in seen or chosen == INDEX:
            raise UsageError(f"{path} and {seen.get(chosen, 'the index')} would both be written to "
                             f"{out_dir / chosen}: review them into separate folders")
        seen[chosen] = path
        if (out_dir / chosen).resolve() in inputs:
            raise UsageError(f"--out-dir {out_dir} would overwrite the contract {out_dir / chosen}")
    return names


def _is_pdf(path: str) -> bool:
    if path == "-" or Path(path).suffix.lower() == ".pdf":
        return path != "-"
    try:
        with open(path, "rb") as f:
            return f.read(1024).lstrip()[:5] == b"%PDF-"
    except OSError:
        return False


def _writer(fmt: str):
    """The module that writes a review as a docx or pdf file, imported only for those formats
    (python-docx and pypdf's writers: 35 ms at every start of every command otherwise)."""
    if fmt == "pdf":
        from ..tasks.formats import pdf as pdf_format

        return pdf_format
    from ..tasks.formats import docx as docx_format

    return docx_format


def _source(fmt: str, path: str, doc) -> bytes | None:
    """The bytes of the file a docx or pdf review copies, read (and checked) before the review, so
    that a file changed during it does not matter; None when no copy is made."""
    if fmt == "pdf" or (fmt == "docx" and doc.kind == "docx"):
        if path == "-":
            raise UsageError(f"--format {fmt} copies the {doc.kind.upper()} file: name the file instead of - (stdin)")
        source = read_source(path, path)
        _writer(fmt).check_source(source, doc)
        return source
    return None


def _render_file(fmt: str, result: ReviewResult, doc, source: bytes | None, session: Session) -> bytes | str:
    if fmt == "html":
        return review_html(result, doc)
    if fmt == "docx":
        return _writer(fmt).commented_docx(result, doc, source)
    highlighted = _writer(fmt).highlighted_pdf(result, doc, source)
    if highlighted.unplaced:
        session.warn(f"{doc.source}: {len(highlighted.unplaced)} of {len(result.findings)} quotes could not be "
                     "located on their page with confidence; the summary page lists them with their words")
    return highlighted.data


def _review_one(session: Session, engine, doc, path: str, book: Playbook, fmt: str, sink: Sink, opts: Options,
                batch: int, all_clauses: bool, explain: bool) -> ReviewResult:
    session.reporter.next_document()
    clause_bar = _ClauseBarAfterPrefill(session)
    with session.model_checked():
        reviewer = Reviewer(engine, doc, playbook=book, max_batch=batch, explain=explain, include_all=all_clauses,
                            explain_tokens=opts.max_new_tokens or 48, on_event=clause_bar, label=document_label(path))
    total = clause_bar.total = len(reviewer.clauses)
    session.reporter.note(f"{doc.source}: {total} clauses, {reviewer.document_tokens:,} tokens with the instructions, "
                          f"{reviewer.mode} mode")
    findings: list[Finding] = []
    try:
        for finding in reviewer.review():
            findings.append(finding)
            session.reporter.note(f"clause {finding.clause_id}: {finding.risk} risk, {', '.join(finding.categories)}")
            if fmt == "jsonl":
                if sink.is_terminal:
                    session.reporter.stop_bars()
                sink.write(render.finding_jsonl(finding))
    except KeyboardInterrupt:
        sink.discard()
        raise Interrupted(_interrupted_note(reviewer.reviewed, total, fmt, opts)) from None
    findings.sort(key=lambda f: RISK_LEVELS.index(f.risk) if f.risk in RISK_LEVELS else len(RISK_LEVELS))
    result = ReviewResult(
        document=doc.source, document_kind=doc.kind, model=engine.name, mode=reviewer.mode,
        findings=findings, complete=True, document_tokens=reviewer.document_tokens, clauses_total=total,
        terms=reviewer.terms, clauses_reviewed=reviewer.reviewed, detector=reviewer.detector,
        playbook=book.source, attended_blocks=reviewer.attended_blocks, total_blocks=reviewer.total_blocks,
        warnings=list(doc.warnings), stats=stats_dict(engine, session.elapsed()),
    )
    if fmt == "jsonl":
        sink.write(render.summary_jsonl(result))
    return result


def _documents(files: list[str], shard: str | None) -> tuple[list[str], dict[str, str]]:
    """The documents named: files as given, folders as the contracts in them (sorted, recursively),
    then every N-th from the I-th with --shard I/N; and for those found in a folder, their path
    inside it (what --out-dir mirrors)."""
    paths: list[str] = []
    relative: dict[str, str] = {}
    for name in files:
        p = Path(name)
        if name != "-" and p.is_dir():
            found = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in CONTRACT_SUFFIXES
                            and not any(part.startswith(".") for part in f.relative_to(p).parts)), key=str)
            if not found:
                raise KvpageError(f"{name} holds no contract (PDF, DOCX, TXT or MD files)")
            paths += [str(f) for f in found]
            relative.update({str(f): f.relative_to(p).as_posix() for f in found})
        else:
            paths.append(name)
    if paths.count("-") > 1:
        raise UsageError("stdin (-) can be read only once")
    if shard is not None:
        m = _SHARD.match(shard.strip())
        if not m or int(m.group(2)) < 1 or int(m.group(1)) >= int(m.group(2)):
            raise UsageError(f"--shard {shard}: expected I/N with 0 <= I < N, e.g. 0/4")
        index, count = int(m.group(1)), int(m.group(2))
        paths = paths[index::count]
        if not paths:
            raise UsageError(f"--shard {shard}: no document falls to this shard ({len(files)} given)")
    return paths, relative


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
        return f"{note}; the lines printed are partial (no summary line)"
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
