"""Issue 47: the evidence under answers (the attention mass it is ranked from, the spans it
quotes), `kvpage find` and `kvpage index`, lazy indexing, answers that stop, the live decode line."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch

from kvpage_cli.cli.app import app
from kvpage_cli.engine import Engine, EngineConfig
from kvpage_cli.engine.attention.evidence import token_mass
from kvpage_cli.ingest import Document, load
from kvpage_cli.tasks import Asker
from kvpage_cli.tasks.ask import BASE_TURNS, PROMPT_TURNS, AnswerText
from kvpage_cli.tasks.find import Finder

from .conftest import SAMPLES, random_prompt, tiny_model, with_native_library

# -- the attention mass ------------------------------------------------------------------------


@pytest.mark.parametrize("answer_tokens", [1, 17, 37])
def test_token_mass_is_the_attention_transformers_computes(answer_tokens, kv_home):
    """Every appended row's queries are kept (in pieces of 16, none of one row) and the mass per
    key is the softmax share transformers' own attention gives it, summed over rows, heads and layers."""
    model = tiny_model("llama")
    model.config._attn_implementation = "eager"  # its attention weights, to compare with
    engine = Engine.load(model, EngineConfig(home=str(kv_home), backend="native"))
    prompt, answer = random_prompt(150, seed=11), random_prompt(answer_tokens, seed=12)
    ctx = engine.prefill(prompt)
    queries = engine.append_with_queries(ctx, answer)
    assert all(q.shape[0] == answer_tokens and start == len(prompt) for q, start in queries.values())
    assert ctx.tokens[:len(prompt) + answer_tokens] == prompt + answer
    mass = token_mass(engine, ctx, queries)
    with torch.no_grad():
        out = model(torch.tensor([prompt + answer]), output_attentions=True)
    expected = sum(a[0, :, len(prompt):, :].sum(dim=(0, 1)) for a in out.attentions)  # [positions]
    length = len(prompt) + answer_tokens
    assert torch.allclose(mass[:length], expected[:length].float(), atol=1e-3, rtol=1e-3)
    assert mass[:length].sum().item() == pytest.approx(answer_tokens * 4 * 3, rel=1e-4)  # rows x heads x layers


# -- spans ---------------------------------------------------------------------------------------

def _repo(tmp_path, fact_line: int = 143):
    """A repository of three files; src/vault/config.py holds a planted fact at `fact_line`."""
    root = tmp_path / "shop"
    (root / "src" / "vault").mkdir(parents=True)
    lines = []
    for i in range(1, 400):
        if i == fact_line:
            lines.append("VAULT_COMBINATION = \"4-8-15-16\"  # the vault combination, set by the owner")
        elif i % 9 == 0:
            lines.append("")
        else:
            lines.append(f"    total_{i} = compute_line({i}, rate=Decimal(\"0.{i % 7}\"))  # ledger entry {i}")
    (root / "src" / "vault" / "config.py").write_text("\n".join(lines) + "\n")
    (root / "README.md").write_text("# Shop\n\nA ledger of sales, one line a sale.\n")
    (root / "src" / "vault" / "__init__.py").write_text("from .config import *\n")
    return root


def _sed(root, where: str) -> str:
    """`sed -n A,Bp FILE` for a place `FILE:A-B`."""
    path, lines = where.rsplit(":", 1)
    a, _, b = lines.partition("-")
    return subprocess.run(["sed", "-n", f"{a},{b or a}p", str(root / path)], capture_output=True, text=True,
                          check=True).stdout


def _check_spans(doc, root, spans):
    for e in spans:
        assert doc.text[e.start:e.end] == e.text  # exact, at its offsets
        assert re.fullmatch(r"[\w./-]+:\d+(-\d+)?", e.where), e.where
        assert _sed(root, e.where).rstrip("\n") == e.text  # the place names exactly those lines


@pytest.mark.real_model
def test_a_planted_fact_is_the_top_evidence_of_the_answer_and_of_find(smollm2, tmp_path):
    """SmolLM2 over a repository longer than its (here shortened) context: the answer's top span,
    quoted exactly with lines that `sed -n` agrees with, holds the planted fact; so does find's,
    which reads the saved index and computes nothing of the document."""
    root = _repo(tmp_path)
    doc = load(str(root))
    engine = Engine.load("smollm2", EngineConfig(home=str(smollm2.home), max_context=2048, kv_cache=True))
    question = "What is the vault combination?"
    asker = Asker(engine, doc, question, max_new_tokens=16)
    assert asker.mode == "retrieval"
    answer = "".join(piece for _, piece in asker.answers())
    assert "4-8-15-16" in answer
    spans = asker.evidence[0]
    assert 1 <= len(spans) <= 3 and "4-8-15-16" in spans[0].text
    _check_spans(doc, root, spans)
    # the attention alone puts it first too: the lexical match is not what finds it
    from kvpage_cli.tasks import evidence
    alone = evidence.rank(doc, *asker.attention[0], question, signal="attention")
    assert "4-8-15-16" in alone[0].text

    asker.retriever.index.release()
    before = engine.stats().prefill_tokens
    finder = Finder(engine, doc)
    found = finder.find("Where is the combination of the vault set?", count=3)
    assert "4-8-15-16" in found[0].text
    _check_spans(doc, root, found)
    assert finder.asker.retriever.index.computed_tokens == 0  # every window mapped from the saved index
    asked = len(finder.asker.question_ids[0]) + len(finder.asker.retriever.tail)
    assert engine.stats().prefill_tokens - before <= asked + 64  # the question (and the head's last block)
    finder.release()


def test_units_are_whole_lines_of_code_and_sentences_of_running_text(tmp_path):
    from kvpage_cli.tasks.evidence import units_of

    root = _repo(tmp_path)
    doc = load(str(root))
    units = units_of(doc, [(0, len(doc.text))])
    texts = [doc.text[u.start:u.end] for u in units]
    assert not any(t.startswith("==>") for t in texts)  # a file's heading says nothing
    assert any(t.startswith("    total_1 = ") for t in texts)  # indented as in the file
    pdf = load(str(SAMPLES / "contract.pdf"))
    sentences = units_of(pdf, [(0, 3000)])
    assert all(u.line is None and pdf.text[u.start:u.end].strip() for u in sentences)
    assert max(u.end - u.start for u in sentences) < 800  # sentences, not the page


def _retry_repo(tmp_path):
    """A module whose default sits in a statement over three lines, a doc comment that matches the
    question's words better, and a Markdown page that says the same."""
    root = tmp_path / "client"
    (root / "client").mkdir(parents=True)
    body = ["import random", ""]
    body += [f"def helper_{i}(x):\n    return x * {i}  # the helper of step {i}\n" for i in range(40)]
    body += ["class Retry:",
             "    #: The headers a redirect to another host removes from the request by default.",
             "    DEFAULT_REMOVE_HEADERS_ON_REDIRECT = frozenset(",
             '        ["Cookie", "Authorization", "Proxy-Authorization"]',
             "    )",
             "    #: The headers a redirect keeps.",
             "    KEPT = frozenset()",
             ""]
    (root / "client" / "retry.py").write_text("\n".join(body) + "\n")
    (root / "README.md").write_text("# Client\n\nWhich headers does a redirect remove? The 2 headers we remove "
                                    "from a request on a redirect to another host are listed in retry.py.\n")
    return root


def test_a_statement_over_lines_is_one_unit_quoted_with_its_lines(tmp_path):
    """The opening line, the list and the closing bracket are one unit, and its place names those
    three lines (as `sed -n` prints them); the lines around stay lines."""
    from kvpage_cli.tasks.evidence import place, units_of

    root = _retry_repo(tmp_path)
    doc = load(str(root))
    units = units_of(doc, [(0, len(doc.text))])
    texts = [doc.text[u.start:u.end] for u in units]
    statement = next(u for u, t in zip(units, texts) if "DEFAULT_REMOVE_HEADERS_ON_REDIRECT" in t)
    text = doc.text[statement.start:statement.end]
    assert text.endswith('"Proxy-Authorization"]\n    )') and text.count("\n") == 2
    where = place(doc, statement, statement)
    assert where.endswith(f":{statement.line}-{statement.line + 2}")
    assert _sed(root, where).rstrip("\n") == text
    assert not any(t.strip() == '["Cookie", "Authorization", "Proxy-Authorization"]' for t in texts)  # taken in
    assert "    #: The headers a redirect keeps." in texts and "    KEPT = frozenset()" in texts


def test_a_span_grows_to_a_few_lines_not_over_whole_blocks_of_statements(tmp_path):
    """Statements of three lines each, all scoring alike: a span takes whole statements up to
    eight lines of the file, and its place still names exactly the lines it quotes."""
    from kvpage_cli.tasks import evidence

    root = tmp_path / "table"
    root.mkdir()
    (root / "rates.py").write_text("".join(f"RATE_{i} = dict(\n    rate={i},\n)\n" for i in range(12)))
    doc = load(str(root))
    units = evidence.units_of(doc, [(0, len(doc.text))])
    assert len(units) == 12  # one a statement
    spans = evidence.spans(doc, units, torch.ones(len(units)), torch.ones(len(units)), count=2)
    assert [e.text.count("\n") + 1 for e in spans] == [6, 6]  # two statements each, not four (12 lines)
    for e in spans:
        assert _sed(root, e.where).rstrip("\n") == e.text


def test_words_rank_not_the_sinks_a_small_model_parks_its_attention_on(tmp_path):
    """Most of the mass on the white space and the "the"s of one line, some on the words of the
    line that holds the answer: the attention ranks the answer's line first, while Evidence.score
    still reports the share of all the mass each span received."""
    from kvpage_cli.tasks import evidence

    root = _retry_repo(tmp_path)
    doc = load(str(root))
    chars = [(m.start(), m.end()) for m in re.finditer(r"\s+|\w+|[^\w\s]", doc.text)]  # words, spaces, marks
    sink = doc.text.index("#: The headers a redirect keeps.")
    fact = doc.text.index('["Cookie"')
    mass = torch.tensor([50.0 if sink <= a < sink + 40 and (doc.text[a:b].isspace() or doc.text[a:b] == "The")
                         else 1.0 if fact <= a < fact + 50 and doc.text[a:b].isalpha() else 0.01
                         for a, b in chars])
    spans = evidence.rank(doc, chars, mass, "What is removed?", signal="attention")
    assert "Authorization" in spans[0].text
    _check_spans(doc, root, spans)
    units = evidence.units_of(doc, chars)  # the document's text the ranking reads
    inside = [any(u.start <= a < u.end for u in units) for a, _ in chars]
    total = sum(float(m) for m, kept in zip(mass, inside) if kept)
    span_mass = sum(float(m) for (a, _), m, kept in zip(chars, mass, inside) if kept and spans[0].start <= a < spans[0].end)
    assert spans[0].score == pytest.approx(span_mass / total, abs=1e-4)
    assert spans[0].score < 0.1  # most of the mass went to the sinks, and the score says so


def _without_attention(root, question: str):
    """`root`'s document ranked for `question` with no attention at all: (doc, its word tokens'
    characters, their zero mass, lexical's spans, the fused ranking's spans)."""
    from kvpage_cli.tasks import evidence

    doc = load(str(root))
    chars = [(m.start(), m.end()) for m in re.finditer(r"\S+", doc.text)]
    flat = torch.zeros(len(chars))
    return (doc, chars, flat, evidence.rank(doc, chars, flat, question, signal="lexical"),
            evidence.rank(doc, chars, flat, question))

def test_in_code_the_line_that_states_the_value_ranks_first_and_in_prose_it_does_not(tmp_path):
    """No attention at all: the doc comment and the page match the question's words best (lexical
    ranks one of them first), yet the fused ranking quotes the statement that holds the value; the Markdown page's
    sentence with a number gets no such lift (prose)."""
    from kvpage_cli.tasks import evidence

    root = _retry_repo(tmp_path)
    question = "Which headers does a redirect to another host remove from the request by default?"
    doc, chars, flat, lexical, fused = _without_attention(root, question)
    assert "Proxy-Authorization" not in lexical[0].text  # the words match the comment and the page better
    assert "Proxy-Authorization" in fused[0].text
    _check_spans(doc, root, fused)
    ranked = evidence.signals(doc, chars, flat, question)
    prose = [i for i, u in enumerate(ranked.units) if u.file == "README.md"]
    assert prose and all(float(ranked.prior[i]) == 0.0 for i in prose)  # "2 headers" in a page: no prior


def _server_repo(tmp_path):
    """A server module whose backlog is a constant named for it, beside prose, a docstring's
    example and a test that use the question's words more often than the constant does."""
    root = tmp_path / "server"
    (root / "server").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "server" / "serving.py").write_text(
        "import socket\n\n"
        "LISTEN_QUEUE = 128\n\n\n"
        "class DevServer:\n"
        '    """A development server.\n\n'
        "    .. code-block:: python\n\n"
        "        server = DevServer(backlog=5)  # the listen backlog of a development server\n"
        '    """\n\n'
        "    #: The development server listens with a backlog; the listen backlog is set at start.\n"
        '    name = "dev"\n\n'
        "    def __init__(self, backlog=None):\n"
        "        self.backlog = backlog or LISTEN_QUEUE\n"
        '        listen_note = "the listen backlog of a development server"\n\n'
        "    def serve(self):\n"
        "        self.socket.listen(self.backlog)  # the development server's listen backlog\n")
    (root / "pyproject.toml").write_text('[tool.setuptools.packages.find]\nwhere = ["server"]\n')
    (root / "tests" / "test_serving.py").write_text(
        "def test_backlog():\n"
        "    server_backlog = 7  # a development server's listen backlog in this test\n"
        "    assert DevServer(backlog=server_backlog).backlog == 7\n")
    return root


def test_the_definition_named_for_the_question_ranks_first(tmp_path):
    """No attention at all: the comment, the docstring's example and the test say "listen backlog
    ... development server" more often than anything (lexical ranks one of them first), yet the
    fused ranking quotes `LISTEN_QUEUE = 128`, the constant whose name the question uses; the
    example, the test's local and the call's keyword define nothing."""
    from kvpage_cli.tasks import evidence

    root = _server_repo(tmp_path)
    question = "What listen backlog does the development server use?"
    doc, chars, flat, lexical, fused = _without_attention(root, question)
    assert "LISTEN_QUEUE = 128" not in lexical[0].text
    assert fused[0].text == "LISTEN_QUEUE = 128" and fused[0].where == "server/serving.py:3"
    _check_spans(doc, root, fused)
    ranked = evidence.signals(doc, chars, flat, question)
    named = {doc.text[u.start:u.end].strip(): float(v) for u, v in zip(ranked.units, ranked.named)}
    assert max(named, key=named.get) == "LISTEN_QUEUE = 128"
    for nothing in ("server = DevServer(backlog=5)  # the listen backlog of a development server",
                    "server_backlog = 7  # a development server's listen backlog in this test",
                    'listen_note = "the listen backlog of a development server"',
                    "self.socket.listen(self.backlog)  # the development server's listen backlog"):
        assert named[nothing] == 0.0, nothing
    # a question word names nothing: `where = [...]` is no answer to "Where ...?"
    where = evidence.named_values(doc, ranked.units, "Where is the listen backlog of the development server set?")
    texts = [doc.text[u.start:u.end].strip() for u in ranked.units]
    assert float(where[texts.index('where = ["server"]')]) == 0.0
    assert texts[int(where.argmax())] == "LISTEN_QUEUE = 128"


def test_by_default_and_the_documents_own_name_point_at_no_line(tmp_path):
    """"By default" asks for the default of what the question's other words name: a constant named
    DEFAULT_* for something else is no answer (it ranked first on "default" alone). The words of the
    document's own name ("signkit" of signkit-1.0/) are about every line: a line that says only
    them matches nothing; the version's numbers are not among them."""
    from kvpage_cli.tasks import evidence

    root = tmp_path / "signkit-1.0"
    (root / "signkit").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "signkit" / "hashing.py").write_text(
        "DEFAULT_DIGEST_SIZE = 20\nSCRYPT_N = 32768\nSCRYPT_R = 8\n\n\ndef scrypt_hash(value):\n"
        "    return value\n")
    (root / "docs" / "conf.py").write_text('project = "signkit"\nrelease = "1.0"\n')
    question = "Which scrypt cost does signkit use by default?"
    doc, chars, flat, lexical, fused = _without_attention(root, question)
    assert evidence.document_terms(doc) == frozenset({"signkit"})
    assert fused[0].text.startswith("SCRYPT_N = 32768") and fused[0].where.startswith("signkit/hashing.py:2")
    _check_spans(doc, root, fused)
    ranked = evidence.signals(doc, chars, flat, question)
    texts = [doc.text[u.start:u.end].strip() for u in ranked.units]
    assert float(ranked.named[texts.index("DEFAULT_DIGEST_SIZE = 20")]) == 0.0
    assert float(ranked.named[texts.index("SCRYPT_N = 32768")]) > 0.0
    assert float(ranked.lexical[texts.index('project = "signkit"')]) == 0.0
    # standard input is named for no subject: a question's "input" is a word like any other
    assert evidence.document_terms(Document("-", "text", "input = 1\n", [])) == frozenset()


def test_two_words_of_a_question_match_the_name_code_writes_as_one(tmp_path):
    """"Block size" is what code names `blocksize`: the constant that holds the value is among the
    spans (without the joined words it matched none of the question's, and was not)."""
    from kvpage_cli.tasks import evidence

    root = tmp_path / "netkit"
    (root / "netkit").mkdir(parents=True)
    (root / "netkit" / "pool.py").write_text(
        "import socket\n\n_DEFAULT_BLOCKSIZE = 16384\n_DEFAULT_TIMEOUT = 5.0\n\n\nclass ConnectionPool:\n"
        '    """Connections to one host, kept open between requests."""\n\n'
        "    def __init__(self, host: str, port: int = 80, maxsize: int = 1, block: bool = False):\n"
        "        self.host = host\n        self.port = port\n        self.maxsize = maxsize\n"
        "        self.block = block\n\n    def new_connection(self, blocksize=None):\n"
        "        size = blocksize or _DEFAULT_BLOCKSIZE\n"
        "        return socket.create_connection((self.host, self.port), _DEFAULT_TIMEOUT), size\n")
    question = "What block size does a connection pool give new connections when none is set?"
    doc, chars, flat, lexical, fused = _without_attention(root, question)
    assert "blocksiz" in evidence.joined(question, frozenset({"what", "does", "a", "when", "none", "is"}))
    assert any(e.text == "_DEFAULT_BLOCKSIZE = 16384" and e.where == "netkit/pool.py:3" for e in fused)
    _check_spans(doc, root, fused)


def test_a_packages_metadata_and_readme_are_prose(tmp_path):
    """PKG-INFO (a package's metadata and its README) and files like README and CHANGES name no
    suffix yet are running text: an example in them with a number and a quoted string gets no
    value prior, and the line that raises the exception ranks ahead of it (it ranked first)."""
    from kvpage_cli.tasks import evidence

    root = tmp_path / "cfgread-1.0"
    (root / "src" / "cfgread").mkdir(parents=True)
    (root / "PKG-INFO").write_text(
        "Metadata-Version: 2.1\nName: cfgread\nVersion: 1.0\nSummary: Reads configuration files\n\nUsage:\n\n"
        '    conf = read_file(open("settings.cfg", "rb"), depth=10)\n\n'
        'The file must be opened in binary mode ("rb"), or read_file raises an error.\n')
    (root / "src" / "cfgread" / "reader.py").write_text(
        "def read_file(fp, depth=10):\n    data = fp.read()\n    if isinstance(data, str):\n"
        '        raise TypeError("File must be opened in binary mode")\n    return parse(data, depth)\n')
    question = "What exception does read_file raise when it is given a file opened in text mode?"
    doc, chars, flat, lexical, fused = _without_attention(root, question)
    assert [e.where for e in fused].index("src/cfgread/reader.py:4") < [e.where for e in fused].index("PKG-INFO:8-10")
    _check_spans(doc, root, fused)
    ranked = evidence.signals(doc, chars, flat, question)
    assert all(float(p) == 0.0 for p, u in zip(ranked.prior, ranked.units) if u.file == "PKG-INFO")
    assert evidence.is_prose("README") and evidence.is_prose("docs/CHANGES") and not evidence.is_prose("Makefile")


def test_the_names_a_line_of_code_defines_with_a_value(tmp_path):
    """Constants, class attributes, attributes set on self and a def's parameters with literal
    defaults define names (with a constructor's keywords); a local variable, a call's keyword, a
    lookup, an empty string and a docstring's example do not."""
    from kvpage_cli.tasks import evidence

    root = tmp_path / "pkg"
    root.mkdir()
    lines = ['RETRY_CODES = frozenset([413, 429, 503])',
             'LIMITS = Limits(max_connections=100, keepalive=20)',
             'PIN_TIME = 60 * 60 * 24 * 7',
             'TOKEN = os.environ.get("TOKEN")',
             'EMPTY = ""',
             'ALIAS = RETRY_CODES',
             '',
             'class Pool:',
             '    """Pools.',
             '',
             '        pool = Pool(size=3)',
             '    """',
             '    max_size = 10',
             '',
             '    def __init__(',
             '        self,',
             '        timeout: float = 5.0,',
             '        name=None,',
             *[f'        option_{i}: bool = False,' for i in range(8)],  # a signature longer than a statement unit
             '    ):',
             '        self.blocks = 16384',
             '        local_limit = 3',
             '        connect(retries=4)',
             '',
             'def dump(key, max_size: int = 4093, sep=","):',
             '    pass']
    (root / "mod.py").write_text("\n".join(lines) + "\n")
    doc = load(str(root))
    units = evidence.units_of(doc, [(0, len(doc.text))])
    files = {}
    defined = {}
    for u in units:
        lines_of = files.setdefault(u.file, evidence._FileLines(doc, u, [s.end for s in doc.spans]))
        defined[doc.text[u.start:u.end].strip()] = lines_of.defined(doc, u)
    assert defined["RETRY_CODES = frozenset([413, 429, 503])"] == ["RETRY_CODES"]
    assert defined["LIMITS = Limits(max_connections=100, keepalive=20)"] == ["LIMITS", "max_connections", "keepalive"]
    assert defined["PIN_TIME = 60 * 60 * 24 * 7"] == ["PIN_TIME"]
    assert defined["max_size = 10"] == ["max_size"]
    assert defined["timeout: float = 5.0,"] == ["timeout"]
    assert defined["self.blocks = 16384"] == ["self.blocks"]
    assert defined['def dump(key, max_size: int = 4093, sep=","):'] == ["max_size", "sep"]
    for nothing in ('TOKEN = os.environ.get("TOKEN")', 'EMPTY = ""', "ALIAS = RETRY_CODES", "pool = Pool(size=3)",
                    "name=None,", "local_limit = 3", "connect(retries=4)"):
        assert defined[nothing] == [], nothing
    pool = next(u for u in units if doc.text[u.start:u.end].strip() == "max_size = 10")
    assert files[pool.file].scope(pool.line) == ["Pool"]


# -- lazy indexing -------------------------------------------------------------------------------

def test_a_lazy_index_gives_the_full_index_answer_and_reuses_its_windows(tiny_cli_model, tmp_path, native_library):
    """A question whose blocks are all indexed either way: the same tokens, the same logits; the
    lazy index computed only some windows, and a later question over the saved index computes
    only windows it did not have."""
    doc = load(str(SAMPLES / "contract.txt"))  # about 6K tokens: past a 1,024-token context
    for home in (tmp_path / "lazy", tmp_path / "full"):
        with_native_library(home, native_library)
    config = EngineConfig(home=str(tmp_path / "lazy"), max_context=1024, backend="native", kv_cache=True)
    question = "Which State's laws govern the agreement?"

    def ask(lazy: bool, home_engine=None):
        engine = home_engine or Engine.load(str(tiny_cli_model), config)
        asker = Asker(engine, doc, question, max_new_tokens=6, lazy=lazy, evidence=False)
        tokens = []
        for request, token in _tokens(asker):
            tokens.append(token)
        return engine, asker, tokens

    full_engine = Engine.load(str(tiny_cli_model), EngineConfig(home=str(tmp_path / "full"), max_context=1024,
                                                                 backend="native", kv_cache=True))
    _, full, full_tokens = ask(False, full_engine)
    engine, lazy, lazy_tokens = ask(True)
    index = lazy.retriever.index
    chosen = set(full.selections[0].blocks)
    assert lazy.selections[0].blocks == full.selections[0].blocks and lazy_tokens == full_tokens
    assert [p for p in lazy.selections[0].best if chosen >= set(p)] == [p for p in full.selections[0].best if chosen >= set(p)]
    assert 0 < index.computed_tokens < len(index.tokens) and index.missing
    assert lazy.indexed[0] == index.indexed_tokens < len(index.tokens)
    computed = {index.window_of(b) for b in lazy.selections[0].blocks}
    assert set(range(len(index.windows))) - index.missing == computed  # those windows, no other
    # a later run: the same question maps every window it needs, computes none
    _, again, again_tokens = ask(True)
    assert again_tokens == lazy_tokens and again.retriever.index.computed_tokens == 0
    assert computed <= set(range(len(index.windows))) - again.retriever.index.missing


def test_a_documents_tokens_and_terms_are_saved_and_a_changed_document_gets_its_own(tiny_cli_model, tmp_path,
                                                                                      native_library):
    """Retrieval keeps a document's tokens and its passages' terms beside its index
    (tasks/prepared.py): a later run reads them back, the same as computed; a document changed
    by one word, or only by the blank lines around it, gets its own tokens and terms, not the
    saved ones; a damaged record is discarded and the document prepared again."""
    from kvpage_cli.tasks import prepared
    from kvpage_cli.tasks.retrieval import search_terms

    with_native_library(tmp_path, native_library)
    engine = Engine.load(str(tiny_cli_model), EngineConfig(home=str(tmp_path), max_context=1024, backend="native",
                                                           kv_cache=True))
    path = tmp_path / "contract.txt"
    text = (SAMPLES / "contract.txt").read_text()
    question = "Which State's laws govern the agreement?"

    def prepare():
        asker = Asker(engine, load(str(path)), question, max_new_tokens=4, evidence=False, mode="retrieval")
        read_back = asker._prepared is not None
        retriever = asker.index()
        engine.kv_cache.close()  # waits for the record's write
        return asker, retriever, read_back

    def check(asker, retriever):
        """The tokens, characters and terms used are those the document computes afresh."""
        doc = asker.doc
        fresh = Asker(_NoCache(engine), doc, question, max_new_tokens=4, evidence=False, mode="retrieval")
        assert asker.prefix_ids == fresh.prefix_ids and asker._chars == fresh._chars
        spans = retriever.char_spans
        assert retriever.terms == [search_terms(doc.text[spans[u[0]][0]:spans[u[-1]][1]], retriever.stopwords)
                                   for u in retriever.units]

    path.write_text(text)
    first, retriever, read_back = prepare()
    assert not read_back
    check(first, retriever)
    second, retriever, read_back = prepare()
    assert read_back and second.prefix_ids == first.prefix_ids
    check(second, retriever)
    for changed in (text.replace("Delaware", "Vermont", 1), "\n\n" + text):
        path.write_text(changed)
        other, retriever, read_back = prepare()
        assert not read_back
        check(other, retriever)
    key = other._prepared_key
    record = engine.kv_cache.path(key)
    data = bytearray(record.read_bytes())
    data[-100] ^= 0xFF
    record.write_bytes(bytes(data))
    damaged, retriever, read_back = prepare()
    assert not read_back and damaged.prefix_ids == other.prefix_ids
    check(damaged, retriever)
    assert prepared.load_prepared(engine.kv_cache, key) is not None  # saved again


class _NoCache:
    """An engine seen without its saved-KV cache: what an Asker computes afresh."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.kv_cache = None

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _tokens(asker):
    """(request, token) of the asker's run, through its own answers() (the text is not needed)."""
    engine = asker.engine
    seen = []
    real = engine.run

    def run(requests, **kwargs):
        for request, token in real(requests, **kwargs):
            seen.append((request, token))
            yield request, token

    engine.run = run
    try:
        list(asker.answers())
    finally:
        del engine.run
    return seen


# -- answers that stop ----------------------------------------------------------------------------

def _stream(words, turns):
    text = AnswerText(lambda tokens: "".join(words[t] for t in tokens), turns)
    shown, ended = "", False
    for t in range(len(words)):
        piece, ended = text.add(t)
        shown += piece
        if ended:
            break
    return shown + text.finish(), ended


def test_an_empty_answer_gets_the_evidence_its_question_attended(tiny_cli_model, tmp_path, native_library,
                                                                  monkeypatch):
    """A model whose first words end its answer (a turn of the prompt's) says nothing; its evidence
    is what its reading of the question attended, exact spans of the document, best first."""
    with_native_library(tmp_path, native_library)
    engine = Engine.load(str(tiny_cli_model), EngineConfig(home=str(tmp_path), backend="native"))
    doc = load(str(SAMPLES / "repo" / "src" / "ledgerline" / "config.py"))
    monkeypatch.setattr(AnswerText, "kept_tokens", lambda self: [])  # as after "Question:" and nothing else
    asker = Asker(engine, doc, "Where is the VAT rate configured?", max_new_tokens=4)
    list(asker.answers())
    assert asker.complete[0] and asker.evidence[0]
    for span in asker.evidence[0]:
        assert doc.text[span.start:span.end] == span.text and re.fullmatch(r".*config\.py:\d+(-\d+)?", span.where)


def test_a_question_of_the_models_own_ends_the_answer_inside_a_line_too():
    text, ended = _stream([" The", " rate", " is", " 0", ".21", ".", " Question", ":", " What", " is"], BASE_TURNS)
    assert ended and text == "The rate is 0.21."
    text, ended = _stream([" The", " rate", " is", " 0", ".21", ".", " Question", "s", " remain", "."], BASE_TURNS)
    assert not ended and text == "The rate is 0.21. Questions remain."  # a word that only starts like one
    # a chat model: its own next question, or the prompt's heading again, ends it
    text, ended = _stream([" Delaware", ".", "\n", "\n", "Question", ":", " Who"], PROMPT_TURNS)
    assert ended and text == "Delaware."
    text, ended = _stream([" See", " below", ":", "\n", "==>", " src", "/app", ".py", " <=="], PROMPT_TURNS)
    assert ended and text == "See below:"
    text, ended = _stream([" The", " answer", ":", " Delaware", "."], PROMPT_TURNS)
    assert not ended and text == "The answer: Delaware."  # "Answer:" inside a chat answer is its own words


# -- the command line ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli(kv_home, tiny_cli_model, native_library):
    from typer.testing import CliRunner

    runner = CliRunner()

    def run(*args, home=None):
        if home is not None:
            with_native_library(home, native_library)
        argv = [str(a) for a in args] + ["--model", str(tiny_cli_model)]
        env = {"KVPAGE_HOME": str(home or kv_home), "KVPAGE_MODEL": None, "KVPAGE_DEBUG": None, "NO_COLOR": None}
        return runner.invoke(app, argv, env=env)

    return run


def test_ask_prints_the_evidence_under_the_answer_and_json_carries_it(cli, tmp_path):
    root = _repo(tmp_path)
    args = ("ask", root, "What is the vault combination?", "--max-new-tokens", "4")
    text = cli(*args)
    assert text.exit_code == 0, text.stderr
    assert "\nEvidence:\n" in text.stdout and "Evidence" not in text.stderr
    data = json.loads(cli(*args, "--json").stdout)
    doc = load(str(root))
    assert 1 <= len(data["evidence"]) <= 3
    for e in data["evidence"]:
        assert set(e) == {"text", "where", "start", "end", "score"}
        assert doc.text[e["start"]:e["end"]] == e["text"] and _sed(root, e["where"]).rstrip("\n") == e["text"]
        assert f"  {e['where']}\n" in text.stdout
    hidden = cli(*args, "--no-evidence")
    assert "Evidence" not in hidden.stdout and json.loads(cli(*args, "--no-evidence", "--json").stdout)["evidence"] == []


def test_find_builds_what_it_needs_then_reads_the_saved_index(cli, tmp_path):
    doc_path = SAMPLES / "contract.txt"
    home = tmp_path / "home"
    first = cli("find", doc_path, "Which law governs?", "--json", home=home)
    assert first.exit_code == 0, first.stderr
    assert re.search(r"^kvpage: indexed [\d,]+ tokens of .* for this question", first.stderr, re.M)
    data = json.loads(first.stdout)
    doc = load(str(doc_path))
    assert 1 <= len(data["spans"]) <= 5 and all(doc.text[s["start"]:s["end"]] == s["text"] for s in data["spans"])
    again = cli("find", doc_path, "Which law governs?", "--json", "-n", "2", home=home)
    assert not re.search(r"^kvpage: indexed", again.stderr, re.M)  # nothing of the document computed again
    second = json.loads(again.stdout)
    assert second["spans"] == data["spans"][:2]
    assert second["prefill_tokens"] < 128  # the question, not a window (the head is loaded too)
    from kvpage_cli.engine.kv.saved.disk import KVCache

    [entry] = KVCache.open(home).list_entries()  # what `kvpage cache ls` lists: the head and windows, one document
    assert entry.label == str(doc_path)
    assert cli("index", doc_path, home=home).exit_code == 0
    plain = cli("find", doc_path, "Which law governs?", home=home)
    assert plain.stdout.startswith(data["spans"][0]["where"] + "\n")


def test_find_over_a_document_shorter_than_a_block(cli, tmp_path):
    """All of it lies in the index's head and tail, with no passage between them (bm25s refused to
    index none: `max() arg is an empty sequence`, exit 1)."""
    doc_path = tmp_path / "note.txt"
    doc_path.write_text("The cat sat on the mat.\n")
    found = cli("find", doc_path, "Where did the cat sit?", "--json", home=tmp_path / "home")
    assert found.exit_code == 0, found.stderr
    [span] = json.loads(found.stdout)["spans"]
    assert span["text"] == "The cat sat on the mat." and span["where"] == f"{doc_path}:1"
    # what was read is said as it is: all of it, not "0 of 0 blocks" (find) or "the document being
    # longer than the context" (ask's retrieval mode, asked for)
    assert "retrieval: all of the document read (shorter than one 64-token block), 1 place," in found.stderr
    asked = cli("ask", doc_path, "Where did the cat sit?", "--mode", "retrieval", "--max-new-tokens", "4",
                home=tmp_path / "home")
    assert asked.exit_code == 0, asked.stderr
    assert "retrieval mode: all of the document read" in asked.stderr and "longer than the context" not in asked.stderr


def test_index_builds_all_of_it_and_refuses_what_it_cannot_save(cli, tmp_path):
    home = tmp_path / "home"
    built = cli("index", SAMPLES / "contract.txt", "--json", home=home)
    assert built.exit_code == 0, built.stderr
    data = json.loads(built.stdout)
    assert data["tokens"] > 1000 and data["computed_tokens"] == data["tokens"]
    assert data["mode"] == "exact"  # it fits the tiny model's context: prefilled whole, as ask reads it
    again = json.loads(cli("index", SAMPLES / "contract.txt", "--json", home=home).stdout)
    assert again["computed_tokens"] < 256  # saved: all but the last part of a 256-token segment
    for args, words in ((("index", "-"), "not stdin"), (("index", SAMPLES / "contract.txt", "--no-cache"), "--no-cache")):
        result = cli(*args, home=home)
        assert result.exit_code == 2 and words in result.stderr and len(result.stderr.splitlines()) == 1


# -- the live decode line ---------------------------------------------------------------------------

def test_the_decode_line_stays_live_below_a_streamed_answer():
    """On a terminal the bars give way to the streamed answer, but tokens and tok/s go on in a line
    pinned to the last row, outside the scroll region the answer is written in."""
    import fcntl
    import pty
    import struct
    import termios

    from rich.console import Console

    from kvpage_cli.cli.progress import Reporter
    from kvpage_cli.engine.events import DecodeProgress

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    stream = os.fdopen(slave, "w")
    try:
        reporter = Reporter(Console(file=stream, force_terminal=True, width=80), bars=True)
        with reporter:
            reporter(DecodeProgress(1, 0.1, 5))
            reporter.pin_status()
            for n in (10, 20):
                reporter(DecodeProgress(n, n / 10, 5))
                reporter._status._drawn_at = 0.0  # the next event redraws at once
        stream.flush()
        out = _read_all(master)
    finally:
        stream.close()
        os.close(master)
    region = out.index("\x1b[1;23r")
    assert out.index("\x1b[24;1H\x1b[2Kdecode 10 tok  10.0 tok/s") > region
    assert out.index("decode 20 tok  10.0 tok/s") > out.index("decode 10 tok")
    assert out.rindex("\x1b[r") > out.index("decode 20 tok")  # the whole screen back at the end


def _read_all(fd) -> str:
    import select

    data = b""
    while select.select([fd], [], [], 0.2)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", errors="replace")
