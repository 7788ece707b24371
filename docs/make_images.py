"""Makes the images of docs/review-formats.md from real reviews of the sample contract.

    python docs/make_images.py                  # reviews samples/contract.pdf and .docx (minutes)
    python docs/make_images.py --pdf-review pdf.json --docx-review docx.json   # from saved --json

Needs LibreOffice (soffice), poppler (pdftoppm) and Chromium, as the tests do:
- review-html-desktop.png, review-html-narrow.png: the HTML report in headless Chromium, 1400 and 400
  pixels wide;
- review-pdf-page.png, review-pdf-summary.png: pages of the highlighted PDF, drawn by pdftoppm;
- review-docx-page.png: a page of the commented DOCX as LibreOffice lays it out (converted to PDF,
  comments exported as PDF annotations, drawn by pdftoppm), with each comment LibreOffice exported
  written beside its line, in the margin, as Word shows them (LibreOffice 7.4 cannot draw them
  into the page itself; 7.5 can, with ExportNotesInMargin).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pypdf  # noqa: E402

from kvpage_cli.ingest import load  # noqa: E402
from kvpage_cli.tasks.formats.docx import commented_docx  # noqa: E402
from kvpage_cli.tasks.formats.html import review_html  # noqa: E402
from kvpage_cli.tasks.formats.pdf import highlighted_pdf  # noqa: E402
from kvpage_cli.tasks.schema import ReviewResult  # noqa: E402
from tests.chromium import Browser  # noqa: E402

IMAGES = REPO / "docs" / "images"


def review(path: Path, saved: str | None) -> ReviewResult:
    if saved:
        return ReviewResult.from_dict(json.loads(Path(saved).read_text()))
    out = subprocess.run([str(Path(sys.executable).with_name("kvpage")), "review", str(path), "--json"],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout
    return ReviewResult.from_dict(json.loads(out))


def pdftoppm(pdf: Path, page: int, out: Path, dpi: int = 80) -> None:
    subprocess.run(["pdftoppm", "-png", "-r", str(dpi), "-f", str(page), "-l", str(page), "-singlefile", str(pdf),
                    str(out.with_suffix(""))], check=True)


def html_images(result: ReviewResult, doc, work: Path) -> None:
    page = work / "contract.review.html"
    page.write_text(review_html(result, doc), encoding="utf-8")
    with Browser(1400, 900) as browser:
        browser.open(page)
        first = next(n for n, f in enumerate(result.findings, start=1) if f.risk == "high")
        browser.evaluate(f"document.getElementById('q-{first}').scrollIntoView({{block: 'center'}});"
                         "document.getElementById('findings').scrollTop = 0;")
        browser.screenshot(IMAGES / "review-html-desktop.png")
    with Browser(400, 860) as browser:
        browser.open(page)
        browser.screenshot(IMAGES / "review-html-narrow.png")


def pdf_images(result: ReviewResult, doc, source: Path, work: Path) -> None:
    out = work / "contract.review.pdf"
    out.write_bytes(highlighted_pdf(result, doc, source.read_bytes()).data)
    pages = len(pypdf.PdfReader(source).pages)
    busiest = max(range(1, pages + 1), key=lambda n: sum(f.source == f"page {n}" for f in result.findings))
    pdftoppm(out, busiest, IMAGES / "review-pdf-page.png")
    pdftoppm(out, pages + 1, IMAGES / "review-pdf-summary.png")


def docx_image(result: ReviewResult, doc, source: Path, work: Path) -> None:
    copy = work / "contract.review.docx"
    copy.write_bytes(commented_docx(result, doc, source.read_bytes()))
    subprocess.run(["soffice", f"-env:UserInstallation={(work / 'lo').as_uri()}", "--headless", "--convert-to",
                    'pdf:writer_pdf_Export:{"ExportNotes":{"type":"boolean","value":"true"}}', "--outdir", str(work),
                    str(copy)], check=True, capture_output=True)
    rendered = work / "contract.review.pdf"
    reader = pypdf.PdfReader(rendered)
    number = max(range(len(reader.pages)), key=lambda i: len(reader.pages[i].get("/Annots", []))) + 1
    png = work / "docx-page.png"
    dpi = 80
    pdftoppm(rendered, number, png, dpi)
    page = reader.pages[number - 1]
    height = float(page.mediabox.height)
    notes = []
    for ref in page.get("/Annots", []):
        a = ref.get_object()
        if a.get("/Subtype") == "/Text":
            top = (height - float(a["/Rect"][3])) * dpi / 72
            notes.append((top, str(a.get("/Contents", ""))))
    boxes, bottom = [], 0.0
    for top, text in sorted(notes):
        top = max(top, bottom)
        head, _, rest = text.partition("\n")
        risk = head.split()[0].lower() if head else "none"
        boxes.append(f'<div class="note {risk}" style="top:{top:.0f}px"><b>{html.escape(head)}</b>'
                     f'<p>{html.escape(rest).replace(chr(10), "<br>")}</p></div>')
        bottom = top + 40 + 14 * (1 + len(rest) // 48 + rest.count("\n"))
    image = base64.b64encode(png.read_bytes()).decode()
    page_html = work / "docx-page.html"
    page_html.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><style>"
        "body{margin:0;background:#e8e8e8;font:12px/1.35 sans-serif}"
        ".wrap{position:relative;width:1060px;padding:16px}"
        "img{box-shadow:0 1px 4px #0004;display:block}"
        ".note{position:absolute;left:716px;width:330px;background:#fff;border-left:4px solid #c62828;"
        "padding:6px 8px;box-shadow:0 1px 3px #0003}.note p{margin:3px 0 0;color:#333}"
        ".medium{border-color:#e0a100}.low{border-color:#1f5f99}.kvpage{border-color:#5b6670}"
        f"</style></head><body><div class='wrap'><img src='data:image/png;base64,{image}'>{''.join(boxes)}"
        "</div></body></html>", encoding="utf-8")
    tall = int(max(bottom, float(page.mediabox.height) * dpi / 72)) + 40
    with Browser(1092, tall) as browser:
        browser.open(page_html)
        browser.screenshot(IMAGES / "review-docx-page.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pdf-review", help="a saved `kvpage review samples/contract.pdf --json`")
    parser.add_argument("--docx-review", help="a saved `kvpage review samples/contract.docx --json`")
    args = parser.parse_args()
    IMAGES.mkdir(parents=True, exist_ok=True)
    pdf, docx_path = REPO / "samples" / "contract.pdf", REPO / "samples" / "contract.docx"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result, doc = review(pdf, args.pdf_review), load(str(pdf))
        html_images(result, doc, work)
        pdf_images(result, doc, pdf, work)
        docx_image(review(docx_path, args.docx_review), load(str(docx_path)), docx_path, work)


if __name__ == "__main__":
    main()
