"""The systems a question goes through, each at the same budget of attended document tokens:
(a) kvpage's retrieval mode, (b) BM25 chunks packed into the `kvpage ask` prompt, (c) the whole
document in that prompt (exact); what each answer cost, and the engines they run on."""

from __future__ import annotations

import bisect
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvpage_cli.tasks.retrieval import search_terms  # the same terms as retrieval mode's BM25

SYSTEMS = ("retrieval", "bm25", "exact")


@dataclass
class Answer:
    """One question's answer and what it cost."""

    text: str
    first_token_s: float  # from the call to the first answer token (what the system builds for the document included)
    total_s: float
    attended_tokens: int  # tokens the answer's first decoded token attends: document part, template, question
    kv_read_bytes: int  # KV read by this question's attention steps (prefill and decode), counted per step
    sources: list[str] = field(default_factory=list)  # where the attended text came from (file and lines)
    ranges: list[tuple[int, int]] | None = None  # character ranges of doc.text attended; None: all of it
    index_s: float = 0.0  # of first_token_s, building what the system keeps for the document (0 when reused)
    indexed_tokens: int = 0  # retrieval: document tokens computed into the index by this question (not mapped)


@dataclass
class RunSettings:
    budget: int  # tokens of document text a question may attend
    max_new_tokens: int
    chunk_tokens: int
    order: str = "best-last"  # passages read in document order, or so with the best one last (both systems)
    evidence_dump: Path | None = None  # questions --evidence-dump: each answer's attention per token, JSON lines


class NotBuilt(Exception):
    """A system that cannot answer over this document (not built yet, or the prompt does not fit
    the model's context): its rows say so."""


# -- (a) retrieval mode, as `kvpage ask --mode retrieval` runs it -----------------------------

def retrieval_answer(engine, doc, question: str, state: dict, settings: RunSettings) -> Answer:
    """(a) kvpage's retrieval mode, as `kvpage ask --mode retrieval` runs it: the document indexed
    window by window for the first question over it (kept in `state` for the next ones), then
    per question the blocks BM25 and the question's own attention choose, `settings.budget`
    tokens of them, moved right after the prompt's head."""
    from kvpage_cli.tasks import Asker

    started = time.perf_counter()
    asker = Asker(engine, doc, question, max_new_tokens=settings.max_new_tokens, retrieval_tokens=settings.budget)
    asker.mode = "retrieval"
    asker.retriever = state.get("retriever")
    index_s = 0.0
    if asker.retriever is None:
        state["retriever"] = asker.index()
        index_s = time.perf_counter() - started
    before = state["retriever"].index.computed_tokens
    with counting_kv_reads(engine) as kv:
        pieces, first = [], None
        for _, piece in asker.answers():
            if first is None:
                first = time.perf_counter() - started
            pieces.append(piece)
    selection = asker.selections[0]
    retriever = asker.retriever
    indexed = retriever.index.computed_tokens - before  # a lazy index's windows this question computed
    state["asker"] = asker  # its evidence is measured against the question set (retrieval_evidence)
    attended = len(retriever.index.head.tokens) + 64 * len(selection.blocks) + len(asker.question_ids[0])
    ranges = [retriever.char_spans[i] for i in selection.blocks]
    return Answer("".join(pieces), first if first is not None else time.perf_counter() - started,
                  time.perf_counter() - started, attended, kv["bytes"], [s["where"] for s in asker.sources[0]],
                  ranges, index_s, indexed)


# -- (b) BM25 chunks packed into the budget ---------------------------------------------------

@dataclass
class Chunk:
    start: int  # characters of doc.text
    end: int
    tokens: int
    where: str


def chunk_document(doc, tokenizer, chunk_tokens: int) -> list[Chunk]:
    """The document cut into consecutive pieces of at most `chunk_tokens` tokens that never cross
    a file (a repo's "==> path <==" heading lines are left out: the packed prompt names the file),
    each ending at a line break where one falls in its second half."""
    text = doc.text
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    token_starts = [start for start, _ in encoded["offset_mapping"]]
    headings = [s for s in doc.spans if s.kind == "heading"]
    if headings:
        regions = [(h.end + 1, nxt.start) for h, nxt in zip(headings, headings[1:] + [None]) if nxt is not None]
        regions.append((headings[-1].end + 1, len(text)))
    else:
        regions = [(0, len(text))]
    chunks = []
    for region_start, region_end in regions:
        pos = region_start
        while pos < region_end and text[pos:region_end].strip():
            first = bisect.bisect_left(token_starts, pos)
            cut = first + chunk_tokens
            if cut >= len(token_starts) or token_starts[cut] >= region_end:
                end = region_end
            else:
                end = token_starts[cut]
                newline = text.rfind("\n", pos, end)
                if newline > pos + (end - pos) // 2:
                    end = newline + 1
            tokens = bisect.bisect_left(token_starts, end) - first
            chunks.append(Chunk(pos, end, tokens, doc.where(pos, end)))
            pos = end
    return chunks


class BM25Chunks:
    """A document's chunks and their BM25 index (bm25s)."""

    def __init__(self, doc, tokenizer, chunk_tokens: int) -> None:
        import bm25s
        from bm25s.stopwords import STOPWORDS_EN

        self.stopwords = frozenset(STOPWORDS_EN)
        self.chunks = chunk_document(doc, tokenizer, chunk_tokens)
        self.index = bm25s.BM25()
        self.index.index([search_terms(doc.text[c.start:c.end], self.stopwords) for c in self.chunks],
                         show_progress=False)

    def pack(self, doc, tokenizer, question: str, budget: int, order: str = "best-last") -> tuple[str, list[Chunk]]:
        """The best chunks for `question` that fit `budget` tokens with their headers, in document
        order (`order` "best-last": the best chunk last, as retrieval mode reads its passages); the
        packed text, tokenized as the prompt will be, is within the budget."""
        scores = self.index.get_scores(search_terms(question, self.stopwords))
        ranked = sorted(range(len(self.chunks)), key=lambda i: -scores[i])
        chosen, used = [], 0
        for i in ranked:
            chunk = self.chunks[i]
            cost = chunk.tokens + len(tokenizer(self._header(doc, chunk), add_special_tokens=False).input_ids)
            if used + cost > budget:
                continue
            chosen.append(i)
            used += cost
            if budget - used < 16:
                break
        while True:  # chunk boundaries tokenize a little differently on their own
            read = sorted(chosen)
            if order == "best-last" and chosen:
                read = [i for i in read if i != chosen[0]] + [chosen[0]]
            text = self._text(doc, read)
            if len(tokenizer(text, add_special_tokens=False).input_ids) <= budget or not chosen:
                break
            chosen.pop()  # the lowest-ranked
        return text, [self.chunks[i] for i in read]

    def _text(self, doc, indices: list[int]) -> str:
        return "\n".join(self._header(doc, self.chunks[i]) + doc.text[self.chunks[i].start:self.chunks[i].end].rstrip()
                         for i in indices)

    @staticmethod
    def _header(doc, chunk: Chunk) -> str:
        where = chunk.where if doc.kind == "repo" else f"{Path(doc.source).name} {chunk.where}"
        return f"==> {where} <==\n"


def bm25_answer(engine, doc, question: str, state: dict, settings: RunSettings) -> Answer:
    """(b) BM25 chunks in the `kvpage ask` prompt, prefilled exactly, answered greedily."""
    from kvpage_cli.errors import ContextTooLongError
    from kvpage_cli.ingest import Document
    from kvpage_cli.tasks import Asker

    started = time.perf_counter()
    if "index" not in state:
        state["index"] = BM25Chunks(doc, engine.tokenizer, settings.chunk_tokens)
    index_s = time.perf_counter() - started
    text, chosen = state["index"].pack(doc, engine.tokenizer, question, settings.budget, settings.order)
    packed = Document(source=doc.source, kind=doc.kind, text=text, spans=[])
    try:
        asker = Asker(engine, packed, question, max_new_tokens=settings.max_new_tokens)
    except ContextTooLongError as exc:
        raise NotBuilt(f"does not fit: the budget with the prompt is too long ({exc})") from None
    with counting_kv_reads(engine) as kv:
        pieces, first = [], None
        for piece in asker.answer():
            if first is None:
                first = time.perf_counter() - started
            pieces.append(piece)
    attended = len(asker.prefix_ids) + len(asker.question_ids[0])
    return Answer("".join(pieces), first if first is not None else time.perf_counter() - started,
                  time.perf_counter() - started, attended, kv["bytes"], [c.where for c in chosen],
                  [(c.start, c.end) for c in chosen], index_s)


# -- (c) exact mode over the whole document ---------------------------------------------------

def exact_answer(engine, doc, question: str, state: dict, settings: RunSettings) -> Answer:
    """(c) The whole document prefilled once (first question), each question on a fork of it."""
    from kvpage_cli.errors import ContextTooLongError
    from kvpage_cli.tasks import Asker
    from kvpage_cli.tasks.ask import loop_start

    started = time.perf_counter()
    try:
        asker = Asker(engine, doc, question, max_new_tokens=settings.max_new_tokens)
    except ContextTooLongError as exc:
        raise NotBuilt(f"does not fit: {exc}") from None
    if asker.mode != "exact":  # mode auto chose retrieval: the prompt is longer than the context
        needed = len(asker.prefix_ids) + len(asker.question_ids[0]) + settings.max_new_tokens
        raise NotBuilt(f"does not fit: the prompt needs {needed} tokens, the context is {engine.max_context}")
    with counting_kv_reads(engine) as kv:
        index_s = 0.0
        if "ctx" not in state:
            state["ctx"] = engine.prefill(asker.prefix_ids, use_cache=False)
            index_s = time.perf_counter() - started
        ctx = engine.fork(state["ctx"])
        stop = engine.stop_ids
        tokens, first = [], None
        for token in engine.generate(ctx, asker.question_ids[0], max_new_tokens=settings.max_new_tokens, stop=stop):
            if first is None:
                first = time.perf_counter() - started
            if token in stop:
                break
            tokens.append(token)
            loop = loop_start(tokens)
            if loop is not None:
                del tokens[loop:]
                break
        engine.release(ctx)
    attended = len(asker.prefix_ids) + len(asker.question_ids[0])
    return Answer(asker.prompts.decode(tokens), first, time.perf_counter() - started, attended, kv["bytes"],
                  [doc.source], None, index_s)


# -- the systems by name, and the engines they run on -----------------------------------------------------

SYSTEM_FUNCTIONS: dict[str, Callable[..., Answer]] = {
    "retrieval": retrieval_answer, "bm25": bm25_answer, "exact": exact_answer,
}


# EngineConfig fields each system's engine is loaded with besides the command line's (retrieval
# mode's saved-KV cache: running.engines_from); systems with the same fields share one engine.
ENGINE_OPTIONS: dict[str, dict] = {"retrieval": {}, "bm25": {}, "exact": {}}


class Engines:
    """The engines the systems run on, loaded on first use, one per distinct set of options."""

    def __init__(self, model: str, **common) -> None:
        self.model = model
        self.common = common
        self.loaded: dict[tuple, object] = {}

    def for_system(self, system: str):
        from kvpage_cli.engine import Engine, EngineConfig

        options = {**self.common, **ENGINE_OPTIONS[system]}
        key = tuple(sorted(options.items()))
        if key not in self.loaded:
            self.loaded[key] = Engine.load(self.model, EngineConfig(**options))
        return self.loaded[key]

    @property
    def tokenizer(self):
        return (next(iter(self.loaded.values())) if self.loaded else self.for_system("bm25")).tokenizer


@contextmanager
def counting_kv_reads(engine):
    """The K/V bytes attention reads while the block runs (the engine's own count: every block a
    step reads, once per layer). Yields a dict whose "bytes" is set at the end."""
    before = engine.stats().kv_read_bytes
    counter = {"bytes": 0}
    try:
        yield counter
    finally:
        counter["bytes"] = engine.stats().kv_read_bytes - before
