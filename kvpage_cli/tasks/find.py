"""Find: the places in a document that answer a question, without an answer (`kvpage find`).

Retrieval with no generation, over the document's saved index: the question's blocks are
selected as `kvpage ask` selects them (a lazy index first indexes the windows they lie in), moved
after the head in the order ask reads them, and the question is read after them with every row's
queries kept; its attention over the document's tokens, fused with its lexical match, ranks the
lines inside those blocks as an answer's evidence is ranked (tasks/evidence.py). Nothing is
decoded; over a saved index nothing of the document is prefilled, only the question.
"""

from __future__ import annotations

from ..engine import Engine
from ..engine.attention.evidence import token_mass
from ..engine.events import EventCallback
from ..ingest import Document
from . import evidence as evidence_spans
from .ask import Asker
from .retrieval import INDEX_TOKENS, Selection
from .schema import Evidence

FIND_SPANS = 5  # spans `kvpage find` prints unless told


class Finder:
    """The spans of one document that answer questions, best first (`find`)."""

    def __init__(self, engine: Engine, doc: Document, on_event: EventCallback | None = None,
                 label: str | None = None, index_tokens: int = INDEX_TOKENS) -> None:
        self.engine = engine
        self.doc = doc
        self.on_event = on_event
        self.label = label
        self.index_tokens = index_tokens
        self.asker: Asker | None = None
        self.selection: Selection | None = None
        self.sources: list[dict] = []
        self.indexed_tokens = 0  # document tokens indexed when the last question was asked
        self.total_tokens = 0  # of the document's

    def find(self, question: str, count: int = FIND_SPANS) -> list[Evidence]:
        """The `count` spans that answer `question` best, best first (fewer where the blocks read
        hold fewer units)."""
        asker = Asker(self.engine, self.doc, question, max_new_tokens=1, on_event=self.on_event, label=self.label,
                      evidence=False, index_tokens=self.index_tokens, mode="retrieval")
        if self.asker is not None:  # the same document: its index is built once
            asker.retriever = self.asker.retriever
        self.asker = asker
        ctx, tokens, places = asker.retrieval_context(0)
        engine = self.engine
        try:
            asked = len(asker.question_ids[0])  # the question's rows rank: the last of the pass
            queries = {layer: (q[-asked:], start + len(q) - asked)
                       for layer, (q, start) in engine.append_with_queries(ctx, tokens).items()}
            chars, mass = asker.document_tokens_of(places, token_mass(engine, ctx, queries))
        finally:
            engine.release(ctx)
        self.selection = asker.selections[0]
        self.sources = asker.sources[0]
        self.indexed_tokens = asker.indexed[0] or 0
        self.total_tokens = len(asker.retriever.index.tokens)
        return evidence_spans.rank(self.doc, chars, mass, question, count=count, min_share=0.0)

    def release(self) -> None:
        if self.asker is not None and self.asker.retriever is not None:
            self.asker.retriever.index.release()
