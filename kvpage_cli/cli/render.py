"""Review and ask results as a rich table, markdown, plain text and JSON: the same fields in each."""

from __future__ import annotations

import json
from typing import Iterable

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..tasks import RISK_LEVELS, SCHEMA_VERSION, AskResult, Finding, ReviewResult

RISK_STYLES = {"high": "bold red", "medium": "yellow", "low": "cyan", "none": "dim"}
MODE_NOTES = {
    "exact": "exact mode (every block attended: lossless)",
    "selective": "selective mode (policy-chosen blocks: approximate)",
    "retrieval": "retrieval mode (the blocks chosen for each question, the document being longer than the context)",
}
TABLE_QUOTE_CHARS = 160


def mode_note(mode: str, attended: int | None = None, total: int | None = None) -> str:
    """How an output was made: "exact mode (...)", or for retrieval how much of the document was read."""
    if mode == "retrieval" and total:
        return f"retrieval mode: attended {attended:,} of {total:,} blocks, {100 * attended / total:.0f}% of the document"
    return MODE_NOTES.get(mode, f"{mode} mode")


def by_risk(findings: Iterable[Finding]) -> list[tuple[str, list[Finding]]]:
    """Findings grouped high -> none, each group in document order; empty groups left out."""
    findings = list(findings)
    groups = [(level, [f for f in findings if f.risk == level]) for level in RISK_LEVELS]
    others = [f for f in findings if f.risk not in RISK_LEVELS]
    if others:
        groups.append(("other", others))
    return [(level, group) for level, group in groups if group]


def shorten(text: str, limit: int) -> str:
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 1)
    return text[: cut if cut > limit // 2 else limit - 1] + "\u2026"


def _summary(result: ReviewResult) -> str:
    clauses = f"{len(result.findings)} of {result.clauses_total} clauses" if not result.complete \
        else f"{result.clauses_total} clauses"
    return f"{result.document}: {clauses}, {result.document_tokens:,} tokens, model {result.model}, {mode_note(result.mode)}"


def _counts(result: ReviewResult) -> str:
    return ", ".join(f"{len(group)} {level}" for level, group in by_risk(result.findings))


# -- review ------------------------------------------------------------------------------------

def review_table(result: ReviewResult) -> RenderableType:
    """One rich table per risk level, high first."""
    parts: list[RenderableType] = [Text(_summary(result), style="bold")]
    for level, group in by_risk(result.findings):
        style = RISK_STYLES.get(level, "")
        table = Table(title=Text(f"{level.upper()} risk ({len(group)})", style=style), title_justify="left",
                      show_lines=True)
        table.add_column("id", no_wrap=True)
        table.add_column("heading", min_width=8, max_width=22)
        table.add_column("category", min_width=11, max_width=20, overflow="fold")
        table.add_column("risk", no_wrap=True)
        table.add_column("reason", min_width=12)
        table.add_column("quote", min_width=14)
        table.add_column("source", min_width=7, max_width=14)
        for f in group:
            table.add_row(f.clause_id, f.heading, f.category, Text(f.risk, style=style), f.rationale,
                          "\u201c" + shorten(f.quote, TABLE_QUOTE_CHARS) + "\u201d", f.source)
        parts.append(Text(""))
        parts.append(table)
    parts.append(Text(f"\n{_counts(result)}", style="bold"))
    return Group(*parts)


def review_markdown(result: ReviewResult) -> str:
    lines = [f"# Contract review: {result.document}", "",
             f"- Model: {result.model}",
             f"- Engine: {mode_note(result.mode)}",
             f"- Document: {result.document_kind}, {result.document_tokens:,} tokens, {result.clauses_total} clauses",
             f"- Findings: {_counts(result)}"]
    if not result.complete:
        lines.append(f"- **Incomplete**: {len(result.findings)} of {result.clauses_total} clauses reviewed")
    for level, group in by_risk(result.findings):
        lines += ["", f"## {level.capitalize()} risk ({len(group)})"]
        for f in group:
            quote = " ".join(f.quote.split())
            lines += ["", f"### {f.clause_id} {f.heading}".rstrip(), "",
                      f"- **Category:** {f.category}",
                      f"- **Risk:** {f.risk}",
                      f"- **Reason:** {f.rationale}",
                      f"- **Source:** {f.source}",
                      "", f"> {quote}"]
    return "\n".join(lines) + "\n"


def finding_text(f: Finding) -> str:
    quote = " ".join(f.quote.split())
    return (f"{f.clause_id} {f.heading}".rstrip() + "\n"
            f"  category: {f.category}\n"
            f"  risk:     {f.risk}\n"
            f"  reason:   {f.rationale}\n"
            f"  quote:    \"{quote}\"\n"
            f"  source:   {f.source}\n")


def review_text(result: ReviewResult) -> str:
    """Plain text for pipes: a header line, then one block per finding in document order."""
    blocks = [_summary(result) + "\n"] + [finding_text(f) for f in result.findings]
    return "\n".join(blocks)


def review_json(result: ReviewResult) -> str:
    data = result.to_dict()
    ordered = {"schema_version": data.pop("schema_version"), **data}
    return json.dumps(ordered, ensure_ascii=False, indent=2) + "\n"


def finding_jsonl(f: Finding) -> str:
    return json.dumps({"type": "finding", "schema_version": SCHEMA_VERSION, **f.to_dict()}, ensure_ascii=False) + "\n"


def summary_jsonl(result: ReviewResult) -> str:
    """The last --jsonl line, written only when every clause was reviewed."""
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


def ask_markdown_tail(model: str, mode: str, source: str, attended: int | None = None, total: int | None = None) -> str:
    return f"\n\n_{source}, model {model}, {mode_note(mode, attended, total)}_\n"
