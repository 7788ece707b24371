"""Candidate values: exact spans of the clause, durations and amounts read as numbers."""

from __future__ import annotations

import pytest

from kvpage_cli.tasks.values import amount, candidates, days, duration_parts, in_unit, party_terms

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


def test_a_party_is_a_name_not_the_end_of_a_sentence_before_one():
    """Common Paper's contractor agreement: "... each as identified on the SOW. Company and
    Contractor desire ..." was a review's Parties key term, "SOW. Company"."""
    text = ("This Independent Contractor Agreement is entered into as of the Effective Date, by and between Company "
            "and Contractor, each as identified on the SOW. Company and Contractor desire to have Contractor perform "
            "the Services. 2.1 Required Production. The Company shall pay. Notices go to 100 Main St., Cherry Hill, "
            "NJ. 08054 and Food For Athletes, Inc. or to U.S. Bancorp Trust.")
    assert spans(text, "party") == ["Food For Athletes, Inc.", "U.S. Bancorp Trust"]  # a role ("Company") names no one


def test_a_notice_period_is_the_duration_its_notice_follows_not_a_cure_period_beside_it():
    """Common Paper's contractor agreement: termination without cause on "thirty (30) days' prior
    written notice" was reported as 15 days, the cure period of the sentence before."""
    text = ("a. Either party may terminate this Agreement immediately if the other party fails to cure a material "
            "breach within 15 days after receiving notice of the breach.\nb. Company may terminate this Agreement "
            "at any time, for any reason or no reason, by giving thirty (30) days' prior written notice.")
    notice = ("notice", "prior", "in advance")
    assert [c.text for c in candidates(text, 0, len(text), "duration", notice, attached="after")] == ["thirty (30) days"]
    assert [c.text for c in candidates(text, 0, len(text), "duration", notice)] == ["15 days", "thirty (30) days"]
    cure_only = text[:text.index("\nb.")]
    assert [c.text for c in candidates(cure_only, 0, len(cure_only), "duration", notice, attached="after")] == ["15 days"]
    renewal = "It renews for two (2) successive terms of five (5) years if you give notice to renew six (6) months before."
    assert [c.text for c in candidates(renewal, 0, len(renewal), "duration", ("renew", "successive"), attached="after")] \
        == ["five (5) years", "six (6) months"]  # a cue before a duration does not narrow the choice "after"
    from kvpage_cli.tasks.playbook import Playbook

    book = Playbook.default()  # the notice periods are attached after; the terms before ("successive 1-year terms")
    assert book.categories["Termination For Convenience"].values["notice"].attached == "after"
    assert book.categories["Notice Period To Terminate Renewal"].values["notice"].attached == "after"
    assert book.categories["Expiration Date"].values["term"].attached == "before"


def test_a_renewal_term_is_the_duration_its_renewal_words_lead_to_not_the_notice_to_stop_it():
    """CUAD: "shall automatically be renewed for subsequent one (1) year periods unless either party
    notifies the other ... at least one hundred twenty (120) days prior to the expiration" gave the
    renewal term as one of three durations (and the SmartRx distributor agreement's review said
    "five (5) year", its initial term)."""
    from kvpage_cli.tasks.playbook import Playbook

    renewal = Playbook.default().categories["Renewal Term"].values["renewal"]
    text = ("Unless otherwise terminated as provided herein, the initial term of this Agreement shall be three (3) "
            "years from the Effective Date and shall thereafter be automatically renewed for subsequent one (1) year "
            "periods unless either party notifies the other in writing of its election not to renew the Agreement at "
            "least one hundred twenty (120) days prior to the expiration of the then-current term.")
    assert [c.text for c in renewal.candidates(text, 0, len(text))] == ["one (1) year"]
    text = "It renews for two (2) successive terms of five (5) years if you give notice to renew six (6) months before."
    assert [c.text for c in renewal.candidates(text, 0, len(text))] == ["five (5) years"]
    text = "This Agreement renews each year unless a party gives sixty (60) days prior written notice."
    assert renewal.candidates(text, 0, len(text)) == []  # a notice period alone is no renewal term: none is said
    text = "The Term will be 3 years from the Effective Date with automatic 2 year term extensions."
    assert [c.text for c in renewal.candidates(text, 0, len(text))] == ["2 year"]


def test_an_initial_term_is_not_the_notice_that_ends_it():
    from kvpage_cli.tasks.playbook import Playbook

    term = Playbook.default().categories["Expiration Date"].values["term"]
    text = ("This Agreement shall continue in effect for an initial term of two (2) years and may be ended by either "
            "party on ninety (90) days prior written notice before the end of the term.")
    assert [c.text for c in term.candidates(text, 0, len(text))] == ["two (2) years"]


def test_the_months_a_cap_counts_fees_over_are_no_duration_of_the_contract():
    text = ("Company's total liability will not be more than the fees paid or payable to Contractor in the twelve "
            "(12) month period preceding the events giving rise to such claim. Invoices are payable within "
            "thirty (30) days.")
    assert spans(text, "duration") == ["thirty (30) days"]
    assert spans(text, "money") == ["the fees paid or payable to Contractor in the twelve (12) month"]  # the cap's own


PREAMBLE = ('This Agreement is made by and between Quillfeather Analytics, Inc., a Delaware corporation with its '
            'principal place of business in Wilmington ("Provider"), and Ostrander Cold Chain Logistics LLC '
            '(hereinafter "Customer"). Provider and Customer are each a "Party" and together the "Parties". '
            'Section 4 (the "Services Warranty") applies.\n\n')
WHO = ("shall defend", "shall indemnify", "agrees to defend", "agrees to indemnify")
WHOM = ("defend", "indemnify", "hold harmless", "hold")


def roles(clause: str) -> tuple[list[str], list[str]]:
    text = PREAMBLE + clause
    start = len(PREAMBLE)
    return ([c.text for c in candidates(text, start, len(text), "party term", WHO, "after")],
            [c.text for c in candidates(text, start, len(text), "party term", WHOM, "before")])


def test_the_terms_a_contract_names_its_parties_by():
    assert party_terms(PREAMBLE) == ("Provider", "Customer")  # not "Party", nor a section's name
    assert party_terms((SAMPLES / "contract.txt").read_text()) == ("Provider", "Customer")


def test_who_indemnifies_whom_is_the_promise_s_own_subject_and_object():
    assert roles("10.1 Indemnification by Provider. Provider shall defend Customer against any claim, and pay "
                 "any damages agreed by Provider in settlement.") == (["Provider"], ["Customer"])
    assert roles("Customer agrees to defend, indemnify and hold harmless Provider and its Affiliates.") == (
        ["Customer"], ["Provider"])
    assert roles("Customer shall indemnify and hold Provider harmless from all losses.") == (["Customer"], ["Provider"])
    # a mutual promise names neither, whatever a later sentence says
    assert roles("Each party shall indemnify and hold harmless the other party. Provider shall defend Customer "
                 "against claims of infringement.") == ([], [])
    # a sentence that promises both ways: its first promise
    assert roles("Provider agrees to indemnify Customer for its acts and Customer agrees to indemnify Provider "
                 "for its own.") == (["Provider"], ["Customer"])
    # a passive promise names no one it is made to: "defended by Provider" is Provider defending
    assert roles("Customer shall be defended by Provider against all claims.") == ([], [])
    # near a cue is not enough: the term must be the cue's subject or object
    assert roles("Losses of Provider's Affiliates shall indemnify no one.") == ([], [])
