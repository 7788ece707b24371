"""The shipped clause head: the runtime's probabilities are the trainer's, and it reads CUAD's
categories off clauses a lawyer would file under them."""

from __future__ import annotations

import numpy as np

from kvpage_cli.tasks.classifier import lexical_head, terms
from kvpage_cli.tasks.taxonomy import CATEGORIES


def test_the_runtime_gives_the_trainers_probabilities():
    head = lexical_head()
    check = head.meta["check_texts"]
    assert len(check) >= 4
    ours = head.probabilities(check)
    assert np.allclose(ours, np.array(head.meta["check_probabilities"]), atol=1e-4)


def test_the_head_is_small_versioned_and_says_how_it_was_trained():
    head = lexical_head()
    assert head.categories == tuple(CATEGORIES)
    assert head.meta["format"] == 1 and head.meta["seed"] == 13
    assert head.meta["command"].startswith("python bench/train_clauses.py")
    assert len(head.meta["dev_contracts"]) >= 40 and head.meta["train_contracts"] >= 400
    assert len(head.vocabulary) == head.coef.shape[1] == head.idf.shape[0]


def test_terms_are_words_and_pairs_with_numbers_folded():
    assert terms("Net 30 days") == ["net", "#", "days", "net #", "# days"]
    assert terms("Party\u2019s consent") == ["party's", "consent", "party's consent"]


def test_clauses_get_their_categories_independently():
    head = lexical_head()
    texts = [
        "This Agreement shall be governed by and construed in accordance with the laws of the State of New York.",
        "Neither party may assign this Agreement without the prior written consent of the other party, except "
        "that either party may assign it without consent in connection with a merger or a change of control.",
        "All notices shall be in writing and delivered by hand or by certified mail to the addresses above.",
    ]
    present = head.present(head.probabilities(texts))
    names = [{head.categories[j] for j in np.nonzero(row)[0]} for row in present]
    assert "Governing Law" in names[0]
    assert "Anti-Assignment" in names[1]  # multi-label: it may be change of control as well
    assert not names[2] & {"Governing Law", "Anti-Assignment", "Cap On Liability"}
