"""Contract review: every clause gets a category, a risk level, a reason and an exact quote.

The document (with the review instructions) is prefilled once; each clause is a question that
forks it. Category and risk are never parsed from generated text: each allowed option is scored
as the continuation of the answer ("Category: indemnification"), and calibrated by subtracting
the same option's score after a content-free clause ("N/A"), which removes the model's prior
preference for some option names. When the options start with distinct tokens (the taxonomy's
do) an option's score is the log-probability of its first token, read off one next-token
distribution; otherwise it is the mean log-probability of all its tokens, one fork per option.
Only the one-sentence reason is generated text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch

from ..engine import Engine
from ..engine.context import Context
from ..engine.events import EventCallback, emit
from ..errors import ContextTooLongError
from ..ingest import Clause, Document, split_clauses
from .chat import PromptBuilder
from .length import refuse_if_too_long
from .events import ReviewProgress
from .prompts import render
from .schema import CATEGORIES, RISK_LEVELS, Finding

MAX_CLAUSE_CHARS = 2400  # a clause longer than this is shown to the model cut at a sentence end
QUOTE_CHARS = 400
HEADING_REACH = 120  # characters before a clause's heading that may still be numbering or an article title

# Words that mark the sentence of a clause a finding should quote for its category. They choose
# the quote only; the category itself comes from the model's scores.
QUOTE_CUES: dict[str, tuple[str, ...]] = {
    "governing law": ("governed by", "laws of", "jurisdiction", "venue", "courts"),
    "liability cap": ("shall not exceed", "in no event", "aggregate liability", "limited to", "cap"),
    "uncapped liability": ("unlimited", "shall not apply", "without limit", "not be limited", "exclusion"),
    "indemnification": ("indemnif", "hold harmless", "defend"),
    "termination for convenience": ("terminate", "for convenience", "without cause"),
    "auto-renewal and renewal notice": ("renew", "non-renewal", "notice"),
    "non-compete": ("compet", "solicit"),
    "exclusivity": ("exclusive", "exclusively", "solely"),
    "change of control": ("change of control", "merger", "acquisition", "acquire"),
    "anti-assignment": ("assign", "transfer"),
    "liquidated damages": ("liquidated", "early termination fee", "as damages"),
    "audit rights": ("audit", "inspect", "records"),
    "ip assignment": ("intellectual property", "assign", "owns", "ownership", "work product"),
    "confidentiality": ("confidential", "disclose"),
    "payment": ("fee", "invoice", "pay", "interest"),
    "warranty": ("warrant", "disclaim", "as is"),
    "insurance": ("insurance", "insured", "coverage"),
    "other": (),
}


@dataclass
class _Option:
    name: str
    token_ids: list[int]


class Reviewer:
    """Reviews one document. `findings()` yields a Finding per clause, in document order."""

    def __init__(self, engine: Engine, doc: Document, clauses: list[Clause] | None = None,
                 max_reason_tokens: int = 40, on_event: EventCallback | None = None, label: str | None = None) -> None:
        self.engine = engine
        self.doc = doc
        refuse_if_too_long(doc.text, engine.tokenizer, engine.max_context)  # before splitting and tokenizing
        self.clauses = clauses if clauses is not None else split_clauses(doc)
        self.max_reason_tokens = max_reason_tokens
        self.on_event = on_event
        self.label = label  # names the document's saved KV (kvpage cache ls)
        self.prompts = PromptBuilder(engine.tokenizer)
        categories = "\n".join(f"- {name}: {desc}" for name, desc in CATEGORIES.items())
        document = render("document", kind="contract", source=doc.source, text=doc.text.strip())
        self.prefix_ids = self.prompts.prefix(document + render("review_instructions", categories=categories))
        self.category_options = [_Option(n, self.prompts.continuation(" " + n)) for n in CATEGORIES]
        self.risk_options = [_Option(n, self.prompts.continuation(" " + n)) for n in RISK_LEVELS]
        self._check_length()
        self._doc_ctx: Context | None = None
        self._null_category: dict[str, float] | None = None
        self._null_risk: dict[str, dict[str, float]] = {}

    @property
    def document_tokens(self) -> int:
        return len(self.prefix_ids)

    def _check_length(self) -> None:
        longest = max((len(self._clause_ids(c)) for c in self.clauses), default=0)
        needed = len(self.prefix_ids) + longest + 16 + self.max_reason_tokens
        if needed > self.engine.max_context:
            raise ContextTooLongError(
                needed, self.engine.max_context,
                f"the document alone is {len(self.prefix_ids)} tokens; use a model with a longer context "
                "(e.g. --model gemma3-270m, 32K tokens) or review a shorter part of the document",
            )

    def findings(self) -> Iterator[Finding]:
        """Prefills the document once, then reviews each clause on a fork of it."""
        self._doc_ctx = self.engine.prefill(self.prefix_ids, on_event=self.on_event, label=self.label)
        total = len(self.clauses)
        for done, clause in enumerate(self.clauses, 1):
            finding = self._review(clause)
            emit(self.on_event, ReviewProgress(done, total, clause.id))
            yield finding

    # -- one clause ------------------------------------------------------------------------------

    def _clause_ids(self, clause: Clause) -> list[int]:
        return self._question_ids(clause.id, clause.heading, _shorten(clause.text, MAX_CLAUSE_CHARS))

    def _question_ids(self, clause_id: str, heading: str, text: str) -> list[int]:
        question = render("review_clause", clause_id=clause_id, heading=heading, clause=text)
        return self.prompts.question(question, answer_prefix=render("review_answer"))

    def _review(self, clause: Clause) -> Finding:
        engine = self.engine
        ctx = engine.append(engine.fork(self._doc_ctx), self._clause_ids(clause))
        category_scores = self._calibrated(ctx, self.category_options, self._null_categories())
        category = max(category_scores, key=category_scores.get)

        risk_ctx = engine.append(engine.fork(ctx), self._field_ids("review_risk", category=category))
        risk_scores = self._calibrated(risk_ctx, self.risk_options, self._null_risks(category))
        risk = max(risk_scores, key=risk_scores.get)

        reason_ctx = engine.append(risk_ctx, self._field_ids("review_reason", risk=risk))  # continues "Risk:"
        reason = self._generate_line(reason_ctx)
        for c in (ctx, reason_ctx):
            engine.release(c)

        start, end = self._quote(clause, category)
        return Finding(
            clause_id=clause.id, heading=clause.heading, category=category, risk=risk, rationale=reason,
            quote=self.doc.text[start:end], source=self.doc.where(start, end), start=start, end=end,
            category_scores={k: round(v, 4) for k, v in category_scores.items()},
            risk_scores={k: round(v, 4) for k, v in risk_scores.items()},
        )

    def _field_ids(self, template: str, **values: str) -> list[int]:
        """The answer's next field, continuing after "Category:" (already in the context)."""
        return self.prompts.continuation(render(template, **values))

    def _scores(self, ctx: Context, options: list[_Option]) -> dict[str, float]:
        """Each option's score as the continuation of `ctx` (see the module docstring)."""
        firsts = [o.token_ids[0] for o in options]
        if len(set(firsts)) == len(firsts):
            log_probs = torch.log_softmax(self.engine.logits(ctx), dim=-1)
            return {o.name: float(log_probs[o.token_ids[0]]) for o in options}
        scores = {}
        for option in options:
            fork = self.engine.fork(ctx)
            log_probs = self.engine.score(fork, option.token_ids)
            self.engine.release(fork)
            scores[option.name] = sum(log_probs) / len(log_probs)
        return scores

    def _calibrated(self, ctx: Context, options: list[_Option], null: dict[str, float]) -> dict[str, float]:
        raw = self._scores(ctx, options)
        return {name: raw[name] - null[name] for name in raw}

    def _null_context(self) -> Context:
        return self.engine.append(self.engine.fork(self._doc_ctx), self._question_ids("N/A", "N/A", "N/A"))

    def _null_categories(self) -> dict[str, float]:
        if self._null_category is None:
            ctx = self._null_context()
            self._null_category = self._scores(ctx, self.category_options)
            self.engine.release(ctx)
        return self._null_category

    def _null_risks(self, category: str) -> dict[str, float]:
        if category not in self._null_risk:
            ctx = self._null_context()
            self.engine.append(ctx, self._field_ids("review_risk", category=category))
            self._null_risk[category] = self._scores(ctx, self.risk_options)
            self.engine.release(ctx)
        return self._null_risk[category]

    def _generate_line(self, ctx: Context) -> str:
        stop = set(self.engine.stop_ids)
        tokens: list[int] = []
        for token in self.engine.generate(ctx, max_new_tokens=self.max_reason_tokens, stop=stop):
            if token in stop:
                break
            tokens.append(token)
            if "\n" in self.prompts.decode(tokens[-1:]):
                break
        line = self.prompts.decode(tokens).strip().split("\n")[0].strip()
        if len(line) > 1 and line[0] in "\"“" and line[-1] in "\"”":  # the model often wraps it in quotes
            line = line[1:-1].strip()
        return line

    # -- quotes ----------------------------------------------------------------------------------

    def _quote(self, clause: Clause, category: str) -> tuple[int, int]:
        """Offsets in the document of the clause's sentence that best shows the category."""
        text = self.doc.text
        start = clause.start
        # the quote comes from the body, after the clause's heading (and the article's above it)
        near_start = min(clause.end, clause.start + len(clause.heading) + HEADING_REACH)
        heading_at = text.find(clause.heading, clause.start, near_start) if clause.heading else -1
        if heading_at >= 0:
            start = heading_at + len(clause.heading)
        sentences = [(s, e) for s, e in _sentences(text, start, clause.end) if len(text[s:e].split()) >= 5]
        if not sentences:
            sentences = [(s, e) for s, e in _sentences(text, clause.start, clause.end) if len(text[s:e].split()) >= 5]
        if not sentences:
            sentences = [(clause.start, clause.end)]
        cues = QUOTE_CUES.get(category, ())
        start, end = next(((s, e) for s, e in sentences if any(cue in text[s:e].lower() for cue in cues)), sentences[0])
        if end - start > QUOTE_CHARS:  # cut at a word boundary: still an exact substring
            cut = text.rfind(" ", start, start + QUOTE_CHARS)
            end = cut if cut > start else start + QUOTE_CHARS
        return start, end


# A sentence ends at . ; or : after a letter or closing mark (not after a digit, so "10.2" and
# "1." numbering do not end one), followed by white space or the end.
_SENTENCE_END = re.compile(r"(?<=[A-Za-z)\]\"”'%])[.;:](?=\s|$)")


_ABBREVIATIONS = {"no", "nos", "inc", "ltd", "co", "corp", "llc", "l.l.c", "e.g", "i.e", "etc", "mr", "mrs", "ms", "dr",
                  "st", "u.s", "art", "sec", "para", "vs", "approx", "jr", "sr"}


def _word_before(text: str, index: int) -> str:
    """The word that ends at `index` (letters and inner dots)."""
    start = index
    while start > 0 and (text[start - 1].isalpha() or text[start - 1] == "."):
        start -= 1
    return text[start:index]


def _sentences(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """(start, end) offsets of the sentences of text[start:end], white space trimmed."""
    spans, first = [], start
    for match in _SENTENCE_END.finditer(text, start, end):
        if match.group() == "." and _word_before(text, match.start()).lower() in _ABBREVIATIONS:
            continue  # "No. 1", "Inc.", "e.g." end no sentence
        spans.append((first, match.end()))
        first = match.end()
    spans.append((first, end))
    out = []
    for s, e in spans:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if e > s:
            out.append((s, e))
    return out


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = max(text.rfind(". ", 0, limit), text.rfind("; ", 0, limit))
    return text[: cut + 1 if cut > limit // 2 else limit] + " [...]"
