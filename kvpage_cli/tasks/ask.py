"""Ask: a question over a document (a file, a repository, stdin); the answer streams as decoded."""

from __future__ import annotations

from typing import Iterator

from ..engine import Engine
from ..engine.events import EventCallback
from ..errors import ContextTooLongError
from ..ingest import Document
from .chat import PromptBuilder
from .length import refuse_if_too_long
from .prompts import render

_KINDS = {"pdf": "a PDF document", "docx": "a Word document", "text": "a text file", "repo": "a code repository"}


class Asker:
    """One question over one document. `answer()` yields the answer's text as it is decoded."""

    def __init__(self, engine: Engine, doc: Document, question: str, max_new_tokens: int = 256,
                 temperature: float = 0.0, on_event: EventCallback | None = None, label: str | None = None) -> None:
        if not question.strip():
            raise ValueError("the question is empty")
        self.engine = engine
        self.doc = doc
        self.question = question.strip()
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.on_event = on_event
        self.label = label
        self.prompts = PromptBuilder(engine.tokenizer)
        refuse_if_too_long(doc.text, engine.tokenizer, engine.max_context)
        document = render("document", kind=_KINDS.get(doc.kind, doc.kind), source=doc.source, text=doc.text.strip())
        self.prefix_ids = self.prompts.prefix(document)
        self.question_ids = self.prompts.question(render("ask", question=self.question))
        needed = len(self.prefix_ids) + len(self.question_ids) + max_new_tokens
        if needed > engine.max_context:
            raise ContextTooLongError(
                needed, engine.max_context,
                f"the document is {len(self.prefix_ids)} tokens; ask about a smaller part of it, lower "
                "--max-new-tokens, or use a model with a longer context (e.g. --model gemma3-270m, 32K tokens)",
            )
        self.cached_tokens = 0
        self.complete = False

    @property
    def document_tokens(self) -> int:
        return len(self.prefix_ids)

    def answer(self) -> Iterator[str]:
        """Prefills the document, then decodes, yielding each new piece of text."""
        engine = self.engine
        ctx = engine.prefill(self.prefix_ids, on_event=self.on_event, label=self.label)
        self.cached_tokens = ctx.cached_prefix
        stop = engine.stop_ids
        tokens: list[int] = []
        shown = ""
        for token in engine.generate(ctx, self.question_ids, max_new_tokens=self.max_new_tokens,
                                     temperature=self.temperature, stop=stop, on_event=self.on_event):
            if token in stop:
                break
            tokens.append(token)
            if _repeating(tokens):
                break
            text = self.prompts.decode(tokens)
            if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
                continue
            piece, shown = text[len(shown):], text
            if piece:
                yield piece
        text = self.prompts.decode(tokens)
        if len(text) > len(shown):
            yield text[len(shown):]
        self.complete = True


REPEAT_WINDOW = 24


def _repeating(tokens: list[int]) -> bool:
    """True when the last REPEAT_WINDOW tokens already occurred earlier: the model is looping."""
    if len(tokens) < 2 * REPEAT_WINDOW:
        return False
    tail = tokens[-REPEAT_WINDOW:]
    return any(tokens[i:i + REPEAT_WINDOW] == tail for i in range(len(tokens) - REPEAT_WINDOW))
