"""Evidence: the few lines of a document (a sentence of a page) an answer rests on, each quoted
exactly with its place, found by the model's own attention while it answered.

The engine gives the attention mass of every document token the answer read
(engine/attention/evidence.py). Here the text those tokens came from is cut into units, each a
line of a file or, in running text (a page, a paragraph, a long line), a sentence; each unit
scores the mass of its tokens, fused with its lexical match to the question (BM25 over the units,
identifiers split as retrieval splits them); the best units become spans, each grown over the
lines beside it that carried attention too, and the spans are returned best first. `kvpage find`
ranks the same way with the question's own attention in place of an answer's.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

import torch

from ..ingest import Document
from ..ingest.document import Span
from .retrieval import lexical_terms
from .schema import Evidence
from .values import sentences

EVIDENCE_SPANS = 3  # spans under an answer (at most)
LONG_UNIT_CHARS = 240  # a line longer than this is cut into its sentences (running text, not code)
MAX_SPAN_UNITS = 4  # a span is at most this many units (lines of code, sentences)
GROW_SHARE = 0.5  # a unit joins the span beside it when it scores at least this share of the span's best unit
MIN_SHARE = 0.2  # a second or third span is shown only when it scores at least this share of the first
SIGNALS = ("attention", "lexical", "fused")
DEFAULT_SIGNAL = "fused"
_WORD = re.compile(r"\w")


@dataclass(frozen=True)
class Unit:
    """A line (or a sentence of running text) of the document: text[start:end], white space
    trimmed; `line` its line number where the document has lines; `file` what it belongs to (a
    span never crosses a file, a page or a paragraph)."""

    start: int
    end: int
    file: str
    line: int | None
    group: int  # index of the document span (line, page, paragraph) it is cut from


def units_of(doc: Document, regions: list[tuple[int, int]]) -> list[Unit]:
    """The units of doc.text that overlap `regions` (character ranges), whole (a line cut by a
    block's edge is quoted whole), in document order. A repository's "==> path <==" lines are
    left out (they name a file, they say nothing), as are units without a letter or digit."""
    found: dict[tuple[int, int], Unit] = {}
    cut: dict[int, list[tuple[int, int]]] = {}  # a span's sentences, once
    for a, b in _merged(regions):
        for n, span in _spans_in(doc, a, b):
            if span.show_file and span.line is None:
                continue  # a repository's file heading
            whole_line = span.line is not None and span.end - span.start <= LONG_UNIT_CHARS
            if whole_line:  # from the line's start: its indentation is quoted too (code reads by it)
                pieces = [(span.start, span.end)]
            else:
                if n not in cut:
                    cut[n] = sentences(doc.text, span.start, span.end)
                pieces = [(s, e) for s, e in cut[n] if s < b and e > a]
            for s, e in pieces:
                s, e = (s, _trim(doc.text, s, e)[1]) if whole_line else _trim(doc.text, s, e)
                if e > s and (s, e) not in found and _WORD.search(doc.text, s, e):
                    found[(s, e)] = Unit(s, e, span.file, span.line, n)
    return sorted(found.values(), key=lambda u: u.start)


def _spans_in(doc: Document, a: int, b: int) -> list[tuple[int, Span]]:
    first = bisect.bisect_right([s.end for s in doc.spans], a)
    out = []
    for n in range(first, len(doc.spans)):
        span = doc.spans[n]
        if span.start >= b:
            break
        if span.end > a:
            out.append((n, span))
    return out


def _trim(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _merged(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for a, b in sorted(r for r in regions if r[1] > r[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def unit_mass(units: list[Unit], token_chars: list[tuple[int, int]], mass: torch.Tensor) -> torch.Tensor:
    """[units] the attention mass of the tokens that start inside each unit (a token is counted
    once, where it starts). token_chars: per token, its characters in the document; mass: [tokens]."""
    out = torch.zeros(len(units))
    if not units:
        return out
    starts = [u.start for u in units]
    for (a, _), m in zip(token_chars, mass.tolist()):
        i = bisect.bisect_right(starts, a) - 1
        if i >= 0 and a < units[i].end:
            out[i] += m
    return out


def lexical_scores(doc: Document, units: list[Unit], question: str) -> torch.Tensor:
    """[units] BM25 of the question's terms over the units (bm25s; retrieval's terms: identifiers
    split into their words)."""
    import bm25s  # loads tqdm: imported where used, never by an engine or task module at import
    from bm25s.stopwords import STOPWORDS_EN

    stopwords = frozenset(STOPWORDS_EN)
    terms = lexical_terms(question, stopwords)
    if not units or not terms:
        return torch.zeros(len(units))
    index = bm25s.BM25()
    index.index([lexical_terms(doc.text[u.start:u.end], stopwords) or ["\u0000"] for u in units], show_progress=False)
    return torch.as_tensor(index.get_scores(terms), dtype=torch.float32)


def fuse(attention: torch.Tensor, lexical: torch.Tensor, signal: str = DEFAULT_SIGNAL) -> torch.Tensor:
    """The units' ranking scores (higher is better) for `signal`: attention alone, lexical alone,
    or both fused by their ranks (reciprocal rank fusion, as retrieval fuses its signals); a unit
    with no lexical match keeps its attention rank."""
    if signal not in SIGNALS:
        raise ValueError(f"signal must be one of {', '.join(SIGNALS)}; got {signal!r}")
    if signal == "attention":
        return attention.clone()
    if signal == "lexical":
        return lexical + 1e-6 * attention / max(float(attention.max()), 1e-12) if len(attention) else lexical
    fused = 1.0 / (60.0 + _rank(attention))
    matched = lexical > 0
    fused[matched] += 1.0 / (60.0 + _rank(lexical)[matched])
    return fused


def _rank(scores: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(scores, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return rank.float()


def spans(doc: Document, units: list[Unit], scores: torch.Tensor, attention: torch.Tensor,
          count: int = EVIDENCE_SPANS, min_share: float = MIN_SHARE) -> list[Evidence]:
    """The best `count` spans, best first: each seeded by the best unit not yet taken, grown over
    the units beside it (same file, page or paragraph; consecutive lines) while they score at least
    GROW_SHARE of the seed, up to MAX_SPAN_UNITS. A span after the first is kept only when it scores
    at least `min_share` of the first. Evidence.score is the span's share of the attention the
    document received (the sum of `attention` over its units, over all units')."""
    if not units:
        return []
    total = float(attention.sum()) or 1.0
    taken = [False] * len(units)
    out: list[Evidence] = []
    first_score = None
    for seed in torch.argsort(scores, descending=True, stable=True).tolist():
        if len(out) == count:
            break
        if taken[seed]:
            continue
        if first_score is not None and float(scores[seed]) < min_share * first_score:
            break
        lo = hi = seed
        while hi - lo + 1 < MAX_SPAN_UNITS:
            grow = [i for i in (lo - 1, hi + 1) if 0 <= i < len(units) and not taken[i] and _beside(units, i, lo, hi)]
            grow = [i for i in grow if float(scores[i]) >= GROW_SHARE * float(scores[seed])]
            if not grow:
                break
            best = max(grow, key=lambda i: float(scores[i]))
            lo, hi = min(lo, best), max(hi, best)
        for i in range(lo, hi + 1):
            taken[i] = True
        start, end = units[lo].start, units[hi].end
        out.append(Evidence(text=doc.text[start:end], where=place(doc, units[lo], units[hi]), start=start, end=end,
                            score=round(float(attention[lo:hi + 1].sum()) / total, 4)))
        first_score = first_score if first_score is not None else float(scores[seed])
    return out


def _beside(units: list[Unit], i: int, lo: int, hi: int) -> bool:
    """Whether unit i follows or precedes the span lo..hi in the same group of lines: the same
    file, the next (or previous) line number (blank lines between allowed), or the next sentence
    of the same page or paragraph."""
    other = units[lo] if i < lo else units[hi]
    near = units[i]
    if near.file != other.file:
        return False
    if near.line is not None and other.line is not None:
        return abs(near.line - other.line) <= 2
    return near.group == other.group


def place(doc: Document, first: Unit, last: Unit) -> str:
    """Where a span is, as a reader looks it up: `path:431-434` (a file's lines, the form editors
    and `sed -n 431,434p path` take), else the document's own place ("page 3", "paragraph 12")."""
    if first.line is not None and last.line is not None:
        lines = f"{first.line}" if first.line == last.line else f"{first.line}-{last.line}"
        return f"{first.file}:{lines}"
    return doc.where(first.start, last.end)


def rank(doc: Document, token_chars: list[tuple[int, int]], mass: torch.Tensor, question: str,
         count: int = EVIDENCE_SPANS, signal: str = DEFAULT_SIGNAL, min_share: float = MIN_SHARE) -> list[Evidence]:
    """The evidence for an answer (or, for `kvpage find`, a question): token_chars, mass: the
    document tokens read and the attention each received. Spans lie in the text those tokens hold."""
    units = units_of(doc, token_chars)
    attention = unit_mass(units, token_chars, mass)
    lexical = lexical_scores(doc, units, question) if signal != "attention" else torch.zeros(len(units))
    return spans(doc, units, fuse(attention, lexical, signal), attention, count, min_share)
