"""Zero-shot clause categories: the model picks one category per clause, no training.

Each category name is scored as the continuation of "Category:" after the clause, by the
log-probability of its first token (the names start with distinct tokens), calibrated by
subtracting the same score after a content-free clause ("N/A"), which removes the model's prior
preference for some names. It is single-label and reads only the categories below; each maps to
the CUAD categories it stands for (None: no CUAD counterpart). The review's trained heads
replaced it (bench/train_clauses.py compares them); it stays as the measured baseline.
"""

from __future__ import annotations

ZERO_SHOT_CATEGORIES: dict[str, str] = {
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

TO_CUAD: dict[str, tuple[str, ...]] = {
    "governing law": ("Governing Law",),
    "liability cap": ("Cap On Liability",),
    "uncapped liability": ("Uncapped Liability",),
    "termination for convenience": ("Termination For Convenience",),
    "auto-renewal and renewal notice": ("Renewal Term", "Notice Period To Terminate Renewal"),
    "non-compete": ("Non-Compete", "No-Solicit Of Customers", "No-Solicit Of Employees"),
    "exclusivity": ("Exclusivity",),
    "change of control": ("Change Of Control",),
    "anti-assignment": ("Anti-Assignment",),
    "liquidated damages": ("Liquidated Damages",),
    "audit rights": ("Audit Rights",),
    "ip assignment": ("Ip Ownership Assignment",),
    "warranty": ("Warranty Duration",),
    "insurance": ("Insurance",),
}
"""The zero-shot categories with a CUAD counterpart (the 14 risk categories of bench/review_quality.py)."""


def shorten(text: str, limit: int) -> str:
    """`text` cut at a sentence end before `limit` characters (marked "[...]"), or whole."""
    if len(text) <= limit:
        return text
    cut = max(text.rfind(". ", 0, limit), text.rfind("; ", 0, limit))
    return text[: cut + 1 if cut > limit // 2 else limit] + " [...]"
