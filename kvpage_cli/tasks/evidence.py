"""Evidence: the few lines of a document (a sentence of a page) an answer rests on, each quoted
exactly with its place, found by the model's own attention while it answered.

The engine gives the attention mass of every document token the answer read
(engine/attention/evidence.py). Here the text those tokens came from is cut into units, each a
line of a file (a statement whose brackets stay open runs on to the line that closes them) or, in
running text (a page, a paragraph, a long line), a sentence. Each unit scores the mass its words
received (white space, punctuation and stop words, where a small model parks most of its
attention, left out), fused with its lexical match to the question (BM25 over the units,
identifiers split as retrieval splits them, two plain words of the question in a row also as the
one name code writes them as: "block size", `blocksize`); in code, a line that states a value (a
number, a quoted string, an exception raised, an assignment) ranks ahead of one that only
mentions the question's words (not in prose: pages, Markdown, README, PKG-INFO), and a
definition that gives a literal value a name the question uses (`LISTEN_QUEUE = 128` for "what
listen backlog", the default `max_size: int = 4093` of `def dump_cookie(` for "the largest
cookie dump_cookie allows") ranks ahead of both, as an engineer looks for the constant before
the prose about it (a docstring's example, a test's local variable and a call's keyword define
nothing). The best units become spans, each grown over the lines beside it that scored too (at
most MAX_SPAN_LINES lines), returned best first.
`kvpage find` ranks the same way with the question's own attention in place of an answer's.
"""

from __future__ import annotations

import bisect
import io
import math
import re
import tokenize
from dataclasses import dataclass
from pathlib import PurePath

import torch

from ..ingest import Document
from ..ingest.document import Span
from .retrieval import lexical_terms, search_terms, stems
from .schema import Evidence
from .values import sentences

EVIDENCE_SPANS = 3  # spans under an answer (at most)
LONG_UNIT_CHARS = 240  # a line longer than this is cut into its sentences (running text, not code)
MAX_SPAN_UNITS = 4  # a span is at most this many units (lines of code, sentences)
MAX_SPAN_LINES = 8  # and grows over no unit that would take it past this many lines of a file
GROW_SHARE = 0.5  # a unit joins the span beside it when it scores at least this share of the span's best unit
MIN_SHARE = 0.2  # a second or third span is shown only when it scores at least this share of the first
MAX_STATEMENT_LINES = 8  # a line whose brackets stay open is one unit with the lines up to the closing one, up to this
VALUE_WEIGHT = 1.0  # in code, a unit that states a value ranks (1 + this) times higher; an assignment half that more
# running text: the value prior is for code and configuration, not prose, whose numbers are no more telling
PROSE_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".rst", ".adoc", ".org", ".tex", ".html", ".htm"})
# A unit of code that gives a literal value a name the question uses ranks up to (1 + this) times
# higher: 1 + NAME_WEIGHT * the share of the question's words (IDF-weighted over the units read)
# that its names hold. Chosen on bench/retrieval.py's questions over packaging, werkzeug and urllib3
# (the answers' attention kept and ranked again without the model), checked on its other sources.
NAME_WEIGHT = 8.0
# the words a question asks with and the word code names the same thing with (a limit is a `max_*`)
NAME_WORDS = {"largest": "max", "longest": "max", "biggest": "max", "highest": "max", "most": "max", "maximum": "max",
              "greatest": "max", "smallest": "min", "shortest": "min", "lowest": "min", "least": "min",
              "fewest": "min", "minimum": "min"}
NAME_PHRASES = ((re.compile(r"\bhow long\b", re.IGNORECASE),
                 ("length", "len", "time", "timeout", "duration", "age", "seconds")),
                (re.compile(r"\bhow (?:big|large)\b", re.IGNORECASE), ("size", "max")),
                (re.compile(r"\bhow many\b", re.IGNORECASE), ("num", "count", "max")))
NAMES_NOTHING = frozenset({"default", "defaults"})  # question words a definition's name does not answer (named_values)
PYTHON_SUFFIXES = frozenset({".py", ".pyi"})  # strings found by tokenize: a docstring's example defines nothing
SIGNALS = ("attention", "lexical", "fused")
DEFAULT_SIGNAL = "fused"
_WORD = re.compile(r"\w")
_WORD_PAIR = re.compile(r"(?<![\w.])([A-Za-z][a-z]*)\s+(?=([A-Za-z][a-z]*)(?![\w.]))")  # two plain words in a row
_OPEN, _CLOSE = "([{", ")]}"
_NOT_CODE = re.compile(r"\"\"\"|'''|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|#.*$")  # strings and comments
_NUMBER = re.compile(r"(?<![\w.])\d[\d_,.]*\b")
_QUOTED = re.compile(r'"[^"\n]{1,40}"|\'[^\'\n]{1,40}\'|``[^`\n]+``')
_RAISED = re.compile(r"\braise\b|\w+(?:Error|Exception)\b")
_ASSIGNED = re.compile(r"^\s*[\w.]+\s*(?::\s*[^=]+)?=\s*\S")
# a definition's name: `NAME = `, `name: T = `, `const NAME = `, `key = ` (TOML, INI)
_TARGET = re.compile(r"\s*(?:(?:export|pub|const|let|var|static|final|readonly)\s+)*([A-Za-z_][\w.-]*)\s*"
                     r"(?::\s*[^=\n]+?)?\s*(?<![=!<>+\-*/%&|^])=(?!=)")
# a parameter and its default
_PARAM = re.compile(r"(?:^|[(,])\s*\*{0,2}([A-Za-z_]\w*)\s*(?::\s*[^=,()\n]+?)?\s*=(?!=)")
_DEF_LINE = re.compile(r"\s*(?:async\s+)?def\s")
_CLASS_LINE = re.compile(r"\s*class\s")
_SCOPE_LINE = re.compile(r"\s*(?:async\s+)?(?:def|class)\s+(\w+)")
_ATTRIBUTE = re.compile(r"\s*(?:self|this|cls)\.")
_STRING = re.compile(r"""[bruf]{0,2}(?:"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')""", re.IGNORECASE)
_EMPTY_STRING = re.compile(r"""\s*[bruf]{0,2}(?:""|'')\s*(?:[,)\]}]|$)""", re.IGNORECASE)
_KEYWORD = re.compile(r"([A-Za-z_]\w*)\s*=(?!=)")
_NAME_READ = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)(\s*\()?")
_LITERAL = re.compile(r'\d|"')


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
    last_line: int | None = None  # a statement's last line (None: `line`)

    @property
    def end_line(self) -> int | None:
        return self.line if self.last_line is None else self.last_line


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
    return _statements(doc, sorted(found.values(), key=lambda u: u.start))


def _statements(doc: Document, units: list[Unit]) -> list[Unit]:
    """Each line that opens more brackets than it closes (strings and comments aside) made one
    unit with the lines up to the one that closes them (`frozenset(` / `["Cookie", ...]` / `)`),
    the lines it takes in dropped; a statement that does not close within MAX_STATEMENT_LINES,
    or runs into the next file, stays a line."""
    out: list[Unit] = []
    taken_to = -1
    for unit in units:
        if unit.start < taken_to:
            continue
        end = _statement_end(doc.text, unit) if unit.line is not None else None
        out.append(unit if end is None else Unit(unit.start, end, unit.file, unit.line, unit.group,
                                                 unit.line + doc.text.count("\n", unit.start, end)))
        taken_to = end or unit.end
    return out


def _statement_end(text: str, unit: Unit) -> int | None:
    depth = _depth(text[unit.start:unit.end])
    if depth <= 0:
        return None
    at = unit.end
    for _ in range(MAX_STATEMENT_LINES - 1):
        start = text.find("\n", at)
        if start < 0:
            return None
        start += 1
        at = text.find("\n", start)
        at = len(text) if at < 0 else at
        line = text[start:at]
        if line.startswith("==> "):  # a repository's next file
            return None
        depth += _depth(line)
        if depth <= 0:
            return start + len(line.rstrip())
    return None


def _depth(line: str) -> int:
    """Brackets a line of code opens less those it closes, its strings and comments aside."""
    code = _NOT_CODE.sub("", line)
    return sum(code.count(c) for c in _OPEN) - sum(code.count(c) for c in _CLOSE)


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


def word_mass(doc: Document, token_chars: list[tuple[int, int]], mass: torch.Tensor) -> torch.Tensor:
    """[tokens] the mass that ranks: a token of white space, punctuation or a stop word gets none
    (a small model parks most of its attention on " the" and on indentation, whatever it reads)."""
    from bm25s.stopwords import STOPWORDS_EN

    stopwords = frozenset(STOPWORDS_EN)
    words = torch.tensor([bool(_WORD.search(doc.text, a, b)) and doc.text[a:b].strip().lower() not in stopwords
                          for a, b in token_chars], dtype=torch.bool)
    return mass.float() * words


def unit_terms(doc: Document, units: list[Unit]) -> list[list[str]]:
    """Each unit's terms as the lexical signals read them (retrieval's: identifiers split into their
    words, bm25s's English stop words left out)."""
    from bm25s.stopwords import STOPWORDS_EN

    stopwords = frozenset(STOPWORDS_EN)
    return [search_terms(doc.text[u.start:u.end], stopwords) for u in units]


def lexical_scores(doc: Document, units: list[Unit], question: str,
                   terms: list[list[str]] | None = None) -> torch.Tensor:
    """[units] BM25 of the question's terms over the units (bm25s; terms: unit_terms, computed where
    not given), the words of the document's own name left out (`document_terms`)."""
    import bm25s  # loads tqdm: imported where used, never by an engine or task module at import
    from bm25s.stopwords import STOPWORDS_EN

    own = document_terms(doc)
    asked = [t for t in search_terms(question, frozenset(STOPWORDS_EN)) + joined(question, frozenset(STOPWORDS_EN))
             if t not in own]
    if not units or not asked:
        return torch.zeros(len(units))
    index = bm25s.BM25()
    index.index([t or ["\u0000"] for t in terms or unit_terms(doc, units)], show_progress=False)
    return torch.as_tensor(index.get_scores(asked), dtype=torch.float32)


def joined(text: str, stopwords: frozenset[str]) -> list[str]:
    """The stems of each two plain words in a row (neither an identifier nor one of `stopwords`)
    written as one, as code names what they say: "block size" is a `blocksize`, "host name" a
    `hostname`."""
    pairs = _WORD_PAIR.findall(text)
    return stems([(a + b).lower() for a, b in pairs if a.lower() not in stopwords and b.lower() not in stopwords])


def document_terms(doc: Document) -> frozenset[str]:
    """The stems of the words of the document's own name ("itsdangerous" of itsdangerous-2.2.0/,
    "gnuplot" and "pdf" of gnuplot.pdf; not the numbers of a version; none for standard input):
    every line of a document is about what it is named for, so a question's word for it points at
    none of them (a question on "an itsdangerous Signer" ranked `salt = b"itsdangerous.Signer"`
    first for the name)."""
    if doc.source == "-":
        return frozenset()
    return frozenset(stems([t for t in lexical_terms(doc.name) if t.isalpha()]))


def is_prose(file: str) -> bool:
    """Whether a file of a repository is running text: a suffix of PROSE_SUFFIXES, or no suffix and
    a name in capitals (README, PKG-INFO, LICENSE, CHANGES: a package's metadata and its README)."""
    path = PurePath(file)
    return path.suffix.lower() in PROSE_SUFFIXES or (not path.suffix and path.name.upper() == path.name)


def value_prior(doc: Document, units: list[Unit]) -> torch.Tensor:
    """[units] how much a unit of code states a value: 1 for a number, a short quoted string or an
    exception raised or named, half more for an assignment (`DEFAULT_BACKOFF_MAX = 120`,
    `num_pools: int = 10,`); 0 for prose (pages, paragraphs, `is_prose` files), whose numbers say no
    more than its words."""
    out = torch.zeros(len(units))
    for i, u in enumerate(units):
        if u.line is None or is_prose(u.file):
            continue
        text = doc.text[u.start:u.end]
        out[i] = ((1.0 if _NUMBER.search(text) or _QUOTED.search(text) or _RAISED.search(text) else 0.0)
                  + (0.5 if _ASSIGNED.search(text) else 0.0))
    return out


def named_values(doc: Document, units: list[Unit], question: str,
                 terms: list[list[str]] | None = None) -> torch.Tensor:
    """[units] 0..1: the share of the question's words (each weighted by its IDF over the units)
    that the names a unit of code defines with a literal value hold, with the names of the def and
    class it lies in (`code = 418` in `class ImATeapot`); the question's words count with the words
    code says them with (NAME_WORDS, NAME_PHRASES: "largest" is a `max_*`, "how long" a length or
    a time; `joined`: "block size" is a `blocksize`); question words and other function words
    (bm25s's longer English list: "where", "what", "does"), "default" (a question's "by default"
    asks for the default of what its other words name: `DEFAULT_PBKDF2_ITERATIONS` is no answer to
    "which scrypt parameters by default") and the words of the document's own name
    (`document_terms`) name nothing, alone or joined. Prose, docstrings and units
    that define nothing get 0. terms: unit_terms, computed where not given."""
    from bm25s.stopwords import STOPWORDS_EN, STOPWORDS_EN_PLUS

    stopwords, function_words = frozenset(STOPWORDS_EN), frozenset(STOPWORDS_EN_PLUS)
    out = torch.zeros(len(units))
    said = lexical_terms(question, stopwords)
    own = document_terms(doc)
    asked = [t for t in stems([t for t in said if t not in function_words and t not in NAMES_NOTHING]) if t not in own]
    if not units or not asked:
        return out
    wanted = set(asked) | set(stems([NAME_WORDS[t] for t in said if t in NAME_WORDS]))
    wanted.update(t for t in joined(question, function_words | NAMES_NOTHING) if t not in own)
    for phrase, words in NAME_PHRASES:
        if phrase.search(question):
            wanted.update(stems(list(words)))
    counts: dict[str, int] = {}
    for unit_words in terms or unit_terms(doc, units):
        for term in set(unit_words):
            counts[term] = counts.get(term, 0) + 1

    def idf(term: str) -> float:
        return math.log(1.0 + len(units) / (1.0 + counts.get(term, 0)))

    files: dict[str, _FileLines] = {}
    ends = [s.end for s in doc.spans]
    for i, u in enumerate(units):
        if u.line is None or is_prose(u.file):
            continue
        if u.file not in files:
            files[u.file] = _FileLines(doc, u, ends)
        names = files[u.file].defined(doc, u)
        if not names:
            continue
        named = {t for name in names for t in search_terms(name.rsplit(".", 1)[-1], stopwords)}
        named.update(t for name in files[u.file].scope(u.line) for t in search_terms(name, stopwords))
        out[i] = sum(idf(t) for t in named & wanted)
    # the question's words found in the text read (all of them where none is), a unit's share at most 1
    whole = sum(idf(t) for t in set(asked) if t in counts) or sum(idf(t) for t in set(asked))
    return (out / whole).clamp(max=1.0)


class _FileLines:
    """One file of a document as its code nests: per line, the line above it with less indentation
    (the block or the bracket it lies in), and, for Python, the lines inside a string that spans
    lines (a docstring and the examples in it), found by `tokenize` when first asked."""

    def __init__(self, doc: Document, unit: Unit, ends: list[int]) -> None:
        """The file `unit` lies in (ends: every span's end in doc, in order)."""
        at = bisect.bisect_right(ends, unit.start)
        lo = hi = min(at, len(doc.spans) - 1)
        while lo > 0 and doc.spans[lo - 1].file == unit.file and doc.spans[lo - 1].line is not None:
            lo -= 1
        while hi + 1 < len(doc.spans) and doc.spans[hi + 1].file == unit.file and doc.spans[hi + 1].line is not None:
            hi += 1
        self.first = doc.spans[lo].line or 1
        self.lines = doc.text[doc.spans[lo].start:doc.spans[hi].end].split("\n")
        self.python = PurePath(unit.file).suffix.lower() in PYTHON_SUFFIXES
        self._strings: set[int] | None = None
        self.parent: list[int | None] = []
        stack: list[tuple[int, int]] = []  # (indentation, index) of the lines still open
        for i, line in enumerate(self.lines):
            if not line.strip():
                self.parent.append(None)
                continue
            indent = len(line) - len(line.lstrip())
            while stack and stack[-1][0] >= indent:
                stack.pop()
            self.parent.append(stack[-1][1] if stack else None)
            stack.append((indent, i))

    def opener(self, number: int) -> str:
        """The line a line lies in (less indented, above it), "" at the file's top level."""
        i = number - self.first
        up = self.parent[i] if 0 <= i < len(self.parent) else None
        return self.lines[up] if up is not None else ""

    def scope(self, number: int) -> list[str]:
        """The names of the defs and classes a line lies in, innermost first."""
        names, i = [], number - self.first
        up = self.parent[i] if 0 <= i < len(self.parent) else None
        while up is not None:
            m = _SCOPE_LINE.match(self.lines[up])
            if m:
                names.append(m.group(1))
            up = self.parent[up]
        return names

    def in_string(self, number: int) -> bool:
        if not self.python:
            return False
        if self._strings is None:
            self._strings = set()
            try:
                for tok in tokenize.generate_tokens(io.StringIO("\n".join(self.lines)).readline):
                    if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                        first = tok.start[0] + (0 if tok.line[:tok.start[1]].strip() == "" else 1)
                        self._strings.update(range(first + self.first - 1, tok.end[0] + self.first))
            except (tokenize.TokenError, SyntaxError):
                pass  # a file that does not tokenize to its end: the strings found before
        return number in self._strings

    def defined(self, doc: Document, unit: Unit) -> list[str]:
        """The names `unit` gives a literal value: a def's parameters with such defaults (the def's
        line, or a line of its open signature), else the target of an assignment at the file's top
        level, in a class body or to an attribute (`self.x = 3`), with the keywords of a constructor
        it calls (`LIMITS = Limits(max_connections=100)`); none inside a string."""
        if self.in_string(unit.line):
            return []
        code = _STRING.sub(lambda m: '"' + "0" * (len(m.group()) - 2) + '"', doc.text[unit.start:unit.end])
        opener = self.opener(unit.line)
        if _DEF_LINE.match(code) or (_DEF_LINE.match(opener) and _depth(opener) > 0):
            return [m.group(1) for m in _PARAM.finditer(code) if _literal(_expression(code, m.end()))[0]]
        if len(code) - len(code.lstrip()) and not _CLASS_LINE.match(opener) and not _ATTRIBUTE.match(code):
            return []  # a local variable of a function
        m = _TARGET.match(code)
        if not m:
            return []
        literal, keywords = _literal(_expression(code, m.end()))
        return [m.group(1), *keywords] if literal else []


def _expression(code: str, at: int) -> str:
    """code from `at` to the end of the expression that starts there (a comma or a bracket it did
    not open, or the end)."""
    depth = 0
    for j in range(at, len(code)):
        c = code[j]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            if depth == 0:
                return code[at:j]
            depth -= 1
        elif c == "," and depth == 0:
            return code[at:j]
    return code[at:]


def _literal(expression: str) -> tuple[bool, list[str]]:
    """Whether an expression (its strings masked: `"000"`) states a value (numbers, non-empty
    strings, containers and arithmetic of them, constructors called by a bare name: `frozenset([413,
    429])`, `60 * 60 * 24 * 7`, `Limits(max_connections=100)`; no other name read, no method
    called), and the keywords it sets."""
    if _EMPTY_STRING.match(expression):
        return False, []
    code = re.sub(r"#.*", "", expression)
    keywords = _KEYWORD.findall(code)
    code = _KEYWORD.sub(" ", code)
    for m in _NAME_READ.finditer(code):
        name, called = m.group(1), m.group(2)
        if name in ("True", "False", "None") or (called and "." not in name):
            continue
        return False, []
    return bool(_LITERAL.search(code)), keywords


def fuse(attention: torch.Tensor, lexical: torch.Tensor, signal: str = DEFAULT_SIGNAL,
         prior: torch.Tensor | None = None, named: torch.Tensor | None = None) -> torch.Tensor:
    """The units' ranking scores (higher is better) for `signal`: attention alone, lexical alone,
    or both fused by their ranks (reciprocal rank fusion, as retrieval fuses its signals; a unit
    with no lexical match keeps its attention rank), times 1 + VALUE_WEIGHT * prior and
    1 + NAME_WEIGHT * named where given (value_prior, named_values: fused only)."""
    if signal not in SIGNALS:
        raise ValueError(f"signal must be one of {', '.join(SIGNALS)}; got {signal!r}")
    if signal == "attention":
        return attention.clone()
    if signal == "lexical":
        return lexical + 1e-6 * attention / max(float(attention.max()), 1e-12) if len(attention) else lexical
    fused = 1.0 / (60.0 + _rank(attention))
    matched = lexical > 0
    fused[matched] += 1.0 / (60.0 + _rank(lexical)[matched])
    if named is not None:
        fused = fused * (1.0 + NAME_WEIGHT * named)
    return fused if prior is None else fused * (1.0 + VALUE_WEIGHT * prior)


def _rank(scores: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(scores, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return rank.float()


def spans(doc: Document, units: list[Unit], scores: torch.Tensor, attention: torch.Tensor,
          count: int = EVIDENCE_SPANS, min_share: float = MIN_SHARE) -> list[Evidence]:
    """The best `count` spans, best first: each seeded by the best unit not yet taken, grown over
    the units beside it (same file, page or paragraph; consecutive lines) while they score at least
    GROW_SHARE of the seed, up to MAX_SPAN_UNITS (and MAX_SPAN_LINES of a file). A span after the first is kept only when it scores
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
            grow = [i for i in grow if float(scores[i]) >= GROW_SHARE * float(scores[seed])
                    and _lines(units[min(lo, i)], units[max(hi, i)]) <= MAX_SPAN_LINES]
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


def _lines(first: Unit, last: Unit) -> int:
    """Lines of a file from `first` to `last` (0 where the units are not lines)."""
    return last.end_line - first.line + 1 if first.line is not None and last.end_line is not None else 0


def _beside(units: list[Unit], i: int, lo: int, hi: int) -> bool:
    """Whether unit i follows or precedes the span lo..hi in the same group of lines: the same
    file, the next (or previous) line number (blank lines between allowed), or the next sentence
    of the same page or paragraph."""
    other = units[lo] if i < lo else units[hi]
    near = units[i]
    if near.file != other.file:
        return False
    if near.line is not None and other.line is not None:
        return near.line - other.end_line <= 2 if i > hi else other.line - near.end_line <= 2
    return near.group == other.group


def place(doc: Document, first: Unit, last: Unit) -> str:
    """Where a span is, as a reader looks it up: `path:431-434` (a file's lines, the form editors
    and `sed -n 431,434p path` take), else the document's own place ("page 3", "paragraph 12")."""
    if first.line is not None and last.line is not None:
        lines = f"{first.line}" if first.line == last.end_line else f"{first.line}-{last.end_line}"
        return f"{first.file}:{lines}"
    return doc.where(first.start, last.end)


@dataclass
class Signals:
    """What ranks the units of the text an answer read: per unit, the attention it received (all
    of it: Evidence.score's measure), the attention its words received as ranked (word_mass), its
    lexical match to the question, its value prior and the question's share in the names it defines."""

    units: list[Unit]
    received: torch.Tensor
    attention: torch.Tensor
    lexical: torch.Tensor
    prior: torch.Tensor
    named: torch.Tensor

    def spans(self, doc: Document, signal: str = DEFAULT_SIGNAL, count: int = EVIDENCE_SPANS,
              min_share: float = MIN_SHARE) -> list[Evidence]:
        fused = signal == "fused"
        scores = fuse(self.attention, self.lexical, signal, self.prior if fused else None,
                      self.named if fused else None)
        return spans(doc, self.units, scores, self.received, count, min_share)


def signals(doc: Document, token_chars: list[tuple[int, int]], mass: torch.Tensor, question: str) -> Signals:
    """The ranking signals of the units in the text `token_chars` hold (see Signals)."""
    units = units_of(doc, token_chars)
    terms = unit_terms(doc, units)
    return Signals(units, unit_mass(units, token_chars, mass),
                   unit_mass(units, token_chars, word_mass(doc, token_chars, mass)),
                   lexical_scores(doc, units, question, terms), value_prior(doc, units),
                   named_values(doc, units, question, terms))


def rank(doc: Document, token_chars: list[tuple[int, int]], mass: torch.Tensor, question: str,
         count: int = EVIDENCE_SPANS, signal: str = DEFAULT_SIGNAL, min_share: float = MIN_SHARE) -> list[Evidence]:
    """The evidence for an answer (or, for `kvpage find`, a question): token_chars, mass: the
    document tokens read and the attention each received. Spans lie in the text those tokens hold;
    their scores are their shares of all the attention the document received."""
    return signals(doc, token_chars, mass, question).spans(doc, signal, count, min_share)
