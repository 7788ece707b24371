"""The clauses a review puts to the model, chosen without a model (tasks/candidates.py): the
sample contract through the shipped clause head and the default playbook."""

from __future__ import annotations

import pytest

from kvpage_cli.ingest import load, split_clauses
from kvpage_cli.tasks.candidates import choose_candidates
from kvpage_cli.tasks.classifier import lexical_head
from kvpage_cli.tasks.playbook import Playbook

from .conftest import REPO


@pytest.fixture(scope="module")
def sample():
    doc = load(str(REPO / "samples" / "contract.txt"))
    clauses = split_clauses(doc)
    chosen = choose_candidates(doc.text, clauses, lexical_head(), Playbook.default())
    by_heading = {clauses[i].heading: items for i, items in chosen.items()}
    return doc, clauses, chosen, by_heading


def categories(items) -> set[str]:
    return {it.play.category for it in items}


def test_the_head_puts_a_clause_to_the_questions_of_its_categories(sample):
    _, _, _, by_heading = sample
    [law] = by_heading["Governing Law and Venue"]
    assert law.play.category == "Governing Law" and law.probability > 0.9 and law.found_at is None
    renewal = by_heading["Automatic Renewal"]
    assert [it.play.category for it in renewal][:2] == ["Renewal Term", "Notice Period To Terminate Renewal"]
    assert renewal[0].probability >= renewal[1].probability  # most probable first


def test_a_clause_that_cannot_say_yes_is_never_put_to_the_model(sample):
    """5.1 grants termination for breach and 5.3 denies termination for convenience: neither is
    asked whether a party may end the agreement without cause; 5.2, which grants it, is."""
    _, _, _, by_heading = sample
    assert "Termination For Convenience" in categories(by_heading["Termination for Convenience by Provider"])
    assert "Termination For Convenience" not in categories(by_heading.get("Termination for Cause", []))
    assert "Termination For Convenience" not in categories(by_heading.get("No Termination for Convenience by Customer", []))


def test_categories_no_head_scores_are_found_by_their_phrases_or_values(sample):
    doc, _, _, by_heading = sample
    for heading in ("Indemnification by Provider", "Indemnification by Customer"):
        [item] = [it for it in by_heading[heading] if it.play.category == "Indemnification"]
        start, end = item.found_at  # the sentence that promises it, quoted later
        assert item.probability is None and doc.text[start:end].startswith(heading.split(" by ")[1] + " shall defend")
    [fees] = by_heading["Fees and Payment Terms"]
    assert fees.play.category == "Payment Terms" and fees.probability is None and fees.found_at is None


def test_a_category_the_playbook_leaves_out_is_never_a_candidate(sample):
    doc, clauses, chosen, _ = sample
    playbook = Playbook.default()
    del playbook.categories["Governing Law"]
    fewer = choose_candidates(doc.text, clauses, lexical_head(), playbook)
    assert "Governing Law" in {it.play.category for items in chosen.values() for it in items}
    assert "Governing Law" not in {it.play.category for items in fewer.values() for it in items}
    assert sum(map(len, fewer.values())) == sum(map(len, chosen.values())) - 1
