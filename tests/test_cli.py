"""The command line, through typer's CliRunner: stdout (data) and stderr (everything else) apart.

The model is a tiny random llama with SmolLM2's tokenizer (`tiny_cli_model` in conftest), passed as
`--model FOLDER` like a user's model: its text is gibberish, but every command path runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpage_cli.cli.app import app
from kvpage_cli.engine.config import DEFAULT_POOL_MIB
from kvpage_cli.ingest import load as load_document
from kvpage_cli.tasks import RISK_LEVELS, SCHEMA_VERSION, Asker, Reviewer
from kvpage_cli.tasks.taxonomy import BY_NAME

from .conftest import CORPUS, SAMPLES

CONTRACT = """SERVICES AGREEMENT

1. TERM

1.1 Initial Term. This Agreement starts on April 1, 2025 and runs for three years.

1.2 Renewal. This Agreement renews automatically for successive three-year terms unless Customer gives notice of non-renewal at least 180 days before the end of the term.

2. LIABILITY

2.1 Limitation of Liability. In no event shall Provider's aggregate liability arising out of this Agreement exceed the fees paid by Customer in the three months before the claim.

3. GOVERNING LAW

3.1 Law. This Agreement is governed by the laws of the State of Delaware.
"""
CLAUSE_IDS = ["1.1", "1.2", "2.1", "3.1"]
COLOR_CODE = re.compile(r"\x1b\[[0-9;]*(?:3[0-8]|9[0-7])[;m]")


@pytest.fixture(scope="module")
def cli(kv_home, tiny_cli_model):
    """run(*args, input=None, env=None, model=True) -> Result, with the tiny model and small outputs."""
    runner = CliRunner()

    def run(*args: str, input=None, env: dict | None = None, model: bool = True):
        argv = [str(a) for a in args]
        if model and argv and argv[0] in ("review", "ask", "info"):
            argv += ["--model", str(tiny_cli_model)]
            if argv[0] != "info":
                argv += ["--max-new-tokens", "3"]
        environment = {"KVPAGE_HOME": str(kv_home), "KVPAGE_MODEL": None, "KVPAGE_DEBUG": None,
                       "NO_COLOR": None, "FORCE_COLOR": None, **(env or {})}
        return runner.invoke(app, argv, input=input, env=environment)

    return run


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    path = tmp_path_factory.mktemp("contract") / "contract.txt"
    path.write_text(CONTRACT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reviewed(cli, contract):
    """One `review --json` run, shared by the checks of its content."""
    result = cli("review", contract, "--json")
    assert result.exit_code == 0, result.stderr
    return result


def one_error_line(result, exit_code: int = 1) -> str:
    """The result is a failure with nothing on stdout and exactly one line on stderr."""
    assert result.exit_code == exit_code, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def stats_only(stderr: str, decoded: bool = True) -> None:
    """stderr holds the final statistics line and nothing else (no bars, no data); a decode rate
    only where tokens were decoded (a review scores its answers: none)."""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("kvpage: prefill ")
    for figure in ("tok/s", "pool", "MiB", "store", "blocks moved"):
        assert figure in lines[0]
    assert ("| decode " in lines[0]) == decoded, lines[0]


# -- help ---------------------------------------------------------------------------------------

@pytest.fixture()
def engine_loads(monkeypatch) -> list[tuple[str, object]]:
    """(model, EngineConfig) of each engine a command loads, the engine loaded as it would be."""
    from kvpage_cli.engine import Engine

    real, seen = Engine.load, []

    def load(source, config=None, **kwargs):
        seen.append((source, config))
        return real(source, config, **kwargs)

    monkeypatch.setattr(Engine, "load", load)
    return seen


def test_the_cli_defaults_are_the_engine_configs(cli, kv_home, engine_loads):
    """A command given no engine option builds EngineConfig's own defaults, and says them."""
    import dataclasses

    from kvpage_cli.engine import EngineConfig

    result = cli("info", "--json")
    assert result.exit_code == 0, result.stderr
    [(_, config)] = engine_loads
    assert config.home == str(kv_home) and config.kv_cache  # the CLI saves a document's KV unless --no-cache
    assert dataclasses.replace(config, home=None, kv_cache=False) == EngineConfig()
    shown, engine = json.loads(result.stdout), EngineConfig()
    assert engine.pool_mib is None  # the device's default: 64 MiB on this CPU
    assert (shown["mode"], shown["pool_mib"], shown["dtype"], shown["weights_option"], shown["kv_dtype_option"]) == (
        engine.mode, DEFAULT_POOL_MIB, engine.dtype, engine.weights, engine.kv_dtype)


def test_engine_options_and_KVPAGE_MODEL_reach_the_engine(cli, tiny_cli_model, engine_loads):
    result = cli("info", "--json", "--threads", "1", "--policy", "lru", "--device", "cpu", "--backend", "torch",
                 "--dtype", "bfloat16", model=False, env={"KVPAGE_MODEL": str(tiny_cli_model)})
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    assert (shown["model"], shown["device"], shown["backend"], shown["dtype"]) == (
        str(tiny_cli_model), "cpu", "torch", "bfloat16")
    [(model, config)] = engine_loads
    assert model == str(tiny_cli_model) and (config.threads, config.policy) == (1, "lru")


def test_help_lists_the_commands(cli):
    result = cli("--help", model=False)
    assert result.exit_code == 0
    for command in ("review", "ask", "info"):
        assert command in result.stdout


@pytest.mark.parametrize("command", ["review", "ask", "info"])
def test_each_command_help_has_examples(cli, command):
    result = cli(command, "--help", model=False)
    assert result.exit_code == 0
    assert "Examples" in result.stdout
    assert f"kvpage {command}" in result.stdout
    for option in ("--model", "--mode", "--pool-mib", "--json", "--out", "--quiet", "--no-color", "--debug"):
        assert option in result.stdout


# -- review -------------------------------------------------------------------------------------

def test_review_json_is_one_document_with_valid_findings(reviewed, contract):
    data = json.loads(reviewed.stdout)
    assert next(iter(data)) == "schema_version" and data["schema_version"] == SCHEMA_VERSION
    assert data["mode"] == "exact" and data["complete"] is True
    assert data["clauses_total"] == len(CLAUSE_IDS)
    ids = [f["clause_id"] for f in data["findings"]]
    assert {"1.2", "2.1", "3.1"} <= set(ids) <= set(CLAUSE_IDS)  # renewal, cap and law are findings
    risks = [RISK_LEVELS.index(f["risk"]) for f in data["findings"]]
    assert risks == sorted(risks)  # worst first
    doc = load_document(str(contract))
    for finding in data["findings"]:
        assert all(c in BY_NAME for c in finding["categories"]) and finding["category"] == finding["categories"][0]
        assert finding["risk"] in RISK_LEVELS
        assert doc.text[finding["start"]:finding["end"]] == finding["quote"]
        assert doc.find_quote(finding["quote"]) is not None
        assert finding["source"].startswith("line")
    terms = {t["label"]: t for t in data["terms"]}
    assert [v["text"] for v in terms["Governing law"]["values"]] == ["Delaware"]  # the contract's own word
    for term in data["terms"]:
        for v in term["values"]:
            assert doc.text[v["start"]:v["end"]] == v["text"]
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "pool_mib", "store_mib", "blocks_moved"):
        assert key in data["stats"]
    stats_only(reviewed.stderr, decoded=False)


def test_a_review_that_asks_the_model_nothing_prints_no_rate(cli, tmp_path):
    """An AI addendum of the corpus: its one finding (an IP assignment) needs no question, so
    nothing is prefilled, and a rate of 0 tokens in 0 seconds is not a measurement."""
    path = tmp_path / "addendum.txt"
    path.write_text("2.1 Ownership. To the extent permitted by Applicable Laws, Provider hereby assigns to Customer "
                    "all right, title, and interest, if any, in and to Output.\n")
    result = cli("review", path, "--json")
    assert result.exit_code == 0, result.stderr
    assert [f["categories"] for f in json.loads(result.stdout)["findings"]] == [["IP ownership assignment"]]
    line = result.stderr.splitlines()[-1]
    assert line.startswith("kvpage: prefill 0 tok | pool ") and "tok/s" not in line, line


def test_review_in_a_pipe_is_plain_text_and_says_the_mode(cli, contract):
    result = cli("review", contract, "-v")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "exact mode" in out.splitlines()[0]
    assert "Key terms" in out and re.search(r"Governing law: +Delaware \(clause 3.1, line 15\)", out)
    found = [c for c in CLAUSE_IDS if re.search(rf"^{re.escape(c)} ", out, re.M)]
    assert {"1.2", "2.1", "3.1"} <= set(found)
    assert out.count("  risk:") == len(found) and out.count("  quote:") == len(found)
    assert "\x1b[" not in out and "\x1b[" not in result.stderr
    assert "━" not in result.stderr  # no progress bars when stderr is not a terminal
    # -v: model-loading stages and one line per clause, then the statistics
    assert "loading weights" in result.stderr
    for clause_id in found:
        assert f"clause {clause_id}: " in result.stderr
    assert result.stderr.splitlines()[-1].startswith("kvpage: prefill ")


def test_review_jsonl_streams_findings_then_a_summary(cli, contract):
    result = cli("review", contract, "--jsonl")
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["type"] for line in lines] == ["finding"] * (len(lines) - 1) + ["summary"]
    ids = [line["clause_id"] for line in lines[:-1]]
    assert ids == [c for c in CLAUSE_IDS if c in ids]  # in document order, as they are done
    assert all(line["document"] == str(contract) for line in lines[:-1])
    assert lines[-1]["complete"] is True and lines[-1]["mode"] == "exact" and lines[-1]["terms"]
    stats_only(result.stderr, decoded=False)


def test_review_markdown_and_table_carry_the_same_fields(cli, contract, reviewed):
    findings = json.loads(reviewed.stdout)["findings"]
    markdown = cli("review", contract, "--format", "markdown", "-q")
    assert markdown.exit_code == 0 and markdown.stderr == ""
    assert markdown.stdout.startswith("# Contract review")
    assert "exact mode" in markdown.stdout
    table = cli("review", contract, "-f", "table", "-q")
    assert table.exit_code == 0 and table.stderr == ""
    assert "exact mode" in table.stdout
    for finding in findings:
        for text in (markdown.stdout, table.stdout):
            assert finding["clause_id"] in text and finding["category"].split()[0] in text
        assert f"- **Reason:** {finding['rationale']}" in markdown.stdout
        assert f"- **Risk:** {finding['risk']}" in markdown.stdout
        assert " ".join(finding["quote"].split()) in markdown.stdout
        assert finding["source"] in markdown.stdout
    for level in {f["risk"] for f in findings}:
        assert f"{level.upper()} risk" in table.stdout
        assert f"## {level.capitalize()} risk" in markdown.stdout


def test_review_out_writes_the_file_and_nothing_on_stdout(cli, contract, tmp_path):
    out = tmp_path / "review.md"
    result = cli("review", contract, "--out", out, "-q")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""
    assert out.read_text().startswith("# Contract review")  # the format follows the suffix
    assert [p.name for p in tmp_path.iterdir()] == ["review.md"]  # no temp file left


def test_out_is_on_disk_before_it_replaces_a_file_and_keeps_that_files_mode(cli, contract, tmp_path, monkeypatch):
    import os

    out = tmp_path / "review.json"
    out.write_text("an older review")
    os.chmod(out, 0o640)
    steps = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        steps.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        steps.append(("replace", str(src)))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    result = cli("review", contract, "--out", out, "-q")
    assert result.exit_code == 0, result.stderr
    part = next(path for step, path in steps if step == "replace" and path.endswith(".part"))
    assert steps.index(("fsync", part)) < steps.index(("replace", part))
    assert json.loads(out.read_text())["findings"]
    assert out.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["review.json"]


def test_review_reads_stdin(cli, contract):
    result = cli("review", "-", "--json", input=CONTRACT.encode())
    assert result.exit_code == 0, result.stderr
    assert {f["clause_id"] for f in json.loads(result.stdout)["findings"]} >= {"1.2", "2.1", "3.1"}


def test_review_selective_mode_says_so(cli, contract):
    result = cli("review", contract, "--json", "--mode", "selective", "--pool-mib", "0.1")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["mode"] == "selective" and data["stats"]["mode"] == "selective"
    assert all(f["category"] in BY_NAME for f in data["findings"])


def test_fail_on_exits_3_only_when_a_finding_reaches_the_level(cli, contract, reviewed, tmp_path):
    assert "high" in [f["risk"] for f in json.loads(reviewed.stdout)["findings"]]  # 1.2's 180 days' notice
    hit = cli("review", contract, "--json", "--fail-on", "high")
    assert hit.exit_code == 3
    assert json.loads(hit.stdout)["complete"] is True  # the output is printed in full first
    assert hit.stderr.splitlines()[-1] == "kvpage: 2 finding(s) at high risk or above (--fail-on high): 1.2, 2.1"
    # the term and the governing law alone: low risk at worst
    mild = tmp_path / "mild.txt"
    mild.write_text(CONTRACT.split("1.2 Renewal")[0] + "3. GOVERNING LAW" + CONTRACT.split("3. GOVERNING LAW")[1])
    assert {f["risk"] for f in json.loads(cli("review", mild, "--json").stdout)["findings"]} == {"low"}
    for level, code in (("high", 0), ("medium", 0), ("low", 3)):
        assert cli("review", mild, "--json", "--fail-on", level).exit_code == code, level


def test_quiet_fail_on_exits_3_and_says_nothing(cli, contract):
    result = cli("review", contract, "--json", "-q", "--fail-on", "high")
    assert result.exit_code == 3
    assert json.loads(result.stdout)["complete"] is True and result.stderr == ""


def test_several_documents_give_one_review_each_and_jsonl_names_the_document(cli, contract, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(CONTRACT.replace("Delaware", "Ohio"), encoding="utf-8")
    result = cli("review", contract, other, "--jsonl", "--batch", "2")
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    summaries = [line for line in lines if line["type"] == "summary"]
    assert [s["document"] for s in summaries] == [str(contract), str(other)]
    assert {line["document"] for line in lines if line["type"] == "finding"} == {str(contract), str(other)}
    laws = [next(t for t in s["terms"] if t["label"] == "Governing law")["values"][0]["text"] for s in summaries]
    assert laws == ["Delaware", "Ohio"]
    text = cli("review", contract, other, "-q")
    assert text.stdout.count("4 clauses, ") == 2


def test_each_documents_prefill_is_reported_in_a_review_of_several(cli, contract, tmp_path, monkeypatch):
    """A log of `review A B -v` follows the second document's prefill too (it was taken for
    questions appended after the first document's, and neither drew a bar nor wrote a line)."""
    from kvpage_cli.cli import progress

    monkeypatch.setattr(progress, "PROGRESS_LINE_S", 0.0)  # a progress line at every event
    other = tmp_path / "other.txt"
    other.write_text(CONTRACT + "\n\n12. Notices. Notices are given in writing.\n", encoding="utf-8")
    result = cli("review", contract, other, "-v", "--format", "text")
    assert result.exit_code == 0, result.stderr
    ends = [line for line in result.stderr.splitlines() if re.match(r"kvpage: prefill (\S+)/\1 tok", line)]
    assert len(ends) == 2 and ends[0] != ends[1], result.stderr


def test_shard_reviews_every_nth_document_of_a_folder(cli, tmp_path):
    folder = tmp_path / "dataroom"
    folder.mkdir()
    for name in ("a.txt", "b.md", "c.txt"):
        (folder / name).write_text(CONTRACT, encoding="utf-8")
    (folder / "notes.csv").write_text("not a contract")

    def reviewed_documents(*extra):
        result = cli("review", folder, "--jsonl", *extra)
        assert result.exit_code == 0, result.stderr
        return [json.loads(line)["document"] for line in result.stdout.splitlines() if '"summary"' in line]

    assert reviewed_documents("--shard", "0/2") == [str(folder / "a.txt"), str(folder / "c.txt")]
    assert reviewed_documents("--shard", "1/2") == [str(folder / "b.md")]
    line = one_error_line(cli("review", folder, "--shard", "2/2"), exit_code=2)
    assert "--shard 2/2" in line


def test_a_malformed_playbook_is_one_line_naming_its_line(cli, contract, tmp_path):
    playbook = tmp_path / "ours.toml"
    playbook.write_text('format = 1\n\n[categories."Governing Law"]\nlevel = "severe"\n')
    line = one_error_line(cli("review", contract, "--playbook", playbook))
    assert f"playbook {playbook} (line 4)" in line and "severe" in line
    playbook.write_text('[categories."Governing Law"]\nlevel = "high"\nreason = "Not our law."\n')
    result = cli("review", contract, "--json", "--playbook", playbook)
    assert result.exit_code == 0, result.stderr
    findings = json.loads(result.stdout)["findings"]
    assert [(f["clause_id"], f["risk"], f["rationale"]) for f in findings] == [("3.1", "high", "Not our law.")]


def test_explain_drops_commentary_that_fails_its_checks(cli, contract):
    result = cli("review", contract, "--json", "--explain", "--max-new-tokens", "12")
    assert result.exit_code == 0, result.stderr
    findings = json.loads(result.stdout)["findings"]
    assert findings and all(f["commentary"] is None for f in findings)  # a random model's words never pass
    assert json.loads(result.stdout)["stats"]["decode_tokens"] > 0  # it was asked


def test_encrypted_pdf_reads_with_the_password(cli):
    result = cli("review", CORPUS / "odd/pdf/issue21579.pdf", "--password", "pässwört", "--json", "--all")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["findings"] and all(f["source"] == "page 1" for f in data["findings"])
    assert "decryption succeeded" in " ".join(f["quote"] for f in data["findings"])


def test_the_pdf_password_from_the_environment_or_a_hidden_prompt(cli, monkeypatch):
    from kvpage_cli.cli import session

    locked = CORPUS / "odd/pdf/issue21579.pdf"
    result = cli("review", locked, "--json", "--all", env={"KVPAGE_PDF_PASSWORD": "pässwört"})
    assert result.exit_code == 0, result.stderr  # never on the command line, so never in ps
    line = one_error_line(cli("review", locked, "--json"))  # no terminal to ask on
    assert "encrypted; pass --password, or set KVPAGE_PDF_PASSWORD" in line
    monkeypatch.setattr(session, "_interactive", lambda: True)
    result = cli("review", locked, "--json", "--all", input="pässwört\n")
    assert result.exit_code == 0, result.stderr
    assert "issue21579.pdf is encrypted; password:" in result.stderr and "pässwört" not in result.stderr
    assert json.loads(result.stdout)["findings"]


def test_non_utf8_text_is_read_with_a_warning(cli, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("1. Le présent contrat est régi par le droit français; la société paie.\n".encode("cp1252"))
    result = cli("review", path, "--json", "--all")
    assert result.exit_code == 0, result.stderr
    assert "présent" in json.loads(result.stdout)["findings"][0]["quote"]
    assert "not UTF-8" in result.stderr.splitlines()[0]


# -- bad input: one line on stderr, nothing on stdout --------------------------------------------

def _broken_files(tmp_path):
    (tmp_path / "broken.docx").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\n1 0 obj garbage")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 16)


@pytest.mark.parametrize("path, says", [
    (CORPUS / "odd/pdf/issue21579.pdf", "encrypted; pass --password"),
    (CORPUS / "odd/pdf/issue7200.pdf", "needs OCR"),
    (CORPUS / "odd/pdf/poppler-395-0-fuzzed.pdf", "could not read page 1"),
    (CORPUS / "odd/docx/doc-word-default-blank.docx", "is empty"),
    (SAMPLES / "repo/assets/logo.png", "not a supported document type"),
    ("no/such/contract.pdf", "does not exist"),
    ("broken.docx", "could not be read"),
    ("broken.pdf", "could not be read"),
    ("empty.txt", "is empty"),
    ("blob.txt", "looks binary"),
])
def test_bad_input_is_one_clear_line(cli, tmp_path, monkeypatch, path, says):
    _broken_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = cli("review", path, "--out", tmp_path / "review.json")
    line = one_error_line(result)
    assert line.startswith("kvpage: error: ") and says in line
    assert not (tmp_path / "review.json").exists()


@pytest.mark.parametrize("name, says", [
    ("zip bomb", "word/document.xml would inflate 1,029-fold"),
    ("nesting", "nests its elements more than 256 levels deep"),
])
def test_hostile_docx_is_one_clear_line(cli, hostile_docx, name, says):
    line = one_error_line(cli("review", hostile_docx[name]))
    assert line.startswith("kvpage: error: ") and says in line


def test_too_much_stdin_is_refused_before_it_is_read_whole(cli, monkeypatch):
    from kvpage_cli.ingest import document

    monkeypatch.setattr(document, "MAX_SOURCE_BYTES", 1000)
    line = one_error_line(cli("ask", "-", "What is it?", input=CONTRACT * 10))
    assert "stdin is too large to read: it is over 1000 bytes" in line


def test_a_directory_with_nothing_readable(cli, tmp_path):
    (tmp_path / "logo.png").write_bytes((SAMPLES / "repo/assets/logo.png").read_bytes())
    line = one_error_line(cli("ask", tmp_path, "What is here?"))
    assert "has no readable text files" in line


def test_a_document_longer_than_the_context_says_both_numbers_in_exact_mode(cli, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("\n\n".join(f"{i}. The Supplier shall deliver the goods on time and in full." for i in range(1, 900)))
    line = one_error_line(cli("ask", path, "When are goods delivered?", "--mode", "exact"))
    numbers = [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?= tokens)", line)]
    assert 8192 in numbers and max(numbers) > 8192, line
    assert "--mode auto" in line  # what to do


def test_a_document_longer_than_the_context_is_answered_from_its_blocks(cli, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("\n\n".join(f"{i}. The Supplier shall deliver the goods on time and in full." for i in range(1, 900)))
    result = cli("ask", path, "When are goods delivered?", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["mode"] == "retrieval" and 0 < data["attended_blocks"] < data["total_blocks"]
    assert data["sources"] and all(s["where"].startswith("line") for s in data["sources"])
    assert re.search(r"retrieval mode: attended \d+ of [\d,]+ blocks, \d+% of the document", result.stderr.splitlines()[-1])
    assert "selective" not in result.stderr.splitlines()[-1]
    selective = cli("ask", path, "When are goods delivered?", "--mode", "selective", "--json")
    assert selective.exit_code == 0, selective.stderr
    assert json.loads(selective.stdout)["mode"] == "retrieval"
    assert re.search(r"retrieval mode: attended \d+ of [\d,]+ blocks, \d+% of the document; decode steps attended "
                     r"the policy's blocks of those \(selective: approximate\)", selective.stderr.splitlines()[-1])


@pytest.mark.parametrize("damage, says", [
    ("config.json", "unreadable config.json"),
    ("tokenizer.json", "no usable tokenizer"),
    ("model.safetensors", "unreadable weights"),
])
def test_a_damaged_model_folder_is_a_model_error(cli, tiny_cli_model, tmp_path, damage, says):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_cli_model, folder)
    (folder / damage).write_bytes(b'{"this is": "not what it should be", ' + b"\x00" * 64)
    line = one_error_line(cli("info", "--model", folder, model=False))
    assert line.startswith(f"kvpage: error: {folder}") and says in line and "unexpected" not in line


@pytest.mark.parametrize("command", ["ask", "review"])
def test_a_document_that_cannot_fit_is_refused_before_it_is_tokenized(cli, tmp_path, monkeypatch, command):
    from kvpage_cli.tasks import chat, length

    def never(self, text):
        raise AssertionError(f"tokenized {len(text):,} characters")

    monkeypatch.setattr(chat.PromptBuilder, "prefix", never)
    monkeypatch.setattr(chat.PromptBuilder, "prefix_spans", never)
    monkeypatch.setattr(length, "NORMALIZER_MARGIN", 1)  # SmolLM2's longest token is 81 characters
    path = tmp_path / "huge.txt"
    path.write_text("1. The supplier delivers.\n" * (8192 * 81 // 26 + 1))
    args = ["ask", path, "What is due?", "--mode", "exact"] if command == "ask" else ["review", path, "--mode", "exact"]
    line = one_error_line(cli(*args))
    assert "the input is more than 8192 tokens but the context limit is 8192 tokens" in line
    assert "no token of this model spells more than 81" in line


def test_unknown_model(cli, contract):
    line = one_error_line(cli("review", contract, "--model", "no-such-model", model=False))
    assert "unknown model 'no-such-model'" in line
    line = one_error_line(cli("info", "--model", "missing.gguf", model=False))
    assert "does not exist" in line


@pytest.mark.parametrize("args, says", [
    (["review"], "Missing argument"),
    (["review", "{contract}", "--mode", "fast"], "--mode"),
    (["review", "{contract}", "--json", "--jsonl"], "choose one output format"),
    (["review", "{contract}", "--json", "--format", "markdown"], "choose one output format"),
    (["review", "{contract}", "--pool-mib", "0"], "pool_mib must be positive"),
    (["review", "{contract}", "--out", "no/such/folder/review.json"], "does not exist"),
    (["review", "{contract}", "--fail-on", "none"], "--fail-on"),
    (["ask", "{contract}", "  "], "the question is empty"),
    (["info", "--format", "markdown"], "not available"),
    (["review", "{contract}", "--no-such-option"], "No such option"),
])
def test_usage_errors_exit_2_with_one_line(cli, contract, args, says):
    args = [str(contract) if a == "{contract}" else a for a in args]
    line = one_error_line(cli(*args), exit_code=2)
    assert line.startswith("kvpage: error: ") and says in line


def test_unexpected_errors_are_one_line_unless_debug(cli, contract, monkeypatch):
    def boom(self):
        raise RuntimeError("boom")
        yield

    monkeypatch.setattr(Reviewer, "review", boom)
    line = one_error_line(cli("review", contract))
    assert "unexpected error: RuntimeError: boom" in line and "--debug" in line
    for debug in ({"env": {"KVPAGE_DEBUG": "1"}}, {}):
        args = ("review", contract) if debug else ("review", contract, "--debug")
        result = cli(*args, **debug)
        assert isinstance(result.exception, RuntimeError)  # re-raised: the traceback is shown


# -- Ctrl-C ---------------------------------------------------------------------------------------

@pytest.fixture()
def interrupt_after_two(monkeypatch):
    real = Reviewer.review

    def review(self):
        for done, finding in enumerate(real(self)):
            if done == 2:
                raise KeyboardInterrupt
            yield finding

    monkeypatch.setattr(Reviewer, "review", review)


def test_ctrl_c_keeps_printed_lines_but_no_summary(cli, contract, interrupt_after_two):
    result = cli("review", contract, "--jsonl")
    assert result.exit_code == 130
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["type"] for line in lines] == ["finding", "finding"]
    assert "interrupted: 2 of 4 clauses reviewed" in result.stderr.splitlines()[-1]


def test_ctrl_c_writes_no_out_file(cli, contract, tmp_path, interrupt_after_two):
    out = tmp_path / "review.json"
    result = cli("review", contract, "--out", out)
    assert result.exit_code == 130 and result.stdout == ""
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert f"{out} was not written" in result.stderr


# -- ask ------------------------------------------------------------------------------------------

def test_ask_streams_each_piece_as_it_is_decoded(cli, contract, monkeypatch):
    real = Asker.answers
    seen: list[tuple[str, str]] = []

    def answers(self):
        for index, piece in real(self):
            seen.append((piece, sys.stdout.buffer.getvalue().decode()))  # stdout before this piece
            yield index, piece

    monkeypatch.setattr(Asker, "answers", answers)
    result = cli("ask", contract, "How long is the initial term?", "--max-new-tokens", "6", "--no-evidence")
    assert result.exit_code == 0, result.stderr
    assert seen
    for i, (_, before) in enumerate(seen):
        assert before == "".join(piece for piece, _ in seen[:i])  # earlier pieces were flushed
    assert result.stdout == "".join(piece for piece, _ in seen) + "\n"
    stats_only(result.stderr)


def test_ask_json_over_a_repository(cli):
    result = cli("ask", SAMPLES / "repo", "Where is the VAT rate configured?", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert next(iter(data)) == "schema_version"
    assert data["question"] == "Where is the VAT rate configured?" and isinstance(data["answer"], str)
    assert data["mode"] == "exact" and data["complete"] is True and data["document_tokens"] > 1000
    assert "assets/logo.png" in result.stderr  # the skipped binary file is a warning on stderr
    assert result.stderr.splitlines()[-1].startswith("kvpage: prefill ")


def test_ask_reads_stdin(cli):
    result = cli("ask", "-", "Who pays?", "--json", "--quiet", input=CONTRACT.encode())
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    assert json.loads(result.stdout)["source"] == "-"


def test_several_questions_are_answered_in_order_each_as_it_would_be_alone(cli, contract):
    from kvpage_cli.cli.render import evidence_text
    from kvpage_cli.tasks.schema import Evidence

    questions = ["Who pays?", "What law governs?", "How long is the initial term?"]
    each = [json.loads(cli("ask", contract, q, "--json", "--max-new-tokens", "5").stdout) for q in questions]
    alone = [d["answer"] for d in each]
    args = ["ask", contract, questions[0], "-q", questions[1], "-q", questions[2], "--max-new-tokens", "5"]
    result = cli(*args)
    assert result.exit_code == 0, result.stderr
    # each answer with its evidence under it, as it would be alone
    expected = "\n".join(f"Q{i + 1}: {q}\n{d['answer']}\n" + evidence_text([Evidence(**e) for e in d["evidence"]])
                         for i, (q, d) in enumerate(zip(questions, each)))
    assert _squash(result.stdout) == _squash(expected)
    listed = json.loads(cli(*args, "--json").stdout)
    assert [d["question"] for d in listed] == questions and [d["answer"] for d in listed] == alone
    assert [d["question_index"] for d in listed] == [0, 1, 2] and all(d["complete"] for d in listed)
    lines = [json.loads(line) for line in cli(*args, "--jsonl").stdout.splitlines()]
    assert sorted(d["question_index"] for d in lines) == [0, 1, 2] and all(d["type"] == "answer" for d in lines)
    markdown = cli(*args, "--format", "markdown").stdout
    assert [markdown.index(f"## {q}") for q in questions] == sorted(markdown.index(f"## {q}") for q in questions)


def _squash(text: str) -> str:
    return " ".join(text.split())


def test_ask_without_a_question_is_a_usage_error(cli, contract):
    result = cli("ask", contract)
    assert result.exit_code == 2 and "give a question" in result.stderr


# -- info -----------------------------------------------------------------------------------------

def test_info_text_and_json(cli):
    text = cli("info")
    assert text.exit_code == 0, text.stderr
    for label in ("model", "architecture", "context limit", "kv per token", "pool", "store", "weights",
                  "device", "backend", "retrieval"):
        assert re.search(rf"^{label} +\S", text.stdout, re.M), label
    data = json.loads(cli("info", "--json").stdout)
    assert data["retrieval_tokens"] == 4096 and data["retrieval_bound"] == "kvpage's budget"  # not the store's pool
    # 2 (K and V) x 2 layers x 2 KV heads x head dim 16 x 4 bytes
    assert data["kv_bytes_per_token"] == 512 and data["kv_bytes_per_token_by_dtype"]["bfloat16"] == 256
    half = json.loads(cli("info", "--kv-dtype", "bfloat16", "--json").stdout)
    assert half["kv_dtype"] == "bfloat16" and half["dtype"] == "float32" and half["kv_bytes_per_token"] == 256
    assert re.search(r"^kv per token +256 bytes .* in bfloat16", cli("info", "--kv-dtype", "bfloat16").stdout, re.M)
    # int8: 2 x 2 layers x 2 KV heads x (16 int8 numbers + a float32 scale) per row
    assert json.loads(cli("info", "--kv-dtype", "int8", "--json").stdout)["kv_bytes_per_token"] == 160
    assert data["context_limit"] == 8192 and data["architecture"] == "llama"
    assert data["pool_slots_per_layer"] > 0 and data["store_mib"] == 0
    assert data["device"] == "cpu" and data["backend"] in ("native", "torch")
    if data["backend"] == "native":  # head dim 16: torch's kernel, whatever the KV and the CPU
        assert data["prefill_attention"].startswith("torch's float32 flash attention (KV in float32")
        assert "(head dim 16; prefill.c takes multiples of 64)" in half["prefill_attention"]
    assert data["weights"] == "float32" and data["weights_option"] == "auto"  # a folder has no GGUF blocks
    if data["backend"] == "native":
        compact = json.loads(cli("info", "--weights", "int8", "--json").stdout)
        assert compact["weights"] == "int8" and compact["weights_mib"] < data["weights_mib"] / 3
        assert re.search(r"^weights .*int8.*; --weights int8; float32 would take", cli("info", "--weights", "int8").stdout, re.M)
        assert "decoding multiplies them with float32 activations" in cli("info", "--weights", "int8").stdout
        fast = cli("info", "--weights", "int8", "--activations", "int8")
        assert "decoding multiplies them with int8 activations" in fast.stdout
        assert json.loads(cli("info", "--weights", "int8", "--activations", "int8", "--json").stdout)["activations"] == "int8"
        refused = cli("info", "--activations", "int8")  # a folder's float32 weights: nothing quantized
        assert refused.exit_code != 0 and "int8 activations multiply quantized weights" in refused.stderr


# -- colour -------------------------------------------------------------------------------------

def test_no_color_and_NO_COLOR_are_honoured(cli):
    args = ("review", "missing.pdf")
    assert COLOR_CODE.search(cli(*args, env={"FORCE_COLOR": "1"}).stderr)  # colour is on when forced
    assert not COLOR_CODE.search(cli(*args, "--no-color", env={"FORCE_COLOR": "1"}).stderr)
    assert not COLOR_CODE.search(cli(*args, env={"FORCE_COLOR": "1", "NO_COLOR": "1"}).stderr)


# -- the saved-KV cache ----------------------------------------------------------------------------


def test_a_second_ask_reads_the_document_from_the_cache(cli, tmp_path):
    env = {"KVPAGE_HOME": str(tmp_path)}
    contract = SAMPLES / "contract.txt"  # long enough for whole 256-token segments
    first = cli("ask", contract, "What is the term?", "--json", env=env)
    second = cli("ask", contract, "What is the term?", "--json", env=env)
    assert first.exit_code == 0 and second.exit_code == 0, second.stderr
    one, two = json.loads(first.stdout), json.loads(second.stdout)
    assert one["cached_tokens"] == 0
    assert two["cached_tokens"] > 0 and two["cached_tokens"] % 64 == 0
    assert two["answer"] == one["answer"]
    assert "from saved KV" in second.stderr

    listed = cli("cache", "ls", "--json", env=env)
    entries = json.loads(listed.stdout)
    assert [e["label"] for e in entries] == [str(contract.resolve())]
    assert entries[0]["tokens"] >= two["cached_tokens"]

    removed = cli("cache", "rm", str(contract), env=env)
    assert removed.exit_code == 0 and "removed 1" in removed.stderr
    assert json.loads(cli("cache", "ls", "--json", env=env).stdout) == []
    missing = cli("cache", "rm", str(contract), env=env)
    assert missing.exit_code == 1 and "no saved document" in missing.stderr


def test_no_cache_neither_reads_nor_writes(cli, tmp_path):
    env = {"KVPAGE_HOME": str(tmp_path)}
    contract = SAMPLES / "contract.txt"
    assert cli("ask", contract, "Who pays?", "--no-cache", env=env).exit_code == 0
    assert json.loads(cli("cache", "ls", "--json", env=env).stdout) == []
    assert cli("ask", contract, "Who pays?", env=env).exit_code == 0
    assert len(json.loads(cli("cache", "ls", "--json", env=env).stdout)) == 1
    cleared = cli("cache", "clear", env=env)
    assert cleared.exit_code == 0 and "removed 1" in cleared.stderr
    assert json.loads(cli("cache", "ls", "--json", env=env).stdout) == []


def test_the_places_an_answer_read_name_each_place_once(tmp_path):
    """Two passages of one page of a PDF read "pages 45-46; page 46" on `ask -v`'s line."""
    from kvpage_cli.cli.ask import _places
    from kvpage_cli.ingest import load

    path = tmp_path / "long-lines.txt"
    path.write_text("A" * 900 + "\n" + "B" * 900 + "\n" + "C" * 900 + "\n")
    doc = load(str(path))
    sources = [{"where": doc.where(s, e), "start": s, "end": e} for s, e in ((0, 100), (500, 1000), (1200, 1300), (2000, 2100))]
    assert [s["where"] for s in sources] == ["line 1", "lines 1-2", "line 2", "line 3"]
    assert _places(doc, sources) == ["line 1", "lines 1-2", "line 3"]  # line 2 again adds nothing to lines 1-2


def test_an_empty_document_is_refused_in_the_words_of_the_command_used(cli, tmp_path):
    """`kvpage ask` over an empty file said "there is no text to review"."""
    path = tmp_path / "empty.txt"
    path.write_text("\n \n")
    line = one_error_line(cli("ask", path, "What is it about?"))
    assert "is empty" in line and "review" not in line, line


# -- paths a user takes that nothing else checks -------------------------------------------------

def test_several_documents_where_one_cannot_be_read(cli, contract, tmp_path):
    """The unreadable one is a warning, the others are reviewed, and the run exits 1."""
    blob = tmp_path / "blob.txt"
    blob.write_bytes(b"\x00\x01\x02binary")
    result = cli("review", contract, blob, "--jsonl")
    assert result.exit_code == 1
    summaries = [json.loads(line) for line in result.stdout.splitlines() if '"summary"' in line]
    assert [s["document"] for s in summaries] == [str(contract)]
    lines = result.stderr.splitlines()
    assert f"kvpage: warning: {blob} skipped: {blob} looks binary, not text" in lines
    assert lines[-1] == "kvpage: error: 1 of 2 documents could not be reviewed or written (see the warnings above)"


@pytest.mark.parametrize("args, code, says", [
    (["-", "-"], 2, "kvpage: error: stdin (-) can be read only once"),
    (["{folder}"], 1, "kvpage: error: {folder} holds no contract (PDF, DOCX, TXT or MD files)"),
    (["{contract}", "--shard", "x"], 2, "kvpage: error: --shard x: expected I/N with 0 <= I < N, e.g. 0/4"),
    (["{contract}", "--shard", "1/0"], 2, "kvpage: error: --shard 1/0: expected I/N with 0 <= I < N, e.g. 0/4"),
    (["{contract}", "--shard", "1/2"], 2, "kvpage: error: --shard 1/2: no document falls to this shard (1 given)"),
])
def test_documents_a_review_cannot_take_are_one_line(cli, contract, tmp_path, args, code, says):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.csv").write_text("not a contract")
    names = {"{folder}": str(folder), "{contract}": str(contract)}
    args = [names.get(a, a) for a in args]
    line = one_error_line(cli("review", *args, input=CONTRACT), exit_code=code)
    assert line == says.replace("{folder}", str(folder))


def test_version_and_no_arguments(cli):
    from importlib.metadata import version

    shown = cli("--version", model=False)
    assert shown.exit_code == 0 and shown.stdout == f"kvpage {version('kvpage')}\n"
    bare = cli(model=False)  # `kvpage` alone: the help, as a usage error
    assert bare.exit_code == 2
    assert "Usage: kvpage" in bare.output and all(c in bare.output for c in ("review", "ask", "info", "cache"))


def test_ask_out_writes_the_answer_and_nothing_on_stdout(cli, contract, tmp_path):
    out = tmp_path / "answer.json"
    result = cli("ask", contract, "How long is the initial term?", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    printed = json.loads(cli("ask", contract, "How long is the initial term?", "--json").stdout)
    assert json.loads(out.read_text())["answer"] == printed["answer"] != ""


def test_ctrl_c_during_an_answer_keeps_what_was_printed(cli, contract, monkeypatch):
    def answers(self):
        yield 0, "The term"
        yield 0, " is three"
        raise KeyboardInterrupt

    monkeypatch.setattr(Asker, "answers", answers)
    result = cli("ask", contract, "How long is the initial term?")
    assert result.exit_code == 130
    assert result.stdout == "The term is three\n"
    assert result.stderr.splitlines()[-1] == "kvpage: interrupted: stopped after 4 words; the answers printed are partial"


def test_cache_ls_as_a_table_and_rm_by_key_prefix(cli, tmp_path):
    env = {"KVPAGE_HOME": str(tmp_path)}
    contract = tmp_path / ("a-folder-whose-name-is-long-" * 3) / "contract.txt"  # wider than its column
    contract.parent.mkdir()
    contract.write_bytes((SAMPLES / "contract.txt").read_bytes())  # long enough for whole 256-token segments
    assert cli("ask", contract, "What is the term?", env=env).exit_code == 0
    [entry] = json.loads(cli("cache", "ls", "--json", env=env).stdout)
    assert entry["label"] == str(contract)
    table = cli("cache", "ls", "--format", "table", env=env)
    assert table.exit_code == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[1].split() == ["┃", "label", "┃", "model", "┃", "tokens", "┃", "MiB", "┃", "last", "used", "┃", "key", "┃"]
    rows = [line.split("│")[1:-1] for line in lines[3:-1]]  # a long label folds onto the lines below its row
    assert "".join(cells[0].strip() for cells in rows) == entry["label"]  # whole, however long the path
    assert [cell.strip() for cell in rows[0][1:]] == [Path(entry["model"]).name, f"{entry['tokens']:,}",
                                                      f"{entry['mib']:.1f}", entry["last_used"], entry["key"]]
    assert table.stderr.splitlines()[-1] == f"kvpage: 1 saved document(s), {entry['mib']:.1f} MiB"
    removed = cli("cache", "rm", entry["key"][:8], env=env)
    assert removed.exit_code == 0 and removed.stderr.startswith("kvpage: removed 1 saved document(s)"), removed.stderr
    assert json.loads(cli("cache", "ls", "--json", env=env).stdout) == []


def test_a_busy_cache_is_one_error_saying_try_again(cli, tmp_path, monkeypatch):
    """Another process holds the cache's lock (stuck, or stopped with Ctrl-Z): `cache clear` gives up."""
    from filelock import FileLock

    from kvpage_cli.engine.kv.saved import disk

    monkeypatch.setattr(disk, "LOCK_NOTICE_S", 0.05)
    monkeypatch.setattr(disk, "LOCK_TIMEOUT_S", 0.1)
    folder = disk.KVCache.open(tmp_path).folder
    with FileLock(str(folder / "lock")):  # a lock of its own on the file: flock excludes it as another process
        result = cli("cache", "clear", env={"KVPAGE_HOME": str(tmp_path)})
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (
        f"kvpage: error: the saved-KV cache is unavailable: another kvpage process held the lock of {folder} "
        "for 0 s; try again later")


def test_an_index_larger_than_the_free_disk_is_refused(cli, tmp_path, monkeypatch):
    import collections
    import shutil

    path = tmp_path / "long.txt"  # longer than the model's context: indexed
    path.write_text("\n\n".join(f"{i}. The Supplier shall deliver the goods on time and in full." for i in range(1, 900)))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(2**30, 2**30 - 2**20, 2**20))
    result = cli("ask", path, "When are goods delivered?", env={"KVPAGE_HOME": str(tmp_path / "home")})
    assert result.exit_code == 1 and result.stdout == ""
    line = result.stderr.splitlines()[-1]
    assert re.fullmatch(r"kvpage: error: indexing this document needs \d+\.\d GiB of disk for its KV and \S+ has "
                        r"0\.0 GiB free: free some space, set KVPAGE_HOME to a larger disk, or use --kv-dtype "
                        r"bfloat16 \(half the bytes\)", line), line


def test_a_ctrl_c_before_any_command_says_so(monkeypatch):
    """typer turns a Ctrl-C that comes while the arguments are read into exit 130 without a word
    (`kvpage serve`'s children start there); kvpage says what happened."""
    from kvpage_cli.cli.app import KvpageGroup

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(KvpageGroup, "make_context", interrupted)
    result = CliRunner().invoke(app, ["info"])
    assert result.exit_code == 130
    assert result.stderr == "kvpage: interrupted: stopped before the command began\n"


# -- as a shell runs it: a closed pipe, a terminal ------------------------------------------------

ROOT = SAMPLES.parent


def kvpage_process(args: list[str], kv_home, **popen) -> subprocess.Popen:
    """`kvpage ARGS` in a process of its own, from this tree (not an installed copy)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVPAGE_MODEL", "NO_COLOR", "FORCE_COLOR")}
    env.update(KVPAGE_HOME=str(kv_home), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               **popen.pop("env", {}))
    kvpage = Path(sys.executable).with_name("kvpage")  # the console script a user runs
    return subprocess.Popen([str(kvpage), *args], env=env, cwd=ROOT, **popen)


def test_a_closed_pipe_exits_141_quietly(contract, tiny_cli_model, kv_home):
    """`kvpage review ... | head -0`: the reader is gone before the first line; exit 141 as from SIGPIPE."""
    reader, writer = os.pipe()
    os.close(reader)
    process = kvpage_process(["review", str(contract), "--jsonl", "--model", str(tiny_cli_model), "--max-new-tokens",
                              "3"], kv_home, stdout=writer, stderr=subprocess.PIPE, text=True)
    os.close(writer)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 141 and stderr == ""


def on_a_terminal(args: list[str], kv_home, env: dict) -> str:
    """What `kvpage ARGS` shows on a terminal (stdout and stderr both), read through a pty."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))  # 160 columns: room for the bars
    process = kvpage_process(args, kv_home, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert process.wait(timeout=300) == 0, shown.decode(errors="replace")
    return shown.decode(errors="replace")


def test_NO_COLOR_takes_the_colour_off_tables_and_bars_on_a_terminal(contract, tiny_cli_model, kv_home):
    args = ["review", str(contract), "--model", str(tiny_cli_model), "--max-new-tokens", "3"]
    for env, coloured in (({}, True), ({"NO_COLOR": "1"}, False)):
        shown = on_a_terminal(args, kv_home, env)
        plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)
        assert re.search(r"clauses +━+ 4/4", plain) and "┃" in plain  # a bar was drawn, and a table
        assert bool(COLOR_CODE.search(shown)) == coloured, env
