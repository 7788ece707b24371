"""Clause splitting on real contracts (CUAD text and PDF, Common Paper DOCX) and small cases."""

from functools import lru_cache
from pathlib import Path

import pytest

from kvpage_cli.ingest import Document, Span, load, split_clauses

CORPUS = Path(__file__).resolve().parents[1] / "corpus"


@lru_cache(maxsize=None)
def clauses_of(relative: str, max_chars: int = 4000):
    doc = load(str(CORPUS / relative))
    return doc, split_clauses(doc, max_chars=max_chars)


def by_id(clauses):
    return {c.id: c for c in clauses}


def check_well_formed(doc, clauses, max_chars=4000, min_coverage=0.9):
    previous_end = 0
    for clause in clauses:
        assert clause.text == doc.text[clause.start:clause.end]
        assert clause.text == clause.text.strip() and clause.text
        assert previous_end <= clause.start < clause.end <= len(doc.text)
        assert len(clause.text) <= max_chars
        # cuts fall between words
        assert clause.start == 0 or not doc.text[clause.start - 1].isalnum() \
            or not clause.text[0].isalnum()
        assert clause.end == len(doc.text) or not (doc.text[clause.end - 1].isalnum()
                                                   and doc.text[clause.end].isalnum())
        previous_end = clause.end
    covered = sum(len("".join(c.text.split())) for c in clauses)
    assert covered >= min_coverage * len("".join(doc.text.split()))
    assert len({c.id for c in clauses}) == len(clauses)


CONTRACTS = [
    "cuad/02-ip-short/contract.txt",
    "cuad/05-cobranding/contract.pdf",
    "cuad/08-manufacturing/contract.pdf",
    "cuad/11-promotion-long/contract.pdf",
    "cuad/12-servicing-longest/contract.pdf",
    "cuad/07-marketing/contract.txt",
]


@pytest.mark.parametrize("relative", CONTRACTS)
def test_clauses_are_ordered_disjoint_and_cover_the_text(relative):
    doc, clauses = clauses_of(relative)
    # the table of contents of 11 and 12 is left out; everything else is covered
    check_well_formed(doc, clauses, min_coverage=0.95)
    assert clauses[0].id == "preamble"


def test_short_contract_numbering():
    _, clauses = clauses_of("cuad/02-ip-short/contract.txt")
    ids = [c.id for c in clauses]
    numbered = [i for i in ids if i.isdigit()]
    assert numbered == [str(n) for n in range(1, 20)]
    clause = by_id(clauses)
    assert clause["12"].heading == "Governing Law"
    assert clause["1"].heading == "Definitions"
    assert "(a)" in clause["1"].text and "(f)" in clause["1"].text  # sub-clauses stay with it
    assert clause["preamble"].heading == "INTELLECTUAL PROPERTY AGREEMENT"


def test_pdf_contract_sections_and_exhibits():
    _, clauses = clauses_of("cuad/05-cobranding/contract.pdf")
    clause = by_id(clauses)
    assert clause["2.1"].heading == "The SpinRecords.com Pages"
    assert clause["7.3"].heading == "Limitation of Liability"
    assert clause["7.3"].text.startswith("7.3 Limitation of Liability. EXCEPT AS SET FORTH")
    assert clause["9.10"].heading == "Controlling Law and Jurisdiction"
    assert clause["1"].heading == "DEFINITIONS"  # 1.1-1.8 are definitions: they stay in 1
    assert "signatures" in clause
    assert clause["signatures"].text.startswith("IN WITNESS WHEREOF")
    assert [i for i in clause if i.startswith("Exhibit")][:3] == ["Exhibit A", "Exhibit B",
                                                                  "Exhibit C"]
    ids = [c.id for c in clauses]
    assert ids.index("signatures") < ids.index("Exhibit A")


def test_articles_with_sections():
    _, clauses = clauses_of("cuad/11-promotion-long/contract.pdf")
    clause = by_id(clauses)
    assert clause["9.5"].heading == "Limitation of Liability"
    assert clause["12.2"].heading == "Governing Law"
    assert clause["1"].heading == "DEFINITIONS"
    assert clause["2.1"].text.startswith("ARTICLE 2\nGRANT OF RIGHTS\n2.1 Grant of Rights to MMT.")


def test_table_of_contents_is_not_exploded():
    doc, clauses = clauses_of("cuad/12-servicing-longest/contract.pdf")
    ids = [c.id for c in clauses]
    assert ids.count("Section 2.1") == 1
    assert ids.index("Section 1.1") < ids.index("Section 2.1") < ids.index("Section 11.2")
    assert not any("TABLE OF CONTENTS" in c.text for c in clauses)
    assert "TABLE OF CONTENTS" in doc.text
    clause = by_id(clauses)
    assert clause["Section 2.1"].text.startswith("ARTICLE II\nTRANSFER AND ACQUISITION")
    assert clause["Section 10.5"].heading == "GOVERNING LAW"
    assert clause["Section 9.7"].heading == "Limitation of Liability"
    assert 60 < len(clauses) < 200


def test_sections_written_with_the_word_section():
    _, clauses = clauses_of("cuad/08-manufacturing/contract.pdf")
    clause = by_id(clauses)
    assert clause["Section 1"].heading == "DEFINITIONS"
    assert clause["11.3"].heading == "Limitation of Liability"
    assert clause["15.11"].heading == "Governing Law"
    assert "Appendix A" in clause


def test_lettered_sections():
    _, clauses = clauses_of("cuad/04-agency/contract.pdf")
    ids = [c.id for c in clauses]
    assert [i for i in ids if len(i) == 1] == list("ABCDEFGHI")
    assert by_id(clauses)["G"].heading == "INDEMNIFICATION"


def test_text_and_pdf_of_one_contract_agree():
    _, from_text = clauses_of("cuad/09-development/contract.txt")
    _, from_pdf = clauses_of("cuad/09-development/contract.pdf")
    text_ids = {c.id for c in from_text}
    pdf_ids = {c.id for c in from_pdf}
    for wanted in ("1", "2.4", "3.13", "5.2", "9.5", "13", "14.8", "signatures"):
        assert wanted in text_ids and wanted in pdf_ids, wanted
    assert by_id(from_pdf)["13"].heading == "LIMITATION OF LIABILITY"


def test_oversized_clause_is_cut_at_its_sub_clauses():
    doc, clauses = clauses_of("cuad/06-cooperation/contract.pdf", max_chars=1500)
    check_well_formed(doc, clauses, max_chars=1500)
    parts = [c.id for c in clauses if c.id.startswith("5(")]
    assert parts and all(c.heading == "Standstill Covenants" for c in clauses if c.id in parts)
    assert all(by_id(clauses)[p].text.startswith("(") for p in parts)


@pytest.mark.parametrize("name, expected", [
    ("common-paper-independent-contractor-agreement.docx",
     {"1.2": "Non-Solicitation", "8.2": "Liability Cap", "9.4": "Governing Law and Chosen Courts"}),
    ("common-paper-business-associate-agreement.docx",
     {"1.7": "Subcontractors", "5.2": "Termination"}),
    ("common-paper-ai-addendum.docx", {"1.3": "Model Training", "2.1": "Ownership"}),
])
def test_docx_templates_numbered_headings(name, expected):
    doc, clauses = clauses_of(f"templates/{name}")
    check_well_formed(doc, clauses, min_coverage=0.99)
    clause = by_id(clauses)
    for cid, heading in expected.items():
        assert clause[cid].heading == heading
    assert "signatures" in clause


def test_docx_heading_paragraphs_without_numbers():
    doc, clauses = clauses_of("templates/common-paper-letter-of-intent.docx")
    check_well_formed(doc, clauses, min_coverage=0.99)
    headings = [c.heading for c in clauses]
    assert headings[0] == "Letter of Intent"
    assert headings[1:6] == ["Product", "Functionality", "Fees", "Launch Date", "Confidentiality"]
    assert clauses[-1].id == "signatures"


def make_doc(text: str) -> Document:
    return Document("t.txt", "text", text, [Span(0, len(text), "t.txt", line=1)])


def test_ids_for_articles_sections_and_capital_headings():
    text = "\n".join([
        "MASTER SERVICES AGREEMENT",
        "This Agreement is made between Alpha Corp. and Beta LLC (the \"Parties\").",
        "ARTICLE IV",
        "PAYMENT",
        "The Customer shall pay every invoice within thirty days of receipt of it.",
        "SECTION 5. TERM",
        "This Agreement runs for one year and renews for further one-year terms.",
        "(a) Either party may give notice of non-renewal ninety days before renewal.",
        "(b) Notice must be in writing and sent to the address above.",
        "GOVERNING LAW",
        "This Agreement is governed by the laws of the State of New York.",
        "IN WITNESS WHEREOF, the Parties have signed this Agreement.",
        "By: ______________",
        "Name: Jane Doe",
        "Title: CEO",
    ])
    clauses = split_clauses(make_doc(text))
    assert [(c.id, c.heading) for c in clauses] == [
        ("preamble", "MASTER SERVICES AGREEMENT"),
        ("IV", "PAYMENT"),
        ("Section 5", "TERM"),
        ("c4", "GOVERNING LAW"),
        ("signatures", "Signatures"),
    ]
    assert "(b) Notice must be in writing" in clauses[2].text


def test_long_unnumbered_text_is_cut_at_paragraphs():
    paragraph = "The supplier shall deliver the goods on time and in good order. " * 8
    text = "\n\n".join(paragraph.strip() for _ in range(20))
    doc = make_doc(text)
    clauses = split_clauses(doc, max_chars=1200)
    check_well_formed(doc, clauses, max_chars=1200, min_coverage=1.0)
    assert all(c.text.startswith("The supplier") for c in clauses)
    assert [c.id for c in clauses][:2] == ["preamble", "preamble-2"]


def test_fragments_join_a_neighbour():
    text = "\n".join([
        "1. Scope. The supplier provides the services described in the order form.",
        "2. Fees.",
        "3. Term. This agreement lasts for twelve months from the effective date.",
        "4. Notices. [***].",
    ])
    clauses = split_clauses(make_doc(text), min_chars=40)
    assert [c.id for c in clauses] == ["1", "3"]
    assert clauses[1].text.startswith("2. Fees.\n3. Term.") and clauses[1].heading == "Term"
    assert clauses[1].text.endswith("4. Notices. [***].")


# Text shaped to make backtracking regular expressions and per-match slicing quadratic: 16K spaces
# took 6.5 s before they were made linear, 200K hours. Each shape is split at n/64, n/8 and n units
# in one run: from one size to the next, linear work grows 8-fold and quadratic work 64-fold. The
# test takes the CPU time of its own thread for each size (the least of three runs: a busy machine
# slows every size alike) and judges the growth, never a time: below 22.6, the geometric middle, a
# factor 3 from either. The smaller pair first, so that a regression as costly as the old one fails
# in seconds; the larger pair catches a quadratic term too small to show at the smaller sizes (a
# copy of the rest of a megabyte line for each match in it).
ADVERSARIAL_SHAPES = {
    "a run of spaces": (lambda n: "1. Definitions" + " " * n + "x 3", 200_000),
    "a run of blank lines": (lambda n: "1. Definitions" + "\n" * n + "x 3", 200_000),
    "no-break spaces and tabs": (lambda n: "1. Definitions" + "\u00a0\t" * n + "x 3", 100_000),
    "a megabyte line of inline numbers": (lambda n: "1. Definitions " + "1.1 A " * n, 170_000),
    "thousands of capital headings": (lambda n: "1. DEFINITIONS\n" + "AAAA BBBB\n" * n, 20_000),
}
LINEAR_GROWTH = 8
QUADRATIC_GROWTH = LINEAR_GROWTH ** 2


def split_cost(text: str) -> float:
    """CPU seconds this thread spends splitting `text` (the least of three runs), its clauses checked.

    The garbage collector is off while it is timed: its passes scan every object the process holds, so
    their cost grows with the heap, not with the splitter's work (on CI it took a linear split of 200K
    blank lines to 25.6x the time of 25K; 8.8x with the collector off).
    """
    import gc
    import time

    doc = make_doc(text)
    spent = []
    for _ in range(3):
        gc.collect()
        gc.disable()
        try:
            started = time.thread_time()
            clauses = split_clauses(doc)
            spent.append(time.thread_time() - started)
        finally:
            gc.enable()
    check_well_formed(doc, clauses, min_coverage=1.0)
    return min(spent)


@pytest.mark.parametrize("name", ADVERSARIAL_SHAPES)
def test_whitespace_runs_and_long_lines_are_split_in_linear_time(name):
    shape, units = ADVERSARIAL_SHAPES[name]
    split_cost(shape(100))  # the regular expressions compiled, the allocator warm
    sizes = [units // LINEAR_GROWTH ** 2, units // LINEAR_GROWTH, units]
    costs = [split_cost(shape(sizes[0]))]
    for smaller, size in zip(sizes, sizes[1:]):
        costs.append(split_cost(shape(size)))
        growth = costs[-1] / costs[-2]
        assert growth < (LINEAR_GROWTH * QUADRATIC_GROWTH) ** 0.5, (
            f"{name}: {size:,} units took {growth:.1f}x the work of {smaller:,} (linear: {LINEAR_GROWTH}x, "
            f"quadratic: {QUADRATIC_GROWTH}x)")
