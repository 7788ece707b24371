"""Which clauses a review puts to the model, and for which categories.

A pure function of the document's text, its clauses, the clause head and the playbook: no model
runs here, so the choice is tested on its own (tests/test_candidates.py). Three ways put a
(clause, category) to the questions:

- the head scores the category present in the clause;
- the head scores the category but passed the clause over, and a sentence of it holds one of the
  category's `found_by` phrases (with the words its questions need, no negation before them);
- no head scores the category (the review's own: payment terms, price increases,
  indemnification): a `found_by` sentence, or, for a category without phrases, a candidate
  span for one of its values.

Every way first asks the playbook whether the clause may hold the category at all (`admits`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..ingest import Clause
from .classifier import ClauseHead
from .playbook import CategoryPlay, Playbook
from .schema import Value
from .values import sentences, words_pattern

HEADING_REACH = 120  # characters before a clause's heading that may still be numbering or an article title

# A sentence of a found_by phrase that says this before the words its questions need denies the
# category: of the 444 training contracts' sentences that hold a termination for convenience
# phrase of the default playbook and a word of termination, 2 of the 41 with it lie in the
# experts' spans of the category, 103 of the 293 without it.
_NEGATION = re.compile(r"(?i)\b(?:not|no|never|cannot|neither|nor)\b")


@dataclass
class Candidate:
    """One (clause, category) the model is asked about; the review fills in the answers."""

    clause: int
    play: CategoryPlay
    probability: float | None  # the head's; None for a category no head scores (taxonomy.EXTRA_CATEGORIES)
    answers: dict[str, bool] = field(default_factory=dict)
    answer_scores: dict[str, float] = field(default_factory=dict)
    values: dict[str, list[Value]] = field(default_factory=dict)
    found_at: tuple[int, int] | None = None  # the sentence whose found_by phrase put the clause to the questions

    @property
    def holds(self) -> bool:
        """A category the head found holds; one found by its values' words, or by its `found_by`
        phrases, holds when the model answered each of its questions yes."""
        return self.probability is not None or all(self.answers.get(q, False) for q in self.play.questions)

    @property
    def confidence(self) -> float:
        """Ranks the candidates of one category: the head's probability, else the least sure yes."""
        if self.probability is not None:
            return self.probability
        return min(self.answer_scores.values(), default=0.0)


def choose_candidates(text: str, clauses: list[Clause], head: ClauseHead,
                      playbook: Playbook) -> dict[int, list[Candidate]]:
    """Clause index -> the candidates of that clause, the head's categories first (most probable
    first), then those found by phrases or values in the playbook's order. `text` is the document
    text the clauses' offsets point into."""
    probabilities = head.probabilities([c.text for c in clauses])
    present = head.present(probabilities)
    chosen: dict[int, list[Candidate]] = {}
    for i in range(len(clauses)):
        for j in sorted(present[i].nonzero()[0].tolist(), key=lambda j: -probabilities[i, j]):
            play = playbook.categories.get(head.categories[j])
            if play is not None and admits(text, play, clauses[i]):
                chosen.setdefault(i, []).append(Candidate(i, play, float(probabilities[i, j])))
    for play in playbook.categories.values():
        scored = play.category in head.categories
        if scored and not play.found_by:
            continue
        for i, clause in enumerate(clauses):
            if not admits(text, play, clause):
                continue
            if scored:  # passed over by the head: a sentence with the category's phrases puts it to the questions
                at = None if any(it.play is play for it in chosen.get(i, [])) else found_at(text, play, clause)
                if at is not None:
                    chosen.setdefault(i, []).append(Candidate(i, play, None, found_at=at))
            elif (at := found_at(text, play, clause) if play.found_by else None) is not None:
                chosen.setdefault(i, []).append(Candidate(i, play, None, found_at=at))  # no head: by its phrases
            elif not play.found_by and any(spec.candidates(text, clause.start, clause.end)
                                           for spec in play.values.values()):
                chosen.setdefault(i, []).append(Candidate(i, play, None))  # no head scores it: found by its values
    return chosen


def heading_span(text: str, clause: Clause) -> tuple[int, int]:
    """Where the clause's own heading starts and ends in its text, after the headings above it
    that the clause's text holds ("4. TERM AND RENEWAL 4.1 Initial Term."); (start, start) if
    it has none."""
    near_start = min(clause.end, clause.start + len(clause.heading) + HEADING_REACH)
    at = text.find(clause.heading, clause.start, near_start) if clause.heading else -1
    return (at, at + len(clause.heading)) if at >= 0 else (clause.start, clause.start)


def admits(text: str, play: CategoryPlay, clause: Clause) -> bool:
    """Whether the clause may hold the category, whatever the head and the model say: its own
    heading or its text (not the article headings above it: "4. TERM AND RENEWAL" over "4.1
    Initial Term") holds a word the category requires, and each question with `unless` or
    `needs_with` words may still be answered yes in a sentence of the clause's text, its
    headings aside (a termination clause that speaks only of breach or of an event is no
    termination for convenience; its heading, "Termination by NCM.", is no sentence that grants
    a right), so that a clause that cannot is never put to the model."""
    heading, body = heading_span(text, clause)
    return play.admits(text[heading:clause.end]) \
        and all(play.may_say_yes(q, text[body:clause.end]) for q in play.by_sentence)


def found_at(text: str, play: CategoryPlay, clause: Clause) -> tuple[int, int] | None:
    """The first sentence of the clause that holds one of the category's found_by phrases and
    the words its questions need (`CategoryPlay.may_say_yes`), with no negation before those
    words ("Customer may not terminate this Agreement ... for convenience"), if any."""
    words = tuple(w for q in play.questions for w in play.needs.get(q, ()))
    needed = words_pattern(words) if words else None
    for s, e in sentences(text, clause.start, clause.end):
        sentence = text[s:e]
        if not play.found_in(sentence) or not all(play.may_say_yes(q, sentence) for q in play.questions):
            continue
        need = needed.search(sentence) if needed else None
        if not _NEGATION.search(sentence, 0, need.start() if need else len(sentence)):
            return s, e
    return None
