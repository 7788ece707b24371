"""The review's playbook: the default parses, a malformed one is a one-line error naming its line,
and rules turn answers and values into a level and a reason."""

from __future__ import annotations

import pytest

from kvpage_cli.tasks.playbook import Playbook, PlaybookError, fill
from kvpage_cli.tasks.taxonomy import ALL_CATEGORIES, EXTRA_CATEGORIES

GOOD = '''format = 1

[terms]
"Renewal" = "Renewal Term.renewal"

[categories."Renewal Term"]
level = "medium"
reason = "It can be renewed."
questions.automatic = "Does it renew automatically?"
values.renewal = { kind = "duration", ask = "For how long does it renew?" }
values.notice = { kind = "duration", ask = "How much notice stops it?" }
rules = [
  { when = ["automatic", "notice >= 90 days", "renewal"], level = "high", reason = "Renews for {renewal}; notice {notice}." },
  { when = ["!automatic"], level = "low", reason = "Renews only if agreed." },
]
'''


def test_the_default_playbook_covers_every_category_and_its_terms():
    book = Playbook.default()
    assert set(book.categories) == set(ALL_CATEGORIES)  # CUAD's and the review's own (payment terms)
    assert book.terms["Governing law"] == ("Governing Law", "law")
    assert book.terms["Payment terms"] == ("Payment Terms", "due")
    cap = book.categories["Cap On Liability"].rules[0].when[0]
    assert (cap.name, cap.op, cap.number, cap.unit) == ("amount", "<", 12, "month")  # under twelve months of fees
    renewal = book.categories["Renewal Term"]
    assert renewal.questions and renewal.values and renewal.rules
    assert not book.categories["Parties"].finding


def test_a_playbook_is_read_with_its_rules():
    book = Playbook.parse(GOOD, "mine.toml")
    play = book.categories["Renewal Term"]
    first = play.rules[0]
    assert [c.name for c in first.when] == ["automatic", "notice", "renewal"]
    assert first.when[1].op == ">=" and first.when[1].number == 90 and first.when[1].unit == "day"
    assert play.rules[1].when[0].negated
    assert fill(first.reason, {"renewal": "three (3) years", "notice": "180 days"}) == \
        "Renews for three (3) years; notice 180 days."


@pytest.mark.parametrize("change, line, words", [
    (('level = "medium"', 'level = "severe"'), 7, "level 'severe'"),
    (('"Renewal Term"]', '"Renewal Terms"]'), 6, "unknown category"),
    (('"notice >= 90 days"', '"notice >= ninety"'), 13, "condition"),
    (('"!automatic"', '"!automatc"'), 14, "names no question or value"),
    (('Renews for {renewal}', 'Renews for {term}'), 13, "{term}"),
    (('"Renewal Term.renewal"', '"Renewal Term.length"'), 4, "no value"),
    (('kind = "duration", ask = "For', 'kind = "length", ask = "For'), 10, "kind"),
    (('questions.automatic', 'question.automatic'), 9, "unknown key 'question'"),
    (('"notice >= 90 days"', '"automatic >= 90 days"'), 13, "compares"),
    (('ask = "How much notice stops it?"', 'ask = "How much?", attached = "beside"'), 11, "attached"),
    (('ask = "How much notice stops it?"', 'ask = "How much?", not_followed_by = "notice"'), 11,
     "not_followed_by of value 'notice'"),
    (('rules = [', 'found_by = "renews"\nrules = ['), 12, "found_by of 'Renewal Term' must be a list"),
])
def test_a_malformed_playbook_names_the_line(change, line, words):
    text = GOOD.replace(*change)
    assert text != GOOD  # the change applies (GOOD itself parses: test_a_playbook_is_read_with_its_rules)
    with pytest.raises(PlaybookError) as info:
        Playbook.parse(text, "mine.toml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("playbook mine.toml (line ")
    assert f"(line {line})" in message and words in message


def test_bad_toml_names_the_line_too(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text(GOOD.replace('level = "medium"', 'level = medium'))
    with pytest.raises(PlaybookError, match=r"broken.toml is not valid TOML: .*line 7"):
        Playbook.load(path)
    with pytest.raises(PlaybookError, match="not found"):
        Playbook.load(tmp_path / "missing.toml")


def test_an_extra_category_is_found_by_its_values_so_it_needs_one():
    text = GOOD + '\n[categories."Payment Terms"]\nfinding = false\nlevel = "none"\nquestions.due = "Due?"\n'
    with pytest.raises(PlaybookError, match=r"line 17\).*'Payment Terms' is found by its values"):
        Playbook.parse(text, "mine.toml")


def test_a_question_may_need_words_in_the_clause_before_a_yes_counts():
    text = GOOD.replace('questions.automatic = "Does it renew automatically?"',
                        'questions.automatic = { ask = "Does it renew automatically?", needs = ["renew", "extend"] }')
    play = Playbook.parse(text, "mine.toml").categories["Renewal Term"]
    assert play.questions == {"automatic": "Does it renew automatically?"}  # asked as before
    assert play.may_say_yes("automatic", "The term is EXTENDED by one year unless either party objects.")
    assert play.may_say_yes("automatic", "It renews each year.")
    assert not play.may_say_yes("automatic", "The initial term is five years.")
    assert not play.may_say_yes("automatic", "Prerenewal fees apply.")  # a word starts with it, not contains it
    assert Playbook.parse(GOOD, "mine.toml").categories["Renewal Term"].may_say_yes("automatic", "Five years.")
    control = Playbook.default().categories["Change Of Control"]
    assert not control.may_say_yes("terminate", "Within fifteen (15) Business Days after the merger, such Person "
                                                "will execute an agreement to assume the Servicer's obligations.")
    with pytest.raises(PlaybookError, match=r"\(line 9\).*question 'automatic'.*needs"):
        Playbook.parse(text.replace('needs = ["renew", "extend"]', 'needs = "renew"'), "mine.toml")


def test_a_question_is_barred_where_every_sentence_that_could_answer_it_holds_an_unless_word():
    """The README contract's 5.1, Termination for Cause: the head filed it under termination for
    convenience and SmolLM2 said yes to "Can a party end this agreement without cause?", so the
    review read "A party may terminate without cause on only thirty (30) days notice". Over the
    CUAD training split, the words of breach and cause took no clause of the category its yes
    (161 of 161 kept it) while 254 of the 2,790 other clauses that could say yes no longer could;
    with a stated event too, read in a clause's text without its heading (candidates.admits), 158
    of 161 and 478 of 2,790."""
    play = Playbook.default().categories["Termination For Convenience"]
    assert not play.may_say_yes("without_cause", "5.1 Termination for Cause. Either Party may terminate this Agreement "
                                "by written notice if the other Party (a) materially breaches this Agreement; or (b) "
                                "becomes the subject of a bankruptcy proceeding.")
    assert play.may_say_yes("without_cause", "Provider may terminate this Agreement at any time, for any reason or "
                            "no reason, on thirty (30) days' written notice to Customer.")
    assert play.may_say_yes("without_cause", "Either party may terminate upon a material breach. Either party may "
                            "also terminate this Agreement upon ninety (90) days written notice.")  # the second
    assert play.may_say_yes("without_cause", "Either party may terminate for convenience or for cause.")  # a phrase
    assert not play.may_say_yes("without_cause", "NCM may terminate this Agreement upon thirty (30) days written notice "
                                "to Network Affiliate in the event that distribution of the Service is prohibited.")
    text = GOOD.replace('questions.automatic = "Does it renew automatically?"',
                        'questions.automatic = { ask = "Does it renew automatically?", unless = "breach" }')
    with pytest.raises(PlaybookError, match=r"\(line 9\).*question 'automatic'.*unless = \[words\]"):
        Playbook.parse(text, "mine.toml")


def test_a_value_may_be_the_duration_its_cue_leads_to_and_never_one_a_notice_follows():
    text = GOOD.replace('ask = "For how long does it renew?"', 'ask = "For how long?", near = ["renew"], '
                        'attached = "before", not_followed_by = ["notice"]')
    text = text.replace('ask = "How much notice stops it?"', 'ask = "How much?", near = ["notice"], attached = true')
    play = Playbook.parse(text, "mine.toml").categories["Renewal Term"]
    assert play.values["notice"].attached == "after"  # true is "after", as before "before" was a choice
    clause = "It renews for successive periods of two (2) years, and a party may stop that on 60 days notice."
    assert [c.text for c in play.values["renewal"].candidates(clause, 0, len(clause))] == ["two (2) years"]
    assert [c.text for c in play.values["notice"].candidates(clause, 0, len(clause))] == ["60 days"]


def test_a_category_may_require_words_of_its_clauses():
    renewal = Playbook.default().categories["Renewal Term"]
    assert not renewal.admits("This Agreement begins on the Effective Date and continues for an initial term of three "
                              "(3) years, unless terminated earlier under Section 5.")
    assert renewal.admits("This Agreement shall automatically RENEW for a successive period of three (3) years.")
    assert renewal.admits("either party may give notice of termination no later than ninety (90) days prior to the "
                          "expiration of the Term")
    assert Playbook.default().categories["Audit Rights"].admits("Anything at all.")  # requires nothing
    with pytest.raises(PlaybookError, match=r"requires of 'Renewal Term' must be a list of words"):
        Playbook.parse(GOOD.replace("rules = [", 'requires = "renew"\nrules = ['), "mine.toml")


def test_a_required_word_right_after_non_does_not_count():
    """A non-exclusive licence is no exclusivity (the head filed four such clauses of the first 34
    development contracts there); "non-renewal" counts for renewal because the playbook lists it."""
    categories = Playbook.default().categories
    exclusivity = categories["Exclusivity"]
    for text in ("OntoChem hereby grants to Anixa a non-exclusive, fully paid-up, royalty-free licence.",
                 "Licensor grants to Licensee a non- exclusive, worldwide licence.",
                 "a limited, revocable, non exclusive licence"):
        assert not exclusivity.admits(text), text
    assert exclusivity.admits("Distributor shall be the exclusive distributor of the Products in the Territory.")
    assert exclusivity.admits("Company appoints Distributor as its exclusive distributor, and grants it a "
                              "non-exclusive licence to the Marks.")
    assert exclusivity.admits("The Distributor shall purchase Products only from the Company.")
    assert categories["Renewal Term"].admits("Either party may give notice of non-renewal sixty (60) days before.")
    law = categories["Governing Law"]
    assert not law.admits("Company represents and warrants that it is a corporation organized and in good standing "
                          "under the laws of the State of Florida.")
    assert not law.admits("The Parties irrevocably consent to the exclusive jurisdiction of the courts of Harris County.")
    assert law.admits("This Agreement shall be governed by the laws of the State of Delaware.")
    uncapped = categories["Uncapped Liability"]
    assert not uncapped.admits("NEITHER PARTY SHALL BE LIABLE FOR ANY SPECIAL, INCIDENTAL OR CONSEQUENTIAL DAMAGES.")
    assert uncapped.admits("EXCEPT FOR BREACH OF SECTION 9, NEITHER PARTY SHALL BE LIABLE FOR CONSEQUENTIAL DAMAGES.")


def test_a_promise_not_to_solicit_is_no_non_compete_unless_it_speaks_of_competing():
    """The head files non-solicitation clauses under non-compete too (the README's contract: 13.1 read
    "A party may not compete, for two (2) years"); such a clause needs a word of competing."""
    noncompete = Playbook.default().categories["Non-Compete"]
    assert not noncompete.admits("SOLICITATION. MKOS agrees that for a twenty four months (24) following the execution "
                                 "of this Agreement, MKOS shall not, without UTEK's prior written consent, directly or "
                                 "indirectly solicit for employment any present employee of UTEK.")
    assert noncompete.admits("Non-Competition. During the Term, Customer shall not engage in any business that "
                             "competes with Provider, nor solicit Provider's customers.")
    assert noncompete.admits("Non-Competition 20.1 The Contractor and the Customer will not be allowed to employ "
                             "employees of the other party.")  # no solicitation: the head's word stands
    assert noncompete.admits("Customer shall not develop any software that performs functions similar to the Platform.")
    assert Playbook.default().categories["Exclusivity"].requires_with == {}
    for bad in ('requires_with = ["solicit"]', 'requires_with = { solicit = [] }', 'requires_with = { solicit = "x" }'):
        with pytest.raises(PlaybookError, match=r"requires_with of 'Renewal Term' must be a table of word = \[words\]"):
            Playbook.parse(GOOD.replace("rules = [", bad + "\nrules = ["), "mine.toml")


def test_an_exclusive_supply_clause_is_no_exception_to_a_restriction_unless_it_allows_something():
    """The head files the README contract's 14.1 Exclusive Provider (the restriction) as a
    competitive restriction exception too; an exception says what a party may still do."""
    exception = Playbook.default().categories["Competitive Restriction Exception"]
    assert not exception.admits(
        "14.1 Exclusive Provider. During the Term, Customer shall obtain, and shall cause each of its Affiliates to "
        "obtain, all data analytics services exclusively from Provider, and shall not purchase, trial or use any such "
        "services from any other person.")
    assert exception.admits("14.3 Nothing in this Agreement restricts Provider from providing services to any "
                            "competitor of Customer.")
    assert exception.admits("Exclusivity. Licensor shall not grant any third party a license in the Territory, except "
                            "for its existing distributors listed in Exhibit B.")


def test_a_fee_schedule_shares_no_revenue_unless_it_says_what_is_shared():
    """The head filed the README contract's statement of work (fees, service credits of a percentage
    of them, a minimum commitment) as revenue or profit sharing too."""
    sharing = Playbook.default().categories["Revenue/Profit Sharing"]
    assert not sharing.admits(
        "A.3 Service Credits. If Platform availability in a calendar month is below the target, Customer will receive "
        "a credit of five percent (5%) of that month's subscription Fees for each full one percent (1%) below the "
        "target. A.4 Minimum Annual Commitment. Customer commits to pay Fees of at least $250,000 each contract year.")
    assert sharing.admits("Distributor shall pay Company a royalty of eight percent (8%) of Net Sales of the Products.")
    assert sharing.admits("The parties shall share equally in the profits of the joint venture.")


def test_a_right_to_raise_prices_is_asked_only_of_a_sentence_that_speaks_of_raising_prices():
    """The README contract's planted 3.3 ("Provider may increase any of the Fees ... at any time and
    by any amount") had no category: CUAD's price restrictions are limits on changing prices. The
    review's own category takes a yes only from a sentence with a word of increase, a word of price
    or fee, and no limit or agreement on it (a franchise's "We may periodically increase the amounts
    of coverage required" in a clause that speaks of fees elsewhere was answered yes without
    `needs_with`)."""
    play = Playbook.default().categories["Price Increases"]
    assert "Price Increases" in EXTRA_CATEGORIES and play.by_sentence == ("may_raise",)
    fees = ("3.3 Fee Adjustments. Provider may increase any of the Fees, including subscription Fees and the hourly "
            "rates in Exhibit A, at any time and by any amount on at least thirty (30) days' notice.")
    assert play.may_say_yes("may_raise", fees)
    assert [c.text for c in play.values["notice"].candidates(fees, 0, len(fees))] == ["thirty (30) days"]
    insurance = ("Franchisee shall pay all premiums and fees of its insurers. We may periodically increase the amounts "
                 "of coverage required under such insurance policies on thirty (30) days' notice.")
    assert not play.may_say_yes("may_raise", insurance)
    capped = "Supplier may increase its prices once a year by no more than the change in the Consumer Price Index."
    assert not play.may_say_yes("may_raise", capped)
    text = GOOD.replace('questions.automatic = "Does it renew automatically?"',
                        'questions.automatic = { ask = "Does it renew automatically?", needs_with = "renew" }')
    with pytest.raises(PlaybookError, match=r"\(line 9\).*question 'automatic'.*needs_with = \[words\]"):
        Playbook.parse(text, "mine.toml")


def test_an_indemnity_is_found_by_the_promise_to_defend_or_indemnify():
    """CUAD has no category for indemnities; the README contract's planted "Customer shall defend,
    indemnify and hold harmless Provider ... from and against any and all claims" (10.2) was a
    finding only through the carve-out from the cap that names it (11.1). The review's own
    category is found by the promise itself, not by a clause that only speaks of indemnities."""
    play = Playbook.default().categories["Indemnification"]
    assert "Indemnification" in EXTRA_CATEGORIES and play.found_by
    # who promises to whom is read from the clauses the phrases find (no clause is found by them)
    assert set(play.values) == {"indemnitor", "indemnitee"} and all(v.kind == "party term" for v in play.values.values())
    promise = ("Customer shall defend, indemnify and hold harmless Provider, its Affiliates, and their officers "
               "from and against any and all claims, losses and damages.")
    assert play.found_in(promise) and play.may_say_yes("indemnifies", promise)
    assert play.found_in("Both parties agree to indemnify each other in respect of any unauthorised disclosure.")
    procedure = ("10.3 Indemnification Procedure. The indemnified Party shall give prompt written notice of a "
                 "claim, and the indemnifying Party controls the defense.")
    assert not play.found_in(procedure)
    found = GOOD + ('\n[categories."Indemnification"]\nlevel = "medium"\nfound_by = ["shall indemnify"]\n'
                    'questions.indemnifies = "Must a party indemnify the other?"\n')
    assert Playbook.parse(found, "mine.toml").categories["Indemnification"].found_by == ("shall indemnify",)
    loose = found + 'values.who = { kind = "party term", ask = "Who must indemnify?", near = ["shall indemnify"] }\n'
    with pytest.raises(PlaybookError, match="party term: it needs near"):  # every use of a term would be the value
        Playbook.parse(loose, "mine.toml")


def test_a_time_limit_for_claims_is_a_cap_on_liability_with_its_period():
    """CUAD's cap on liability includes a time limit to bring claims (21 of the 576 training
    spans); the README contract's 11.4 was "Liability is capped: check the amount". Its period is
    a duration the words of bringing a claim stand near; a cap's months of fees are not one
    (over the training spans: a candidate in 16 of those 21, in 8 of the 555 others, most of
    them time limits too)."""
    play = Playbook.default().categories["Cap On Liability"]
    limit = "Customer may not bring any claim against Provider more than one (1) year after the cause of action accrues"
    assert [c.text for c in play.values["claim_period"].candidates(limit, 0, len(limit))] == ["one (1) year"]
    cap = ("PROVIDER'S TOTAL LIABILITY SHALL NOT EXCEED THE FEES PAID BY CUSTOMER DURING THE TWELVE (12) MONTHS BEFORE "
           "THE EVENT GIVING RISE TO THE CLAIM.")
    assert play.values["claim_period"].candidates(cap, 0, len(cap)) == []
    assert [r.reason for r in play.rules][-1] == "A claim must be brought within {claim_period}."


def test_a_category_may_be_found_by_phrases_as_words():
    play = Playbook.parse(GOOD.replace("rules = [", 'found_by = ["renew  automatically", "evergreen"]\nrules = ['),
                          "mine.toml").categories["Renewal Term"]
    assert play.found_in("It shall RENEW\nautomatically each year.") and play.found_in("an evergreen term")
    assert not play.found_in("It renews automatically.") and not play.found_in("evergreens")
    bare = 'format = 1\n\n[categories."Renewal Term"]\nlevel = "low"\nreason = "Renews."\nfound_by = ["renews"]\n'
    with pytest.raises(PlaybookError, match=r"line 6\).*found by phrases, which its questions must confirm"):
        Playbook.parse(bare, "mine.toml")


def test_a_party_free_to_assign_without_consent_is_an_optional_question_of_anti_assignment():
    """The README contract's 16.2 ("Provider may assign this Agreement ... to any Affiliate or third
    party, including a competitor of Customer ... without Customer's consent") was low with the
    generic reason. A yes counts only from a sentence in which a party may assign and "without",
    and no prohibition; the question is optional: a clause with no such sentence is still an
    anti-assignment clause (the category's own questions with sentence words decide that)."""
    play = Playbook.default().categories["Anti-Assignment"]
    assert play.optional == ("assigns_freely",) and "assigns_freely" not in play.by_sentence
    free = ("Provider may assign this Agreement, in whole or in part, to any Affiliate or third party, without "
            "Customer's consent, and shall notify Customer within thirty (30) days after the assignment.")
    assert play.may_say_yes("assigns_freely", free)  # "shall notify" is no "shall not"
    for barred in ("Customer may not assign this Agreement without Provider's prior written consent.",
                   "Neither party may assign this Agreement without the consent of the other party.",
                   "A Party may assign its rights to a Subsidiary only if the other Party agrees, without delay."):
        assert not play.may_say_yes("assigns_freely", barred), barred
    mine = GOOD + ('\n[categories."Anti-Assignment"]\nlevel = "low"\nreason = "Assignment."\n'
                   'questions.free = { ask = "May a party assign freely?", needs = ["may assign"], '
                   'needs_with = ["without"], optional = true }\n')
    parsed = Playbook.parse(mine, "mine.toml").categories["Anti-Assignment"]
    assert parsed.optional == ("free",) and parsed.by_sentence == ()
    with pytest.raises(PlaybookError, match="optional = true"):
        Playbook.parse(mine.replace("optional = true", 'optional = "yes"'), "mine.toml")
