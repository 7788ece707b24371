"""A review as one self-contained HTML file: key terms, findings grouped by risk with filters, and
the contract's full text with every quote highlighted where it stands, linked both ways.

Nothing is fetched: the style and the script are inline, and a Content-Security-Policy allows
exactly those two (by their hashes) and nothing else. Every piece of the document's text is
escaped; direction overrides (U+202A-U+202E, U+2066-U+2069) are shown as visible marks instead
of reordering what follows, and other control characters likewise.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import html
import re
from functools import lru_cache
from importlib import resources

from ...ingest import Document
from ..schema import Finding, ReviewResult
from .paragraphs import paragraphs
from .wording import (
    by_risk, categories, clauses_note, counts, one_line, reasons, review_mode, term_source, term_value, values_found,
)

_CONTROLS = {0x202A: "LRE", 0x202B: "RLE", 0x202C: "PDF", 0x202D: "LRO", 0x202E: "RLO", 0x2066: "LRI",
             0x2067: "RLI", 0x2068: "FSI", 0x2069: "PDI"}
_CONTROL = re.compile("[\u202a-\u202e\u2066-\u2069\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
RISK_ORDER = ("high", "medium", "low", "none", "other")


def esc(text: str) -> str:
    """`text` as HTML text: markup characters escaped, invisible controls made visible marks."""
    return _CONTROL.sub(_control_mark, html.escape(text, quote=True))


def _control_mark(match: re.Match) -> str:
    code = ord(match.group())
    if 0xD800 <= code <= 0xDFFF:  # half of a surrogate pair: not a character at all
        return "\ufffd"
    name = _CONTROLS.get(code, f"U+{code:04X}")
    return (f'<abbr class="ctl" title="U+{code:04X}, an invisible control character in the document">'
            f"{name}</abbr>")


@lru_cache(maxsize=None)
def asset(name: str) -> str:
    """report.css, report.js: shipped beside this module."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def csp(style: str, script: str | None) -> str:
    """A policy that lets in this style and this script (by hash) and nothing else: no network at all."""
    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"

    policy = f"default-src 'none'; style-src {digest(style)}; img-src 'none'; base-uri 'none'; form-action 'none'"
    if script is not None:
        policy += f"; script-src {digest(script)}"
    return policy


def page(title: str, body: str, script: str | None, style: str | None = None) -> str:
    """A whole HTML document around `body` (already HTML)."""
    style = asset("report.css") if style is None else style
    head = (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{csp(style, script)}">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f'<meta name="referrer" content="no-referrer">\n<meta name="generator" content="kvpage">\n'
            f"<title>{esc(title)}</title>\n<style>{style}</style>\n</head>\n")
    tail = f"<script>{script}</script>\n" if script is not None else ""
    return head + f"<body>\n{body}\n{tail}</body>\n</html>\n"


def review_html(result: ReviewResult, doc: Document) -> str:
    """The report of one review: `doc` is the document it was made from (its full text is shown)."""
    numbered = list(enumerate(result.findings, start=1))
    parts = [_header(result), _terms(result), '<div class="panes">', _findings(numbered), _contract(numbered, doc),
             "</div>", _footer(result)]
    return page(f"Review: {doc.name}", "\n".join(parts), asset("report.js"))


def _header(result: ReviewResult) -> str:
    lines = [f'<header class="top"><h1>Contract review <span class="doc">{esc(result.document)}</span></h1>',
             f'<p class="meta">{esc(clauses_note(result))} &middot; {esc(counts(result))} &middot; '
             f"model {esc(result.model)} &middot; {esc(review_mode(result))}</p>"]
    if not result.complete:
        lines.append(f'<p class="warning">Incomplete: {result.clauses_reviewed} of {result.clauses_total} clauses '
                     "were reviewed; the findings are partial.</p>")
    for warning in result.warnings:
        lines.append(f'<p class="warning">{esc(warning)}</p>')
    lines.append("</header>")
    return "\n".join(lines)


def _terms(result: ReviewResult) -> str:
    if not result.terms:
        return '<section id="terms"><h2>Key terms</h2><p class="none">No key term was found.</p></section>'
    rows = "\n".join(f'<tr><th scope="row">{esc(t.label)}</th><td class="value">{esc(term_value(t))}</td>'
                     f'<td data-label="clause">{esc(t.clause_id)}</td><td class="where">{esc(term_source(t))}</td>'
                     "</tr>" for t in result.terms)
    return ('<section id="terms"><h2>Key terms</h2><table class="terms"><thead><tr><th scope="col">Term</th>'
            '<th scope="col">Value (exact words)</th><th scope="col">Clause</th><th scope="col">Source</th></tr>'
            f"</thead><tbody>\n{rows}\n</tbody></table></section>")


def _findings(numbered: list[tuple[int, Finding]]) -> str:
    groups = by_risk(f for _, f in numbered)
    number = {id(f): n for n, f in numbered}
    all_categories = sorted({c for _, f in numbered for c in (f.categories or [f.category]) if c})
    boxes = "".join(f'<label class="risk-{level}"><input type="checkbox" name="risk" value="{level}" checked> '
                    f"{level.capitalize()} ({len(group)})</label>" for level, group in groups)
    options = "".join(f'<option value="{esc(c)}">{esc(c)}</option>' for c in all_categories)
    parts = ['<section id="findings" class="pane"><h2>Findings</h2>']
    if not numbered:
        parts.append('<p class="none">No clause was found to matter.</p></section>')
        return "\n".join(parts)
    parts.append(f'<form class="filters" aria-label="Filter the findings">{boxes}'
                 f'<label class="category">Category <select name="category"><option value="">all</option>{options}'
                 f'</select></label><output class="shown" aria-live="polite"></output></form>')
    for level, group in groups:
        parts.append(f'<section class="group" data-risk="{level}"><h3 class="risk-{level}">'
                     f"{level.capitalize()} risk ({len(group)})</h3>")
        parts += [_finding(number[id(f)], f) for f in group]
        parts.append("</section>")
    parts.append("</section>")
    return "\n".join(parts)


def _finding(n: int, f: Finding) -> str:
    cats = "|".join(f.categories or [f.category])
    items = "".join(f"<li>{esc(reason)}</li>" for reason in reasons(f))
    found = values_found(f)
    lines = [f'<article class="finding risk-{esc(f.risk)}" id="f-{n}" data-risk="{esc(f.risk)}" '
             f'data-categories="{esc(cats)}">',
             f'<h4><a href="#q-{n}" title="Show the quote in the contract">{esc(f.clause_id)} {esc(f.heading)}</a> '
             f'<span class="badge">{esc(f.risk)}</span></h4>',
             f'<p class="categories">{esc(categories(f))}</p>']
    if items:
        lines.append(f'<ul class="reasons">{items}</ul>')
    if found:
        lines.append(f'<p class="values">Values found: {esc("; ".join(found))}</p>')
    if f.commentary:
        lines.append(f'<p class="commentary">Model\'s commentary: {esc(f.commentary)}</p>')
    lines.append(f'<blockquote class="quote">{esc(one_line(f.quote))}</blockquote>')
    lines.append(f'<p class="source">{esc(f.source)} &middot; <a href="#q-{n}">in the contract</a></p></article>')
    return "\n".join(lines)


def _contract(numbered: list[tuple[int, Finding]], doc: Document) -> str:
    """The full text, a label at each page (PDF), paragraph (DOCX) or line (text), every quote
    marked; a PDF's wrapped lines joined into its paragraphs (formats/paragraphs.py)."""
    text = doc.text
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[tuple[int, Finding]]] = {}
    cuts = {0, len(text)}
    for n, f in numbered:
        if 0 <= f.start < f.end <= len(text):
            starts.setdefault(f.start, []).append(n)
            ends.setdefault(f.end, []).append((n, f))
            cuts.update((f.start, f.end))
    labels: dict[int, tuple[str, str]] = {}
    previous = None
    for span in doc.spans:
        unit, value = _unit(span)
        if value is not None and (unit, value) != previous:
            labels.setdefault(span.start, (unit, str(value)))
            cuts.add(span.start)
            previous = (unit, value)
    blocks = paragraphs(doc)
    titles = _Intervals([(p.start, p.end) for p in blocks if p.heading])
    headings = _Intervals([(s.start, s.end) for s in doc.spans if s.kind == "heading"])
    paragraph = _Intervals([(p.start, p.end) for p in blocks])
    cuts.update(x for p in blocks for x in (p.start, p.end))
    cuts.update(x for s in doc.spans if s.kind == "heading" for x in (s.start, s.end))
    joined = doc.kind == "pdf"  # its line breaks inside a paragraph are the page's wraps
    out = [f'<section id="contract" class="pane"><h2>The contract <span class="doc">{esc(doc.name)}</span></h2>'
           f'<div class="text {esc(doc.kind)}">']
    points = sorted(c for c in cuts if 0 <= c <= len(text))
    active: list[tuple[int, Finding]] = []  # the findings whose quote covers the current piece
    for a, b in zip(points, points[1:]):
        if a in labels:
            unit, value = labels[a]
            out.append(f'<span class="src {unit}" id="{unit}-{esc(value)}" data-src="{esc(value)}"></span>')
        for n in starts.get(a, []):
            out.append(f'<span class="anchor" id="q-{n}"></span>')
            active.append((n, numbered[n - 1][1]))
        piece = text[a:b]
        if joined:
            if paragraph.holds(a, b):
                piece = piece.replace("\n", " ")
            elif "\n" in piece:  # between two paragraphs
                piece = "\n"
        piece = esc(piece)
        if titles.holds(a, b) or headings.holds(a, b):
            piece = f"<strong>{piece}</strong>"
        if active:
            worst = min((f.risk for _, f in active), key=lambda r: RISK_ORDER.index(r) if r in RISK_ORDER else 9)
            ids = " ".join(f"f-{n}" for n, _ in active)
            out.append(f'<mark class="risk-{esc(worst)}" data-f="{ids}">{piece}</mark>')
        else:
            out.append(piece)
        for n, f in ends.get(b, []):
            active = [(m, g) for m, g in active if m != n]
            out.append(f'<a class="back risk-{esc(f.risk)}" href="#f-{n}" data-f="f-{n}" '
                       f'title="{esc(f.risk)} risk: {esc(f.category)}">{esc(f.clause_id)}</a>')
    out.append("</div></section>")
    return "".join(out)


def _unit(span) -> tuple[str, int | None]:
    """Which source position a span's label gives: page (PDF), paragraph (DOCX) or line (text)."""
    if span.kind == "footnote":
        return "note", None
    if span.page is not None:
        return "page", span.page
    if span.paragraph is not None:
        return "paragraph", span.paragraph
    return "line", span.line


def _footer(result: ReviewResult) -> str:
    return (f'<footer><p>Made by kvpage from {esc(result.document)} with model {esc(result.model)} '
            f"(detector {esc(result.detector or 'n/a')}, playbook {esc(result.playbook or 'default')}). "
            "Every quote and value is the document's own words; the risk levels and reasons come from the playbook. "
            "This report is an aid to a lawyer's reading, not legal advice.</p></footer>")


class _Intervals:
    """Ranges of the text that do not overlap; whether one holds a piece (no piece straddles an end)."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = sorted(ranges)
        self.starts = [a for a, _ in self.ranges]

    def holds(self, a: int, b: int) -> bool:
        i = bisect.bisect_right(self.starts, a) - 1
        return i >= 0 and self.ranges[i][0] <= a and b <= self.ranges[i][1]
