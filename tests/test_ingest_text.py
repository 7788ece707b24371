"""Text files, encodings, the loader's dispatch, and quotes found back in the text."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import SAMPLES

from kvpage_cli.errors import IngestError
from kvpage_cli.ingest import (
    BinaryDocument,
    DirectoryNotAllowed,
    Document,
    DocumentNotFound,
    EmptyDocument,
    Span,
    UnsupportedDocument,
    load,
    read_text,
)

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "corpus"


def test_utf8_with_bom_and_crlf(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes("\ufeffFirst line\r\n\r\nThird – line é\r\n".encode("utf-8"))
    doc = read_text(path)
    assert doc.text == "First line\n\nThird – line é\n"
    assert doc.warnings == []
    assert [(s.line, doc.text[s.start:s.end]) for s in doc.spans] == [
        (1, "First line"), (3, "Third – line é")]
    assert doc.spans[1].where() == "line 3"
    assert doc.spans[1].file == str(path)


def test_cp1252_is_guessed_with_a_warning(tmp_path):
    text = "The “Licensee” shall pay 5€ – see Annex for café prices.\nDéjà vu.\n"
    path = tmp_path / "old.txt"
    path.write_bytes(text.encode("cp1252"))
    doc = read_text(path)
    assert doc.text == text
    assert len(doc.warnings) == 1 and "cp1252" in doc.warnings[0] and "old.txt" in doc.warnings[0]


def test_latin1_is_decoded(tmp_path):
    text = "Müller GmbH and Société Générale agree.\nGrüße aus Zürich.\n"
    path = tmp_path / "latin.md"
    path.write_bytes(text.encode("latin-1"))
    assert read_text(path).text == text


def test_utf16_with_bom(tmp_path):
    text = "Governing law: the laws of Québec.\n"
    path = tmp_path / "wide.txt"
    path.write_bytes(text.encode("utf-16"))
    doc = read_text(path)
    assert doc.text == text and doc.warnings == []


def test_binary_and_empty_files(tmp_path):
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(BinaryDocument, match="data.bin looks binary, not text"):
        read_text(binary)
    with pytest.raises(BinaryDocument):
        load(str(binary))  # unknown suffix: sniffed, and binary
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\t\n")
    with pytest.raises(EmptyDocument, match="blank.txt is empty"):
        load(str(blank))


def test_loader_dispatch_and_errors(tmp_path):
    with pytest.raises(DocumentNotFound, match="missing.pdf does not exist"):
        load(str(tmp_path / "missing.pdf"))
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(UnsupportedDocument) as info:
        load(str(photo))
    assert "photo.png is not a supported document type (use PDF, DOCX, TXT or MD)" \
        in str(info.value)
    with pytest.raises(DirectoryNotAllowed, match="is a directory; review takes one file"):
        load(str(tmp_path), allow_directory=False)
    code = tmp_path / "app.py"
    code.write_text("print('hi')\n")
    assert load(str(code)).kind == "text"


def test_stdin_is_sniffed():
    pdf = (CORPUS / "odd" / "pdf" / "crazyones.pdf").read_bytes()
    docx = (CORPUS / "odd" / "docx" / "citation.docx").read_bytes()
    assert load("-", stdin=pdf).kind == "pdf"
    assert load("-", stdin=docx).kind == "docx"
    doc = load("-", stdin=b"hello\nworld\n")
    assert doc.kind == "text" and doc.spans[1].file == "-" and doc.spans[1].line == 2
    with pytest.raises(EmptyDocument, match="^stdin is empty"):
        load("-", stdin=b"")


def test_every_error_is_one_line(tmp_path):
    for path in ("missing.txt", str(CORPUS / "odd" / "pdf" / "issue7200.pdf"),
                 str(CORPUS / "odd" / "pdf" / "poppler-395-0-fuzzed.pdf")):
        with pytest.raises(IngestError) as info:
            load(path)
        assert "\n" not in str(info.value)


def test_find_quote_tolerates_whitespace_and_quotes():
    text = "This  Agreement (the “Agreement”)\nis made by\tACME  Inc.\n\n"
    doc = Document("x", "text", text, [Span(0, len(text.rstrip()), "x", line=1)])
    start, end = doc.find_quote('the "Agreement") is made by ACME Inc.')
    assert text[start:end] == "the “Agreement”)\nis made by\tACME  Inc."
    # PDF extraction drops or adds spaces: as a last resort whitespace is ignored
    start, end = doc.find_quote("made byACME Inc")
    assert text[start:end] == "made by\tACME  Inc"
    assert doc.find_quote("not in the text") is None
    assert doc.find_quote("   ") is None


def test_locate_and_where():
    text = "one\ntwo\nthree"
    spans = [Span(0, 3, "f", line=1), Span(4, 7, "f", line=2), Span(8, 13, "f", line=3)]
    doc = Document("f", "text", text, spans)
    assert doc.locate(5, 10) == spans[1:]
    assert doc.locate(3, 4) == []
    assert doc.locate(9, 9) == [spans[2]]
    assert doc.where(0, 13) == "lines 1-3"
    assert Span(0, 1, "src/app.py", line=7, show_file=True).where() == "src/app.py line 7"
    assert Span(0, 1, "a.pdf", page=3).where() == "page 3"
    assert Span(0, 1, "a.docx", paragraph=12).where() == "paragraph 12"


@pytest.mark.parametrize("folder", ["02-ip-short", "07-marketing", "11-promotion-long"])
def test_cuad_labels_are_found_in_the_text(folder):
    doc = load(str(CORPUS / "cuad" / folder / "contract.txt"))
    labels = json.loads((CORPUS / "cuad" / folder / "labels.json").read_text(encoding="utf-8"))
    quotes = [part.strip()
              for category in labels["labels"].values()
              for clause in category.get("clauses", [])
              for part in clause.split("<omitted>") if part.strip()]
    assert len(quotes) >= 10
    for quote in quotes:
        found = doc.find_quote(quote)
        assert found is not None, quote[:80]
        assert doc.locate(*found), quote[:80]


def test_ingest_never_imports_cli_libraries():
    code = ("import sys, kvpage_cli.ingest as i; i.load('-', stdin=b'x'); "
            "bad = [m for m in ('typer', 'rich', 'tqdm') if m in sys.modules]; "
            "print(*bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr


def test_text_and_files_past_the_limits_are_refused(tmp_path, monkeypatch):
    from kvpage_cli.ingest import DocumentTooLarge, document

    path = tmp_path / "big.txt"
    path.write_text("The supplier delivers. " * 100)
    monkeypatch.setattr(document, "MAX_TEXT_CHARS", 1000)
    with pytest.raises(DocumentTooLarge, match="its text passes 1,000 characters"):
        load(str(path))
    monkeypatch.setattr(document, "MAX_SOURCE_BYTES", 1000)
    with pytest.raises(DocumentTooLarge, match=r"big.txt is too large to read: it is over 1000 bytes"):
        load(str(path))


COMMON_PAPER_STYLE = """# Standard Terms

1. <span class="header_2" id="1">Services</span>

    1.1. <span class="header_3" id="1.1">Access.</span> Provider will give Customer access to the **Product** under
    the [Order Form](#order-form).

    1.2. <span class="header_3" id="1.2">Restrictions.</span> Customer will not resell the Product &amp; will not copy it.

2. <span class="header_2" id="2">Governing Law and Chosen Courts</span>

    <div class="note">This Agreement is governed by the laws of the State of Delaware.</div>

| Term | Value |
|---|---|
| Fees | $100 per month |
"""


def test_markdown_gives_the_text_a_reader_sees_with_its_source_lines(tmp_path):
    from kvpage_cli.ingest import split_clauses

    path = tmp_path / "terms.md"
    path.write_text(COMMON_PAPER_STYLE, encoding="utf-8")
    doc = load(str(path))
    assert "<span" not in doc.text and "class=" not in doc.text and "**" not in doc.text and "](" not in doc.text
    assert "1.2. Restrictions. Customer will not resell the Product & will not copy it." in doc.text
    assert "access to the Product under the Order Form." in doc.text  # a line break inside a paragraph: a space
    assert "Fees | $100 per month" in doc.text
    at = doc.text.index("Restrictions")
    assert doc.where(at, at + 12) == "line 8"
    at = doc.text.index("governed by")
    assert doc.where(at, at + 11) == "line 12"
    headings = {c.id: c.heading for c in split_clauses(doc)}
    assert headings["1.2"] == "Restrictions" and headings["1.1"] == "Access"
    assert all("<" not in h and "header_" not in h for h in headings.values())
    assert next(s for s in doc.spans if s.line == 1).kind == "heading"


def test_the_sample_contract_in_markdown_reads_like_its_text(tmp_path):
    from kvpage_cli.ingest import split_clauses

    md = load(str(SAMPLES / "contract.md"))
    txt = load(str(SAMPLES / "contract.txt"))
    assert [c.id for c in split_clauses(md)] == [c.id for c in split_clauses(txt)]
