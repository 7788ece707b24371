"""Result schemas of review and ask: what the renderers print and --json carries."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SCHEMA_VERSION = 1

# The review taxonomy, based on CUAD's clause categories. Each has a one-line description the
# prompt shows the model; "other" takes every clause that fits none of the rest.
CATEGORIES: dict[str, str] = {
    "governing law": "which jurisdiction's law governs the contract, and where disputes are heard",
    "liability cap": "a limit or cap on the amount of damages a party can be liable for",
    "uncapped liability": "liability that is not limited: exclusions from a cap, unlimited damages",
    "indemnification": "one party must defend, indemnify or hold harmless the other against claims or losses",
    "termination for convenience": "a party may terminate without cause, at will, on notice",
    "auto-renewal and renewal notice": "the term renews automatically unless notice of non-renewal is given",
    "non-compete": "a party may not compete, or solicit the other's employees or customers",
    "exclusivity": "a party must deal exclusively with the other, or may not deal with others",
    "change of control": "rights triggered by a merger, acquisition or change of control of a party",
    "anti-assignment": "a party may not assign the contract without consent",
    "liquidated damages": "a fixed sum or fee payable on breach or early termination",
    "audit rights": "a party may audit or inspect the other's books, records or compliance",
    "ip assignment": "intellectual property created under the contract is assigned to or owned by a party",
    "confidentiality": "information must be kept confidential and not disclosed",
    "payment": "fees, prices, invoices, payment terms, interest on late payment",
    "warranty": "promises about quality or performance, and disclaimers of warranties",
    "insurance": "a party must maintain insurance",
    "other": "none of the above: definitions, notices, boilerplate, recitals, signatures",
}

RISK_LEVELS = ("high", "medium", "low", "none")


@dataclass
class Finding:
    """One clause of a reviewed contract: what it is about, how risky it is, and the exact quote."""

    clause_id: str
    heading: str
    category: str
    risk: str
    rationale: str
    quote: str
    source: str  # where the quote is: "page 3", "paragraph 12", "line 40"
    start: int  # offsets of the quote in the document text
    end: int
    category_scores: dict[str, float] = field(default_factory=dict)  # calibrated log-probabilities
    risk_scores: dict[str, float] = field(default_factory=dict)

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
    warnings: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        data = asdict(self)
        data["findings"] = [f.to_dict() for f in self.findings]
        return data


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
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)
