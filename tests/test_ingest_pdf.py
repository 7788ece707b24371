"""PDF ingestion on the odd corpus files and on real contracts."""

import json
import re
from pathlib import Path

import pypdf
import pytest

from kvpage_cli.errors import IngestError
from kvpage_cli.ingest import (
    BrokenDocument,
    EncryptedDocument,
    NoTextLayer,
    load,
    read_pdf,
)

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
ODD = CORPUS / "odd"
EXPECTED = json.loads((ODD / "expected.json").read_text(encoding="utf-8"))


def squash(text: str) -> str:
    return " ".join(text.split())


def test_encrypted_pdf_without_password_says_pass_password():
    path = ODD / "pdf" / "issue21579.pdf"
    with pytest.raises(EncryptedDocument) as info:
        read_pdf(path)
    message = str(info.value)
    assert "issue21579.pdf" in message and "--password" in message
    assert "\n" not in message


def test_encrypted_pdf_without_the_aes_package(monkeypatch):
    def decrypt(self, password):
        raise pypdf.errors.DependencyError("cryptography>=3.1 is required for AES algorithm")

    monkeypatch.setattr(pypdf.PdfReader, "decrypt", decrypt)
    with pytest.raises(EncryptedDocument) as info:
        read_pdf(ODD / "pdf" / "issue21579.pdf")
    assert "--password" in str(info.value) and "pip install cryptography" in str(info.value)


def test_encrypted_pdf_with_wrong_password_says_so():
    pytest.importorskip("cryptography")
    with pytest.raises(EncryptedDocument, match="password is wrong"):
        read_pdf(ODD / "pdf" / "issue21579.pdf", password="passwoert")


def test_encrypted_pdf_reads_with_the_password():
    pytest.importorskip("cryptography")  # pypdf needs it for AES
    expected = EXPECTED["pdf/issue21579.pdf"]
    doc = load(str(ODD / "pdf" / "issue21579.pdf"), password=expected["password"])
    assert doc.kind == "pdf"
    for sentence in expected["must_contain_after_decrypt"]:
        assert sentence in doc.text
    assert {span.page for span in doc.spans} == {1}


def test_scanned_pdf_needs_ocr():
    with pytest.raises(NoTextLayer) as info:
        read_pdf(ODD / "pdf" / "issue7200.pdf")
    assert "OCR" in str(info.value) and "issue7200.pdf" in str(info.value)


def test_fuzzed_pdf_is_a_clean_error():
    # pypdf raises DeprecationError (not a PdfReadError) while extracting the only page
    with pytest.raises(BrokenDocument) as info:
        read_pdf(ODD / "pdf" / "poppler-395-0-fuzzed.pdf")
    message = str(info.value)
    assert "could not read page 1" in message and "\n" not in message


def test_rotated_page_keeps_its_text_and_page_number():
    doc = read_pdf(ODD / "pdf" / "rotation.pdf")
    truths = EXPECTED["pdf/rotation.pdf"]["truth_per_page"]
    assert [span.page for span in doc.spans] == [1, 2]
    for page, truth in enumerate(truths, start=1):
        found = doc.find_quote(truth)
        assert found is not None, truth
        assert {span.page for span in doc.locate(*found)} == {page}
        assert doc.where(*found) == f"page {page}"


def test_crazyones_matches_the_expected_text():
    doc = read_pdf(ODD / "pdf" / "crazyones.pdf")
    expected = (ODD / "pdf" / "crazyones.expected.txt").read_text(encoding="utf-8")
    assert squash(doc.text) == squash(expected)
    assert doc.warnings == []


def test_two_column_headings_in_reading_order():
    doc = read_pdf(ODD / "pdf" / "bug1997343.pdf")
    lines = [line.strip() for line in doc.text.splitlines()]
    # the table of contents lists the same headings with page numbers; the headings are lines
    positions = [lines.index(h) for h in EXPECTED["pdf/bug1997343.pdf"]["truth_reading_order"]]
    assert positions == sorted(positions)
    assert "including" in doc.text  # "in\xad\ncluding": the soft hyphen joined


def test_not_a_pdf_is_broken(tmp_path):
    fake = tmp_path / "fake.pdf"
    fake.write_text("just some text")
    with pytest.raises(BrokenDocument, match="fake.pdf could not be read: it is not a PDF"):
        read_pdf(fake)
    with pytest.raises(BrokenDocument):
        read_pdf(b"")


def test_truncated_pdf_never_raises_anything_else(tmp_path):
    data = (ODD / "pdf" / "crazyones.pdf").read_bytes()
    for cut in (200, len(data) // 3, len(data) // 2, len(data) - 50):
        try:
            doc = read_pdf(data[:cut], display="cut.pdf")
        except IngestError as e:
            assert "cut.pdf" in str(e)
        else:
            assert doc.text.strip()


def _raw_pages(path: Path) -> list[str]:
    return [page.extract_text() for page in pypdf.PdfReader(path).pages]


def test_running_headers_and_footers_are_removed():
    path = CORPUS / "cuad" / "10-collaboration-long" / "contract.pdf"
    raw = _raw_pages(path)
    assert sum("Page 7 of 85" in page for page in raw) == 1  # the footer is really there
    doc = read_pdf(path)
    assert not re.search(r"Page \d+ of 85", doc.text)
    assert [span.page for span in doc.spans] == list(range(1, 86))

    path = CORPUS / "cuad" / "01-affiliate-short" / "contract.pdf"
    assert all("Source: STEEL VAULT CORP" in page for page in _raw_pages(path))
    doc = read_pdf(path)
    assert "Source: STEEL VAULT CORP" not in doc.text
    assert "Page 2 of 3" not in doc.text
    assert "MARKETING AFFILIATE AGREEMENT" in doc.text


def test_page_spans_point_at_the_right_page():
    path = CORPUS / "cuad" / "05-cobranding" / "contract.pdf"
    raw = [squash(page) for page in _raw_pages(path)]
    doc = read_pdf(path)
    assert "Source: RAE SYSTEMS INC" not in doc.text
    for quote in ("Limitation of Liability. EXCEPT AS SET FORTH IN SECTION 6 AND 7.1",
                  "Controlling Law and Jurisdiction",
                  "Representations and Warranties of NETTAXI"):
        found = doc.find_quote(quote)
        assert found is not None, quote
        (span,) = doc.locate(found[0], found[0] + 1)
        assert squash(quote) in raw[span.page - 1]


def test_a_header_line_of_thousands_of_digits_is_read():
    from .hostile import pdf_bytes

    # int() refuses runs of more than 4,300 digits; the header check must not call it on them
    bodies = ["The supplier delivers on time.", "The customer pays within thirty days.", "Either party may end it."]
    pages = [["7" * 5000 + str(page), body] for page, body in enumerate(bodies, start=1)]
    doc = read_pdf(pdf_bytes(pages))
    assert [s.page for s in doc.spans] == [1, 2, 3]
    assert all(body in doc.text for body in bodies)
