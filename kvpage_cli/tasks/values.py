"""Candidate values in a clause: the exact spans of text that could answer a value question.

Each kind has patterns for the ways contracts write it (durations "one hundred eighty (180)
days", amounts "$1,000,000", dates "April 1, 2025", places "the laws of the State of Delaware",
parties "Quillfeather Analytics, Inc.", and the terms the document names its parties by, "Provider").
The candidates are offsets into the document's text,
never rewritten; the model chooses among them (review.py). Durations and amounts are also read
as numbers, for a playbook's comparisons ("notice < 90 days").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_UNITS = {"day": 1, "business day": 1, "week": 7, "month": 30, "year": 365}
_NUMBER_WORDS = {
    "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
    "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
    "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "seventy": 70, "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1000, "a": 1, "an": 1,
}
_WORDS = r"(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen" \
         r"|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|thousand)"
_DURATION = re.compile(
    rf"(?i)\b(?:(?P<words>{_WORDS}(?:[\s-]+(?:and[\s-]+)?{_WORDS})*)(?:\s*\((?P<n1>\d{{1,4}})\))?|(?P<n2>\d{{1,4}})"
    rf"|(?P<article>an?))[\s-]+(?:(?:calendar|business|consecutive|full)[\s-]+)?"
    rf"(?P<unit>days?|weeks?|months?|years?)\b")
_MONEY = re.compile(
    r"(?i)(?:US\s?|U\.S\.\s?)?(?:\$|USD\s?|EUR\s?|€|£)\s?\d[\d,]*(?:\.\d+)?(?:\s?(?:million|billion|thousand))?"
    r"|\b\d[\d,]*(?:\.\d+)?\s?(?:million\s|billion\s)?(?:dollars|euros|USD|EUR)\b")
FEES_OVER_A_PERIOD = re.compile(  # a cap counted as fees: "the fees paid in the three (3) months before the claim"
    r"(?i)\b(?:the\s+)?(?:total\s+|aggregate\s+)?(?:amounts?|fees|charges|sums)\s+(?:actually\s+)?(?:paid|payable)"
    r"[^.;]{0,160}?\b(?:months?|years?|period)\b(?:\s+(?:immediately\s+)?(?:preceding|prior\s+to|before)\b[^.;,]{0,80})?")
_MONTH = r"(?:January|February|March|April|May|June|July|August|September|October|November|December" \
         r"|Jan\.?|Feb\.?|Mar\.?|Apr\.?|Jun\.?|Jul\.?|Aug\.?|Sep\.?|Sept\.?|Oct\.?|Nov\.?|Dec\.?)"
_DATE = re.compile(
    rf"\b{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b"
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+(?:day\s+of\s+)?{_MONTH},?\s+\d{{4}}\b"
    rf"|\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}}\b")
_PLACES = (
    "Alabama", "Alaska", "Arizona", "Arkansas", "California", "Colorado", "Connecticut", "Delaware", "Florida",
    "Georgia", "Hawaii", "Idaho", "Illinois", "Indiana", "Iowa", "Kansas", "Kentucky", "Louisiana", "Maine",
    "Maryland", "Massachusetts", "Michigan", "Minnesota", "Mississippi", "Missouri", "Montana", "Nebraska", "Nevada",
    "New Hampshire", "New Jersey", "New Mexico", "New York", "North Carolina", "North Dakota", "Ohio", "Oklahoma",
    "Oregon", "Pennsylvania", "Rhode Island", "South Carolina", "South Dakota", "Tennessee", "Texas", "Utah",
    "Vermont", "Virginia", "Washington", "West Virginia", "Wisconsin", "Wyoming", "District of Columbia",
    "Ontario", "Quebec", "British Columbia", "Alberta", "Manitoba", "Nova Scotia", "Saskatchewan",
    "England and Wales", "England", "Scotland", "Ireland", "Northern Ireland", "Canada", "Australia", "New Zealand",
    "Germany", "France", "Switzerland", "Netherlands", "Belgium", "Luxembourg", "Sweden", "Denmark", "Norway",
    "Finland", "Spain", "Portugal", "Italy", "Austria", "Israel", "India", "China", "Hong Kong", "Singapore",
    "Japan", "Korea", "Taiwan", "Mexico", "Brazil", "Argentina", "Chile", "Cayman Islands", "Bermuda",
    "British Virgin Islands", "United Kingdom", "United States", "Puerto Rico", "South Africa", "Philippines",
    "Malaysia", "Thailand", "Indonesia", "Vietnam", "Hungary", "Poland", "Cyprus", "Greece", "Turkey",
)
_PLACE = re.compile(r"\b(?:" + "|".join(sorted(map(re.escape, _PLACES), key=len, reverse=True)) + r")\b")
_LAWS_OF = re.compile(r"\blaws?\s+(?:in\s+force\s+in\s+|of\s+)(?:the\s+)?(?:(?:State|Commonwealth|Province|Republic"
                      r"|Kingdom|People's Republic)\s+of\s+)?(?P<place>[A-Z][\w.'-]*(?:\s+(?:of\s+)?[A-Z][\w.'-]*){0,3})")
_SUFFIXES = (r"(?:Inc\.|Inc\b|Incorporated|LLC|L\.L\.C\.|Ltd\.|Ltd\b|Limited|Corp\.|Corporation|Company|Co\.|LLP|L\.L\.P\."
             r"|L\.P\.|LP\b|PLC|plc|GmbH|AG\b|S\.A\.|N\.V\.|B\.V\.|Pty\.? Ltd\.?|S\.p\.A\.|Trust|Bank|N\.A\.)")
_ENTITY = re.compile(
    r"\b(?:[A-Z0-9][\w&'.\-]*[ \t]+(?:(?:and|of|&|de|la|du)[ \t]+)?){0,6}?[A-Z0-9][\w&'.\-]*,?[ \t]+" + _SUFFIXES)


@dataclass(frozen=True)
class Candidate:
    start: int  # offsets in the document's text
    end: int
    text: str


CUE_REACH = 80  # characters around a candidate where one of its cue words must be


def candidates(text: str, start: int, end: int, kind: str, near: tuple[str, ...] = (),
               attached: str = "", not_followed_by: tuple[str, ...] = ()) -> list[Candidate]:
    """The candidate spans of `kind` in text[start:end], in order, none inside another; with
    `not_followed_by`, none that one of these words follows as its own (`_attached`: "sixty (60)
    days prior written notice" is no renewal term); with `near`, only those with one of its words
    (case-insensitive, as a word start) within CUE_REACH characters before or after them, in the
    same sentence; with `attached` ("after" or "before") too, only those that a cue word follows,
    or comes before, as their own (`_attached`), where there are such."""
    found = _candidates(text, start, end, kind)
    if kind == "party term":
        return _party_term_uses(found, text, start, end, near, attached)
    if not_followed_by:
        apart = words_pattern(not_followed_by)
        found = [c for c in found if not _attached(text, c, apart, "after")]
    if not near:
        return found
    cue = words_pattern(near)
    kept = []
    for c in found:
        before = text[max(start, c.start - CUE_REACH):c.start]
        after = text[c.end:min(end, c.end + CUE_REACH)]
        before = re.split(r"[.;](?:\s|$)", before)[-1]
        after = re.split(r"[.;](?:\s|$)", after)[0]
        if cue.search(before) or cue.search(after):
            kept.append(c)
    if attached:  # a candidate that is its cue's own ("thirty (30) days' prior written notice") is the one
        return [c for c in kept if _attached(text, c, cue, attached)] or kept
    return kept


def _party_term_uses(found: list[Candidate], text: str, start: int, end: int, near: tuple[str, ...],
                     attached: str) -> list[Candidate]:
    """The first use of a party's term, in the first sentence of the clause that holds a cue word,
    that a cue word follows (attached "after": "Customer shall indemnify") or leads to ("before":
    "defend, indemnify and hold harmless Provider") as its own; none where no use is (a term is
    the value only as the cue's subject or object, never by standing near it: "Provider shall
    defend Customer" names one of each; in "Each party shall indemnify the other party" neither is
    named, whatever the clause's later sentences say; of a sentence that promises both ways, the
    first promise)."""
    cue = words_pattern(near)  # the playbook gives a party term both
    first = next(((s, e) for s, e in sentences(text, start, end) if cue.search(text, s, e)), None)
    if first is None:
        return []
    return [c for c in found if first[0] <= c.start and c.end <= first[1] and _attached(text, c, cue, attached)
            and not (attached == "before" and _BY.search(text, first[0], c.start))][:1]


_BY = re.compile(r"\bby(?:\s+the)?\s+$", re.IGNORECASE)  # "defended by Provider": the one who defends, not whom


# A term in quotes that opens a parenthesis, as contracts name their parties: ("Provider"), (the
# "Company"), (hereinafter referred to as "Licensee"), (each a "Party"); words before the quote
# are those such a parenthesis uses.
_TERM_DEFINED = re.compile(
    r"\(\s*(?:(?:each|together|collectively|individually|jointly|hereinafter|herein|after|referred|to|as|the|and"
    r"|or|a|an|its|his|her|their|successors|permitted|assigns|called|known)[\s,]+)*[\"“]"
    r"(?P<term>[A-Z][\w&\-]*(?:[ \t]+[A-Z][\w&\-]*){0,3})[\"”]")
_NOT_A_PARTY = {"party", "parties"}  # either party; nor a term whose last word is one of these:
_NOT_A_PARTY_LAST = {"agreement", "date", "term", "period", "services", "products", "product", "territory"}
PARTY_TERM_REACH = 300  # characters from a party's name to the parenthesis that names its term
_BETWEEN_SENTENCES = re.compile(r"[.;]\s+[A-Z]|\n\s*\n")


@lru_cache(maxsize=4)
def party_terms(text: str) -> tuple[str, ...]:
    """The terms the document names its parties by: a term in quotes opening a parenthesis within
    PARTY_TERM_REACH characters after an entity's name, in the same sentence ("Quillfeather
    Analytics, Inc., a Delaware corporation ... ("Provider")"); not "Party" or "Parties", which name
    either, nor a name for an agreement, a date, a term, services or products ("the Split Dollar
    Agreement", "the Effective Date")."""
    ends = [m.end() for m in _ENTITY.finditer(text)]
    terms = []
    for m in _TERM_DEFINED.finditer(text):
        term = " ".join(m.group("term").split())
        if term.lower() in _NOT_A_PARTY or term.split()[-1].lower() in _NOT_A_PARTY_LAST or term in terms:
            continue
        if any(0 <= m.start() - e <= PARTY_TERM_REACH and not _BETWEEN_SENTENCES.search(text, e, m.start())
               for e in ends):
            terms.append(term)
    return tuple(terms)


@lru_cache(maxsize=256)
def words_pattern(words: tuple[str, ...], whole: bool = False, after_non: bool = True) -> re.Pattern:
    """Any of `words` (each a word or phrase) starting a word, case and the spacing between a
    phrase's words aside; `whole`: ending one too. The playbook's cue words, needs and phrases.
    `after_non` False: not right after "non" and a hyphen or a space ("non-exclusive", "non- exclusive"
    and "non exclusive" hold no "exclusive"; "nonexclusive" never did, being one word)."""
    alternatives = "|".join(r"\s+".join(map(re.escape, w.split())) for w in words)
    guard = "" if after_non else r"(?<!non-)(?<!non\s)(?<!non-\s)"
    return re.compile(r"\b" + guard + "(?:" + alternatives + ")" + (r"\b" if whole else ""), re.IGNORECASE)


# The words that may stand between a candidate and the cue after it when the candidate is the
# cue's own (a playbook value's `attached`): "thirty (30) days' prior written notice", "ninety
# (90) days in advance", "one hundred eighty (180) days before the end of the term"; not "within
# 15 days after receiving notice" (a cure period). Over CUAD's 113 clauses that set a notice
# period to stop a renewal, the right period stays a candidate in the 95 where it was one, and is
# the only one in 94 (75 before). Since a cue phrase matches across any spacing ("prior  to" in
# a PDF's text; words_pattern), of the 101 with an expert answer it is a candidate in 96 and the
# only one in 96 (95 and 94 before: a throwaway script with bench/review_quality.py's value_right).
_LINK = r"(?:\s+(?:prior|advance|written|of|at|least|not|no|less|more|than|a|an|the|such))*"


# The words that may stand between a cue and the candidate after it when the candidate is the
# cue's own (`attached = "before"`): "renew for successive one (1) year terms", "successive terms
# of one (1) year", "two (2) renewal terms of five (5) years", "an additional period of three (3)
# years". Over CUAD's 170 renewal clauses with an expert answer (bench/review_quality.py's
# value_right), with notice periods left out (`not_followed_by`): the right term is a candidate
# in 119 (121 before) and the only one in 119 (71 before).
_LEAD = r"(?:\s+(?:for|of|up|to|by|a|an|the|such|each|like|equal|consecutive|successive|subsequent|additional" \
        rf"|further|renewal|extension|automatic|automatically|thereafter|terms?|periods?|\(\d+\)|{_WORDS}))*"


def _attached(text: str, c: Candidate, cue: re.Pattern, side: str) -> bool:
    """Whether a cue follows the candidate (side "after") with only _LINK's words between, or
    comes before it (side "before") with only _LEAD's words between."""
    if side == "after":
        return re.match(r"['’]?s?" + _LINK + r"\s+(?=" + cue.pattern + ")", text[c.end:c.end + CUE_REACH],
                        re.IGNORECASE) is not None
    return re.search("(?:" + cue.pattern + r")\w*" + _LEAD + r"\s+$", text[max(0, c.start - CUE_REACH):c.start],
                     re.IGNORECASE) is not None


def _candidates(text: str, start: int, end: int, kind: str) -> list[Candidate]:
    if kind == "duration":  # not the period a cap counts fees over ("the fees paid in the twelve (12) months before")
        lookback = [m.span() for m in FEES_OVER_A_PERIOD.finditer(text, start, end)]
        spans = [m.span() for m in _DURATION.finditer(text, start, end)
                 if not any(s <= m.start() and m.end() <= e for s, e in lookback)]
    elif kind == "money":
        spans = [m.span() for m in _MONEY.finditer(text, start, end)] + [m.span() for m in FEES_OVER_A_PERIOD.finditer(text, start, end)]
    elif kind == "date":
        spans = [m.span() for m in _DATE.finditer(text, start, end)]
    elif kind == "place":
        spans = [m.span() for m in _PLACE.finditer(text, start, end)]
        spans += [(m.start("place"), m.end("place") - (m.group("place")[-1] == ".")) for m in _LAWS_OF.finditer(text, start, end)]
    elif kind == "party":
        spans = [_trim_entity(text, *m.span()) for m in _ENTITY.finditer(text, start, end)]
    elif kind == "party term":  # every use, in order (candidates() keeps the one that counts)
        terms = party_terms(text)
        if not terms:
            return []
        term = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(terms, key=len, reverse=True))) + r")\b")
        return [Candidate(m.start(), m.end(), m.group()) for m in term.finditer(text, start, end)]
    else:
        raise ValueError(f"unknown value kind {kind!r}")
    spans = sorted({(s, e) for s, e in spans if e > s}, key=lambda se: (se[0], -se[1]))
    kept: list[tuple[int, int]] = []
    for s, e in spans:
        if kept and s < kept[-1][1]:  # inside (or across) the one before: keep the longer
            if e - s > kept[-1][1] - kept[-1][0]:
                kept[-1] = (s, e)
            continue
        kept.append((s, e))
    seen, out = set(), []
    for s, e in kept:
        key = text[s:e].lower()
        if key not in seen:  # the same words twice: the first place they occur
            seen.add(key)
            out.append(Candidate(s, e, text[s:e]))
    return out


def _trim_entity(text: str, s: int, e: int) -> tuple[int, int]:
    """An entity name without the sentence words a match may start with ("between Acme Inc."), nor
    a sentence before it ("... on the SOW. Company and Contractor desire ...": no entity, since
    a suffix alone names no one)."""
    words = text[s:e].split()
    lead = 0
    for n, word in enumerate(words[:-1]):
        if word.endswith(".") and word[:-1].lower() not in ABBREVIATIONS and not _INITIALS.fullmatch(word):
            lead = n + 1  # a sentence ended: the name starts after it
    for word in words[lead:-1]:
        if word[:1].isupper() and word.lower() not in ("the", "this", "by", "and", "between", "among", "whereas"):
            break
        lead += 1
    if lead >= len(words) - 1 and _SUFFIX.fullmatch(words[-1]):
        return s, s  # only "Company" (or "Inc.") is left
    if lead:
        s = text.index(words[lead], s + sum(len(w) for w in words[:lead]))
    return s, e


# Words whose dot ends no sentence ("No. 1", "Acme Inc. shall", "Smith Bros. Company"), less the dot:
# the review's sentences and the names of parties here.
ABBREVIATIONS = {"no", "nos", "inc", "ltd", "co", "corp", "llc", "l.l.c", "e.g", "i.e", "etc", "mr", "mrs", "ms", "dr",
                 "st", "u.s", "art", "sec", "para", "vs", "approx", "jr", "sr", "bros", "mt", "mfg", "assn", "intl"}
_INITIALS = re.compile(r"(?:[A-Za-z]\.)+")  # "J.", "U.S.", "N.V."
_SUFFIX = re.compile(_SUFFIXES)


def days(value: str) -> float | None:
    """A duration in days ("three (3) years" -> 1095), or None when it is not one."""
    m = _DURATION.search(value)
    if not m:
        return None
    number = _number(m)
    unit = m["unit"].lower().rstrip("s")
    return None if number is None else number * _UNITS[unit]


def duration_parts(value: str) -> tuple[float, str] | None:
    """(number, singular unit) of a duration: "one hundred eighty (180) days" -> (180, "day")."""
    m = _DURATION.search(value)
    if not m:
        return None
    number = _number(m)
    return None if number is None else (number, m["unit"].lower().rstrip("s"))


def in_unit(value: str, unit: str) -> float | None:
    """A duration converted to `unit` (day, week, month, year), by 30-day months and 365-day years."""
    d = days(value)
    return None if d is None else d / _UNITS[unit]


def amount(value: str) -> float | None:
    """An amount of money as a number ("$1.5 million" -> 1500000), or None."""
    m = re.search(r"(\d[\d,]*(?:\.\d+)?)\s?(million|billion|thousand)?", value)
    if not m or not _MONEY.search(value):
        return None
    number = float(m.group(1).replace(",", ""))
    return number * {"million": 1e6, "billion": 1e9, "thousand": 1e3}.get((m.group(2) or "").lower(), 1)


def _number(m: re.Match) -> float | None:
    if m["n1"] or m["n2"]:
        return float(m["n1"] or m["n2"])
    if m["article"]:
        return 1.0
    total, current = 0, 0
    for word in re.split(r"[\s-]+", m["words"].lower()):
        if word == "and" or not word:
            continue
        n = _NUMBER_WORDS[word]
        if n == 100:
            current = max(1, current) * 100
        elif n == 1000:
            total += max(1, current) * 1000
            current = 0
        else:
            current += n
    return float(total + current) or None


# A sentence ends at . ; or : after a letter or closing mark (not after a digit, so "10.2" and
# "1." numbering do not end one), followed by white space or the end.
_SENTENCE_END = re.compile(r"(?<=[A-Za-z)\]\"”'%])[.;:](?=\s|$)")


def _word_before(text: str, index: int) -> str:
    """The word that ends at `index` (letters and inner dots)."""
    start = index
    while start > 0 and (text[start - 1].isalpha() or text[start - 1] == "."):
        start -= 1
    return text[start:index]


def sentences(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """(start, end) offsets of the sentences of text[start:end], white space trimmed."""
    spans, first = [], start
    for match in _SENTENCE_END.finditer(text, start, end):
        if match.group() == "." and _word_before(text, match.start()).lower() in ABBREVIATIONS:
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
