"""Retrieval mode: a document longer than the model's context, indexed once, asked many times.

The document is indexed into blocks (engine/index.py). For each question the
blocks that matter are chosen (`Retriever.select`), always with the head (the instructions and
the document's first tokens) kept, then assembled right after the head in document order, the
best passage last (`tasks.ask.reading_order`), and the question is asked of that context.
Signals, combined by rank:
- lexical: BM25 (bm25s) over each block's text, identifiers split into words, words reduced to
  their stems (`search_terms`);
- bounds: the same queries against each block's key bounds (Quest: the element-wise min and max
  of its keys per layer and head, kept in memory and saved with the index): an upper bound of the
  block's largest q.k, cheap enough to rank every block of a long document;
- keys: the question's own attention: its last tokens' queries, in every layer, against the
  keys of candidate blocks, each block seen as if it sat just before the question.
The first-stage signals (lexical, bounds) rank every passage; keys scores the best of them. The
default is lexical alone: the measurements (DEFAULT_SIGNALS) found the model's attention no help.
Every answer says which blocks it read: their files, pages and lines.

An index may be lazy (`Retriever.build(..., lazy=True)`): the lexical signal needs only the text,
so a question's passages are ranked over the whole document first, then the windows they lie in,
best first, up to `index_tokens` of windows a question, are indexed where they are not yet
(`select_lazily`); passages past that give way to the next.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import torch

from ..engine import Engine
from ..engine.config import BLOCK_TOKENS
from ..engine.index import RetrievalIndex
from ..ingest import Document

_WORD = re.compile(r"[A-Za-z0-9]+")
_CAMEL = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def lexical_terms(text: str, stopwords: frozenset[str] = frozenset()) -> list[str]:
    """Lower-cased words; identifiers split too (max_redirects -> max, redirects;
    TooManyRedirects -> too, many, redirects), each compound kept beside its parts."""
    terms = []
    for match in re.finditer(r"\w+", text):
        word = match.group()
        parts = [p.lower() for piece in _WORD.findall(word) for p in _CAMEL.findall(piece)]
        whole = word.lower()
        if len(parts) > 1 and whole not in stopwords:
            terms.append(whole)
        terms += [p for p in parts if p not in stopwords and len(p) > 1]
    return terms


def search_terms(text: str, stopwords: frozenset[str] = frozenset()) -> list[str]:
    """`lexical_terms` reduced to their stems (`stems`): the terms BM25 matches a question with."""
    return stems(lexical_terms(text, stopwords))


def stems(terms: list[str]) -> list[str]:
    """Terms reduced to their stems (Snowball's English stemmer): "governs", "governed" and
    "governing" are one term, as are "connections" and "connection". Over bench/retrieval.py's
    79 questions the passages selected held the evidence of 61 against 57 with whole words, 7
    found and 3 lost (`python bench/retrieval_evidence.py lazy`; 22 of the 27 questions over
    packaging, werkzeug and urllib3 against 19, 39 of the 52 others against 38)."""
    stemmer = getattr(_STEMMERS, "english", None)
    if stemmer is None:  # one a thread: a PyStemmer stemmer is not safe to share between threads
        import Stemmer  # PyStemmer: Snowball's stemmers in C, the one bm25s takes

        stemmer = _STEMMERS.english = Stemmer.Stemmer("english")
    return stemmer.stemWords(terms)


_STEMMERS = threading.local()


@dataclass(frozen=True)
class Selection:
    """The blocks a question reads: indices into the index's blocks, in document order; and the
    passages that matched the question best, best first (each a tuple of blocks)."""

    blocks: list[int]
    total: int  # blocks in the index
    best: tuple[tuple[int, ...], ...] = ()

    @property
    def share(self) -> float:
        return len(self.blocks) / self.total if self.total else 1.0


SIGNALS = ("lexical", "bounds", "keys")
# lexical alone: over bench/retrieval.py's 73 questions (SmolLM2, 4,096 tokens a question) it
# selected the evidence of 75.3% against 74.0% with the keys signal fused, which read 270 MiB of K
# and 0.8 s a question; keys alone 15.1%, bounds alone 12.3% (bench/results/retrieval-select-smollm2.json)
DEFAULT_SIGNALS = ("lexical",)
UNIT_BLOCKS = 4  # blocks chosen together: 256 consecutive tokens read as one passage
CANDIDATES = 3  # the keys signal scores this many times the budget's passages, the lexical signal's best
BEST = 4  # passages a Selection names as the best (Asker reads some of them again for sliding-window layers)
INDEX_TOKENS = 10240
"""Over a lazy index a question reads the passages of the windows its best passages lie in, up to
this many tokens of windows (each window's tokens and the overlap before it: four of SmolLM2's
2,048-token windows), computing those not indexed yet; passages past it give way to the next."""


class Retriever:
    """The index of one document and what selects its blocks.

    Blocks are chosen by passages of UNIT_BLOCKS consecutive blocks (a model reads a passage
    better than scattered 64-token pieces). The lexical signal ranks every passage; the keys
    signal ranks the lexical signal's best CANDIDATES x budget passages (reading their keys costs
    memory traffic); the ranks are fused (reciprocal rank fusion)."""

    def __init__(self, engine: Engine, index: RetrievalIndex, doc: Document, char_spans: list[tuple[int, int]],
                 unit_blocks: int = UNIT_BLOCKS, terms: list[list[str]] | None = None) -> None:
        """char_spans: per index block, the characters of doc.text it holds. terms: per passage,
        its search terms as computed before (tasks/prepared.py; computed here when None or not
        one per passage)."""
        import bm25s  # imported here: it loads tqdm, which no engine or task module may bring in at import
        from bm25s.stopwords import STOPWORDS_EN

        self.engine = engine
        self.index = index
        self.doc = doc
        self.char_spans = char_spans
        self.unit_blocks = unit_blocks
        self.units = [list(range(i, min(i + unit_blocks, index.num_blocks)))
                      for i in range(0, index.num_blocks, unit_blocks)]
        self.tail: list[int] = []  # tokens read before every question (the document's last, the template's end)
        self.stopwords = frozenset(STOPWORDS_EN)
        self.bm25 = bm25s.BM25()
        if terms is None or len(terms) != len(self.units):
            terms = [search_terms(doc.text[char_spans[u[0]][0]:char_spans[u[-1]][1]], self.stopwords) for u in self.units]
        self.terms = terms  # per passage, what BM25 indexed
        if terms:  # a document shorter than its head and tail has no passage to index (bm25s refuses none)
            self.bm25.index([t or ["\u0000"] for t in terms], show_progress=False)

    @classmethod
    def build(cls, engine: Engine, doc: Document, prefix_ids: list[int], chars: list[tuple[int, int] | None],
              on_event=None, label: str | None = None, lazy: bool = False,
              terms: list[list[str]] | None = None) -> "Retriever":
        """Indexes a prompt's document once: the prompt's tokens before the document (its head)
        prefilled, the document's window by window (lazy: the saved windows mapped, the others
        left to the questions that need them, `select_lazily`). chars: per prompt token, the
        characters of doc.text it holds (None for the template's own words). `tail` is what every
        question reads before it: the document's last tokens (less than a block) and the
        template's end. terms: the passages' search terms as computed before (tasks/prepared.py)."""
        first = next(i for i, c in enumerate(chars) if c is not None)
        last = max(i for i, c in enumerate(chars) if c is not None) + 1
        window, overlap = default_window(engine.max_context)
        index = RetrievalIndex.build(engine, prefix_ids[:first], prefix_ids[first:last], window, overlap, on_event, label,
                                     lazy=lazy)
        retriever = cls(engine, index, doc, block_char_spans(index, chars, len(index.head.tokens)), terms=terms)
        retriever.tail = index.rest + prefix_ids[last:]
        return retriever

    def select_lazily(self, question: str, question_ids: list[int], budget: int,
                      index_tokens: int = INDEX_TOKENS, on_event=None) -> Selection:
        """`select`'s choice over a lazy index: the passages ranked as `select` ranks them (the
        lexical signal), taken best first while the windows they lie in come to at most
        `index_tokens` of prefill (each window's tokens and its overlap); a passage past that
        gives way to the next. The windows not indexed yet are then computed (their blocks join
        the saved index). Windows already indexed count too, so a question reads the same
        passages whatever earlier questions indexed: asked again, it computes nothing. Where the
        passages `select` would choose all fit, the choice is `select`'s, block for block."""
        index = self.index
        if not index.missing:
            return self.select(question, question_ids, budget)
        total = index.num_blocks
        scores = self._lexical_scores(question)
        order = torch.argsort(_rank(scores), stable=True).tolist()  # best first, ties in document order
        wanted = len(self.units) if total <= budget else max(1, budget // self.unit_blocks)
        taken: list[int] = []
        windows: list[int] = []
        spent = 0
        for u in order:
            if len(taken) == wanted:
                break
            new = [w for w in dict.fromkeys(index.window_of(b) for b in self.units[u]) if w not in windows]
            cost = sum(index.window_cost(w) for w in new)
            if new and spent + cost > index_tokens:
                continue
            windows += new
            spent += cost
            taken.append(u)
        index.ensure(windows, on_event)  # those not indexed yet
        # as `select` names them: the best passages, chosen or not, but of the windows indexed
        readable = [u for u in order if all(index.ready(b) for b in self.units[u])]
        best = tuple(tuple(self.units[u]) for u in readable[:BEST])
        return Selection(sorted(b for u in taken for b in self.units[u]), total, best)

    def select(self, question: str, question_ids: list[int], budget: int, signals: tuple[str, ...] = DEFAULT_SIGNALS,
               candidates: int | None = None) -> Selection:
        """About `budget` blocks that matter most to the question (whole passages), in document order.

        signals: some of SIGNALS. The first-stage signals (lexical, bounds) rank every passage; the
        keys signal scores the candidates they rank best, or every passage without them.
        candidates: passages the keys signal scores (default CANDIDATES x the budget's)."""
        unknown = set(signals) - set(SIGNALS)
        if unknown or not signals:
            raise ValueError(f"signals must be some of {', '.join(SIGNALS)}; got {', '.join(signals) or 'none'}")
        total = self.index.num_blocks
        if set(signals) - {"lexical"} or total <= budget:  # the model's signals read every block's keys
            self.index.ensure(sorted(self.index.missing))
        if total <= budget:  # every block is read; the lexically best passages are still named
            return Selection(list(range(total)), total, self._best(_rank(self._lexical_scores(question))))
        count = len(self.units)
        wanted = max(1, budget // self.unit_blocks)
        ranks = []
        queries = None
        if "lexical" in signals:
            ranks.append(_rank(self._lexical_scores(question)))
        if "bounds" in signals:
            queries = self._question_queries(question_ids)
            ranks.append(_rank(self._per_unit(self.index.bound_scores(queries), range(count))))
        if "keys" in signals:
            pool = list(range(count))
            limit = candidates if candidates is not None else CANDIDATES * wanted
            if ranks and limit < count:
                pool = sorted(torch.argsort(_fuse(ranks), descending=True, stable=True)[:limit].tolist())
            queries = queries if queries is not None else self._question_queries(question_ids)
            per_block = self.index.attention_scores(queries, [b for u in pool for b in self.units[u]])
            ranks.append(_rank(self._per_unit(per_block, pool)))
        fused = _fuse(ranks)
        chosen = torch.argsort(fused, descending=True, stable=True)[:wanted].tolist()
        return Selection(sorted(b for u in chosen for b in self.units[u]), total, self._best(-fused))

    def _lexical_scores(self, question: str) -> torch.Tensor:
        """BM25 score of every passage for the question's terms [passages]."""
        terms = search_terms(question, self.stopwords)
        if not terms or not self.units:
            return torch.zeros(len(self.units))
        return torch.as_tensor(self.bm25.get_scores(terms), dtype=torch.float32)

    def _best(self, rank: torch.Tensor) -> tuple[tuple[int, ...], ...]:
        """The BEST passages of lowest `rank` (ties in document order), best first, as blocks."""
        return tuple(tuple(self.units[u]) for u in torch.argsort(rank, stable=True)[:BEST].tolist())

    def _per_unit(self, per_block: torch.Tensor, units) -> torch.Tensor:
        """Passage scores [passages] from the scores of the blocks of `units` (in that order; the
        other passages score -inf)."""
        scores = torch.full((len(self.units),), float("-inf"))
        offset = 0
        for u in units:
            scores[u] = per_block[offset:offset + len(self.units[u])].sum()
            offset += len(self.units[u])
        return scores

    def _question_queries(self, question_ids: list[int]) -> dict[int, tuple[torch.Tensor, int]]:
        """The question's last tokens' queries per layer, asked right after the head."""
        return self.engine.queries_after(self.index.head, question_ids)

    def sources(self, selection: Selection) -> list[dict]:
        """Where the selected blocks' text is: consecutive blocks joined, each with its span."""
        merged: list[list[int]] = []
        for index in selection.blocks:
            start, end = self.char_spans[index]
            if merged and start <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [{"where": self.doc.where(s, e), "start": s, "end": e} for s, e in merged if e > s]


def _fuse(ranks: list[torch.Tensor]) -> torch.Tensor:
    """Reciprocal rank fusion: higher is better."""
    return sum(1.0 / (60.0 + r) for r in ranks)


def _rank(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each score (0 = best), ties in document order."""
    order = torch.argsort(scores, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return rank.float()


def block_char_spans(index: RetrievalIndex, token_chars: list[tuple[int, int] | None], head_tokens: int) -> list[tuple[int, int]]:  # noqa: E501
    """Per index block, the characters of the document its tokens came from.

    token_chars: per prompt token, its characters in the document (None outside it); the index's
    tokens are the prompt's tokens after the first `head_tokens`."""
    spans = []
    for block in index.blocks:
        chars = [c for c in token_chars[head_tokens + block.first:head_tokens + block.first + BLOCK_TOKENS] if c]
        spans.append((chars[0][0], chars[-1][1]) if chars else (0, 0))
    return spans


def question_budget(engine: Engine, fixed_tokens: int, tokens: int | None = None) -> int:
    """Blocks a question may read in retrieval mode: `tokens` (default the engine's
    retrieval_tokens), within the model's context less `fixed_tokens` (the head, what follows the
    blocks, the answer), and where attention reads blocks through the pool's slots (kv_path
    "pool", as on a GPU) within the slots those leave, so that the chosen blocks stay resident
    while the answer is decoded: --pool-mib sets how much a question reads there."""
    bounds = budget_bounds(engine, tokens)
    room = min(limit - (fixed_tokens if name != "kvpage's budget" else 0) for name, limit in bounds.items())
    return max(1, room // BLOCK_TOKENS)


def budget_bounds(engine: Engine, tokens: int | None = None) -> dict[str, int]:
    """What bounds the tokens a question reads in retrieval mode, by name (kvpage info says the
    least): the budget, the context limit and, where blocks are read through the pool, its slots."""
    bounds = {"kvpage's budget": tokens or engine.config.retrieval_tokens, "the context limit": engine.max_context}
    if engine.kv_path == "pool":
        bounds["the pool (--pool-mib)"] = engine.pool.num_slots * BLOCK_TOKENS
    return bounds


def default_window(max_context: int) -> tuple[int, int]:
    """(window, overlap) in tokens for a model trained on `max_context` positions. For SmolLM2
    (8K) 2,048 and 512: `bench/retrieval.py windows` measured +0.014 nats a token over an exact
    prefill with them, +0.023 without overlap, +0.049 with 1,024-token windows, +0.006 with 4,096
    and half of each window overlapping (which computes half of the document twice)."""
    window = max(BLOCK_TOKENS, min(2048, max_context // 4) // BLOCK_TOKENS * BLOCK_TOKENS)
    return window, max(0, window // 4 // BLOCK_TOKENS * BLOCK_TOKENS)
