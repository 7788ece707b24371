"""The review's playbook: per category, the questions that decide the risk, and what follows.

A playbook is a TOML file (the default is prompts/playbook.toml; `--playbook FILE` replaces it):

    [categories."Cap On Liability"]
    level = "medium"                                  # when no rule applies
    reason = "Liability is capped."
    questions.carve_outs = "Are some claims excluded from the cap on liability?"
    values.amount = { kind = "money", ask = "What is the most a party can be liable for?" }
    rules = [
      { when = ["carve_outs", "amount"], level = "high",
        reason = "Liability is capped at {amount}, but some claims are carved out of the cap." },
    ]

    [terms]                                          # the key terms a review opens with
    "Liability cap" = "Cap On Liability.amount"

A question is answered yes or no by the model; `questions.name = { ask = "...", needs =
["terminat", "cancel"] }` takes a yes only from a clause that holds a word starting so (a clause
that never mentions termination lets no one terminate, whatever the model says); with `unless =
["breach", "for cause"]` too, only from a sentence that holds such a word and none of these,
unless it holds one of the category's found_by phrases (with `needs_with = ["price", "fee"]`, from
a sentence that holds one of those too: a right to increase the insurance coverage is no right to
increase prices); a clause with no such sentence does not
hold the category, whatever the head says, and is not asked (a right to terminate on breach is no
right to terminate without cause), unless the question is `optional = true`: then such a sentence
only allows its yes, and the clause holds the category as the head says (an assignment clause may
or may not let a party assign without consent). A value is an
exact span of the clause (kind: duration, money, date, place, party, or party term: the word
the document names a party by, "Provider", only where a cue word is its own; `near` lists cue words, one
of which must stand close to a candidate, e.g. near = ["notice"] for a notice period; with
attached = "after", a candidate a cue word follows as its own, "thirty (30) days' prior written
notice", is preferred to a cure period beside it, "within 15 days after receiving notice"; with
attached = "before", one a cue word leads to, "renewed for successive one (1) year periods";
not_followed_by = ["notice"] rules out the candidates those words follow as their own). A
rule applies when every condition in `when` holds: a question answered yes (`name`) or no (`!name`), a value found (`name`) or not (`!name`), or a
duration or amount compared (`notice < 90 days`, `amount >= 1000000`); an amount compared with a
duration (`amount < 12 months`) holds when the amount is fees over a period ("the fees paid in
the three (3) months before the claim") and the period compares so. The first rule that applies
gives the level and the reason, whose `{name}` places take the values found. A category with
`finding = false` gives values (key terms) but no finding. `found_by = ["without cause"]` puts
to a category's questions the clauses the head passed over that have a sentence holding one of
these phrases and the words the questions need; such a clause has the category only when the
model answers every question yes, and its quote is that sentence (a clause that is mostly
something else hides a sentence of the category from the head). `requires = ["renew", "extend"]`
keeps the category from a clause that holds none of these words (in its own heading or its text;
a word right after "non-" does not count), whatever the head and the model say (a clause that only
sets the initial term is no renewal term, a non-exclusive licence no exclusivity);
`requires_with = { solicit = ["compet"] }` keeps it from a clause that holds a word starting with
"solicit" and none of "compet" (a promise not to solicit employees is no promise not to compete).

The categories are CUAD's, which the trained head finds, and the few a review adds
(taxonomy.EXTRA_CATEGORIES, e.g. "Payment Terms"), which no head scores: a clause is considered
for one of those when a sentence of it holds one of the category's found_by phrases (as above),
or, for a category without found_by phrases, when one of its values has a candidate in the clause,
and kept when the model answers every question of the category yes; such a category needs a value
or found_by phrases.

A malformed playbook is a PlaybookError naming the file and the line.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import KvpageError
from .taxonomy import ALL_CATEGORIES, CATEGORIES, EXTRA_CATEGORIES
from .values import Candidate, candidates, sentences, words_pattern

LEVELS = ("high", "medium", "low", "none")
VALUE_KINDS = ("duration", "money", "date", "place", "party", "party term")
_CONDITION = re.compile(r"^(?P<not>!)?\s*(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                        r"(?:\s*(?P<op><=|>=|<|>|==)\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>days?|weeks?|months?|years?)?)?$")
_PLACE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
DEFAULT_PLAYBOOK = "playbook.toml"


class PlaybookError(KvpageError):
    """The playbook cannot be used: the message names the file and the line."""


@dataclass(frozen=True)
class Condition:
    name: str
    negated: bool = False
    op: str | None = None
    number: float | None = None
    unit: str | None = None  # a duration's unit, singular ("day"); None for amounts


@dataclass(frozen=True)
class Rule:
    when: tuple[Condition, ...]
    level: str
    reason: str


@dataclass(frozen=True)
class ValueSpec:
    name: str
    kind: str
    ask: str
    near: tuple[str, ...] = ()  # cue words: a candidate counts only with one of them close by
    attached: str = ""  # "after" ("before"): where a cue word follows (leads to) a candidate, only such ones count
    not_followed_by: tuple[str, ...] = ()  # a candidate one of these words follows as its own is not this value

    def candidates(self, text: str, start: int, end: int) -> list[Candidate]:
        """This value's candidates in text[start:end] (values.candidates)."""
        return candidates(text, start, end, self.kind, self.near, self.attached, self.not_followed_by)


@dataclass(frozen=True)
class CategoryPlay:
    category: str  # CUAD name
    level: str
    reason: str
    questions: dict[str, str] = field(default_factory=dict)
    values: dict[str, ValueSpec] = field(default_factory=dict)
    rules: tuple[Rule, ...] = ()
    finding: bool = True
    needs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # question -> words a yes needs in the clause
    found_by: tuple[str, ...] = ()  # phrases that put a clause the head passed over to the questions
    unless: dict[str, tuple[str, ...]] = field(default_factory=dict)  # question -> words that bar a sentence's yes
    requires: tuple[str, ...] = ()  # words one of which a clause of the category holds
    requires_with: dict[str, tuple[str, ...]] = field(default_factory=dict)  # word -> words one of which go with it
    needs_with: dict[str, tuple[str, ...]] = field(default_factory=dict)  # question -> words a yes's sentence holds too
    optional: tuple[str, ...] = ()  # questions whose sentence words do not decide whether a clause holds the category

    def admits(self, clause: str) -> bool:
        """Whether `clause` holds one of the words the category `requires` (any, if none), and, if
        it holds a word of `requires_with`, one of the words listed for it (a promise not to
        solicit is a non-compete only where it speaks of competing); a required word right after
        "non-" does not count ("non-exclusive" is no "exclusive"; list "non-renew" where it counts)."""
        if self.requires and words_pattern(self.requires, after_non=False).search(clause) is None:
            return False
        return all(words_pattern(also, after_non=False).search(clause) is not None
                   for word, also in self.requires_with.items() if words_pattern((word,)).search(clause))

    def may_say_yes(self, question: str, clause: str) -> bool:
        """Whether `clause` holds one of the words a yes to `question` needs (any, if it needs none);
        for a question with `needs_with` words, in a sentence that holds one of those too; with
        `unless` words, in a sentence that holds none of them or one of the category's found_by
        phrases."""
        words, barred = self.needs.get(question, ()), self.unless.get(question, ())
        along = self.needs_with.get(question, ())
        needed = words_pattern(words) if words else None
        if not barred and not along:
            return needed is None or needed.search(clause) is not None
        bar = words_pattern(barred) if barred else None
        also = words_pattern(along) if along else None
        for s, e in sentences(clause, 0, len(clause)):
            sentence = clause[s:e]
            if (needed is None or needed.search(sentence)) and (also is None or also.search(sentence)) \
                    and (bar is None or not bar.search(sentence) or self.found_in(sentence)):
                return True
        return False

    @property
    def by_sentence(self) -> tuple[str, ...]:
        """The questions whose yes a sentence of the clause must allow (`unless` or `needs_with` words)
        for the clause to hold the category (all but the `optional` ones)."""
        return tuple(q for q in self.questions if (q in self.unless or q in self.needs_with) and q not in self.optional)

    def found_in(self, clause: str) -> bool:
        """Whether `clause` holds one of the `found_by` phrases (as words, case and spacing aside)."""
        return bool(self.found_by) and words_pattern(self.found_by, whole=True).search(clause) is not None


@dataclass(frozen=True)
class Playbook:
    source: str
    categories: dict[str, CategoryPlay]
    terms: dict[str, tuple[str, str]]  # label -> (category, value name)

    @classmethod
    def default(cls) -> "Playbook":
        text = resources.files("kvpage_cli.prompts").joinpath(DEFAULT_PLAYBOOK).read_text(encoding="utf-8")
        return cls.parse(text, f"prompts/{DEFAULT_PLAYBOOK}")

    @classmethod
    def load(cls, path: str | Path) -> "Playbook":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PlaybookError(f"playbook {path} not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PlaybookError(f"playbook {path} cannot be read: {exc}") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str) -> "Playbook":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PlaybookError(f"playbook {source} is not valid TOML: {exc}") from None
        return _Parser(text, source).playbook(data)


class _Parser:
    """Checks a parsed playbook, naming the line of whatever is wrong."""

    def __init__(self, text: str, source: str) -> None:
        self.lines = text.splitlines()
        self.source = source

    def fail(self, message: str, *needles: str, after: int = 0) -> PlaybookError:
        line = self.line_of(*needles, after=after)
        where = f" (line {line})" if line else ""
        return PlaybookError(f"playbook {self.source}{where}: {message}")

    def line_of(self, *needles: str, after: int = 0) -> int:
        """The first line (1-based) at or after `after` holding every needle, else 0."""
        for i in range(max(0, after - 1), len(self.lines)):
            if all(n in self.lines[i] for n in needles):
                return i + 1
        return 0

    def playbook(self, data: dict) -> Playbook:
        unknown = set(data) - {"format", "categories", "terms"}
        if unknown:
            key = sorted(unknown)[0]
            raise self.fail(f"unknown key {key!r} (expected format, categories, terms)", key)
        if data.get("format", 1) != 1:
            raise self.fail(f"format {data.get('format')!r} is not one this kvpage reads (1)", "format")
        categories = data.get("categories")
        if not isinstance(categories, dict) or not categories:
            raise self.fail("no [categories.\"...\"] table", "categories")
        plays = {name: self.category(name, entry) for name, entry in categories.items()}
        terms = {}
        for label, ref in (data.get("terms") or {}).items():
            at = self.line_of(label, after=self.line_of("[terms]"))
            if not isinstance(ref, str) or "." not in ref:
                raise self.fail(f"term {label!r} must be \"Category.value\"", label, after=at)
            category, value = ref.rsplit(".", 1)
            if category not in plays or value not in plays[category].values:
                raise self.fail(f"term {label!r} names {ref!r}, which is no value of the playbook's categories",
                                label, after=at)
            terms[label] = (category, value)
        return Playbook(self.source, plays, terms)

    def category(self, name: str, entry) -> CategoryPlay:
        at = self.line_of(f'"{name}"') or self.line_of(name)
        if name not in ALL_CATEGORIES:
            raise PlaybookError(f"playbook {self.source} (line {at}): unknown category {name!r} (the CUAD "
                                f"categories are {', '.join(list(CATEGORIES)[:4])}, ...; and "
                                f"{', '.join(EXTRA_CATEGORIES)})")
        if not isinstance(entry, dict):
            raise self.fail(f"categories.{name!r} must be a table", name)
        allowed = {"level", "reason", "questions", "values", "rules", "finding", "found_by", "requires",
                   "requires_with"}
        for key in entry:
            if key not in allowed:
                raise self.fail(f"unknown key {key!r} in {name!r} (expected {', '.join(sorted(allowed))})", key, after=at)
        level = self.level(entry.get("level", "low"), name, at)
        reason = entry.get("reason", "")
        if not isinstance(reason, str):
            raise self.fail(f"the reason of {name!r} must be a string", "reason", after=at)
        questions, needs, unless, along, optional = {}, {}, {}, {}, []
        if not isinstance(entry.get("questions") or {}, dict):
            raise self.fail(f"the questions of {name!r} must be a table of name = \"question\"", "questions", after=at)

        def words_of(q, key: str) -> tuple[str, ...] | None:
            words = q.get(key, [])
            ok = isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)
            return tuple(w.strip() for w in words) if ok else None

        for q_name, q in (entry.get("questions") or {}).items():
            if isinstance(q, dict) and set(q) <= {"ask", "needs", "needs_with", "unless", "optional"} \
                    and isinstance(q.get("ask"), str) and isinstance(q.get("optional", False), bool):
                words, barred, with_ = words_of(q, "needs"), words_of(q, "unless"), words_of(q, "needs_with")
                if words is not None and barred is not None and with_ is not None:
                    if q.get("optional", False):
                        optional.append(q_name)
                    q, needs[q_name], unless[q_name], along[q_name] = q["ask"], words, barred, with_
            if not isinstance(q, str) or not q.strip():
                raise self.fail(f"question {q_name!r} of {name!r} must be name = \"question\" or name = {{ ask = "
                                "\"question\", needs = [words], needs_with = [words], unless = [words], optional = "
                                "true|false }", q_name,
                                after=at)
            questions[q_name] = q
        values = {}
        for value_name, spec in (entry.get("values") or {}).items():
            line = self.line_of(value_name, after=at)
            attached = spec.get("attached", False) if isinstance(spec, dict) else None
            attached = {True: "after", False: ""}.get(attached, attached) if isinstance(attached, bool) else attached
            if not isinstance(spec, dict) or spec.get("kind") not in VALUE_KINDS or not isinstance(spec.get("ask"), str) \
                    or set(spec) - {"kind", "ask", "near", "attached", "not_followed_by"} \
                    or attached not in ("", "after", "before"):
                raise self.fail(f"value {value_name!r} of {name!r} needs kind (one of {', '.join(VALUE_KINDS)}) "
                                "and ask, and may have near, not_followed_by and attached (\"after\", \"before\", "
                                "true for \"after\", or false)", value_name, after=line)
            for words in ("near", "not_followed_by"):
                listed = spec.get(words, [])
                if not isinstance(listed, list) or not all(isinstance(w, str) and w.strip() for w in listed):
                    raise self.fail(f"{words} of value {value_name!r} of {name!r} must be a list of words", value_name,
                                    after=line)
            near = spec.get("near", [])
            if spec["kind"] == "party term" and not (near and attached):
                raise self.fail(f"value {value_name!r} of {name!r} is a party term: it needs near (the promise's "
                                "words) and attached (\"after\": the term is their subject; \"before\": their object)",
                                value_name, after=line)
            if value_name in questions:
                raise self.fail(f"{value_name!r} is both a question and a value of {name!r}", value_name, after=at)
            values[value_name] = ValueSpec(value_name, spec["kind"], spec["ask"], tuple(near), attached,
                                           tuple(spec.get("not_followed_by", [])))
        self.places(reason, values, (), name, at)
        rules = []
        for rule in entry.get("rules", []):
            if not isinstance(rule, dict) or set(rule) - {"when", "level", "reason"} or "reason" not in rule:
                raise self.fail(f"a rule of {name!r} needs when, level and reason", "when", after=at)
            line = self.line_of(str(rule.get("reason"))[:40], after=at) or at
            when = rule.get("when", [])
            if isinstance(when, str):
                when = [when]
            conditions = tuple(self.condition(c, questions, values, name, line) for c in when)
            self.places(rule["reason"], values, conditions, name, line)
            rules.append(Rule(conditions, self.level(rule.get("level"), name, line), rule["reason"]))
        finding = entry.get("finding", True)
        if not isinstance(finding, bool):
            raise self.fail(f"finding of {name!r} must be true or false", "finding", after=at)
        found_by = entry.get("found_by", [])
        if not isinstance(found_by, list) or not all(isinstance(w, str) and w.strip() for w in found_by):
            raise self.fail(f"found_by of {name!r} must be a list of phrases", "found_by", after=at)
        if found_by and not questions:
            raise self.fail(f"{name!r} is found by phrases, which its questions must confirm: give it one", "found_by",
                            after=at)
        if name in EXTRA_CATEGORIES and not values and not found_by:
            raise self.fail(f"{name!r} is found by its values or its found_by phrases (no trained head scores it): "
                            "give it one", name)
        requires = entry.get("requires", [])
        if not isinstance(requires, list) or not all(isinstance(w, str) and w.strip() for w in requires):
            raise self.fail(f"requires of {name!r} must be a list of words", "requires", after=at)
        requires_with = entry.get("requires_with", {})
        if not isinstance(requires_with, dict) or not all(
                isinstance(w, str) and w.strip() and isinstance(also, list) and also
                and all(isinstance(a, str) and a.strip() for a in also) for w, also in requires_with.items()):
            raise self.fail(f"requires_with of {name!r} must be a table of word = [words]", "requires_with", after=at)
        return CategoryPlay(name, level, reason, questions, values, tuple(rules), finding, needs,
                            tuple(w.strip() for w in found_by), {q: w for q, w in unless.items() if w},
                            tuple(w.strip() for w in requires),
                            {w.strip(): tuple(a.strip() for a in also) for w, also in requires_with.items()},
                            {q: w for q, w in along.items() if w}, tuple(optional))

    def level(self, level, name: str, at: int) -> str:
        if level not in LEVELS:
            raise PlaybookError(f"playbook {self.source} (line {self.line_of('level', after=at) or at}): level "
                                f"{level!r} of {name!r} is not one of {', '.join(LEVELS)}")
        return level

    def condition(self, text, questions: dict, values: dict, name: str, line: int) -> Condition:
        m = _CONDITION.match(text.strip()) if isinstance(text, str) else None
        if not m:
            raise PlaybookError(f"playbook {self.source} (line {line}): condition {text!r} of {name!r} is not "
                                "NAME, !NAME or NAME < NUMBER [days|weeks|months|years]")
        cond = Condition(m["name"], bool(m["not"]), m["op"], float(m["number"]) if m["number"] else None,
                         (m["unit"] or "").rstrip("s") or None)
        if cond.name not in questions and cond.name not in values:
            raise PlaybookError(f"playbook {self.source} (line {line}): condition {text!r} of {name!r} names no "
                                "question or value of the category")
        if cond.op is not None:
            kind = values[cond.name].kind if cond.name in values else None
            if kind not in ("duration", "money") or cond.negated or (kind == "duration" and cond.unit is None):
                raise PlaybookError(f"playbook {self.source} (line {line}): condition {text!r} of {name!r} compares "
                                    "what is not a duration (with its unit) or an amount (with a unit: the "
                                    "period of fees it counts)")
        return cond

    def places(self, reason: str, values: dict, conditions: tuple[Condition, ...], name: str, line: int) -> None:
        """Every {name} in a reason is a value that the rule requires to be found."""
        required = {c.name for c in conditions if not c.negated and c.name in values}
        for place in _PLACE.findall(reason):
            if place not in required:
                raise PlaybookError(f"playbook {self.source} (line {line}): the reason of {name!r} uses {{{place}}}, "
                                    "which must be a value named in the rule's `when`")


def fill(reason: str, values: dict[str, str]) -> str:
    """The rationale with its {name} places filled by the values found (their words on one line)."""
    return _PLACE.sub(lambda m: " ".join(values[m.group(1)].split()), reason)
