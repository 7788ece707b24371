"""DOCX ingestion: what python-docx loses, kvpage keeps."""

import io
import json
import re
import zipfile
from pathlib import Path

import docx
import pytest

from kvpage_cli.ingest import BrokenDocument, EmptyDocument, load, read_docx

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
ODD = CORPUS / "odd"
EXPECTED = json.loads((ODD / "expected.json").read_text(encoding="utf-8"))
W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"


def squash(text: str) -> str:
    return " ".join(text.split())


def assert_in_order(text: str, pieces: list[str]) -> None:
    text = squash(text)
    pos = 0
    for piece in pieces:
        found = text.find(squash(piece), pos)
        assert found >= 0, f"{piece!r} missing (or out of order)"
        pos = found + len(squash(piece))


def python_docx_text(path: Path) -> str:
    return "\n".join(p.text for p in docx.Document(str(path)).paragraphs)


@pytest.mark.parametrize("name, key", [
    ("track-changes-test.docx", "truth_accepted"),
    ("blk-paras-and-tables.docx", "truth_in_order"),
    ("citation.docx", "truth_in_order"),
    ("labrys.document.docx", "truth_body"),
])
def test_odd_docx_gives_the_whole_text_in_order(name, key):
    doc = read_docx(ODD / "docx" / name)
    assert doc.kind == "docx"
    assert_in_order(doc.text, EXPECTED[f"docx/{name}"][key])


def test_tracked_changes_are_read_accepted():
    path = ODD / "docx" / "track-changes-test.docx"
    doc = read_docx(path)
    expected = EXPECTED["docx/track-changes-test.docx"]
    for deleted in expected["deleted_text_must_not_appear_as_current"]:
        assert deleted not in doc.text
    assert "C1" not in doc.text  # the deleted table row
    # python-docx drops the insertions; kvpage keeps them
    assert "And here is much more content." in doc.text
    assert "And here is much more content." not in python_docx_text(path)
    assert "This is new content, that I suggest." not in python_docx_text(path)
    assert any("tracked changes" in w for w in doc.warnings)


def test_content_controls_show_field_results_not_codes():
    path = ODD / "docx" / "citation.docx"
    doc = read_docx(path)
    assert "This is a reference: (Wu, 2024)" in doc.text
    assert "(Wu, 2024)" not in python_docx_text(path)
    for code in EXPECTED["docx/citation.docx"]["field_codes"]:
        assert code not in doc.text
    assert doc.text.count("Insights on Galaxy Evolution") == 3
    headings = [doc.text[s.start:s.end] for s in doc.spans if s.kind == "heading"]
    assert headings == ["Heading 1", "Bibliography", "References", "Works Cited"]


def test_nested_table_text_is_kept():
    path = ODD / "docx" / "blk-paras-and-tables.docx"
    doc = read_docx(path)
    assert "Text before" in doc.text and "Text before" not in python_docx_text(path)
    assert [s.paragraph for s in doc.spans] == [1, 2, 3, 4, 5, 6]


def test_footnote_with_id_zero_is_kept_and_linked():
    path = ODD / "docx" / "labrys.document.docx"
    doc = read_docx(path)
    assert "Paragraph with footnote[^1]" in doc.text
    (note,) = [s for s in doc.spans if "The actual footnote" in doc.text[s.start:s.end]]
    assert note.kind == "footnote"
    (body,) = [s for s in doc.spans if doc.text[s.start:s.end].startswith("Paragraph with")]
    assert note.paragraph == body.paragraph
    assert note.where() == f"footnote to paragraph {body.paragraph}"
    assert "h1 | h2 | h3 | h4 | h5" in doc.text  # the table, one row per line
    assert "h1" not in python_docx_text(path)


def test_blank_docx_is_empty():
    with pytest.raises(EmptyDocument, match="doc-word-default-blank.docx is empty"):
        load(str(ODD / "docx" / "doc-word-default-blank.docx"))


def test_not_a_docx_is_broken(tmp_path):
    with pytest.raises(BrokenDocument, match="not a zip"):
        read_docx(b"hello", display="x.docx")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("hello.txt", "hi")
    with pytest.raises(BrokenDocument, match="no word/document.xml"):
        read_docx(buffer.getvalue(), display="x.docx")


def test_templates_keep_table_text_and_heading_spans():
    path = CORPUS / "templates" / "common-paper-ai-addendum.docx"
    doc = read_docx(path)
    assert len(doc.text) > 9000 > 2 * len(python_docx_text(path))
    assert "Provider may Train the Model(s) using the following Training Data:" in doc.text
    headings = [doc.text[s.start:s.end] for s in doc.spans if s.kind == "heading"]
    assert "1. AI Services" in headings and "4. Definitions" in headings
    # clause numbers come from numbering.xml, as Word shows them
    assert "\n1.1 Using AI Services." in doc.text
    contractor = read_docx(
        CORPUS / "templates" / "common-paper-independent-contractor-agreement.docx")
    assert "\n4.2 Termination.\na. Either party may terminate" in contractor.text
    baa = read_docx(CORPUS / "templates" / "common-paper-business-associate-agreement.docx")
    # the drafting note refers to "Sections 1.7 and 3": the numbers must agree
    assert "\n1.7 Subcontractors." in baa.text and "\n3. Data Rights & Restrictions" in baa.text


# ----- synthetic documents for numbering, text boxes and deleted paragraph marks -----

def make_docx(body: str, numbering: str = "", styles: str = "") -> bytes:
    ns = f'xmlns:w="{W}" xmlns:mc="http://schemas.openxmlformats.org/markup-compatibility/2006"'
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/document.xml", f"<w:document {ns}><w:body>{body}</w:body></w:document>")
        if numbering:
            z.writestr("word/numbering.xml", f"<w:numbering {ns}>{numbering}</w:numbering>")
        if styles:
            z.writestr("word/styles.xml", f"<w:styles {ns}>{styles}</w:styles>")
    return buffer.getvalue()


def para(text: str, num: tuple[int, int] | None = None, style: str = "", extra: str = "") -> str:
    ppr = ""
    if style:
        ppr += f'<w:pStyle w:val="{style}"/>'
    if num:
        ppr += f'<w:numPr><w:ilvl w:val="{num[1]}"/><w:numId w:val="{num[0]}"/></w:numPr>'
    ppr += extra
    return f"<w:p><w:pPr>{ppr}</w:pPr><w:r><w:t xml:space=\"preserve\">{text}</w:t></w:r></w:p>"


def level(ilvl: int, fmt: str, text: str, start: int = 1) -> str:
    return (f'<w:lvl w:ilvl="{ilvl}"><w:start w:val="{start}"/><w:numFmt w:val="{fmt}"/>'
            f'<w:lvlText w:val="{text}"/></w:lvl>')


def test_automatic_numbering_labels():
    numbering = (
        '<w:abstractNum w:abstractNumId="0">' + level(0, "decimal", "%1.")
        + level(1, "decimal", "%1.%2") + level(2, "lowerLetter", "(%3)")
        + level(3, "lowerRoman", "(%4)") + "</w:abstractNum>"
        + '<w:abstractNum w:abstractNumId="1">' + level(0, "upperRoman", "Article %1")
        + "</w:abstractNum>"
        + '<w:num w:numId="1"><w:abstractNumId w:val="0"/></w:num>'
        + '<w:num w:numId="2"><w:abstractNumId w:val="1"/></w:num>'
    )
    body = "".join([
        para("Definitions", (1, 0)), para("Terms", (1, 1)), para("first", (1, 2)),
        para("second", (1, 2)), para("inner", (1, 3)), para("", (1, 2)),
        para("More", (1, 1)), para("Payment", (1, 0)), para("Fees", (1, 1)),
        para("Scope", (2, 0)), para("Law", (2, 0)),
    ])
    doc = read_docx(make_docx(body, numbering), display="n.docx")
    assert doc.text.split("\n") == [
        "1. Definitions", "1.1 Terms", "(a) first", "(b) second", "(i) inner", "1.2 More",
        "2. Payment", "2.1 Fees", "Article I Scope", "Article II Law",
    ]


def test_heading_styles_and_outline_levels():
    styles = (
        '<w:style w:type="paragraph" w:styleId="Titel"><w:name w:val="Title"/></w:style>'
        '<w:style w:type="paragraph" w:styleId="Custom"><w:name w:val="Clause Head"/>'
        '<w:pPr><w:outlineLvl w:val="1"/></w:pPr></w:style>'
        '<w:style w:type="paragraph" w:styleId="Derived"><w:name w:val="Derived"/>'
        '<w:basedOn w:val="Custom"/></w:style>'
    )
    body = para("Services Agreement", style="Titel") + para("Plain text.") + \
        para("Fees", style="Derived") + para("Term", extra='<w:outlineLvl w:val="0"/>')
    doc = read_docx(make_docx(body, styles=styles), display="h.docx")
    kinds = {doc.text[s.start:s.end]: s.kind for s in doc.spans}
    assert kinds == {"Services Agreement": "heading", "Plain text.": "text", "Fees": "heading",
                     "Term": "heading"}


def test_text_box_is_read_once_and_deleted_paragraph_mark_joins():
    box = ("<w:txbxContent>" + para("Boxed text") + "</w:txbxContent>")
    body = (
        "<w:p><w:r><w:t>Before</w:t></w:r><w:r><mc:AlternateContent>"
        f"<mc:Choice Requires=\"wps\"><w:drawing><x:a xmlns:x=\"urn:x\">{box}</x:a></w:drawing>"
        "</mc:Choice>"
        f"<mc:Fallback><w:pict><x:b xmlns:x=\"urn:x\">{box}</x:b></w:pict></mc:Fallback>"
        "</mc:AlternateContent></w:r></w:p>"
        "<w:p><w:pPr><w:rPr><w:del w:id=\"1\"/></w:rPr></w:pPr><w:r><w:t>Joined </w:t></w:r></w:p>"
        + para("paragraph")
    )
    doc = read_docx(make_docx(body), display="t.docx")
    assert doc.text.split("\n") == ["Before", "Boxed text", "Joined paragraph"]


# -- hostile files: each is read into capped text, or refused with one line, in little memory ----

MEMORY_LIMIT_MIB = 200


def test_a_list_numbered_from_a_billion_in_letters_gets_short_labels(hostile_docx):
    doc = read_docx(hostile_docx["numbering"])
    lines = doc.text.split("\n")
    assert len(lines) == 100
    # Word's letters for 10^9 would be 38 million letters a paragraph; past 30 letters, digits
    assert lines[0] == "1000000000. Clause text 0." and lines[-1] == "1000000099. Clause text 99."


@pytest.mark.parametrize("name, says", [
    ("numbering", None),
    ("zip bomb", "would inflate 1,029-fold, to 1,024.0 MiB"),
    ("nesting", "nests its elements more than 256 levels deep"),
])
def test_hostile_docx_is_read_or_refused_in_little_memory(hostile_docx, name, says):
    from .hostile import read_in_child

    result = read_in_child(hostile_docx[name])
    assert not result["traceback"], result["stderr"]
    if says is None:
        assert result["ok"] and result["chars"] < 10_000
    else:
        assert not result["ok"] and says in result["error"] and "\n" not in result["error"]
    assert result["peak_mib"] < MEMORY_LIMIT_MIB


@pytest.mark.parametrize("limit, says", [
    ("_MAX_PART_BYTES", "word/document.xml would inflate to 1.1 MiB (at most 1.0 MiB is read)"),
    ("_MAX_PARTS_BYTES", "its XML parts would inflate to over 1.0 MiB"),
])
def test_parts_past_the_size_budget_are_refused_before_they_inflate(monkeypatch, limit, says):
    from kvpage_cli.ingest import DocumentTooLarge, docx as docx_reader

    from .hostile import document_xml, docx_bytes, paragraph

    # plausible ratios (about 10-fold); the budgets are lowered from 64 and 128 MiB to 1 MiB
    monkeypatch.setattr(docx_reader, limit, 2**20)
    paragraphs = 10_800 if limit == "_MAX_PART_BYTES" else 8_500  # 1.1 or 0.9 MiB of document.xml
    filler = "".join(paragraph(f"Paragraph {i}: the supplier delivers goods number {i * 7919 % 10007}.")
                     for i in range(paragraphs))
    numbering = f'<w:numbering xmlns:w="{W}">' + "<!-- -->" * 70_000 + "</w:numbering>"
    data = docx_bytes(document_xml(filler), numbering)
    with pytest.raises(DocumentTooLarge, match=re.escape(says)):
        read_docx(data)


def test_text_after_an_entity_reference_is_kept():
    from .hostile import document_xml, docx_bytes

    doctype = '<!DOCTYPE w:document [<!ENTITY party "Alpha Corp.">]>'
    body = '<w:p><w:r><w:t>Payment is due to &party; within 30 days &amp; without set-off.</w:t></w:r></w:p>'
    doc = read_docx(docx_bytes(document_xml(body, doctype)))
    # the entity is not expanded (it could be a billion laughs), and the text after it stays
    assert doc.text == "Payment is due to &party; within 30 days & without set-off."
