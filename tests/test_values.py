"""Candidate values: exact spans of the clause, durations and amounts read as numbers."""

from __future__ import annotations

import pytest

from kvpage_cli.tasks.values import amount, candidates, days, duration_parts, in_unit

from .conftest import SAMPLES


def spans(text: str, kind: str) -> list[str]:
    found = candidates(text, 0, len(text), kind)
    for c in found:
        assert text[c.start:c.end] == c.text  # the document's own words, never rewritten
    return [c.text for c in found]


def test_durations_in_the_ways_contracts_write_them():
    text = ("renews for a successive period of three (3) years unless notice is given at least one hundred "
            "eighty (180) days before the end, or within 30 business days, or for twelve months.")
    assert spans(text, "duration") == ["three (3) years", "one hundred eighty (180) days", "30 business days",
                                       "twelve months"]
    assert days("one hundred eighty (180) days") == 180
    assert duration_parts("three (3) years") == (3, "year")
    assert in_unit("twelve months", "day") == 360 and in_unit("two years", "month") == pytest.approx(24.33, 0.01)
    assert days("a year") == 365 and days("no time") is None


def test_money_dates_places_and_parties():
    text = ('This Agreement is made as of April 1, 2025 by and between Quillfeather Analytics, Inc., a Delaware '
            'corporation, and Ostrander Cold Chain Logistics LLC. Liability shall not exceed $1,500,000 or the '
            'fees paid by Customer in the twelve (12) months before the claim. It is governed by the laws of the '
            'State of New York.')
    assert spans(text, "date") == ["April 1, 2025"]
    assert spans(text, "party") == ["Quillfeather Analytics, Inc.", "Ostrander Cold Chain Logistics LLC"]
    money = spans(text, "money")
    assert money[0] == "$1,500,000" and money[1] == "the fees paid by Customer in the twelve (12) months before the claim"
    assert amount("$1.5 million") == 1_500_000 and amount("$1,500,000") == 1_500_000 and amount("twelve") is None
    assert spans(text, "place") == ["Delaware", "New York"]


def test_the_sample_contracts_governing_law_and_renewal():
    text = (SAMPLES / "contract.txt").read_text()
    start = text.index("4.2 Automatic Renewal")
    end = text.index("5. TERMINATION")
    assert spans(text[start:end], "duration")[:2] == ["three (3) years", "one hundred eighty (180) days"]
