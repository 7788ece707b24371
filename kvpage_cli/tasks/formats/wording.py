"""The words every format of a review shares: how it was made, counts by risk, key-term values,
a finding's categories and reasons, and the note a comment or a highlight carries."""

from __future__ import annotations

from typing import Iterable

from ..schema import RISK_LEVELS, AskResult, Finding, ReviewResult, Term

MODE_NOTES = {
    "exact": "exact mode (every block attended: lossless)",
    "selective": "selective mode (policy-chosen blocks: approximate)",
    "retrieval": "retrieval mode (the blocks chosen for each question, the document being longer than the context)",
}
ALL_READ = "all of the document read (shorter than one 64-token block)"  # retrieval over a document with no passage
SELECTIVE_DECODE = "; decode steps attended the policy's blocks of those (selective: approximate)"


def mode_note(mode: str, attended: int | None = None, total: int | None = None, selective: bool = False,
              each: str = "", indexed: tuple[int, int] | None = None) -> str:
    """How an output was made: "exact mode (...)", or for retrieval how much of the document was read
    (`each`: said after the share, e.g. " each (on average)"; `selective`: the engine ran in selective
    mode, so decode steps attended the policy's blocks of those; `indexed`: (tokens indexed when the
    answer was given, the document's tokens), said where the index was not yet whole)."""
    if mode == "retrieval" and total == 0:  # all of its text lies in the prompt's own tokens
        return f"retrieval mode: {ALL_READ}"
    if mode == "retrieval" and total:
        note = (f"retrieval mode: attended {attended:,} of {total:,} blocks, {100 * attended / total:.0f}% of the "
                f"document{each}" + (SELECTIVE_DECODE if selective else ""))
        if indexed is not None and indexed[1] and indexed[0] < indexed[1]:
            note += (f"; chosen from the {100 * indexed[0] / indexed[1]:.0f}% of it indexed so far "
                     f"({indexed[0]:,} of {indexed[1]:,} tokens)")
        return note
    return MODE_NOTES.get(mode, f"{mode} mode")


def selective_decode(result: AskResult | ReviewResult) -> bool:
    """Whether the engine that made `result` ran in selective mode (its stats say)."""
    return result.stats.get("mode") == "selective"


def review_mode(result: ReviewResult) -> str:
    """How a review was made, said once for the whole review (retrieval: the most any clause read)."""
    if result.mode == "retrieval" and result.total_blocks:
        return (f"retrieval mode: each clause read at most {result.attended_blocks:,} of {result.total_blocks:,} "
                f"blocks, {100 * result.attended_blocks / result.total_blocks:.0f}% of the document"
                + (SELECTIVE_DECODE if selective_decode(result) else ""))
    return mode_note(result.mode, result.attended_blocks, result.total_blocks)


def by_risk(findings: Iterable[Finding]) -> list[tuple[str, list[Finding]]]:
    """Findings grouped high -> none, each group in document order; empty groups left out."""
    findings = list(findings)
    groups = [(level, [f for f in findings if f.risk == level]) for level in RISK_LEVELS]
    others = [f for f in findings if f.risk not in RISK_LEVELS]
    if others:
        groups.append(("other", others))
    return [(level, group) for level, group in groups if group]


def counts(result: ReviewResult) -> str:
    """"findings: 2 high, 5 medium" (or "findings: none")."""
    said = ", ".join(f"{len(group)} {level}" for level, group in by_risk(result.findings))
    return f"findings: {said}" if said else "findings: none"


def clauses_note(result: ReviewResult) -> str:
    """"57 clauses", or "12 of 57 clauses" for an interrupted review."""
    if not result.complete:
        return f"{result.clauses_reviewed} of {result.clauses_total} clauses"
    return f"{result.clauses_total} clauses"


def one_line(text: str) -> str:
    """Text with its line breaks and runs of spaces made single spaces (PDF lines, table cells)."""
    return " ".join(text.split())


def shorten(text: str, limit: int) -> str:
    """`text` on one line, cut at a word before `limit` characters and marked with an ellipsis."""
    text = one_line(text)
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 1)
    return text[: cut if cut > limit // 2 else limit - 1] + "\u2026"


def term_value(term: Term) -> str:
    return "; ".join(one_line(v.text) for v in term.values)


def term_source(term: Term) -> str:
    return ", ".join(dict.fromkeys(v.source for v in term.values))


def terms_of(result: ReviewResult, category: str) -> list[str]:
    """The values of the key terms of a category ("parties", "governing law"), each once."""
    values = [one_line(v.text) for t in result.terms if t.category == category for v in t.values]
    return list(dict.fromkeys(values))


def categories(f: Finding) -> str:
    return ", ".join(f.categories) if f.categories else f.category


def reasons(f: Finding) -> list[str]:
    """One reason per category of the finding (the first sets the risk)."""
    return [a.reason for a in f.assessments] if f.assessments else ([f.rationale] if f.rationale else [])


def values_found(f: Finding) -> list[str]:
    """"notice: one hundred eighty (180) days" per value the playbook's questions copied, in order."""
    found = []
    for a in f.assessments:
        for name, values in a.values.items():
            for v in values:
                line = f"{name.replace('_', ' ')}: {one_line(v.text)}"
                if line not in found:
                    found.append(line)
    return found


def finding_title(f: Finding) -> str:
    """"HIGH risk: renewal term (clause 4.2 Renewal)"."""
    where = f"clause {f.clause_id} {f.heading}".rstrip()
    return f"{f.risk.upper()} risk: {f.category or 'no category'} ({where})"


def finding_note(f: Finding) -> list[str]:
    """The note a comment or a highlight carries: title, reasons, values, other categories, the
    model's commentary (labelled), source. One line per item."""
    lines = [finding_title(f)]
    lines += reasons(f)
    found = values_found(f)
    if found:
        lines.append("Values found: " + "; ".join(found))
    others = [c for c in f.categories if c != f.category]
    if others:
        lines.append("Also: " + ", ".join(others))
    if f.commentary:
        lines.append(f"Model's commentary: {f.commentary}")
    lines.append(f"Source: {f.source}")
    return lines


def summary_line(result: ReviewResult) -> str:
    """One line: what was reviewed, how, and what was found."""
    return (f"kvpage review of {result.document}: {clauses_note(result)}, {counts(result)}; "
            f"model {result.model}, {result.mode} mode")
