"""The question set of bench/retrieval.py: well-formed, pinned, and its evidence where it says.

The benchmark itself is not run here; this only checks the data it scores answers with.
"""

from __future__ import annotations

import re
import sys

import pytest

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

from retrieval_parts.sources import evidence_ranges, fetch_source, is_right, load_question_set  # noqa: E402
from retrieval_parts.systems import BM25Chunks  # noqa: E402

from kvpage_cli.tasks.retrieval import lexical_terms  # noqa: E402

QUESTION_SET = load_question_set()
QUESTIONS = QUESTION_SET["questions"]
SOURCES = QUESTION_SET["sources"]
HELD_OUT = {"requests", "click"}  # kept apart for independent evaluation


def test_enough_questions_with_unique_ids_over_known_sources():
    assert len(QUESTIONS) >= 40
    ids = [q["id"] for q in QUESTIONS]
    assert len(ids) == len(set(ids))
    assert {q["source"] for q in QUESTIONS} <= set(SOURCES)
    assert set(SOURCES) <= {q["source"] for q in QUESTIONS}  # no source without questions


@pytest.mark.parametrize("question", QUESTIONS, ids=lambda q: q["id"])
def test_question_is_well_formed(question):
    assert question["question"].strip().endswith("?")
    assert question["regexes"]
    for rx in question["regexes"]:
        re.compile(rx)
    # the reference answer scores as right, a non-answer does not
    assert is_right(question["answer"], question["regexes"])
    assert not is_right("The document does not say.", question["regexes"])
    assert question["evidence"]
    for ev in question["evidence"]:
        assert isinstance(ev["file"], str) and ev["file"]
        place = ev["line"] if "line" in ev else ev["page"]  # a PDF's evidence names its page
        assert isinstance(place, int) and place >= 1
        assert isinstance(ev["quote"], str) and ev["quote"].strip()


@pytest.mark.parametrize("source_id", sorted(SOURCES))
def test_sources_are_pinned(source_id):
    spec = SOURCES[source_id]
    assert spec["kind"] in ("pypi", "corpus", "cuad", "deb")
    if spec["kind"] == "pypi":
        assert spec["package"].lower() not in HELD_OUT
        assert re.fullmatch(r"\d+(\.\d+)+", spec["version"])
        assert re.fullmatch(r"[0-9a-f]{64}", spec["sha256"])
        assert spec["root"].startswith(f"{spec['package'].lower()}-{spec['version']}")
    elif spec["kind"] == "cuad":
        assert re.fullmatch(r"[0-9a-f]{64}", spec["sha256"]) and spec["cuad_filename"]
    elif spec["kind"] == "deb":  # a file of a Debian package, the package pinned by its hash
        assert re.fullmatch(r"[0-9a-f]{64}", spec["sha256"]) and spec["url"].startswith("http://deb.debian.org/")
        assert spec["member"].startswith("./") and spec["file"]
    else:
        assert (REPO / spec["path"]).is_file()


def test_evidence_in_the_corpus_contracts_is_on_its_line():
    """The contracts that ship in corpus/ are checked here; the downloaded sources by
    `python bench/retrieval.py check`."""
    from kvpage_cli.ingest import load

    checked = 0
    for source_id, spec in SOURCES.items():
        if spec["kind"] != "corpus":
            continue
        doc = load(str(REPO / spec["path"]))
        for question in (q for q in QUESTIONS if q["source"] == source_id):
            ranges = evidence_ranges(doc, question["evidence"])
            assert all(doc.text[a:b] == ev["quote"] for (a, b), ev in zip(ranges, question["evidence"]))
            checked += 1
    assert checked >= 10


def test_a_file_is_taken_from_a_debian_package_checked_by_its_hash(tmp_path):
    """The deb source kind: an ar archive whose data.tar.* holds the file (no download when the
    package is already in the cache; a package with another hash is refused)."""
    import hashlib
    import io
    import tarfile

    def member(name: str, data: bytes) -> bytes:
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
        return header + data + (b"\n" if len(data) % 2 else b"")

    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w:xz") as archive:
        content = b"%PDF-1.4 a manual"
        info = tarfile.TarInfo("./usr/share/doc/tool/manual.pdf")
        info.size = len(content)
        archive.addfile(info, io.BytesIO(content))
    package = b"!<arch>\n" + member("debian-binary", b"2.0\n") + member("data.tar.xz", payload.getvalue())
    folder = tmp_path / "deb"
    folder.mkdir()
    (folder / "tool-doc_1.0_all.deb").write_bytes(package)
    spec = {"kind": "deb", "url": "http://deb.debian.org/debian/pool/main/t/tool/tool-doc_1.0_all.deb",
            "sha256": hashlib.sha256(package).hexdigest(), "member": "./usr/share/doc/tool/manual.pdf",
            "file": "manual.pdf"}
    path = fetch_source("tool", spec, tmp_path)
    assert path == folder / "manual.pdf" and path.read_bytes() == content
    (folder / "manual.pdf").unlink()
    with pytest.raises(SystemExit, match="does not have the recorded sha256"):
        fetch_source("tool", {**spec, "sha256": "0" * 64}, tmp_path)


@pytest.mark.parametrize("order", ["best-last", "document"])
def test_the_text_baseline_packs_its_chunks_in_the_order_retrieval_mode_reads_them(order, smollm2):
    """`--order best-last` (the default, as kvpage reads its passages): document order but the best
    chunk last, right before the question; `--order document`: document order."""
    from kvpage_cli.ingest import load

    doc = load(str(REPO / "corpus" / "cuad" / "10-collaboration-long" / "contract.txt"))
    tokenizer, question = smollm2.tokenizer, "Which State's laws govern this agreement?"
    index = BM25Chunks(doc, tokenizer, 256)
    text, chosen = index.pack(doc, tokenizer, question, 1024, order)
    scores = index.index.get_scores(lexical_terms(question, index.stopwords))
    best = index.chunks[max(range(len(index.chunks)), key=lambda i: scores[i])]
    starts = [c.start for c in chosen]
    assert len(chosen) > 2 and best in chosen
    if order == "document":
        assert starts == sorted(starts)
    else:
        assert chosen[-1] is best and starts[:-1] == sorted(starts[:-1])
        assert starts != sorted(starts)  # here the best chunk is not the document's last of them
    assert text.rstrip().endswith(doc.text[chosen[-1].start:chosen[-1].end].rstrip())
    assert len(tokenizer(text, add_special_tokens=False).input_ids) <= 1024
