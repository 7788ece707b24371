"""Contract review: the clauses that matter, their risk from a playbook, values copied from the text.

1. The contract is cut into clauses (ingest.split_clauses) and a trained head gives each clause
   its categories (multi-label over CUAD's taxonomy; classifier.py). A clause with no category
   is not a finding.
2. For every category of a clause, the playbook's questions are put to the model, on a fork of the
   document's context with the clause appended: a yes/no question is the log-odds of "Yes"
   against "No" as the answer's first token, calibrated by subtracting the same log-odds after a
   content-free clause ("N/A"); a value is chosen among the clause's candidate spans (values.py)
   by the mean log-probability of its tokens as the answer, calibrated the same way. A value is
   always the document's own words, with its page.
3. The playbook's first rule that holds gives the level and the reason, filled with the values.
   The findings are ordered by risk; the key terms (parties, dates, renewal, law, cap) open the
   review. Only `explain` asks the model for prose, labelled as its commentary, and drops what
   fails a check.

The document is prefilled once (exact mode); a document longer than the context is indexed
window by window (retrieval mode) and each clause's questions read the clause's own blocks, the
definitions clause's, and the passages BM25 ranks best for the clause's words. All model work of a stage (clauses appended, questions,
candidates) runs as one batch of `max_batch` sequences; max_batch=1 runs them one at a time and
gives the same findings.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

from ..engine import Engine
from ..engine.config import BLOCK_TOKENS
from ..engine.events import EventCallback, emit
from ..engine.kv.context import Context
from ..errors import ContextTooLongError
from ..ingest import Clause, Document, split_clauses
from .ask import loop_start
from .candidates import Candidate, choose_candidates, heading_span
from .chat import PromptBuilder
from .classifier import ClauseHead, lexical_head
from .events import ReviewProgress
from .length import refuse_if_too_long
from .playbook import LEVELS, CategoryPlay, Condition, Playbook, fill
from .prompts import render
from .retrieval import Retriever, question_budget
from .schema import Assessment, Finding, Term, Value
from .taxonomy import ALL_CATEGORIES
from .values import FEES_OVER_A_PERIOD, amount, in_unit, sentences
from .zero_shot import shorten

MAX_CLAUSE_CHARS = 2400  # a clause longer than this is shown to the model cut at a sentence end
QUOTE_CHARS = 400
MAX_CANDIDATES = 8  # candidate spans scored per value, the first in the clause
VALUE_ANSWERS = 2  # a "party" value keeps this many (a contract has two sides); others keep one
EXPLAIN_TOKENS = 48
_DEFINITIONS = re.compile(r"\bdefinitions?\b|\bdefined terms\b|\binterpretation\b", re.IGNORECASE)


class Reviewer:
    """Reviews one document: `findings()` yields the findings, worst first; `terms` and
    `reviewed` are ready after it."""

    def __init__(self, engine: Engine, doc: Document, clauses: list[Clause] | None = None, *,
                 playbook: Playbook | None = None, head: ClauseHead | None = None, max_batch: int | None = None,
                 explain: bool = False, explain_tokens: int = EXPLAIN_TOKENS, include_all: bool = False,
                 on_event: EventCallback | None = None, label: str | None = None) -> None:
        self.engine = engine
        self.doc = doc
        self.mode = engine.config.mode
        if self.mode == "exact":  # before splitting and tokenizing; retrieval (and selective's) reads any length
            refuse_if_too_long(doc.text, engine.tokenizer, engine.max_context)
        self.clauses = clauses if clauses is not None else split_clauses(doc)
        self.playbook = playbook or Playbook.default()
        self.head = head or lexical_head()
        self.max_batch = max_batch
        self.explain = explain
        self.explain_tokens = explain_tokens
        self.include_all = include_all
        self.on_event = on_event
        self.label = label  # names the document's saved KV (kvpage cache ls)
        self.prompts = PromptBuilder(engine.tokenizer)
        text = doc.text.strip()
        document = render("document", kind="contract", source=doc.name, text=text)
        self.prefix_ids, chars = self.prompts.prefix_spans(document)
        start, shift = document.find(text), doc.text.find(text) - document.find(text)
        self._chars = [(c[0] + shift, c[1] + shift) if c is not None and c[1] > start and c[0] < start + len(text)
                       else None for c in chars]
        self.intro_ids = self.prompts.continuation("\n\n" + render("review_intro"))
        self.terms: list[Term] = []
        self.reviewed = 0  # clauses done
        self.retriever: Retriever | None = None
        self.attended_blocks: int | None = None
        self._doc_ctx: Context | None = None
        self._longest: int | None = None
        self._null: Context | None = None
        self._null_odds: dict[str, float] = {}  # question -> its log-odds of yes after the content-free clause
        self._null_scores: dict[tuple[str, str], float] = {}  # (question, candidate) -> its mean log-prob there
        self._choose_mode()

    @property
    def document_tokens(self) -> int:
        return len(self.prefix_ids) + len(self.intro_ids)

    @property
    def detector(self) -> str:
        return f"{self.head.meta.get('head', 'head')} head ({self.head.meta.get('trained_on', '')})".strip()

    # -- mode ------------------------------------------------------------------------------------

    def _longest_question(self) -> int:
        """Tokens after a clause's context at most: the clause, a question and an answer."""
        if self._longest is None:
            self._longest = self._measure_longest()
        return self._longest

    def _measure_longest(self) -> int:
        longest = max((len(self._clause_ids(c)) for c in self.clauses), default=0)
        asks = [q for p in self.playbook.categories.values() for q in p.questions.values()]
        asks += [v.ask for p in self.playbook.categories.values() for v in p.values.values()]
        tail = max((len(self._question_ids(a, "review_value")) for a in asks), default=0) + 32  # and a candidate's tokens
        if self.explain:
            tail = max(tail, len(self._explain_ids("uncapped liability")) + self.explain_tokens)
        return longest + tail

    def _choose_mode(self) -> None:
        needed = self.document_tokens + self._longest_question()
        fits = needed <= self.engine.max_context
        if self.mode == "auto":
            self.mode = "exact" if fits else "retrieval"
        elif self.mode == "selective" and not fits:
            self.mode = "retrieval"  # each clause's blocks; the engine's decode steps still select
        if self.mode != "retrieval" and not fits:
            raise ContextTooLongError(
                needed, self.engine.max_context,
                f"the document alone is {self.document_tokens} tokens; use --mode auto or retrieval (each clause's "
                "questions read the blocks chosen for it), or review a shorter part of the document",
            )
        if self.mode == "retrieval" and self.engine.max_context - self._longest_question() < 4 * BLOCK_TOKENS:
            raise ContextTooLongError(needed, self.engine.max_context,
                                      "the longest clause leaves no room for the document's blocks")

    # -- the review ------------------------------------------------------------------------------

    def review(self) -> Iterator[Finding]:
        """Decides the categories, asks the playbook's questions, and yields the findings in
        document order as their clauses are done (a group of clauses per batch); `terms` is set
        at the end."""
        chosen = choose_candidates(self.doc.text, self.clauses, self.head, self.playbook)
        asked = [i for i in sorted(chosen) if any(it.play.questions or it.play.values for it in chosen[i])]
        total = len(self.clauses)
        emit(self.on_event, ReviewProgress(0, total, ""))
        group = 2 * (self.max_batch or self.engine.config.max_batch)
        done = 0
        try:
            for first in range(0, len(asked) + 1, group):
                part = asked[first:first + group]
                if part:
                    self._ask([it for i in part for it in chosen[i] if it.play.questions or it.play.values])
                until = part[-1] + 1 if part and first + group < len(asked) else total
                findings = []  # (clause index, finding)
                for i in range(done, until):
                    finding = self._finding(self.clauses[i],
                                            [it for it in chosen.get(i, []) if it.play.finding and it.holds])
                    if finding is not None:
                        findings.append((i, finding))
                if self.explain and findings:
                    self._commentary([f for _, f in findings if f.assessments])
                for i, finding in findings:
                    yield finding
                    self.reviewed = i + 1  # every clause up to this one is done and given
                done = until
                self.reviewed = done
                emit(self.on_event, ReviewProgress(done, total, self.clauses[done - 1].id if done else ""))
                if done >= total:
                    break
        finally:
            for ctx in (self._doc_ctx, self._null):
                if ctx is not None:
                    self.engine.release(ctx)
            self._doc_ctx = self._null = None
        self.terms = self._terms(chosen)

    def findings(self) -> list[Finding]:
        """The findings, worst first (document order within a level)."""
        return sorted(self.review(), key=lambda f: LEVELS.index(f.risk) if f.risk in LEVELS else len(LEVELS))

    def _ask(self, items: list[Candidate]) -> None:
        """Every question and value of `items`, batched stage by stage."""
        engine = self.engine
        asked = sorted({it.clause for it in items})
        base = self._base_contexts(asked)
        clause_ctx = dict(zip(asked, base))
        engine.append_many([clause_ctx[i] for i in asked], [self._lead() + self._clause_ids(self.clauses[i]) for i in asked],
                           on_event=self.on_event, max_batch=self.max_batch)
        # yes/no questions: one fork per (item, question); the content-free clause's once per question
        questions = [(it, name, text) for it in items for name, text in it.play.questions.items()]
        new = sorted({text for _, _, text in questions} - self._null_odds.keys())
        self._null_odds.update(zip(new, self._yes_odds([self._null_context()] * len(new), new)))
        odds = self._yes_odds([clause_ctx[it.clause] for it, _, _ in questions], [t for _, _, t in questions])
        for (it, name, text), score in zip(questions, odds):
            it.answer_scores[name] = round(score - self._null_odds[text], 4)
            it.answers[name] = score - self._null_odds[text] > 0 \
                and it.play.may_say_yes(name, self.clauses[it.clause].text)
        # values: each candidate span scored as the answer, after the clause and after "N/A"
        self._values(items, clause_ctx, self._null_context())
        for ctx in base:
            engine.release(ctx)

    def _yes_odds(self, contexts: list[Context], questions: list[str]) -> list[float]:
        """log P(yes) - log P(no) as the first token of the answer to each question after its context."""
        if not questions:
            return []
        forks = [self.engine.fork(ctx) for ctx in contexts]
        self.engine.append_many(forks, [self._question_ids(q) for q in questions], on_event=self.on_event,
                                max_batch=self.max_batch)
        yes = [self.prompts.continuation(w)[0] for w in (" Yes", " yes")]
        no = [self.prompts.continuation(w)[0] for w in (" No", " no")]
        out = []
        for fork in forks:
            log_probs = torch.log_softmax(fork.last_logits, dim=-1)
            out.append(float(torch.logsumexp(log_probs[yes], 0) - torch.logsumexp(log_probs[no], 0)))
            self.engine.release(fork)
        return out

    def _values(self, items: list[Candidate], clause_ctx: dict[int, Context], null: Context) -> None:
        engine, text = self.engine, self.doc.text
        asks = []  # (item, value spec, candidates)
        for it in items:
            clause = self.clauses[it.clause]
            for spec in it.play.values.values():
                found = spec.candidates(text, clause.start, clause.end)[:MAX_CANDIDATES]
                if found:
                    asks.append((it, spec, found))
        if not asks:
            return
        asked = [engine.fork(clause_ctx[it.clause]) for it, _, _ in asks]
        engine.append_many(asked, [self._question_ids(spec.ask, "review_value") for _, spec, _ in asks],
                           on_event=self.on_event, max_batch=self.max_batch)
        # the same question and words after the content-free clause, once per review
        new = sorted({(spec.ask, c.text) for _, spec, found in asks for c in found} - self._null_scores.keys())
        null_asked = {}
        for ask in sorted({ask for ask, _ in new}):
            null_asked[ask] = engine.fork(null)
        engine.append_many(list(null_asked.values()), [self._question_ids(a, "review_value") for a in null_asked],
                           on_event=self.on_event, max_batch=self.max_batch)
        pairs = [(engine.fork(ctx), self._answer_ids(c.text)) for (_, _, found), ctx in zip(asks, asked) for c in found]
        null_pairs = [(engine.fork(null_asked[ask]), self._answer_ids(words)) for ask, words in new]
        scores = engine.score_many(pairs + null_pairs, max_batch=self.max_batch, on_event=self.on_event)
        for ctx in [p[0] for p in pairs + null_pairs] + asked + list(null_asked.values()):
            engine.release(ctx)
        means = [sum(s) / len(s) for s in scores]
        self._null_scores.update(zip(new, means[len(pairs):]))
        at = 0
        ranked: dict[int, list[tuple[object, list[Value]]]] = {}  # per item: (spec, its candidates best first)
        for it, spec, found in asks:
            scored = []
            for cand in found:
                calibrated = means[at] - self._null_scores[(spec.ask, cand.text)]
                at += 1
                scored.append(Value(cand.text, cand.start, cand.end, self.doc.where(cand.start, cand.end),
                                    round(calibrated, 4)))
            scored.sort(key=lambda v: -v.score)
            ranked.setdefault(it.clause, []).append((it, spec, scored))
        for clause_values in ranked.values():
            self._assign(clause_values)

    @staticmethod
    def _assign(ranked: list) -> None:
        """Each value of a clause its best candidate, two values of different names never the
        same words (a renewal term is not the notice period; the notice period of two categories
        may be the same words): the value with fewer candidates chooses first (then the one whose
        best scores higher), the others take their next best (or none). The clause's likelier
        categories choose first."""
        owner: dict[tuple[int, int], str] = {}  # span -> the value name that took it
        for it, spec, scored in sorted(ranked, key=lambda x: (x[0].probability is None, -(x[0].probability or 0),
                                                              len(x[2]), -x[2][0].score)):
            keep = VALUE_ANSWERS if spec.kind == "party" else 1
            free = [v for v in scored if owner.get((v.start, v.end), spec.name) == spec.name][:keep]
            for v in free:
                owner[(v.start, v.end)] = spec.name
            if free:
                it.values[spec.name] = sorted(free, key=lambda v: v.start)

    def _answer_ids(self, words: str) -> list[int]:
        """A candidate's tokens as the answer's continuation (after "Answer:")."""
        return self.prompts.continuation(" " + " ".join(words.split()))

    # -- contexts --------------------------------------------------------------------------------

    def _base_contexts(self, asked: list[int]) -> list[Context]:
        """Per clause asked about, a context holding the document (or the blocks chosen for the
        clause) and the review's introduction, ready for the clause."""
        engine = self.engine
        if self.mode != "retrieval":
            return [engine.fork(self._document()) for _ in asked]
        retriever = self._index()
        definitions = self._definition_blocks(retriever)
        budget = self._budget(retriever)
        contexts = []
        for i in asked:
            clause = self.clauses[i]
            fixed = set(self._clause_blocks(retriever, clause))
            fixed |= set(definitions[:max(0, budget - len(fixed))])
            rest = budget - len(fixed)
            question = self._lead() + self._clause_ids(clause)
            # the lexical signal only: the keys signal costs a forward pass of the clause per clause
            picked = set(retriever.select(clause.text, question, rest, signals=("lexical",)).blocks) if rest > 0 else set()
            blocks = sorted(fixed | picked)
            self.attended_blocks = max(self.attended_blocks or 0, len(blocks))
            contexts.append(retriever.index.assemble(blocks))
        return contexts

    def _lead(self) -> list[int]:
        """Tokens read after a clause's context and before the clause: in retrieval mode the
        document's last tokens and the template's end, then the introduction (exact mode has them
        in the document's prefill)."""
        return self._index().tail + self.intro_ids if self.mode == "retrieval" else []

    def _budget(self, retriever: Retriever) -> int:
        """Blocks a clause's questions may read (retrieval.question_budget)."""
        fixed = len(retriever.index.head.tokens) + len(self._lead()) + self._longest_question() + BLOCK_TOKENS
        return question_budget(self.engine, fixed)

    def _null_context(self) -> Context:
        """The content-free clause, after the document's head (retrieval) or the whole document (once)."""
        if self._null is not None:
            return self._null
        engine = self.engine
        ctx = engine.fork(self._index().index.head if self.mode == "retrieval" else self._document())
        engine.append(ctx, self._lead() + self._clause_ids(None))
        self._null = ctx
        return ctx

    def _document(self) -> Context:
        """Exact mode: the document and the introduction, prefilled once."""
        if self._doc_ctx is None:
            self._doc_ctx = self.engine.prefill(self.prefix_ids + self.intro_ids, on_event=self.on_event,
                                                label=self.label)
        return self._doc_ctx

    def _index(self) -> Retriever:
        if self.retriever is None:
            self.retriever = Retriever.build(self.engine, self.doc, self.prefix_ids, self._chars, self.on_event,
                                             self.label)
        return self.retriever

    def _allowed_at(self, item: Candidate, clause: Clause) -> tuple[int, int] | None:
        """For a clause whose `optional` question was answered yes, the first sentence of its text
        (headings aside) that allows that yes ("Provider may assign this Agreement ... without
        Customer's consent"), not a restriction beside it; None otherwise."""
        play = item.play
        asked = [q for q in play.optional if item.answers.get(q)]
        if not asked:
            return None
        body = heading_span(self.doc.text, clause)[1]
        return next(((s, e) for s, e in sentences(self.doc.text, body, clause.end)
                     if all(play.may_say_yes(q, self.doc.text[s:e]) for q in asked)), None)

    def _blocks_of(self, retriever: Retriever, start: int, end: int) -> list[int]:
        return [b for b, (s, e) in enumerate(retriever.char_spans) if e > start and s < end]

    def _clause_blocks(self, retriever: Retriever, clause: Clause) -> list[int]:
        return self._blocks_of(retriever, clause.start, clause.end)[:8]

    def _definition_blocks(self, retriever: Retriever) -> list[int]:
        """The blocks of the definitions clause (the first whose heading says so), if any."""
        for clause in self.clauses:
            if clause.heading and _DEFINITIONS.search(clause.heading):
                return self._blocks_of(retriever, clause.start, clause.end)[:16]
        return []

    @property
    def total_blocks(self) -> int | None:
        return self.retriever.index.num_blocks if self.retriever is not None else None

    # -- prompts ---------------------------------------------------------------------------------

    def _clause_ids(self, clause: Clause | None) -> list[int]:
        if clause is None:
            text = render("review_clause", clause_id="N/A", heading="N/A", clause="N/A")
        else:
            text = render("review_clause", clause_id=clause.id, heading=clause.heading,
                          clause=shorten(clause.text, MAX_CLAUSE_CHARS))
        return self.prompts.continuation("\n\n" + text)

    def _question_ids(self, question: str, template: str = "review_question") -> list[int]:
        return self.prompts.question("\n\n" + render(template, question=question), answer_prefix=render("review_reply"))

    def _explain_ids(self, category: str) -> list[int]:
        return self.prompts.question("\n\n" + render("review_explain", category=category))

    # -- judgement -------------------------------------------------------------------------------

    def _assess(self, it: Candidate) -> Assessment:
        play = it.play
        level, reason = play.level, play.reason
        found = {name: values[0].text if len(values) == 1 else " and ".join(v.text for v in values)
                 for name, values in it.values.items() if values}
        for rule in play.rules:
            if all(self._holds(c, it, play) for c in rule.when):
                level, reason = rule.level, fill(rule.reason, found)
                break
        probability = None if it.probability is None else round(it.probability, 4)
        return Assessment(ALL_CATEGORIES[play.category].name, play.category, probability, level,
                          reason or f"A {ALL_CATEGORIES[play.category].name} clause.", dict(it.answers),
                          dict(it.answer_scores), {k: list(v) for k, v in it.values.items()})

    @staticmethod
    def _holds(cond: Condition, it: Candidate, play: CategoryPlay) -> bool:
        if cond.name in play.questions:
            answer = it.answers.get(cond.name, False)
            return answer != cond.negated
        values = it.values.get(cond.name) or []
        if cond.op is None:
            return bool(values) != cond.negated
        if not values:
            return False
        spec = play.values[cond.name]
        if cond.unit is not None:  # a duration, or an amount counted as fees over a period
            if spec.kind == "money" and not FEES_OVER_A_PERIOD.search(values[0].text):
                return False
            number = in_unit(values[0].text, cond.unit)
        else:
            number = amount(values[0].text)
        if number is None:
            return False
        return {"<": number < cond.number, "<=": number <= cond.number, ">": number > cond.number,
                ">=": number >= cond.number, "==": number == cond.number}[cond.op]

    def _finding(self, clause: Clause, items: list[Candidate]) -> Finding | None:
        if not items:
            if not self.include_all:
                return None
            start, end = self._quote(clause, None, [])
            return Finding(clause.id, clause.heading, "", "none", "", self.doc.text[start:end],
                           self.doc.where(start, end), start, end, document=self.doc.source)
        assessments = sorted((self._assess(it) for it in items), key=lambda a: LEVELS.index(a.level))
        top = assessments[0]
        top_item = next((it for it in items if it.play.category == top.cuad), None)
        found_at = top_item.found_at if top_item is not None else None
        if found_at is None and top_item is not None:  # an optional question's yes: the sentence that allowed it
            found_at = self._allowed_at(top_item, clause)
        start, end = self._quote(clause, top.cuad, [v for vs in top.values.values() for v in vs], found_at)
        return Finding(clause.id, clause.heading, top.category, top.level, top.reason, self.doc.text[start:end],
                       self.doc.where(start, end), start, end, categories=[a.category for a in assessments],
                       assessments=assessments, document=self.doc.source)

    def _terms(self, chosen: dict[int, list[Candidate]]) -> list[Term]:
        """The playbook's key terms, each from the clause of its category most likely to be one that has the value."""
        terms = []
        for label, (category, value) in self.playbook.terms.items():
            best = None
            for items in chosen.values():
                for it in items:
                    if it.play.category == category and it.holds and it.values.get(value):
                        if best is None or it.confidence > best.confidence:
                            best = it
            if best is not None:
                terms.append(Term(label, list(best.values[value]), self.clauses[best.clause].id,
                                  ALL_CATEGORIES[category].name))
        return terms

    # -- quotes ----------------------------------------------------------------------------------

    def _quote(self, clause: Clause, cuad: str | None, values: list[Value],
               found_at: tuple[int, int] | None = None) -> tuple[int, int]:
        """Offsets of the clause's sentence that shows the category best: the one holding its
        value, else the one that holds its found_by phrase (`found_at`), else the one the head
        scores highest for the category."""
        text = self.doc.text

        def long_sentences(start: int) -> list[tuple[int, int]]:
            return [(s, e) for s, e in sentences(text, start, clause.end) if len(text[s:e].split()) >= 5]

        spans = long_sentences(heading_span(self.doc.text, clause)[1]) or long_sentences(clause.start) \
            or [(clause.start, clause.end)]
        best = spans[0]
        holding = [(s, e) for s, e in spans if any(s <= v.start and v.end <= e for v in values)]
        if holding:
            best = holding[0]
        elif found_at is not None:
            best = found_at
        elif cuad is not None and len(spans) > 1:
            j = self.head.categories.index(cuad)
            scores = self.head.probabilities([text[s:e] for s, e in spans])[:, j]
            best = spans[int(scores.argmax())]
        start, end = best
        if end - start > QUOTE_CHARS:  # cut at a word boundary: still an exact substring
            keep = next((v for v in values if start <= v.start and v.end <= end), None)
            if keep is not None and keep.end > start + QUOTE_CHARS:
                start = max(start, keep.start - QUOTE_CHARS // 2)
                start = text.find(" ", start, keep.start) + 1 or start
            cut = text.rfind(" ", start, start + QUOTE_CHARS)
            end = cut if cut > start else start + QUOTE_CHARS
        return start, end

    # -- commentary ------------------------------------------------------------------------------

    def _commentary(self, findings: list[Finding]) -> None:
        """--explain: one sentence of the model's per finding, kept only when it passes the checks."""
        from ..engine.engine import Request

        engine = self.engine
        by_id = {c.id: c for c in self.clauses}
        base = self._base_contexts([self.clauses.index(by_id[f.clause_id]) for f in findings])
        requests = []
        for n, (finding, ctx) in enumerate(zip(findings, base)):
            clause = by_id[finding.clause_id]
            requests.append(Request(ctx, self._lead() + self._clause_ids(clause) + self._explain_ids(finding.category),
                                    self.explain_tokens, stop=engine.stop_ids, tag=n))
        tokens: list[list[int]] = [[] for _ in requests]
        for request, token in engine.run(requests, max_batch=self.max_batch, on_event=self.on_event):
            if token in engine.stop_ids:
                continue
            tokens[request.tag].append(token)
            if loop_start(tokens[request.tag]) is not None or "\n" in self.prompts.decode(tokens[request.tag][-1:]):
                request.done = True
        for finding, request, ids in zip(findings, requests, tokens):
            text = self.prompts.decode(ids).strip().split("\n")[0].strip().strip("\"\u201c\u201d").strip()
            finding.commentary = text if _passes(text, by_id[finding.clause_id].text, finding) else None
            engine.release(request.ctx)


_STOP = {"the", "a", "an", "of", "to", "and", "or", "in", "on", "for", "by", "with", "this", "that", "is", "be", "are",
         "any", "its", "it", "as", "at", "from", "under", "shall", "may", "will", "not", "party", "parties", "clause",
         "agreement", "contract", "which", "if", "has", "have", "been", "their", "other", "such"}


def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]{3,}", text.lower()) if w not in _STOP}


def _passes(text: str, clause: str, finding: Finding) -> bool:
    """A commentary is kept when it is a sentence without repetition that uses a word of the
    clause and a word of its category (its name or description)."""
    words = re.findall(r"\w+", text.lower())
    if len(words) < 4:
        return False
    trigrams = list(zip(words, words[1:], words[2:]))
    if len(trigrams) != len(set(trigrams)):
        return False  # says something twice
    own = _content_words(text)
    if not own & _content_words(clause):
        return False
    topic = set()
    for a in finding.assessments:
        c = ALL_CATEGORIES[a.cuad]
        topic |= _content_words(c.name + " " + c.description)
    stems = {w[:5] for w in topic}
    return any(w[:5] in stems for w in own)
