"""Result schemas of review and ask: what the renderers print and --json carries."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SCHEMA_VERSION = 2

RISK_LEVELS = ("high", "medium", "low", "none")


@dataclass
class Value:
    """A value copied from the document: its exact words, where they are, and the model's score."""

    text: str
    start: int  # offsets in the document text: text == document[start:end]
    end: int
    source: str  # "page 3", "line 40"
    score: float = 0.0  # calibrated log-probability of these words as the answer

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Assessment:
    """One category of a clause, judged by the playbook: the answers, the values, the level."""

    category: str  # readable name ("cap on liability")
    cuad: str  # CUAD's name ("Cap On Liability"), or an extra category's key ("Payment Terms")
    probability: float | None  # the head's probability that the clause is of this category; None for
    # a category no head scores (found by its values' words and the model's answers)
    level: str
    reason: str  # the playbook's rationale, filled with the values found
    answers: dict[str, bool] = field(default_factory=dict)  # question name -> yes
    answer_scores: dict[str, float] = field(default_factory=dict)  # calibrated log-odds of yes
    values: dict[str, list[Value]] = field(default_factory=dict)


@dataclass
class Finding:
    """A clause that matters: its categories, the worst level among them, the reason and the exact quote."""

    clause_id: str
    heading: str
    category: str  # the category that sets the risk (readable name)
    risk: str
    rationale: str  # that category's reason from the playbook
    quote: str  # the clause's sentence that shows it, exact
    source: str  # where the quote is: "page 3", "paragraph 12", "line 40"
    start: int  # offsets of the quote in the document text
    end: int
    categories: list[str] = field(default_factory=list)  # every category of the clause, worst first
    assessments: list[Assessment] = field(default_factory=list)
    commentary: str | None = None  # --explain: the model's own words, checked (None: not asked, or dropped)
    document: str = ""  # the document it is in (several documents per run)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Term:
    """A key term of the contract (parties, dates, renewal, governing law, ...), copied from the text."""

    label: str
    values: list[Value]
    clause_id: str
    category: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ReviewResult:
    document: str
    document_kind: str
    model: str
    mode: str  # how it was made: "exact", "selective" or "retrieval"
    findings: list[Finding]
    complete: bool  # False when the run stopped early (Ctrl-C): findings are partial
    document_tokens: int
    clauses_total: int
    terms: list[Term] = field(default_factory=list)
    clauses_reviewed: int = 0  # of clauses_total, those done (all of them unless interrupted)
    detector: str = ""  # which head decided the categories
    playbook: str = ""
    attended_blocks: int | None = None  # retrieval mode: blocks read per clause, at most
    total_blocks: int | None = None
    warnings: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        data = asdict(self)
        data["findings"] = [f.to_dict() for f in self.findings]
        data["terms"] = [t.to_dict() for t in self.terms]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ReviewResult:
        """A review read back from its JSON (`kvpage review --json`), to render it in another format."""
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"a review of schema version {data.get('schema_version')} (this kvpage reads "
                             f"version {SCHEMA_VERSION})")
        fields = dict(data)
        fields["findings"] = [_finding(f) for f in data.get("findings", [])]
        fields["terms"] = [Term(t["label"], _values(t["values"]), t["clause_id"], t["category"])
                           for t in data.get("terms", [])]
        return cls(**fields)


def _values(items: list[dict]) -> list[Value]:
    return [Value(**v) for v in items]


def _finding(data: dict) -> Finding:
    fields = dict(data)
    fields.pop("type", None)  # a --jsonl line
    fields.pop("schema_version", None)
    fields["assessments"] = [
        Assessment(**{**a, "values": {name: _values(vs) for name, vs in a.get("values", {}).items()}})
        for a in data.get("assessments", [])]
    return Finding(**fields)


@dataclass
class Evidence:
    """A span an answer rests on: its exact text, where it is, and its share of the attention."""

    text: str  # exactly document[start:end]
    where: str  # "src/pkg/sessions.py:431-434" (a file's lines), "page 3", "paragraph 12"
    start: int  # offsets in the document text
    end: int
    score: float  # the share of the attention the answer paid the document that this span received

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class AskResult:
    source: str
    question: str
    answer: str
    model: str
    mode: str
    document_tokens: int
    cached_tokens: int = 0
    complete: bool = True
    warnings: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    question_index: int = 0  # its place among the questions asked together
    attended_blocks: int | None = None  # retrieval mode: the blocks of the document the answer read,
    total_blocks: int | None = None  # of all the document's blocks
    sources: list[dict] = field(default_factory=list)  # retrieval mode: where they are ({where, start, end})
    evidence: list[Evidence] = field(default_factory=list)  # the spans the answer rests on, best first
    indexed_tokens: int | None = None  # retrieval mode: document tokens indexed when the answer was given,
    index_total_tokens: int | None = None  # of all the document's (a lazy index grows as questions need it)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)
