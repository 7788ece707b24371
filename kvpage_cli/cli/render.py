"""Review and ask results as a rich table, markdown, plain text and JSON: the same fields in each."""

from __future__ import annotations

import json
import re

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..tasks import SCHEMA_VERSION, AskResult, Finding, ReviewResult
from ..tasks.formats.wording import (  # noqa: F401 (ALL_READ, mode_note, selective_decode: the commands' words too)
    ALL_READ, by_risk, categories, clauses_note, counts, mode_note, reasons, review_mode, selective_decode, shorten,
    term_source, term_value,
)
from ..tasks.schema import Evidence

RISK_STYLES = {"high": "bold red", "medium": "yellow", "low": "cyan", "none": "dim"}
TABLE_QUOTE_CHARS = 160


def _summary(result: ReviewResult) -> str:
    return (f"{result.document}: {clauses_note(result)}, {len(result.findings)} findings, "
            f"{result.document_tokens:,} tokens, model {result.model}, {review_mode(result)}")


# -- review ------------------------------------------------------------------------------------

def review_table(result: ReviewResult) -> RenderableType:
    """The key terms, then one rich table per risk level, high first."""
    parts: list[RenderableType] = [Text(_summary(result), style="bold")]
    if result.terms:
        terms = Table(title=Text("Key terms", style="bold"), title_justify="left", show_lines=False)
        terms.add_column("term", no_wrap=True)
        terms.add_column("value (exact words)")
        terms.add_column("clause", no_wrap=True)
        terms.add_column("source", min_width=7, max_width=14)
        for t in result.terms:
            terms.add_row(t.label, term_value(t), t.clause_id, term_source(t))
        parts += [Text(""), terms]
    for level, group in by_risk(result.findings):
        style = RISK_STYLES.get(level, "")
        table = Table(title=Text(f"{level.upper()} risk ({len(group)})", style=style), title_justify="left",
                      show_lines=True)
        table.add_column("id", no_wrap=True)
        table.add_column("heading", min_width=8, max_width=22)
        table.add_column("category", min_width=11, max_width=22, overflow="fold")
        table.add_column("reason", min_width=12)
        table.add_column("quote", min_width=14)
        table.add_column("source", min_width=7, max_width=14)
        for f in group:
            reason = Text("\n".join(reasons(f)))
            if f.commentary:
                reason.append(f"\nmodel's commentary: {f.commentary}", style="italic dim")
            table.add_row(f.clause_id, f.heading, categories(f), reason,
                          "\u201c" + shorten(f.quote, TABLE_QUOTE_CHARS) + "\u201d", f.source)
        parts.append(Text(""))
        parts.append(table)
    parts.append(Text(f"\n{counts(result)}", style="bold"))
    return Group(*parts)


def review_markdown(result: ReviewResult) -> str:
    lines = [f"# Contract review: {result.document}", "",
             f"- Model: {result.model}",
             f"- Engine: {mode_note(result.mode, result.attended_blocks, result.total_blocks, selective_decode(result))}",
             f"- Document: {result.document_kind}, {result.document_tokens:,} tokens, {result.clauses_total} clauses",
             f"- {counts(result).capitalize()}"]
    if not result.complete:
        lines.append(f"- **Incomplete**: {result.clauses_reviewed} of {result.clauses_total} clauses reviewed")
    if result.terms:
        lines += ["", "## Key terms", "", "| term | value (exact words) | clause | source |", "|---|---|---|---|"]
        lines += [f"| {t.label} | {term_value(t)} | {t.clause_id} | {term_source(t)} |" for t in result.terms]
    for level, group in by_risk(result.findings):
        lines += ["", f"## {level.capitalize()} risk ({len(group)})"]
        for f in group:
            quote = " ".join(f.quote.split())
            lines += ["", f"### {f.clause_id} {f.heading}".rstrip(), "",
                      f"- **Category:** {categories(f)}",
                      f"- **Risk:** {f.risk}"]
            lines += [f"- **Reason:** {reason}" for reason in reasons(f)]
            if f.commentary:
                lines.append(f"- **Model's commentary:** _{f.commentary}_")
            lines += [f"- **Source:** {f.source}", "", f"> {quote}"]
    return "\n".join(lines) + "\n"


def finding_text(f: Finding) -> str:
    quote = " ".join(f.quote.split())
    lines = [f"{f.clause_id} {f.heading}".rstrip(),
             f"  category: {categories(f)}",
             f"  risk:     {f.risk}"]
    lines += [f"  reason:   {reason}" for reason in reasons(f)]
    if f.commentary:
        lines.append(f"  model's commentary: {f.commentary}")
    lines += [f"  quote:    \"{quote}\"", f"  source:   {f.source}"]
    return "\n".join(lines) + "\n"


def review_text(result: ReviewResult) -> str:
    """Plain text for pipes: a header line, the key terms, then one block per finding, worst first."""
    blocks = [_summary(result) + "\n"]
    if result.terms:
        width = max(len(t.label) for t in result.terms)
        blocks.append("Key terms\n" + "".join(f"  {t.label + ':':<{width + 1}} {term_value(t)} "
                                                f"(clause {t.clause_id}, {term_source(t)})\n" for t in result.terms))
    blocks += [finding_text(f) for f in result.findings]
    blocks.append(counts(result) + "\n")
    return "\n".join(blocks)


def review_json(result: ReviewResult) -> str:
    data = result.to_dict()
    ordered = {"schema_version": data.pop("schema_version"), **data}
    return json.dumps(ordered, ensure_ascii=False, indent=2) + "\n"


def reviews_json(results: list[ReviewResult]) -> str:
    """Several documents: a list of reviews."""
    data = [{"schema_version": r.schema_version, **{k: v for k, v in r.to_dict().items() if k != "schema_version"}}
            for r in results]
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def finding_jsonl(f: Finding) -> str:
    return json.dumps({"type": "finding", "schema_version": SCHEMA_VERSION, **f.to_dict()}, ensure_ascii=False) + "\n"


def summary_jsonl(result: ReviewResult) -> str:
    """The last --jsonl line of a document, written only when every clause was reviewed."""
    data = result.to_dict()
    del data["findings"]
    ordered = {"type": "summary", "schema_version": data.pop("schema_version"), **data}
    return json.dumps(ordered, ensure_ascii=False) + "\n"


# -- ask ---------------------------------------------------------------------------------------

def ask_json(result: AskResult) -> str:
    data = result.to_dict()
    ordered = {"schema_version": data.pop("schema_version"), **data}
    return json.dumps(ordered, ensure_ascii=False, indent=2) + "\n"


def asks_json(results: list[AskResult]) -> str:
    """Several questions: a list of answers."""
    data = [{"schema_version": r.schema_version, **{k: v for k, v in r.to_dict().items() if k != "schema_version"}}
            for r in results]
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def ask_jsonl(result: AskResult) -> str:
    data = result.to_dict()
    ordered = {"type": "answer", "schema_version": data.pop("schema_version"), **data}
    return json.dumps(ordered, ensure_ascii=False) + "\n"


def ask_markdown_head(question: str, first: bool = True) -> str:
    return ("" if first else "\n") + f"## {question}\n\n"


def ask_markdown_tail(model: str, mode: str, source: str, attended: int | None = None, total: int | None = None,
                      selective: bool = False, indexed: tuple[int, int] | None = None) -> str:
    return f"\n\n_{source}, model {model}, {mode_note(mode, attended, total, selective, indexed=indexed)}_\n"


def indexed_share(result: AskResult) -> tuple[int, int] | None:
    """(tokens indexed when the answer was given, the document's) in retrieval mode, else None."""
    if result.indexed_tokens is None or not result.index_total_tokens:
        return None
    return result.indexed_tokens, result.index_total_tokens


_FILE_LINES = re.compile(r":\d+(?:-\d+)?$")


def _dedent(text: str) -> list[str]:
    """A quote's lines, less the indentation they all share."""
    lines = text.split("\n")
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return [line[indent:] for line in lines]


def spans_text(spans: list[Evidence], indent: str = "") -> str:
    """Spans as plain text: each one's place, then its exact lines indented under it."""
    out = []
    for e in spans:
        out.append(f"{indent}{e.where}")
        out += [f"{indent}  {line}".rstrip() for line in _dedent(e.text)]
    return "\n".join(out) + "\n" if out else ""


def spans_markdown(spans: list[Evidence]) -> str:
    """Spans as a Markdown list: a file's lines fenced, running text quoted."""
    out = []
    for e in spans:
        if _FILE_LINES.search(e.where):
            fence = "~~~~" if "```" in e.text else "```"
            out += [f"- `{e.where}`", "", f"  {fence}"] + [f"  {line}".rstrip() for line in _dedent(e.text)] + [f"  {fence}"]
        else:
            out.append(f"- {e.where}: \u201c{' '.join(e.text.split())}\u201d")
    return "\n".join(out) + "\n" if out else ""


def evidence_text(evidence: list[Evidence]) -> str:
    """The evidence under an answer, as plain text (nothing where there is none)."""
    return "\nEvidence:\n" + spans_text(evidence, "  ") if evidence else ""


def evidence_markdown(evidence: list[Evidence]) -> str:
    """The evidence under an answer, in Markdown (nothing where there is none)."""
    return "\n**Evidence**\n\n" + spans_markdown(evidence) if evidence else ""
