"""A review in Word, PDF and HTML, each output opened by the application a lawyer would open it with:
LibreOffice and python-docx for the DOCX, poppler (pdftotext, pdftoppm) and pypdf for the PDF,
headless Chromium for the HTML. Those applications are required (.ci/run installs them): a test
fails, never skips, where one is missing.

The real review of samples/contract.pdf (conftest `sample_review`, shared with test_cli_e2e) is
rendered directly; the command line runs once per format with the tiny model, on a small contract
that LibreOffice turns into a real PDF and DOCX."""

from __future__ import annotations

import collections
import io
import json
import re
import subprocess
import zipfile
from pathlib import Path

import docx
import pypdf
import pytest
from docx.oxml.ns import qn
from lxml import etree
from typer.testing import CliRunner

from kvpage_cli.cli.app import app
from kvpage_cli.ingest import Document, Span, load, split_clauses
from kvpage_cli.tasks.formats import FormatError
from kvpage_cli.tasks.formats.docx import AUTHOR, commented_docx
from kvpage_cli.tasks.formats.html import review_html
from kvpage_cli.tasks.formats.html_index import index_html
from kvpage_cli.tasks.formats.pdf import highlighted_pdf
from kvpage_cli.tasks.schema import Finding, ReviewResult

from .chromium import Browser
from .conftest import CORPUS, SAMPLES, application
from .test_cli import CONTRACT, one_error_line



# -- the real review, and the same findings in the DOCX of the same contract ----------------------

@pytest.fixture(scope="module")
def pdf_review(sample_review) -> tuple[ReviewResult, Document]:
    assert sample_review.exit_code == 0, sample_review.stderr
    return ReviewResult.from_dict(json.loads(sample_review.stdout)), load(str(SAMPLES / "contract.pdf"))


@pytest.fixture(scope="module")
def docx_review(pdf_review) -> tuple[ReviewResult, Document]:
    """The real review's findings where their quotes are in samples/contract.docx (the same contract,
    made by samples/make_samples.py), with the DOCX's offsets and sources."""
    result, _ = pdf_review
    doc = load(str(SAMPLES / "contract.docx"))
    findings = []
    for f in result.findings:
        start, end = doc.find_quote(f.quote)
        findings.append(Finding(**{**f.__dict__, "quote": doc.text[start:end], "start": start, "end": end,
                                   "source": doc.where(start, end), "document": doc.source}))
    moved = ReviewResult(**{**result.__dict__, "findings": findings, "document": doc.source, "document_kind": "docx"})
    return moved, doc


def _words(text: str) -> list[str]:
    """Words as a reader compares them: a table's " | " and automatic list numbers ("1.4") are
    ingest's, not the document's runs'."""
    return [w for w in text.split() if w != "|" and not re.fullmatch(r"\(?\d+(?:\.\d+)*[.)]?", w)]


# -- DOCX ----------------------------------------------------------------------------------------

def comments_and_anchors(data: bytes) -> list[tuple[str, str, str]]:
    """(author, comment text, the document text its range covers) per comment, as python-docx reads them."""
    word = docx.Document(io.BytesIO(data))
    open_ranges: dict[str, list[str]] = {}
    covered: dict[str, str] = {}
    for el in word.element.body.iter():
        if el.tag == qn("w:commentRangeStart"):
            open_ranges[el.get(qn("w:id"))] = []
        elif el.tag == qn("w:commentRangeEnd"):
            key = el.get(qn("w:id"))
            covered[key] = "".join(open_ranges.pop(key))
        elif el.tag == qn("w:p"):
            for parts in open_ranges.values():
                parts.append("\n")
        elif el.tag in (qn("w:t"), qn("w:tab")):
            if any(a.tag in (qn("w:del"), qn("w:moveFrom")) for a in el.iterancestors()):
                continue
            for parts in open_ranges.values():
                parts.append(el.text or "" if el.tag == qn("w:t") else "\t")
    comments = {str(c.comment_id): c for c in word.comments}
    assert set(covered) == set(comments)
    return [(comments[k].author, comments[k].text, covered[k]) for k in sorted(covered, key=int)]


def characters(data: bytes) -> list[list[tuple[str, bytes]]]:
    """Per w:p of the body (tables, text boxes included), each visible character with its run's
    formatting (its w:rPr): what a reader sees, outside any comment mark."""
    word = docx.Document(io.BytesIO(data))
    out = []
    for p in word.element.body.iter(qn("w:p")):
        chars = []
        for r in p.iter(qn("w:r")):
            if r.find(qn("w:commentReference")) is not None:
                continue
            props = r.find(qn("w:rPr"))
            style = etree.tostring(props) if props is not None else b""
            for child in r:
                if child.tag == qn("w:t"):
                    chars += [(c, style) for c in child.text or ""]
                elif child.tag in (qn("w:tab"), qn("w:br")):
                    chars.append(("\t" if child.tag == qn("w:tab") else "\n", style))
        out.append(chars)
    return out


def parts(data: bytes) -> dict[str, bytes]:
    """Each part of the package: XML as parsed and written again by lxml, the rest as it is."""
    out = {}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for name in z.namelist():
            if name.endswith("/"):  # a folder entry, not a part
                continue
            raw = z.read(name)
            if name.endswith((".xml", ".rels")) and raw.strip():
                root = etree.fromstring(raw, etree.XMLParser(remove_blank_text=True))
                if name.endswith(".rels") and len(root) == 0:  # no relationship: python-docx writes none
                    continue
                raw = etree.tostring(root)
            out[name] = raw
    return out


def assert_copy_keeps_the_document(source: bytes, copy: bytes) -> None:
    """Text and formatting outside the comment marks, and every part but the body and the package's
    lists of parts, as they were; the tracked changes too."""
    assert characters(copy) == characters(source)
    before, after = parts(source), parts(copy)
    changed = {"word/document.xml", "[Content_Types].xml", "word/_rels/document.xml.rels"}
    assert set(before) <= set(after)
    for name in set(before) - changed:
        assert after[name] == before[name], name
    body_before, body_after = (etree.fromstring(docx_part(d)) for d in (source, copy))
    for tag in ("w:ins", "w:del", "w:moveFrom", "w:moveTo", "w:tbl", "w:numPr", "w:sectPr", "w:hyperlink"):
        assert len(body_after.findall(f".//{qn(tag)}")) == len(body_before.findall(f".//{qn(tag)}")), tag


def docx_part(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return z.read("word/document.xml")


@pytest.fixture(scope="module")
def office(tmp_path_factory) -> Path:
    """A LibreOffice profile for the module's conversions (its first start makes it)."""
    return tmp_path_factory.mktemp("libreoffice-profile")


def soffice(path: Path, profile: Path, kind: str = "pdf") -> Path:
    """LibreOffice converts the file (exit 0, the file made), as a user's would."""
    out = path.parent / f"soffice-{kind}"
    result = subprocess.run([application("soffice"), f"-env:UserInstallation={profile.as_uri()}", "--headless",
                             "--convert-to", kind, "--outdir", str(out), str(path)],
                            capture_output=True, text=True, timeout=300)
    converted = out / f"{path.stem}.{kind}"
    assert result.returncode == 0 and converted.exists(), result.stdout + result.stderr
    return converted


def soffice_to_pdf(path: Path, profile: Path) -> Path:
    return soffice(path, profile, "pdf")


def pdftotext(path: Path, *args: str) -> str:
    result = subprocess.run([application("pdftotext"), *args, str(path), "-"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.real_model
@pytest.mark.slow
def test_the_docx_copy_has_a_comment_on_each_findings_quote_and_nothing_else_changed(docx_review, office, tmp_path):
    result, doc = docx_review
    source = (SAMPLES / "contract.docx").read_bytes()
    copy = commented_docx(result, doc, source)
    comments = comments_and_anchors(copy)
    assert len(comments) == len(result.findings) + 1  # and one on the title
    for (author, text, covered), f in zip(comments, result.findings):
        assert author == AUTHOR
        assert _words(covered) == _words(f.quote), f.clause_id
        assert f.risk.upper() in text and f.category in text and f.rationale in text
        for values in (a.values for a in f.assessments):
            for found in values.values():
                assert all(" ".join(v.text.split()) in text for v in found)
    author, summary, title = comments[-1]
    assert title == "MASTER SERVICES AGREEMENT"
    high = sum(f.risk == "high" for f in result.findings)
    assert "Governing law: Delaware" in summary and f"{high} high" in summary
    assert_copy_keeps_the_document(source, copy)
    path = tmp_path / "contract.review.docx"
    path.write_bytes(copy)
    rendered = pdftotext(soffice_to_pdf(path, office))
    assert "MASTER SERVICES AGREEMENT" in rendered and "Governing Law" in rendered


@pytest.mark.parametrize("name", ["templates/common-paper-ai-addendum.docx",
                                  "templates/common-paper-independent-contractor-agreement.docx",
                                  "odd/docx/track-changes-test.docx"])
def test_comments_anchor_on_real_documents_with_tables_numbering_and_tracked_changes(name):
    """Every sentence of every clause a finding: quotes across runs, inside tables and numbered
    lists, next to tracked changes; each comment covers its quote's words exactly."""
    path = CORPUS / name
    source = path.read_bytes()
    doc = load(str(path))
    findings = []
    for c in split_clauses(doc):
        for m in re.finditer(r"(?m)(?:^|(?<=\s))[^\s.;:][^.;:\n]{24,}[.;:]", doc.text[c.start:c.end]):
            s, e = c.start + m.start(), c.start + m.end()
            findings.append(Finding(c.id, c.heading, "governing law", "medium", "The law that governs.", doc.text[s:e],
                                    doc.where(s, e), s, e, categories=["governing law"]))
    assert findings
    copy = commented_docx(ReviewResult(str(path), "docx", "test", "exact", findings, True, 1, 1), doc, source)
    comments = comments_and_anchors(copy)
    assert len(comments) == len(findings) + 1
    for (_, _, covered), f in zip(comments, findings):
        assert _words(covered) == _words(f.quote), f.quote
    assert_copy_keeps_the_document(source, copy)


def test_a_quote_in_a_footnote_is_commented_on_the_paragraph_that_refers_to_it():
    path = CORPUS / "odd/docx/labrys.document.docx"
    doc = load(str(path))
    start = doc.text.rindex("[^1]")
    end = len(doc.text)
    finding = Finding("1", "Notes", "governing law", "low", "A footnote.", doc.text[start:end], doc.where(start, end),
                      start, end)
    copy = commented_docx(ReviewResult(str(path), "docx", "test", "exact", [finding], True, 1, 1), doc,
                          path.read_bytes())
    (_, note, covered), _ = comments_and_anchors(copy)
    assert covered == "Paragraph with footnote"  # the footnote mark is a run of its own, with no text
    assert "footnote to paragraph" in note and "The quote: [^1] The actual footnote" in note


@pytest.mark.real_model
@pytest.mark.slow
def test_a_pdf_contract_becomes_a_new_docx_of_its_text_with_the_same_comments(pdf_review, office, tmp_path):
    result, doc = pdf_review
    data = commented_docx(result, doc)
    comments = comments_and_anchors(data)
    assert len(comments) == len(result.findings) + 1
    for (_, _, covered), f in zip(comments, result.findings):
        assert covered.split() == f.quote.split()
    word = docx.Document(io.BytesIO(data))
    text = " ".join(p.text for p in word.paragraphs)
    assert text.split() == doc.text.split()  # all of the contract, nothing else
    headings = [p.text for p in word.paragraphs if p.style.name == "Heading 2"]
    assert "3. FEES AND PAYMENT" in headings and not any("EXCEPT FOR" in h for h in headings)
    path = tmp_path / "contract.review.docx"
    path.write_bytes(data)
    assert "Provider may increase" in pdftotext(soffice_to_pdf(path, office))


# -- PDF -----------------------------------------------------------------------------------------

def bbox_words(path: Path, page: int) -> list[tuple[float, float, float, float, str]]:
    """pdftotext -bbox's words of a page (1-based): x0, y0, x1, y1 in PDF space (y up), text."""
    xml = pdftotext(path, "-bbox", "-f", str(page), "-l", str(page))
    height = float(re.search(r'<page width="[\d.]+" height="([\d.]+)"', xml).group(1))
    words = re.findall(r'xMin="([\d.]+)" yMin="([\d.]+)" xMax="([\d.]+)" yMax="([\d.]+)">(.*?)</word>', xml)
    unescape = {"&amp;": "&", "&quot;": '"', "&apos;": "'", "&lt;": "<", "&gt;": ">"}
    return [(float(a), height - float(d), float(c), height - float(b), re.sub("&[a-z]+;", lambda m: unescape[m[0]], t))
            for a, b, c, d, t in words]


def covered_words(words, quads: list[float]) -> list[str]:
    """The words whose centre is inside one of the quadrilaterals (8 numbers each)."""
    out = []
    for x0, y0, x1, y1, text in words:
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        for i in range(0, len(quads), 8):
            xs, ys = quads[i:i + 8:2], quads[i + 1:i + 8:2]
            if min(xs) <= cx <= max(xs) and min(ys) <= cy <= max(ys):
                out.append(text)
                break
    return out


@pytest.mark.real_model
@pytest.mark.slow
def test_the_pdf_copy_highlights_each_quote_on_its_page_and_keeps_every_page(pdf_review, tmp_path):
    result, doc = pdf_review
    source = (SAMPLES / "contract.pdf").read_bytes()
    highlighted = highlighted_pdf(result, doc, source)
    assert highlighted.unplaced == [] and len(highlighted.placed) == len(result.findings)
    path = tmp_path / "contract.review.pdf"
    path.write_bytes(highlighted.data)
    # the original file is the copy's first bytes; the update redefines no page content stream
    assert highlighted.data.startswith(source)
    original, copy = pypdf.PdfReader(io.BytesIO(source)), pypdf.PdfReader(path)
    streams = set()
    for page in original.pages:
        contents = page.raw_get("/Contents")
        streams.update(ref.idnum for ref in (contents if isinstance(contents, list) else [contents]))
    redefined = {int(n) for n in re.findall(rb"(?m)^(\d+) 0 obj", highlighted.data[len(source):])}
    assert not streams & redefined
    for before, after in zip(original.pages, copy.pages):
        assert after.get_contents().get_data() == before.get_contents().get_data()
    # a highlight per finding and page it is on, on those pages, over exactly its quote's words
    annotations = [(number, a.get_object()) for number, page in enumerate(copy.pages, start=1)
                   for a in page.get("/Annots", [])]
    parts = collections.defaultdict(list)
    for number, annotation in annotations:
        assert annotation["/Subtype"] == "/Highlight" and annotation["/T"] == "kvpage"
        parts[re.match(r"kvpage-(\d+)-", annotation["/NM"]).group(1)].append((number, annotation))
    assert len(parts) == len(result.findings)
    for i, f in enumerate(result.findings):
        pages = [number for number, _ in parts[str(i + 1)]]
        assert f.source == (f"page {pages[0]}" if len(pages) == 1 else f"pages {pages[0]}-{pages[-1]}")
        words = []
        for number, annotation in parts[str(i + 1)]:
            assert f.rationale in annotation["/Contents"] and f.risk.upper() in annotation["/Contents"]
            words += covered_words(bbox_words(path, number), [float(v) for v in annotation["/QuadPoints"]])
        assert words == f.quote.split(), f.clause_id
    # poppler reads and draws it; the summary pages follow the contract's
    assert len(copy.pages) > len(original.pages)
    summary = pdftotext(path, "-f", str(len(original.pages) + 1))
    assert "Key terms" in summary and "Governing law: Delaware" in summary
    assert all(f"{f.clause_id} {f.heading}" in " ".join(summary.split()) for f in result.findings)
    assert "Not highlighted" not in summary
    page = next(n for n, a in annotations)
    rendered = subprocess.run([application("pdftoppm"), "-r", "40", "-f", str(page), "-l", str(page), "-png",
                               str(path), str(tmp_path / "page")], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0 and list(tmp_path.glob("page*.png")), rendered.stderr


def test_a_quote_that_cannot_be_located_is_listed_on_the_summary_page_not_placed(tmp_path):
    """A font with no widths (a base font name no reader knows, no /Widths): its glyphs cannot be
    measured, so the quote on it is not highlighted but printed in full on the summary page."""
    writer = pypdf.PdfWriter()
    page = writer.add_blank_page(612, 792)
    font = pypdf.generic.DictionaryObject({
        pypdf.generic.NameObject("/Type"): pypdf.generic.NameObject("/Font"),
        pypdf.generic.NameObject("/Subtype"): pypdf.generic.NameObject("/Type1"),
        pypdf.generic.NameObject("/BaseFont"): pypdf.generic.NameObject("/NoSuchFont"),
        pypdf.generic.NameObject("/Encoding"): pypdf.generic.NameObject("/WinAnsiEncoding")})
    page[pypdf.generic.NameObject("/Resources")] = pypdf.generic.DictionaryObject({
        pypdf.generic.NameObject("/Font"): pypdf.generic.DictionaryObject({pypdf.generic.NameObject("/F1"): font})})
    sentence = "This Agreement is governed by the laws of the State of Delaware."
    stream = pypdf.generic.DecodedStreamObject()
    stream.set_data(f"BT /F1 11 Tf 72 700 Td ({sentence}) Tj ET".encode())
    page.replace_contents(stream)
    source = io.BytesIO()
    writer.write(source)
    path = tmp_path / "unmeasured.pdf"
    path.write_bytes(source.getvalue())
    doc = load(str(path))
    start, end = doc.find_quote(sentence)
    finding = Finding("1", "Law", "governing law", "low", "The law is Delaware's.", doc.text[start:end],
                      doc.where(start, end), start, end, categories=["governing law"])
    highlighted = highlighted_pdf(ReviewResult(str(path), "pdf", "test", "exact", [finding], True, 1, 1), doc,
                                  path.read_bytes())
    assert highlighted.unplaced == [finding] and highlighted.placed == []
    out = tmp_path / "out.pdf"
    out.write_bytes(highlighted.data)
    copy = pypdf.PdfReader(out)
    assert not any("/Annots" in p for p in copy.pages)
    summary = " ".join(pdftotext(out, "-f", "2").split())
    assert "Not highlighted" in summary and sentence in summary


def test_an_encrypted_pdf_is_refused_before_any_review(tmp_path):
    path = CORPUS / "odd/pdf/issue21579.pdf"
    doc = load(str(path), password="p\u00e4ssw\u00f6rt")
    with pytest.raises(FormatError, match="encrypted"):
        highlighted_pdf(ReviewResult(str(path), "pdf", "test", "exact", [], True, 1, 1), doc, path.read_bytes())


# -- HTML ----------------------------------------------------------------------------------------

def open_report(path: Path, width: int = 1280, height: int = 900) -> Browser:
    browser = Browser(width, height)
    browser.open(path)
    assert browser.console_errors() == []
    assert browser.requests() == [path.resolve().as_uri()]  # nothing leaves the file
    return browser


@pytest.mark.real_model
@pytest.mark.slow
def test_the_html_report_shows_every_finding_highlighted_in_the_text_and_linked_both_ways(pdf_review, tmp_path):
    result, doc = pdf_review
    path = tmp_path / "contract.review.html"
    path.write_text(review_html(result, doc), encoding="utf-8")
    with open_report(path) as browser:
        js = browser.evaluate
        assert js("document.querySelectorAll('article.finding').length") == len(result.findings)
        for n, f in enumerate(result.findings, start=1):
            marked = js(f"Array.from(document.querySelectorAll('.text mark')).filter(m => "
                        f"m.dataset.f.split(' ').includes('f-{n}')).map(m => m.textContent).join('')")
            assert marked.split() == f.quote.split(), f.clause_id
            assert js(f"!!document.querySelector('#f-{n} a[href=\"#q-{n}\"]') && !!document.getElementById('q-{n}')")
            assert js(f"!!document.querySelector('.text a.back[href=\"#f-{n}\"]')")
            assert js(f"document.querySelector('#f-{n} .source').textContent").startswith(f.source)
        terms = js("Array.from(document.querySelectorAll('table.terms tbody tr')).map(r => r.textContent)")
        assert any("Governing law" in t and "Delaware" in t for t in terms)
        # a filter hides the findings of a level and fades their marks in the text
        high = sum(f.risk == "high" for f in result.findings)
        js("document.querySelector('input[name=risk][value=high]').click()")
        assert js("document.querySelectorAll('article.finding[hidden]').length") == high
        assert js("Array.from(document.querySelectorAll('article.finding.risk-high')).every(a => a.hidden)")
        assert js("document.querySelector('output.shown').textContent") == \
            f"{len(result.findings) - high} of {len(result.findings)} shown"
        # printing shows every finding, filters or not, and no filter controls
        printed = tmp_path / "printed.pdf"
        browser.send("Emulation.setEmulatedMedia", session=True, media="print")
        assert browser.evaluate("getComputedStyle(document.querySelector('form.filters')).display") == "none"
        import base64
        printed.write_bytes(base64.b64decode(browser.send("Page.printToPDF", session=True)["data"]))
        text = " ".join(pdftotext(printed).split())
        assert all(" ".join(f.rationale.split()) in text for f in result.findings)  # the cards' words
        assert "MASTER SERVICES AGREEMENT" in text
        assert browser.console_errors() == []


HOSTILE = ("MASTER AGREEMENT\n\n1. Law. This Agreement is governed by the laws of <script>window.pwned = 1</script>"
           " Delaware &amp; New York <img src=x onerror=\"window.pwned = 2\">.\n\n"
           "2. Notice. The notice period is \u202eshtnom xis\u202c as stated.\n\n"
           "3. Schedule. " + "A" * 10_000 + "\n")


def hostile_review() -> tuple[ReviewResult, Document]:
    lines = list(re.finditer(r"[^\n]+", HOSTILE))
    doc = Document("hostile.txt", "text", HOSTILE, [Span(m.start(), m.end(), "hostile.txt", line=n + 1)
                                                    for n, m in enumerate(lines)])
    findings = []
    quotes = (("1", "This Agreement is governed by the laws of <script>"), ("2", "\u202eshtnom xis\u202c"),
              ("3", "A" * 300))
    for clause_id, quote in quotes:
        start = HOSTILE.index(quote)
        findings.append(Finding(clause_id, "<b>Heading</b>", "governing law", "high", "A \"reason\" & <i>more</i>.",
                                quote, doc.where(start, start + len(quote)), start, start + len(quote),
                                categories=["governing law", "<script>x</script>"]))
    return ReviewResult("hostile.txt", "text", "test", "exact", findings, True, 10, 3), doc


def test_a_hostile_contract_stays_text_in_the_html_report(tmp_path):
    result, doc = hostile_review()
    path = tmp_path / "hostile.html"
    path.write_text(review_html(result, doc), encoding="utf-8")
    with open_report(path, width=900) as browser:
        js = browser.evaluate
        assert js("window.pwned === undefined") and js("document.scripts.length") == 1
        assert js("document.querySelectorAll('img, i, b:not(.x)').length") == 0
        text = js("(() => { const t = document.querySelector('.text').cloneNode(true); "
                  "t.querySelectorAll('a.back').forEach(a => a.remove()); return t.textContent; })()")
        assert "<script>window.pwned = 1</script>" in text and "&amp;" in text and 'onerror="window.pwned = 2"' in text
        assert js("Array.from(document.querySelectorAll('.text abbr.ctl')).map(a => a.textContent)") == ["RLO", "PDF"]
        assert js("document.querySelector('#f-1 h4').textContent").startswith("1 <b>Heading</b>")
        # the 10,000-character line wraps inside the page
        assert js("document.querySelector('.text').scrollWidth <= document.querySelector('.text').clientWidth + 1")
        assert js("document.documentElement.scrollWidth <= window.innerWidth")
        assert js("document.querySelectorAll('.text mark').length") >= 3


def test_the_html_report_of_a_contract_without_findings_says_so(tmp_path):
    doc = Document("empty.txt", "text", "Nothing here.", [Span(0, 13, "empty.txt", line=1)])
    path = tmp_path / "empty.html"
    path.write_text(review_html(ReviewResult("empty.txt", "text", "test", "exact", [], True, 3, 1), doc))
    with open_report(path) as browser:
        assert "No clause was found to matter" in browser.evaluate("document.body.textContent")


# -- the command line, once per format (the tiny model) ------------------------------------------



@pytest.fixture(scope="module")
def small_contracts(tmp_path_factory, office) -> dict[str, Path]:
    """The small contract as text, and as the PDF and DOCX LibreOffice makes of it."""
    text = tmp_path_factory.mktemp("small") / "services.txt"
    text.write_text(CONTRACT, encoding="utf-8")
    return {"txt": text, "pdf": soffice(text, office, "pdf"), "docx": soffice(text, office, "docx")}


@pytest.fixture(scope="module")
def cli(kv_home, tiny_cli_model):
    def run(*args):
        argv = ["review", *[str(a) for a in args], "--model", str(tiny_cli_model), "--max-new-tokens", "3"]
        return CliRunner().invoke(app, argv, env={"KVPAGE_HOME": str(kv_home), "KVPAGE_MODEL": None,
                                                  "KVPAGE_DEBUG": None, "NO_COLOR": None})
    return run


def test_review_out_docx_writes_a_commented_copy(cli, small_contracts, office, tmp_path):
    """The command end to end (what the comments say is checked on the real review above): a copy
    with the document unchanged, a comment on each finding's sentence and one on the title."""
    out = tmp_path / "services.review.docx"
    result = cli(small_contracts["docx"], "--out", out)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    comments = comments_and_anchors(out.read_bytes())
    assert len(comments) >= 2 and comments[-1][2] == "SERVICES AGREEMENT"
    text = load(str(small_contracts["docx"])).text
    for _, note, covered in comments[:-1]:
        assert " ".join(covered.split()) in " ".join(text.split()) and "risk" in note
    assert_copy_keeps_the_document(small_contracts["docx"].read_bytes(), out.read_bytes())
    assert "Delaware" in pdftotext(soffice_to_pdf(out, office))


def test_review_format_pdf_writes_a_highlighted_copy(cli, small_contracts, tmp_path):
    out = tmp_path / "services.review.pdf"
    result = cli(small_contracts["pdf"], "--format", "pdf", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes().startswith(small_contracts["pdf"].read_bytes())
    copy = pypdf.PdfReader(out)
    highlights = [a.get_object() for a in copy.pages[0].get("/Annots", [])]
    assert highlights and all(a["/Subtype"] == "/Highlight" for a in highlights)
    words = bbox_words(out, 1)
    page = " ".join(w[4] for w in words)
    for annotation in highlights:  # each covers a run of the page's words: a sentence of a clause
        covered = covered_words(words, [float(v) for v in annotation["/QuadPoints"]])
        assert len(covered) >= 5 and " ".join(covered) in page
    assert "Key terms" in pdftotext(out, "-f", "2")


def test_review_of_a_folder_writes_a_report_per_contract_and_an_index(cli, small_contracts, tmp_path):
    room = tmp_path / "dataroom"
    (room / "sub").mkdir(parents=True)
    (room / "services.txt").write_text(CONTRACT, encoding="utf-8")
    (room / "services.md").write_text(CONTRACT.replace("Delaware", "New York"), encoding="utf-8")
    (room / "sub" / "services.txt").write_text(CONTRACT, encoding="utf-8")
    out = tmp_path / "reviews"
    result = cli(room, "--format", "html", "--out-dir", out)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.html"))
    assert written == ["index.html", "services-md.review.html", "services-txt.review.html",
                       "sub/services.review.html"]
    with open_report(out / "index.html") as browser:
        rows = browser.evaluate("Array.from(document.querySelectorAll('table.index tbody tr')).map(r => "
                                "[r.querySelector('a').getAttribute('href'), r.textContent])")
        assert sorted(href for href, _ in rows) == written[1:]
        laws = {href: text for href, text in rows}
        assert "New York" in laws["services-md.review.html"] and "Delaware" in laws["services-txt.review.html"]
    with open_report(out / "sub/services.review.html") as browser:
        assert browser.evaluate("document.querySelectorAll('article.finding').length") >= 1


@pytest.mark.parametrize("args, says", [
    (["{docx}", "--format", "pdf", "--out", "{tmp}/x.pdf"], "is not one: use --format docx or html"),
    (["{txt}", "{docx}", "--format", "docx"], "give --out-dir DIR for these 2"),
    (["{txt}", "{docx}", "--format", "html", "--out", "{tmp}/x.html"], "give --out-dir DIR for these 2"),
    (["{txt}", "--format", "json", "--out-dir", "{tmp}/d"], "use it with --format html, docx or pdf"),
    (["{txt}", "--out", "{tmp}/x.html", "--out-dir", "{tmp}/d"], "not both"),
    (["-", "--format", "pdf", "--out", "{tmp}/x.pdf"], "name the file instead of -"),
])
def test_a_format_that_cannot_be_written_is_one_usage_error_before_any_work(cli, small_contracts, tmp_path, args, says):
    argv = [a.format(tmp=tmp_path, **{k: str(v) for k, v in small_contracts.items()}) for a in args]
    line = one_error_line(cli(*argv), exit_code=2)
    assert says in line
    assert not list(tmp_path.glob("x.*")) and not (tmp_path / "d").exists()


def test_index_page_lists_every_contract_with_parties_law_and_counts(tmp_path):
    result, doc = hostile_review()
    page = index_html([(result, "hostile.review.html")], failed=[("broken.pdf", "it is not a PDF file")])
    path = tmp_path / "index.html"
    path.write_text(page, encoding="utf-8")
    with open_report(path, width=400) as browser:
        cells = browser.evaluate("Array.from(document.querySelectorAll('table.index tbody td'))"
                                 ".map(c => c.textContent)")
        assert cells[0] == "hostile.txt" and cells[3:6] == ["3", "0", "0"]
        assert "broken.pdf: it is not a PDF file" in browser.evaluate("document.body.textContent")
