"""The review's taxonomy: CUAD's 41 clause categories, each with a readable name.

The names are CUAD's (Cap On Liability, Governing Law, ...) written as a reader would; the
CUAD name stays the key that the training data, the trained heads and the playbook use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Category:
    cuad: str  # CUAD's own name, the key in contracts.jsonl and in labels.json
    name: str  # what a reader sees
    description: str  # one line, for a prompt and for --help


_CATEGORIES = (
    Category("Document Name", "document name", "the name of the contract"),
    Category("Parties", "parties", "the parties who signed the contract"),
    Category("Agreement Date", "agreement date", "the date of the contract"),
    Category("Effective Date", "effective date", "the date when the contract is effective"),
    Category("Expiration Date", "term and expiration", "when the contract's initial term expires"),
    Category("Renewal Term", "renewal term", "the term after the initial term: automatic extensions, renewals"),
    Category("Notice Period To Terminate Renewal", "notice to terminate renewal",
             "the notice needed to terminate renewal"),
    Category("Governing Law", "governing law", "which state's or country's law governs the contract"),
    Category("Most Favored Nation", "most favored nation",
             "a party gets terms at least as good as those given to any third party"),
    Category("Competitive Restriction Exception", "competitive restriction exception",
             "exceptions or carve-outs to non-compete, exclusivity or no-solicit"),
    Category("Non-Compete", "non-compete", "a party may not compete with the other, in a field, time or place"),
    Category("Exclusivity", "exclusivity",
             "exclusive dealing: a party may not buy from or sell to others, or license to others"),
    Category("No-Solicit Of Customers", "no-solicit of customers", "a party may not solicit the other's customers"),
    Category("No-Solicit Of Employees", "no-solicit of employees",
             "a party may not solicit or hire the other's employees"),
    Category("Non-Disparagement", "non-disparagement", "a party may not disparage the other"),
    Category("Termination For Convenience", "termination for convenience",
             "a party may terminate without cause, on notice"),
    Category("Rofr/Rofo/Rofn", "right of first refusal, offer or negotiation",
             "a right of first refusal, first offer or first negotiation"),
    Category("Change Of Control", "change of control",
             "rights on a merger, acquisition or change of control of a party"),
    Category("Anti-Assignment", "anti-assignment", "assignment needs the other party's consent or notice"),
    Category("Revenue/Profit Sharing", "revenue or profit sharing", "a party shares revenue or profit with the other"),
    Category("Price Restrictions", "price restrictions", "restrictions on raising or lowering prices"),
    Category("Minimum Commitment", "minimum commitment", "a minimum order, purchase or volume a party must buy"),
    Category("Volume Restriction", "volume restriction", "a fee increase or consent above a volume of use"),
    Category("Ip Ownership Assignment", "IP ownership assignment",
             "intellectual property created by one party becomes the other's"),
    Category("Joint Ip Ownership", "joint IP ownership", "intellectual property owned jointly by the parties"),
    Category("License Grant", "license grant", "a license granted by one party to the other"),
    Category("Non-Transferable License", "non-transferable license", "a license that may not be transferred"),
    Category("Affiliate License-Licensor", "affiliate license (licensor)",
             "a license that covers the licensor's affiliates' IP"),
    Category("Affiliate License-Licensee", "affiliate license (licensee)",
             "a license granted to the licensee's affiliates"),
    Category("Unlimited/All-You-Can-Eat-License", "unlimited license",
             "a license without limits of use (all you can eat, enterprise-wide)"),
    Category("Irrevocable Or Perpetual License", "irrevocable or perpetual license",
             "a license that is irrevocable or perpetual"),
    Category("Source Code Escrow", "source code escrow", "source code deposited in escrow, released on events"),
    Category("Post-Termination Services", "post-termination services",
             "obligations after termination: transition, wind-down, sell-off"),
    Category("Audit Rights", "audit rights", "a party may audit the other's books, records or compliance"),
    Category("Uncapped Liability", "uncapped liability",
             "liability that is not capped: exclusions from the cap, unlimited liability"),
    Category("Cap On Liability", "cap on liability", "a cap on the damages or liability of a party"),
    Category("Liquidated Damages", "liquidated damages", "a fixed sum or fee payable on breach or termination"),
    Category("Warranty Duration", "warranty duration", "how long a warranty lasts"),
    Category("Insurance", "insurance", "a party must maintain insurance"),
    Category("Covenant Not To Sue", "covenant not to sue", "a party may not sue or challenge the other's IP"),
    Category("Third Party Beneficiary", "third-party beneficiary", "a non-party may enforce the contract"),
)

CATEGORIES: dict[str, Category] = {c.cuad: c for c in _CATEGORIES}
"""CUAD name -> Category, in CUAD's order: the taxonomy the trained heads learn."""

EXTRA_CATEGORIES: dict[str, Category] = {c.cuad: c for c in (
    Category("Payment Terms", "payment terms", "how soon an invoice must be paid"),
    Category("Price Increases", "price increases", "a party may raise its prices or fees on its own"),
    Category("Indemnification", "indemnification", "a party must defend or indemnify the other against claims"),
)}
"""Categories a review adds to CUAD's (the key is not a CUAD name): CUAD has no labels for them,
so no trained head scores them; the review considers a clause for one when a sentence of it holds
one of the category's found_by phrases (or, for a category without them, when one of its values
has a candidate in the clause), and keeps it when the model answers its questions yes."""

ALL_CATEGORIES: dict[str, Category] = {**CATEGORIES, **EXTRA_CATEGORIES}

BY_NAME: dict[str, Category] = {c.name: c for c in ALL_CATEGORIES.values()}


def readable(cuad: str) -> str:
    """The readable name of a category (CUAD's or an extra one)."""
    return ALL_CATEGORIES[cuad].name
