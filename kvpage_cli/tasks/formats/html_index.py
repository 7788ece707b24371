"""The index page of a review of several contracts: a row per contract (parties, governing law,
findings by risk), each linking to its own report."""

from __future__ import annotations

from urllib.parse import quote

from ..schema import RISK_LEVELS, ReviewResult
from .html import esc, page
from .wording import terms_of

COUNTED = ("high", "medium", "low")


def index_html(entries: list[tuple[ReviewResult, str]], failed: list[tuple[str, str]] | None = None) -> str:
    """`entries`: each review with the path of its report relative to the index; `failed`: the
    documents that could not be reviewed, with the reason."""
    totals = {level: 0 for level in COUNTED}
    rows = []
    for result, href in entries:
        counts = {level: sum(1 for f in result.findings if f.risk == level) for level in RISK_LEVELS}
        for level in COUNTED:
            totals[level] += counts[level]
        parties = "; ".join(terms_of(result, "parties")) or "\u2014"
        law = "; ".join(terms_of(result, "governing law")) or "\u2014"
        cells = [f'<td><a href="{esc(quote(href))}">{esc(result.document)}</a>'
                 + ("" if result.complete else " (incomplete)") + "</td>",
                 f'<td data-label="parties">{esc(parties)}</td>',
                 f'<td data-label="governing law">{esc(law)}</td>']
        cells += [f'<td class="count risk-{level}" data-label="{level}">{counts[level]}</td>' for level in COUNTED]
        cells.append(f'<td class="count" data-label="clauses">{result.clauses_total}</td>')
        cells.append(f'<td data-label="mode">{esc(result.mode)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f'<th scope="col" class="count">{level.capitalize()}</th>' for level in COUNTED)
    summary = ", ".join(f"{totals[level]} {level}" for level in COUNTED)
    body = [f'<header class="top"><h1>Contract reviews</h1><p class="meta">{len(entries)} contract'
            f'{"s" if len(entries) != 1 else ""} &middot; findings: {summary}</p></header>',
            '<main class="index-page"><table class="index"><thead><tr><th scope="col">Contract</th>'
            f'<th scope="col">Parties</th><th scope="col">Governing law</th>{head}'
            '<th scope="col" class="count">Clauses</th><th scope="col">Mode</th></tr></thead><tbody>',
            "\n".join(rows), "</tbody></table>"]
    if failed:
        items = "".join(f"<li>{esc(name)}: {esc(reason)}</li>" for name, reason in failed)
        body.append(f'<h2>Not reviewed</h2><ul class="failed">{items}</ul>')
    body.append("</main>")
    return page("Contract reviews", "\n".join(body), script=None)
