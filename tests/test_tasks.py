"""The tasks' own pieces: prompt templates, prompt assembly, quotes, and review/ask on a tiny model."""

from __future__ import annotations

import pytest

from kvpage_cli.cli.render import review_text
from kvpage_cli.engine import Engine, EngineConfig
from kvpage_cli.errors import ContextTooLongError
from kvpage_cli.ingest import load, split_clauses
from kvpage_cli.tasks import RISK_LEVELS, Asker, PromptError, Reviewer, render
from kvpage_cli.tasks.schema import ReviewResult
from kvpage_cli.tasks.taxonomy import BY_NAME
from kvpage_cli.tasks.chat import PromptBuilder
from kvpage_cli.tasks.values import sentences as _sentences

from .conftest import SAMPLES


def test_every_shipped_template_renders_with_its_placeholders():
    assert "Question: why?" in render("ask", question="why?")
    text = render("review_clause", clause_id="4.2", heading="Renewal", clause="It renews.")
    assert "4.2" in text and "Renewal" in text and "It renews." in text
    assert "$1,000,000" in render("review_instructions", categories="- other")  # $$ is a literal dollar
    assert render("review_question", question="Is it capped?") == "Question: Is it capped? Answer yes or no."


def test_a_missing_or_unknown_placeholder_is_an_error():
    with pytest.raises(PromptError, match=r"\$question"):
        render("ask")
    with pytest.raises(PromptError, match="no placeholder"):
        render("ask", question="q", extra="x")
    with pytest.raises(PromptError, match="missing"):
        render("no_such_template")


def test_sentences_do_not_end_inside_clause_numbers():
    text = "10.2 Indemnification by Customer. Customer shall indemnify Provider; see Section 11.1. Done: yes"
    sentences = [text[s:e] for s, e in _sentences(text, 0, len(text))]
    assert sentences == ["10.2 Indemnification by Customer.", "Customer shall indemnify Provider;",
                         "see Section 11.1. Done:", "yes"]


def test_sentences_do_not_end_at_abbreviations():
    text = "Statement of Work No. 1 is made with Quillfeather Analytics, Inc. and others. It binds e.g. both."
    sentences = [text[s:e] for s, e in _sentences(text, 0, len(text))]
    assert sentences == ["Statement of Work No. 1 is made with Quillfeather Analytics, Inc. and others.",
                         "It binds e.g. both."]


@pytest.fixture(scope="module")
def tiny_engine(tiny_cli_model, kv_home):
    return Engine.load(str(tiny_cli_model), EngineConfig(home=str(kv_home)))


def test_the_document_prefix_is_shared_and_questions_follow_it(tiny_engine):
    prompts = PromptBuilder(tiny_engine.tokenizer)
    prefix = prompts.prefix("DOCUMENT TEXT")
    question = prompts.question("What?")
    whole = tiny_engine.tokenizer.decode(prefix + question)
    assert whole.index("DOCUMENT TEXT") < whole.index("What?")
    assert whole.rstrip().endswith("assistant")  # the chat template's answer turn opens last


@pytest.fixture(scope="module")
def sample_review(tiny_engine):
    doc = load(str(SAMPLES / "contract.txt"))
    reviewer = Reviewer(tiny_engine, doc, max_batch=8)
    return doc, reviewer, reviewer.findings()


def check_values(doc, values):
    for v in values:
        assert doc.text[v.start:v.end] == v.text and v.source.startswith("line")


def test_review_findings_are_categorised_clauses_with_exact_quotes_worst_first(sample_review):
    doc, reviewer, findings = sample_review
    assert 0 < len(findings) < len(reviewer.clauses)  # a clause of no category is not a finding
    assert [RISK_LEVELS.index(f.risk) for f in findings] == sorted(RISK_LEVELS.index(f.risk) for f in findings)
    ids = [c.id for c in reviewer.clauses]
    for f in findings:
        assert f.categories and all(name in BY_NAME for name in f.categories) and f.category == f.categories[0]
        assert f.risk == f.assessments[0].level and f.rationale == f.assessments[0].reason
        assert doc.text[f.start:f.end] == f.quote and len(f.quote.split()) >= 3 and f.source.startswith("line")
        assert f.clause_id in ids and f.commentary is None
        for a in f.assessments:
            assert "{" not in a.reason  # every place in a reason was filled
            for values in a.values.values():
                check_values(doc, values)
    by_id = {f.clause_id: f for f in findings}
    assert "governing law" in by_id["17.1"].categories  # the head, trained on CUAD, finds the obvious ones
    assert "renewal term" in by_id["4.2"].categories


def test_key_terms_are_exact_words_of_the_contract(sample_review):
    doc, reviewer, _ = sample_review
    labels = [t.label for t in reviewer.terms]
    assert "Governing law" in labels and "Parties" in labels
    for term in reviewer.terms:
        assert term.values
        check_values(doc, term.values)
    law = next(t for t in reviewer.terms if t.label == "Governing law")
    assert law.values[0].text in ("Delaware", "New Castle County")  # the clause's places; the model picks


def test_batched_review_equals_one_at_a_time(tiny_engine, sample_review):
    doc, _, batched = sample_review
    alone = Reviewer(tiny_engine, doc, max_batch=1)
    assert [f.to_dict() for f in alone.findings()] == [f.to_dict() for f in batched]


def test_a_contract_longer_than_the_context_is_reviewed_in_retrieval_mode(tiny_cli_model, kv_home):
    engine = Engine.load(str(tiny_cli_model), EngineConfig(home=str(kv_home), max_context=2048))
    doc = load(str(SAMPLES / "contract.txt"))
    reviewer = Reviewer(engine, doc)
    assert reviewer.mode == "retrieval"
    findings = reviewer.findings()
    assert findings and reviewer.total_blocks > 2048 // 64
    assert 0 < reviewer.attended_blocks < 2048 // 64
    for f in findings:
        assert doc.text[f.start:f.end] == f.quote
    result = ReviewResult("contract.txt", "text", "tiny", reviewer.mode, findings, True, reviewer.document_tokens,
                          len(reviewer.clauses), attended_blocks=reviewer.attended_blocks,
                          total_blocks=reviewer.total_blocks)
    share = round(100 * reviewer.attended_blocks / reviewer.total_blocks)
    assert (f"retrieval mode: each clause read at most {reviewer.attended_blocks} of {reviewer.total_blocks} blocks, "
            f"{share}% of the document") in review_text(result).splitlines()[0]
    with pytest.raises(ContextTooLongError, match="--mode auto or retrieval"):
        Reviewer(Engine.load(str(tiny_cli_model), EngineConfig(home=str(kv_home), max_context=2048, mode="exact")), doc)


def test_the_clause_bar_shows_the_reading_pace_while_the_questions_run(tiny_engine):
    """The clause questions and values report their progress, and the review's clause bar shows
    the tokens read per second before the first clauses are done."""
    import io

    from rich.console import Console

    from kvpage_cli.cli.progress import Reporter
    from kvpage_cli.engine.events import PrefillProgress
    from kvpage_cli.tasks.events import ReviewProgress

    doc = load(str(SAMPLES / "contract.txt"))
    events = []
    tiny_engine.reset_stats()
    reporter = Reporter(Console(file=io.StringIO(), force_terminal=True, width=120), bars=True)
    with reporter:
        def both(event):
            events.append(event)
            reporter(event)
        reviewer = Reviewer(tiny_engine, doc, clauses=split_clauses(doc)[:30], on_event=both)
        rates = []
        for _ in reviewer.review():
            rates.append(reporter._progress.tasks[reporter._tasks["clauses"]].fields["rate"])
    started = next(i for i, e in enumerate(events) if isinstance(e, ReviewProgress))
    first_done = next(i for i, e in enumerate(events) if isinstance(e, ReviewProgress) and e.done)
    assert any(isinstance(e, PrefillProgress) for e in events[started:first_done])
    # the tokens the review computed were reported (the question and value batches are most of
    # them): each batch's last event has done == total
    reported = sum(e.total - e.cached for e in events if isinstance(e, PrefillProgress) and e.done == e.total)
    computed = tiny_engine.stats().prefill_tokens
    assert abs(reported - computed) <= 0.02 * computed
    assert rates and all(r.endswith("tok/s read") for r in rates)


def test_without_bars_verbose_writes_a_long_stages_progress_every_half_minute():
    """A job's log (stderr not a terminal) with -v: an indexing of 20 minutes says how far it is,
    a line each PROGRESS_LINE_S seconds of it and one at its end; a short stage writes none."""
    import io

    from rich.console import Console

    from kvpage_cli.cli.progress import Reporter
    from kvpage_cli.engine.events import IndexProgress, PrefillProgress

    def lines(verbose: bool, events) -> list[str]:
        out = io.StringIO()
        with Reporter(Console(file=out, width=200), bars=False, verbose=verbose) as reporter:
            for event in events:
                reporter(event)
        return out.getvalue().splitlines()

    indexing = [IndexProgress(done, 449_926, seconds) for done, seconds in
                [(2048, 6.0), (12_288, 29.9), (14_336, 33.6), (20_480, 50.0), (24_576, 64.1), (449_926, 1236.0)]]
    assert lines(True, indexing) == ["kvpage: indexing 14,336/449,926 tok, 427 tok/s, 33.6 s",
                                     "kvpage: indexing 24,576/449,926 tok, 383 tok/s, 1 min 04 s",
                                     "kvpage: indexing 449,926/449,926 tok, 364 tok/s, 20 min 36 s"]
    assert lines(False, indexing) == []  # without -v, nothing but warnings and the statistics line
    assert lines(True, [PrefillProgress(512, 1024, 1.0), PrefillProgress(1024, 1024, 2.1)]) == []


def test_all_lists_the_clauses_of_no_category_too(tiny_engine):
    doc = load(str(SAMPLES / "contract.txt"))
    reviewer = Reviewer(tiny_engine, doc, clauses=split_clauses(doc)[:12], include_all=True)
    findings = reviewer.findings()
    assert sorted(f.clause_id for f in findings) == sorted(c.id for c in reviewer.clauses)
    assert any(f.risk == "none" and not f.categories for f in findings)


def test_a_commentary_is_kept_only_when_it_passes_the_checks():
    from kvpage_cli.tasks.review import _passes
    from kvpage_cli.tasks.schema import Assessment, Finding

    clause = "Either Party may terminate this Agreement on thirty days notice without cause."
    finding = Finding("5.2", "Termination", "termination for convenience", "medium", "", clause, "line 3", 0, 10,
                      assessments=[Assessment("termination for convenience", "Termination For Convenience", 0.9,
                                              "medium", "")])
    assert _passes("Either party can terminate without cause on thirty days notice.", clause, finding)
    assert not _passes("The above is a risk of the above the above is a risk of the above.", clause, finding)
    assert not _passes("The weather is nice today in the city.", clause, finding)  # no word of the clause
    assert not _passes("Yes.", clause, finding)


def test_quotes_come_from_the_clause_body_not_its_heading(tiny_engine):
    doc = load(str(SAMPLES / "contract.txt"))
    reviewer = Reviewer(tiny_engine, doc)
    starts = {c.id: reviewer._quote(c, None, [])[0] for c in reviewer.clauses}
    assert doc.text[starts["10.1"]:].startswith("Provider shall defend Customer")  # not "10. INDEMNIFICATION 10.1 ..."
    assert doc.text[starts["5.2"]:].startswith("Provider may terminate this Agreement")
    for c in reviewer.clauses:
        if c.id[0].isdigit():
            assert starts[c.id] >= doc.text.index(c.heading, c.start) + len(c.heading)


def test_ask_streams_text_and_refuses_an_empty_question(tiny_engine, monkeypatch):
    doc = load(str(SAMPLES / "repo"))
    asker = Asker(tiny_engine, doc, "Where is the VAT rate?", max_new_tokens=8)
    decoded = []  # the tokens the engine has given so far
    real_run = tiny_engine.run

    def run(*args, **kwargs):
        for request, token in real_run(*args, **kwargs):
            decoded.append(token)
            yield request, token

    monkeypatch.setattr(tiny_engine, "run", run)
    pieces = [(piece, len(decoded)) for piece in asker.answer()]
    assert all(asker.complete) and asker.document_tokens > 1000
    assert len(pieces) >= 2 and all(piece for piece, _ in pieces)  # text, in several pieces
    assert pieces[0][1] < len(decoded)  # the first piece came before the last token was decoded
    with pytest.raises(ValueError, match="empty"):
        Asker(tiny_engine, doc, "  ")


def test_a_document_reads_the_same_whatever_path_names_it(tiny_engine, monkeypatch):
    """`kvpage ask jinja2-3.1.4 Q` and `kvpage ask /abs/path/jinja2-3.1.4 Q` gave two answers (the
    prompt named the path as typed) and indexed the sources twice."""
    relative = "samples/contract.txt"
    monkeypatch.chdir(SAMPLES.parent)
    absolute = str(SAMPLES / "contract.txt")
    prompts = [Asker(tiny_engine, load(path), "Who pays?").prefix_ids for path in (relative, absolute)]
    assert prompts[0] == prompts[1]
    assert Reviewer(tiny_engine, load(relative)).prefix_ids == Reviewer(tiny_engine, load(absolute)).prefix_ids
    assert "contract.txt" in tiny_engine.tokenizer.decode(prompts[0])
    monkeypatch.chdir(SAMPLES)
    assert load(".").name == "samples" and load("-", stdin=b"some text").name == "standard input"


def test_an_answer_that_loops_is_cut_after_its_first_copy():
    from kvpage_cli.tasks.ask import LOOP_TOKENS, loop_start

    line = list(range(100, 140))  # a 40-token line said twice: a loop
    assert loop_start([1, 2, 3] + line + line) == 3 + 40
    word = [7]  # one token over and over
    assert loop_start([1, 2] + word * LOOP_TOKENS) == 3
    assert loop_start([1, 2] + word * (LOOP_TOKENS - 1)) is None  # not yet long enough to call it a loop
    pair = [5, 6]
    assert loop_start([9] + pair * (LOOP_TOKENS // 2)) == 3
    assert loop_start(list(range(200))) is None  # no repetition at all
    table = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6]  # a repeated start that does not repeat to the end
    assert loop_start(table) is None


def streamed(answer, tokens) -> tuple[str, bool]:
    """What an AnswerText shows as `tokens` come (and when they end), and whether it ended the answer."""
    pieces, ended = [], False
    for token in tokens:
        piece, ended = answer.add(token)
        pieces.append(piece)
        if ended:
            break
    pieces.append(answer.finish())  # as Asker.answers does for every answer, ended or not
    return "".join(pieces), ended


def test_a_loop_is_cut_before_its_second_copy_is_shown_and_other_repeats_are_shown_whole():
    from kvpage_cli.tasks.ask import AnswerText, repeating_tail

    def decode(tokens):
        return "".join(f"<{t}>" for t in tokens)

    def stream(tokens):
        return streamed(AnswerText(decode), tokens)

    line = list(range(100, 120))  # a 20-token line: said twice it is 40 tokens, a loop
    shown, ended = stream([1, 2] + line + line + line)
    assert ended and shown == decode([1, 2] + line)  # not a token of the second copy was streamed
    shown, ended = stream([1, 2] + line + line[:15] + [7, 8])  # repeats 15 tokens, then goes on
    assert not ended and shown == decode([1, 2] + line + line[:15] + [7, 8])
    shown, ended = stream([1, 2] + line + line[:15])  # the answer ends while repeating: all of it is shown
    assert not ended and shown == decode([1, 2] + line + line[:15])
    assert repeating_tail([5, 6, 7, 5, 6]) == 2 and repeating_tail([1, 2, 3]) == 0 and repeating_tail([4, 4, 4]) == 2


def test_a_loop_whose_copies_break_their_lines_at_other_words_is_still_a_loop(tiny_engine):
    """SmolLM2 over Jinja's sources said one sentence eight times, its copies wrapped at different
    words (the newlines are its own): the answer ends after the first copy."""
    from kvpage_cli.tasks.ask import AnswerText

    tokenizer = tiny_engine.tokenizer
    first = "The function `select_autoescape` picks autoescaping by file name.  "
    copy = "The function is defined as `select_autoescape` when enabled."
    looped = first + copy + "  The\nfunction is defined as `select_autoescape` when enabled.  The function is defined as\n" \
        "`select_autoescape` when enabled.  The function is defined as `select_autoescape` when\nenabled."
    ids = tokenizer(looped, add_special_tokens=False).input_ids
    assert len(ids) > 40 and ids[:len(tokenizer(first + copy, add_special_tokens=False).input_ids)] \
        == tokenizer(first + copy, add_special_tokens=False).input_ids
    decode = lambda tokens: tokenizer.decode(tokens)  # noqa: E731
    shown, ended = streamed(AnswerText(decode), ids)
    assert ended and shown.strip().rstrip(".") == (first + copy).rstrip(".")  # cut where the copies repeat from
    # Its own answer: the sentence said again and again is kept once, after the one it repeats
    # the end of, and nothing of its next copy (not "The function")
    answer = "This is the recommended way.  The function is defined as `select_autoescape` and is defined as " \
        "`select_autoescape`\nwhen enabled.  The function is defined as `select_autoescape` when enabled.  The\n" \
        "function is defined as `select_autoescape` when enabled.  The function is defined as `select_autoescape` " \
        "when\nenabled.  The function is defined as `select_autoescape` when enabled."
    shown, ended = streamed(AnswerText(decode), tokenizer(answer, add_special_tokens=False).input_ids)
    second = answer.index("when enabled.", answer.index("when enabled.") + 1)
    assert ended and shown.strip() == answer[:second + len("when enabled.")]
    # a sentence said twice in a row is a loop, though its two copies are under LOOP_TOKENS
    twice = "This document is about bicycles. It is a legal and technical analysis of a document. It is a legal " \
        "and technical analysis of a document. It is"
    shown, ended = streamed(AnswerText(decode), tokenizer(twice, add_special_tokens=False).input_ids)
    assert ended and shown == "This document is about bicycles. It is a legal and technical analysis of a document."
    # the same words said once more, then something new: nothing is cut, and all of it is shown
    said_again = first + copy + "  The\nfunction is defined as `select_autoescape` when enabled, and by `escape` otherwise."
    shown, ended = streamed(AnswerText(decode), tokenizer(said_again, add_special_tokens=False).input_ids)
    assert not ended and shown == said_again
    # SmolLM2 over urllib3's sources: a sentence said again with a word more, again and again; the
    # loop's period cut after that word, and "The document also" had been shown before it repeated
    first = "The document provides a detailed explanation of how to retry a request by default."
    more = "The document also provides a detailed explanation of how to retry a request by default."
    for gap in ("\n\n", " "):
        looped = tokenizer(first + (gap + more) * 3, add_special_tokens=False).input_ids
        shown, ended = streamed(AnswerText(decode), looped)
        assert ended and shown == first  # no fragment of a sentence, no white space at the end
        other = first + gap + "The document also says how long to wait between tries."  # starts alike, no loop
        shown, ended = streamed(AnswerText(decode), tokenizer(other, add_special_tokens=False).input_ids)
        assert not ended and shown == other


def test_a_base_models_answer_ends_where_it_writes_the_next_question():
    """Gemma 3 270M (a base model) answered "10 months" and went on with a question of its own and
    "Answer:"; a user sees the answer only, and a line that merely starts like a turn is shown."""
    from kvpage_cli.tasks.ask import BASE_TURNS, AnswerText

    def stream(words):  # one token per word
        return streamed(AnswerText(lambda tokens: "".join(words[t] for t in tokens), BASE_TURNS), range(len(words)))

    text, ended = stream([" 10", " months", "\n", "\n", "Ques", "tion", ":", " How", " long", "?"])
    assert ended and text.strip() == "10 months"  # not even "Ques" was streamed
    text, ended = stream(["\n", "\n", "Answer", ":"])  # only the cue again: nothing to show
    assert ended and text.strip() == ""
    text, ended = stream([" Five", " years", ".", "\n", "Ques", "tions", " of", " law", " remain"])
    assert not ended and text == "Five years.\nQuestions of law remain"
    text, ended = stream([" Five", " years", "\n", "Ques"])  # the answer stops mid-word: all of it
    assert not ended and text == "Five years\nQues"
    # Gemma's answer to "Who are the parties?": its own next question, in short
    text, ended = stream(["\n", "\n", "Q", ":", " What", " is", " the", " purpose", "?"])
    assert ended and text == ""
    text, ended = stream([" Delaware", "\n", "\n", "\n"])  # no space before it, no blank lines after it
    assert not ended and text == "Delaware"
    text, ended = stream([" 2", ".", "2", ".", "1", "\n", "</", "document", ">", "Question", ":"])  # the prompt again
    assert ended and text == "2.2.1"


def test_a_chat_models_question_starts_on_its_own_line_after_the_document(tiny_engine):
    """The document's end, a blank line, then the question (they ran together as "</document>Question:
    ..." before); a base model's prompt keeps them together, as measured (Asker.__init__)."""
    tokenizer = tiny_engine.tokenizer
    doc = load(str(SAMPLES / "contract.txt"))
    asker = Asker(tiny_engine, doc, "Who pays?", max_new_tokens=4)
    assert asker.prompts.chat
    assert "</document>\n\nQuestion: Who pays?" in tokenizer.decode(asker.prefix_ids + asker.question_ids[0])
    saved = tokenizer.chat_template
    tokenizer.chat_template = None  # the same tokenizer, as a base model has it
    try:
        base = Asker(tiny_engine, doc, "Who pays?", max_new_tokens=4)
        assert "</document>Question: Who pays?" in tokenizer.decode(base.prefix_ids + base.question_ids[0])
    finally:
        tokenizer.chat_template = saved


def test_a_base_model_gets_a_question_to_continue_not_an_instruction(tiny_engine):
    tokenizer = tiny_engine.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = None  # the same tokenizer, as a base model has it
    try:
        doc = load(str(SAMPLES / "contract.txt"))
        asker = Asker(tiny_engine, doc, "Who pays?", max_new_tokens=4)
        assert not asker.prompts.chat
        text = tokenizer.decode(asker.prefix_ids + asker.question_ids[0])
        assert text.rstrip().endswith("Question: Who pays?\n\nAnswer:")
        assert "briefly and precisely" not in text
    finally:
        tokenizer.chat_template = saved


CAPS_AND_PAYMENT = """MASTER AGREEMENT

1. Limitation of Liability. Provider's total liability arising out of this Agreement shall not exceed the fees paid by Customer in the three (3) months before the event giving rise to the claim.

2. Limitation of Customer Liability. Customer's total liability arising out of this Agreement shall not exceed the fees paid by Customer in the twelve (12) months before the event giving rise to the claim.

3. Limitation of Partner Liability. Partner's total liability arising out of this Agreement shall not exceed $1,000,000 in the aggregate.

4. Payment. Each invoice is payable in full within forty-five (45) days after its date.

5. Notices. A notice sent by mail takes effect ten (10) days after it is posted.
"""


@pytest.fixture(scope="module")
def caps_contract(tmp_path_factory):
    path = tmp_path_factory.mktemp("caps") / "caps.txt"
    path.write_text(CAPS_AND_PAYMENT)
    return load(str(path))


def test_a_cap_under_twelve_months_of_fees_is_high_risk(tiny_engine, caps_contract):
    findings = {f.clause_id: f for f in Reviewer(tiny_engine, caps_contract).findings()}
    caps = {cid: next(a for a in findings[cid].assessments if a.cuad == "Cap On Liability") for cid in "123"}
    assert (caps["1"].level, caps["1"].reason) == (
        "high", "Liability is capped at the fees paid by Customer in the three (3) months before the event giving "
                "rise to the claim: less than twelve months of fees.")
    assert (caps["2"].level, caps["2"].reason) == (
        "medium", "Liability is capped at the fees paid by Customer in the twelve (12) months before the event "
                  "giving rise to the claim.")
    assert (caps["3"].level, caps["3"].reason) == ("medium", "Liability is capped at $1,000,000.")


def test_payment_terms_are_found_by_their_words_and_copied_exactly(tiny_engine, caps_contract):
    from kvpage_cli.tasks.playbook import DEFAULT_PLAYBOOK, Playbook

    text = (SAMPLES.parent / "prompts" / DEFAULT_PLAYBOOK).read_text()
    question = next(line for line in text.splitlines() if line.startswith("questions.sets_due"))
    book = Playbook.parse(text.replace(question, ""), "no-question.toml")  # a random model's yes is noise
    reviewer = Reviewer(tiny_engine, caps_contract, playbook=book)
    findings = reviewer.findings()
    assert "payment terms" not in {c for f in findings for c in f.categories}  # a key term, not a finding
    terms = {t.label: t for t in reviewer.terms}
    assert [v.text for v in terms["Payment terms"].values] == ["forty-five (45) days"]  # not the notice's ten days
    assert terms["Payment terms"].clause_id == "4"
    value = terms["Payment terms"].values[0]
    assert caps_contract.text[value.start:value.end] == "forty-five (45) days"


CHANGE_OF_CONTROL = """MASTER SERVICES AGREEMENT

1. Merger. Within fifteen (15) Business Days after any merger, consolidation or change of control of the
Servicer, the surviving Person will execute an agreement to assume the Servicer's obligations under this
Agreement and deliver to the Issuer an Officer's Certificate stating that the merger complies with this Section 1.

2. Change of Control. Either party may terminate this Agreement on thirty (30) days' written notice if the
other party undergoes a change of control, including a merger in which it is not the surviving entity.
"""


def test_a_clause_that_never_mentions_termination_does_not_let_anyone_terminate(tiny_engine, tmp_path, monkeypatch):
    """The 111-page servicing agreement of the corpus: its merger clauses (a successor assumes the
    obligations) were high risk, "A change of control lets the other party terminate", from the
    model's yes. The playbook's question needs a word of termination in the clause; here the
    model says yes to every question, so only the playbook decides."""
    path = tmp_path / "control.txt"
    path.write_text(CHANGE_OF_CONTROL)
    monkeypatch.setattr(Reviewer, "_yes_odds", lambda self, contexts, questions: [
        0.0 if ctx is self._null else 3.0 for ctx in contexts])
    findings = {f.clause_id: f for f in Reviewer(tiny_engine, load(str(path))).findings()}
    control = {cid: next(a for a in findings[cid].assessments if a.cuad == "Change Of Control") for cid in "12"}
    assert (control["2"].level, control["2"].reason) == ("high", "A change of control lets the other party terminate.")
    assert control["1"].level == "medium" and "lets the other party terminate" not in control["1"].reason


FOR_CAUSE = """MASTER SERVICES AGREEMENT

5.1 Termination for Cause. Either Party may terminate this Agreement by written notice if the other Party (a)
materially breaches this Agreement and fails to cure the breach within thirty (30) days after written notice of it;
or (b) becomes the subject of a bankruptcy or insolvency proceeding that is not dismissed within sixty (60) days.

5.2 Termination for Convenience by Provider. Provider may terminate this Agreement or any Statement of Work at any
time, for any reason or no reason, on thirty (30) days' written notice to Customer.
"""


def test_a_termination_clause_that_speaks_only_of_breach_is_no_termination_for_convenience(tiny_engine, tmp_path,
                                                                                          monkeypatch):
    """The README contract's 5.1: the head files it under termination for convenience, and
    SmolLM2 said yes to "Can a party end this agreement without cause?". Every sentence of it
    that terminates speaks of breach (the question's `unless` words), so it does not hold the
    category whatever the model says; 5.2 does."""
    path = tmp_path / "for_cause.txt"
    path.write_text(FOR_CAUSE)
    reviewer = Reviewer(tiny_engine, load(str(path)))
    column = reviewer.head.categories.index("Termination For Convenience")
    probabilities = reviewer.head.probabilities([c.text for c in reviewer.clauses])
    assert reviewer.head.present(probabilities)[:, column].all()  # the head files both clauses under it
    monkeypatch.setattr(Reviewer, "_yes_odds", lambda self, contexts, questions: [
        0.0 if ctx is self._null else 3.0 for ctx in contexts])
    findings = {f.clause_id: f for f in reviewer.findings()}
    found = {cid: a for cid, f in findings.items() for a in f.assessments if a.cuad == "Termination For Convenience"}
    assert list(found) == ["5.2"]
    assert found["5.2"].reason == "A party may terminate without cause on only thirty (30) days notice."


TERM_AND_RENEWAL = """MASTER SERVICES AGREEMENT

4. TERM AND RENEWAL

4.1 Initial Term. This Agreement begins on the Effective Date and continues for an initial term of three (3) years
(the "Initial Term"), unless terminated earlier under Section 5.

4.2 Automatic Renewal. At the end of the Initial Term and of each Renewal Term, this Agreement shall automatically renew
for a successive period of three (3) years, unless either Party gives written notice of non-renewal at least one
hundred eighty (180) days before the end of the then-current term.
"""


def test_a_clause_that_only_sets_the_term_is_no_renewal_clause(tiny_engine, tmp_path, monkeypatch):
    """The README contract's 4.1: the head files it under renewal term and the notice to stop a
    renewal (its text starts with the article's heading, "4. TERM AND RENEWAL"), and SmolLM2 said
    yes to "Does this agreement renew automatically", so the review read "The contract can be
    renewed or extended; check how.". The categories require a word of renewal in the clause's
    own text; 4.1 is its initial term, 4.2 the renewal."""
    path = tmp_path / "term.txt"
    path.write_text(TERM_AND_RENEWAL)
    reviewer = Reviewer(tiny_engine, load(str(path)))
    column = reviewer.head.categories.index("Renewal Term")
    probabilities = reviewer.head.probabilities([c.text for c in reviewer.clauses])
    ids = [c.id for c in reviewer.clauses]
    assert reviewer.head.present(probabilities)[ids.index("4.1"), column]  # the head files 4.1 under it
    monkeypatch.setattr(Reviewer, "_yes_odds", lambda self, contexts, questions: [
        0.0 if ctx is self._null else 3.0 for ctx in contexts])
    findings = {f.clause_id: f for f in reviewer.findings()}
    assert findings["4.1"].categories == ["term and expiration"]
    assert findings["4.1"].rationale == "The initial term is three (3) years."
    assert "renewal term" in findings["4.2"].categories and findings["4.2"].risk == "high"


CONVENIENCE = """SUPPLY AGREEMENT

8. Warranties and Term. THE PRODUCTS ARE PROVIDED ON AN "AS IS" AND "AS AVAILABLE" BASIS, AND SUPPLIER DOES NOT
MAKE ANY WARRANTIES, EXPRESS OR IMPLIED, WITH RESPECT TO THE PRODUCTS, MERCHANTABILITY AND FITNESS FOR A
PARTICULAR PURPOSE. IN NO EVENT SHALL SUPPLIER BE LIABLE FOR ANY CONSEQUENTIAL, INDIRECT, SPECIAL, INCIDENTAL, OR
PUNITIVE DAMAGES, OR ANY LOSS OF PROFITS, LOSS OF BUSINESS OR LOSS OF REVENUE. This Agreement shall have an initial
term of three (3) years (the "Initial Term"). Following the Initial Term, either Party may terminate this Agreement
without cause upon written notice to the other Party of at least 3 months.

9. Invoices. Invoices may be sent at any time and are payable within thirty (30) days.

10. Insurance. Supplier shall maintain commercial general liability insurance with limits of not less than one
million dollars per occurrence and name Buyer as an additional insured. Buyer may also terminate this Agreement at
any time for its convenience.

11. Fees. The Fees are fixed for the Term in reliance on Customer's commitment and are payable monthly in advance by
wire transfer. Customer may not terminate this Agreement at any time for its convenience.
"""


@pytest.mark.parametrize("yes", [True, False])
def test_a_clause_the_head_passes_over_is_found_by_its_phrases_when_the_model_confirms(tiny_engine, tmp_path,
                                                                                       monkeypatch, yes):
    """CUAD's HealthcareIntegratedTechnologies agreement: "either Party may terminate this
    Agreement without cause upon written notice ... of at least 3 months", inside a clause that
    is mostly a warranty disclaimer and a limitation of liability, scores 0.09 for termination
    for convenience with the lexical head (its threshold 0.17), so the review never asked about
    it. A clause with the playbook's found_by phrases is asked too, and is a finding only when the
    model says yes, quoting the sentence that holds the phrase; the question needs a word of
    termination (clause 9 has "at any time" but terminates nothing), and a negation before it
    denies the category (clause 11: SmolLM2 answered yes to the README contract's "Customer may
    not terminate this Agreement ... for convenience")."""
    path = tmp_path / "convenience.txt"
    path.write_text(CONVENIENCE)
    reviewer = Reviewer(tiny_engine, load(str(path)))
    column = reviewer.head.categories.index("Termination For Convenience")
    probabilities = reviewer.head.probabilities([c.text for c in reviewer.clauses])
    assert not reviewer.head.present(probabilities)[:, column].any()  # the head alone finds none
    monkeypatch.setattr(Reviewer, "_yes_odds", lambda self, contexts, questions: [
        0.0 if ctx is self._null else (3.0 if yes else -3.0) for ctx in contexts])
    findings = {f.clause_id: f for f in reviewer.findings()}
    found = {cid: a for cid, f in findings.items() for a in f.assessments if a.cuad == "Termination For Convenience"}
    if yes:
        assert list(found) == ["8", "10"]
        assert found["8"].level == "medium"
        assert found["8"].reason == "A party may terminate without cause on 3 months notice."
        assert findings["10"].categories == ["termination for convenience", "insurance"]  # medium, then low
        assert findings["10"].quote == "Buyer may also terminate this Agreement at\nany time for its convenience."
    else:
        assert found == {}


NOT_WHAT_THE_HEAD_SAYS = """DISTRIBUTOR AGREEMENT

1. License. For the term of this Agreement, Company grants Distributor a limited, revocable, non-transferable,
non-exclusive license to use the Company Marks solely to market the Products in the Territory.

2. Company Representations. Company represents and warrants that it is a corporation organized and in good standing
under the laws of the State of Florida.

3. Governing Law. This Agreement shall be governed by and construed in accordance with the laws of the State of Texas.

4. Limitation of Liability. Neither party shall be liable to the other for lost profits or indirect, special,
consequential or punitive damages of any kind arising out of this Agreement.
"""


def test_the_words_a_category_requires_keep_it_from_clauses_the_head_misfiles(tiny_engine, tmp_path, monkeypatch):
    """Clauses of the first 50 development contracts that the head filed wrongly (outside the
    experts' spans): a non-exclusive licence as exclusivity, a party's state of incorporation as
    governing law, an exclusion of consequential damages with no carve-out as uncapped liability.
    The governing law of this contract is Texas, from 3 only."""
    path = tmp_path / "distributor.txt"
    path.write_text(NOT_WHAT_THE_HEAD_SAYS)
    reviewer = Reviewer(tiny_engine, load(str(path)))
    ids = [c.id for c in reviewer.clauses]
    present = reviewer.head.present(reviewer.head.probabilities([c.text for c in reviewer.clauses]))
    for clause_id, category in (("1", "Exclusivity"), ("2", "Governing Law"), ("4", "Uncapped Liability")):
        assert present[ids.index(clause_id), reviewer.head.categories.index(category)]  # the head files it there
    monkeypatch.setattr(Reviewer, "_yes_odds", lambda self, contexts, questions: [
        0.0 if ctx is self._null else 3.0 for ctx in contexts])
    flagged = {(f.clause_id, a.cuad) for f in reviewer.findings() for a in f.assessments}
    assert ("3", "Governing Law") in flagged
    assert not flagged & {("1", "Exclusivity"), ("2", "Governing Law"), ("4", "Uncapped Liability")}
    assert {t.label: " and ".join(v.text for v in t.values) for t in reviewer.terms}["Governing law"] == "Texas"


ON_AN_EVENT = """SERVICES AGREEMENT

8. Termination

8.1 Termination by Supplier. Supplier may terminate this Agreement upon thirty (30) days written notice to Buyer in
the event that Buyer fails to pay any invoice when due.

8.2 Termination by Buyer. Buyer may terminate this Agreement upon thirty (30) days written notice to Supplier.
"""


def test_a_right_to_terminate_on_an_event_is_no_termination_for_convenience(tiny_engine, tmp_path, monkeypatch):
    """A development contract's "Termination by NCM. NCM may terminate this Agreement upon thirty
    (30) days written notice ... in the event that distribution of the Service ... is permanently
    discontinued" was flagged as termination for convenience: the head files it there (0.64) and
    its heading, a sentence with "terminat" and no word that bars a yes, let the clause through.
    The `unless` words now include a stated event, and they are read in the clause's text, its
    heading aside. 8.2, with no condition, keeps the category."""
    path = tmp_path / "services.txt"
    path.write_text(ON_AN_EVENT)
    reviewer = Reviewer(tiny_engine, load(str(path)))
    ids = [c.id for c in reviewer.clauses]
    present = reviewer.head.present(reviewer.head.probabilities([c.text for c in reviewer.clauses]))
    column = reviewer.head.categories.index("Termination For Convenience")
    assert present[ids.index("8.1"), column] and present[ids.index("8.2"), column]  # the head files both there
    monkeypatch.setattr(Reviewer, "_yes_odds", lambda self, contexts, questions: [
        0.0 if ctx is self._null else 3.0 for ctx in contexts])
    flagged = {f.clause_id for f in reviewer.findings() for a in f.assessments if a.cuad == "Termination For Convenience"}
    assert flagged == {"8.2"}
