"""End to end: `kvpage review samples/contract.pdf` with the real default model (a few minutes on CPU)."""

from __future__ import annotations

import json

import pytest
from kvpage_cli.ingest import load as load_document
from kvpage_cli.ingest import split_clauses
from kvpage_cli.tasks import RISK_LEVELS, SCHEMA_VERSION
from kvpage_cli.tasks.taxonomy import BY_NAME

from .conftest import SAMPLES

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def test_review_of_the_sample_contract_with_the_default_model(sample_review):
    pdf = SAMPLES / "contract.pdf"
    result = sample_review  # `kvpage review samples/contract.pdf --json` (conftest)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)  # stdout is one JSON document and nothing else
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["model"] == "smollm2" and data["mode"] == "exact" and data["complete"] is True

    doc = load_document(str(pdf))
    clauses = split_clauses(doc)
    assert data["clauses_total"] == len(clauses) == data["clauses_reviewed"]
    ids = [c.id for c in clauses]
    assert 10 < len(data["findings"]) < len(clauses)  # the clauses that matter, not every clause
    risks = [RISK_LEVELS.index(f["risk"]) for f in data["findings"]]
    assert risks == sorted(risks)  # worst first
    for finding in data["findings"]:
        assert finding["clause_id"] in ids
        assert finding["categories"] and all(c in BY_NAME for c in finding["categories"]), finding
        assert finding["risk"] in RISK_LEVELS, finding
        assert doc.text[finding["start"]:finding["end"]] == finding["quote"] and finding["quote"].strip()
        assert finding["source"].startswith("page"), finding
        assert finding["rationale"].strip() and "{" not in finding["rationale"], finding
    by_id = {f["clause_id"]: f for f in data["findings"]}
    # what a lawyer checks first: the planted auto-renewal and the governing law, with their words
    assert "renewal term" in by_id["4.2"]["categories"] and by_id["4.2"]["risk"] == "high"
    assert "governing law" in by_id["17.1"]["categories"]
    assert "termination for convenience" in by_id["5.2"]["categories"]  # Provider's, on thirty days' notice
    assert "termination for convenience" not in by_id.get("5.1", {}).get("categories", [])  # for cause: breach
    assert by_id["11.4"]["rationale"] == "A claim must be brought within one (1) year."  # a time limit for claims
    assert by_id["4.1"]["categories"] == ["term and expiration"]  # the initial term, no renewal
    assert by_id["14.1"]["categories"] == ["exclusivity"]  # the restriction, no exception to it
    # the planted unilateral fee increase: "Provider may increase any of the Fees ... by any amount"
    assert "price increases" in by_id["3.3"]["categories"] and by_id["3.3"]["risk"] in ("high", "medium")
    assert "prices or fees on thirty (30) days notice" in by_id["3.3"]["rationale"]
    # the planted indemnity, by its promise; the procedure clause after it is none
    assert "indemnification" in by_id["10.2"]["categories"]
    promise = " ".join(by_id["10.2"]["quote"].split())
    assert promise.startswith("Customer shall defend, indemnify and hold harmless Provider")
    # who promises to whom, read from the promise itself
    assert by_id["10.1"]["rationale"].startswith("Provider must defend or indemnify Customer against claims")
    assert by_id["10.2"]["rationale"].startswith("Customer must defend or indemnify Provider against claims")
    assert "indemnification" not in by_id.get("10.3", {}).get("categories", [])
    # Provider may assign to anyone, a competitor included, without Customer's consent
    assert by_id["16.2"]["risk"] == "medium"
    assert by_id["16.2"]["rationale"].startswith("A party may assign the contract without the other's consent")
    # samples/README.md: a review flags each planted risk high or medium, and no benign section so
    expected = json.loads((SAMPLES / "expected.json").read_text(encoding="utf-8"))["contract"]
    for risk in expected["planted_risks"]:
        assert any(by_id.get(s, {}).get("risk") in ("high", "medium") for s in risk["sections"]), risk["id"]
    for section in expected["benign_sections"]:
        assert by_id.get(section, {}).get("risk") in (None, "low"), section
    terms = {t["label"]: [v["text"] for v in t["values"]] for t in data["terms"]}
    assert terms["Governing law"] == ["Delaware"]
    assert terms["Payment terms"] == ["thirty (30) days"]  # "payable ... within thirty (30) days after its date"
    cap = next(a for a in by_id["11.2"]["assessments"] if a["cuad"] == "Cap On Liability")
    assert cap["level"] == "high" and cap["reason"].endswith("less than twelve months of fees.")  # three months
    assert terms["Parties"] == ["Quillfeather Analytics, Inc.", "Ostrander Cold Chain Logistics LLC"]
    for term in data["terms"]:
        for v in term["values"]:
            assert doc.text[v["start"]:v["end"]] == v["text"] and v["source"].startswith("page")
    # the document was prefilled once (or loaded from the KV an earlier run saved in this home), with
    # statistics on stderr only
    stats = data["stats"]
    assert stats["prefill_tokens"] + stats["cached_tokens"] >= data["document_tokens"] > 5000
    assert result.stderr.splitlines()[-1].startswith("kvpage: prefill ")
