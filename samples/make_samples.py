#!/usr/bin/env python3
"""Build the kvpage demo documents from ``samples/contract.md``.

Run from anywhere::

    python samples/make_samples.py            # write everything
    python samples/make_samples.py --check    # write everything, then verify the outputs
    python samples/make_samples.py --repo-only  # only the files under samples/repo/ (no reportlab needed)

Outputs (all beside this script):

* ``contract.txt``  - the contract as plain text, one paragraph per line, as a lawyer would paste it;
* ``contract.docx`` - python-docx: Title/Heading 1 styles, indented sub-clauses, a table in
  Exhibit A, a header with the agreement title and a footer "Page N of M" (PAGE/NUMPAGES fields);
* ``contract.pdf``  - reportlab, US Letter, a running header with the agreement title and a
  footer "Page N of M" on every page; standard Type 1 fonts, no hyphenation, so pypdf extracts
  the text in order with no ligatures and no split words;
* ``repo/assets/logo.png`` - the demo repository's binary file (committed; rewritten identically);
* ``repo/build/`` and ``repo/ledgerline-debug.log`` - files that ``samples/repo/.gitignore``
  ignores. Git ignores them too, so they are not committed: this script recreates them. The stale
  ``repo/build/lib/ledgerline/config.py`` holds an old VAT rate (19%) on purpose: an ``ask`` that
  wrongly reads ignored files answers 19% instead of the real 20%.

Dependencies: python-docx (a kvpage runtime dependency) and, for the PDF only, **reportlab**
(BSD licence; a dev-only dependency of this script, not of kvpage: ``pip install reportlab``).
The output is deterministic: the same bytes on every run with the same library versions
(reportlab's invariant mode, fixed DOCX core properties and ZIP timestamps).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import re
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "contract.md"
OUT_TXT = HERE / "contract.txt"
OUT_DOCX = HERE / "contract.docx"
OUT_PDF = HERE / "contract.pdf"
REPO = HERE / "repo"

RUNNING_HEADER = (
    "Master Services Agreement - Quillfeather Analytics, Inc. and Ostrander Cold Chain Logistics LLC"
)
DOC_TITLE = "Master Services Agreement"
DOC_AUTHOR = "kvpage samples"
FIXED_TIME = _dt.datetime(2025, 4, 1, 9, 0, 0, tzinfo=_dt.timezone.utc)

# ---------------------------------------------------------------------------------------------
# Parsing contract.md
# ---------------------------------------------------------------------------------------------

ROMANS = {"i", "ii", "iii", "iv", "v", "vi", "vii", "viii", "ix", "x"}
CLAUSE_RE = re.compile(r"^(\d+\.\d+|[A-Z]\.\d+) ")
ITEM_RE = re.compile(r"^\(([a-z]{1,4})\) ")
BOLD_RE = re.compile(r"\*\*(.+?)\*\*")


@dataclass
class Block:
    kind: str  # "title" | "subtitle" | "heading" | "para" | "table"
    text: str = ""  # plain text (markup removed)
    runs: list[tuple[str, bool]] = field(default_factory=list)  # (text, bold)
    level: int = 0  # indentation level of a paragraph: 0 body/clause, 1 (a), 2 (i) under (a)
    rows: list[list[str]] = field(default_factory=list)  # table rows, first one is the header
    page_break_before: bool = False
    keep_with_next: bool = False


def _runs(md_text: str) -> list[tuple[str, bool]]:
    runs: list[tuple[str, bool]] = []
    pos = 0
    for m in BOLD_RE.finditer(md_text):
        if m.start() > pos:
            runs.append((md_text[pos : m.start()], False))
        runs.append((m.group(1), True))
        pos = m.end()
    if pos < len(md_text):
        runs.append((md_text[pos:], False))
    return runs


def _table_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(md: str) -> list[Block]:
    blocks: list[Block] = []
    lines = md.splitlines()
    in_letter_list = False
    last_letter = ""
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        i += 1
        if not line.strip():
            continue
        if line.startswith("# "):
            blocks.append(Block("title", text=line[2:].strip()))
            continue
        if line.startswith("## "):
            text = line[3:].strip()
            blocks.append(
                Block("heading", text=text, page_break_before=text.startswith("EXHIBIT"))
            )
            in_letter_list = False
            continue
        if line.startswith("|"):
            rows = [_table_row(line)]
            while i < len(lines) and lines[i].startswith("|"):
                row = _table_row(lines[i])
                i += 1
                if all(re.fullmatch(r":?-{3,}:?", c) for c in row):
                    continue  # the Markdown separator row
                rows.append(row)
            blocks.append(Block("table", rows=rows))
            continue
        runs = _runs(line)
        text = "".join(t for t, _ in runs)
        level = 0
        if CLAUSE_RE.match(text):
            in_letter_list = False
        else:
            m = ITEM_RE.match(text)
            if m:
                label = m.group(1)
                is_roman = label in ROMANS and not (label == "i" and last_letter == "h")
                if is_roman:
                    level = 2 if in_letter_list else 1
                else:
                    level = 1
                    in_letter_list = True
                    last_letter = label
        kind = "subtitle" if blocks and blocks[-1].kind == "title" else "para"
        blocks.append(Block(kind, text=text, runs=runs, level=level))
    # Keep signature blocks together: a bold-only party line and the lines after it up to "Date:".
    for idx, b in enumerate(blocks):
        if _is_party_line(b):
            j = idx
            while j < len(blocks) and not blocks[j].text.startswith("Date:"):
                blocks[j].keep_with_next = True
                j += 1
        if b.kind == "para" and b.text.startswith("IN WITNESS WHEREOF"):
            b.keep_with_next = True
    return blocks


def _is_party_line(b: Block) -> bool:
    """A signature block's party name: a paragraph that is bold from end to end."""
    return b.kind == "para" and len(b.runs) == 1 and b.runs[0][1]


# ---------------------------------------------------------------------------------------------
# Plain text
# ---------------------------------------------------------------------------------------------


def to_text(blocks: list[Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if b.kind == "table":
            out.append("\n".join("\t".join(r) for r in b.rows))
        else:
            out.append(b.text)
    return "\n\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# DOCX (python-docx)
# ---------------------------------------------------------------------------------------------


def _set_font(style, name: str, size_pt: float, bold: bool | None = None, color=None) -> None:
    from docx.oxml.ns import qn
    from docx.shared import Pt

    style.font.name = name
    style.font.size = Pt(size_pt)
    if bold is not None:
        style.font.bold = bold
    if color is not None:
        style.font.color.rgb = color
    rpr = style.element.get_or_add_rPr()
    rfonts = rpr.find(qn("w:rFonts"))
    if rfonts is not None:  # theme fonts would override the explicit name in Word
        for attr in ("w:asciiTheme", "w:hAnsiTheme", "w:eastAsiaTheme", "w:cstheme"):
            rfonts.attrib.pop(qn(attr), None)
        rfonts.set(qn("w:eastAsia"), name)
        rfonts.set(qn("w:cs"), name)


def _add_field(paragraph, instr: str, placeholder: str) -> None:
    """Append a complex field (PAGE, NUMPAGES) whose cached result is ``placeholder``."""
    from docx.oxml import OxmlElement
    from docx.oxml.ns import qn

    def fld_char(kind: str):
        run = paragraph.add_run()
        el = OxmlElement("w:fldChar")
        el.set(qn("w:fldCharType"), kind)
        run._r.append(el)

    fld_char("begin")
    run = paragraph.add_run()
    it = OxmlElement("w:instrText")
    it.set(qn("xml:space"), "preserve")
    it.text = f" {instr} "
    run._r.append(it)
    fld_char("separate")
    paragraph.add_run(placeholder)
    fld_char("end")


def _normalize_zip(data: bytes) -> bytes:
    """Rewrite a ZIP with fixed timestamps so the DOCX bytes do not depend on the clock."""
    src = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            zi = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            dst.writestr(zi, src.read(info.filename))
    return buf.getvalue()


def write_docx(blocks: list[Block], path: Path) -> None:
    from docx import Document
    from docx.enum.table import WD_TABLE_ALIGNMENT
    from docx.enum.text import WD_ALIGN_PARAGRAPH
    from docx.shared import Inches, Pt, RGBColor

    doc = Document()
    section = doc.sections[0]
    section.page_width, section.page_height = Inches(8.5), Inches(11)
    for side in ("left_margin", "right_margin", "top_margin", "bottom_margin"):
        setattr(section, side, Inches(1))

    black = RGBColor(0, 0, 0)
    _set_font(doc.styles["Normal"], "Times New Roman", 11.5)
    doc.styles["Normal"].paragraph_format.space_after = Pt(6)
    _set_font(doc.styles["Title"], "Times New Roman", 18, bold=True, color=black)
    _set_font(doc.styles["Heading 1"], "Times New Roman", 12, bold=True, color=black)
    doc.styles["Heading 1"].paragraph_format.space_before = Pt(14)
    doc.styles["Heading 1"].paragraph_format.space_after = Pt(6)

    header_p = section.header.paragraphs[0]
    header_p.text = RUNNING_HEADER
    header_p.alignment = WD_ALIGN_PARAGRAPH.CENTER
    for r in header_p.runs:
        r.font.size = Pt(8.5)
    footer_p = section.footer.paragraphs[0]
    footer_p.alignment = WD_ALIGN_PARAGRAPH.CENTER
    footer_p.add_run("Page ")
    _add_field(footer_p, "PAGE", "1")
    footer_p.add_run(" of ")
    _add_field(footer_p, "NUMPAGES", "1")

    for b in blocks:
        if b.kind == "title":
            p = doc.add_paragraph(b.text, style="Title")
            p.alignment = WD_ALIGN_PARAGRAPH.CENTER
        elif b.kind == "subtitle":
            p = doc.add_paragraph(b.text)
            p.alignment = WD_ALIGN_PARAGRAPH.CENTER
        elif b.kind == "heading":
            p = doc.add_paragraph(b.text, style="Heading 1")
            if b.page_break_before:
                p.paragraph_format.page_break_before = True
        elif b.kind == "table":
            table = doc.add_table(rows=len(b.rows), cols=len(b.rows[0]))
            table.style = "Table Grid"
            table.alignment = WD_TABLE_ALIGNMENT.CENTER
            for r_idx, row in enumerate(b.rows):
                for c_idx, cell_text in enumerate(row):
                    cell = table.cell(r_idx, c_idx)
                    cell.text = ""
                    run = cell.paragraphs[0].add_run(cell_text)
                    run.bold = r_idx == 0
                    cell.paragraphs[0].paragraph_format.space_after = Pt(0)
                    if c_idx == len(row) - 1:
                        cell.paragraphs[0].alignment = WD_ALIGN_PARAGRAPH.RIGHT
        else:
            p = doc.add_paragraph()
            for text, bold in b.runs:
                run = p.add_run(text)
                run.bold = bold
            if b.level:
                p.paragraph_format.left_indent = Inches(0.4 * b.level)
            if b.keep_with_next:
                p.paragraph_format.keep_with_next = True
            if b.text.startswith(("By:", "Name:", "Title:")):
                p.paragraph_format.space_after = Pt(2)
            if _is_party_line(b):
                p.paragraph_format.space_before = Pt(12)
                p.paragraph_format.space_after = Pt(10)

    cp = doc.core_properties
    cp.title = DOC_TITLE
    cp.subject = "Quillfeather Analytics, Inc. and Ostrander Cold Chain Logistics LLC"
    cp.author = DOC_AUTHOR
    cp.last_modified_by = DOC_AUTHOR
    cp.comments = "Fictional sample contract written for kvpage; generated by samples/make_samples.py"
    cp.created = FIXED_TIME.replace(tzinfo=None)
    cp.modified = FIXED_TIME.replace(tzinfo=None)
    cp.revision = 1

    buf = io.BytesIO()
    doc.save(buf)
    path.write_bytes(_normalize_zip(buf.getvalue()))


# ---------------------------------------------------------------------------------------------
# PDF (reportlab)
# ---------------------------------------------------------------------------------------------


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _markup(runs: list[tuple[str, bool]]) -> str:
    return "".join(f"<b>{_esc(t)}</b>" if bold else _esc(t) for t, bold in runs)


def _pdf_bytes(blocks: list[Block], total_pages: int | None) -> tuple[bytes, int]:
    from reportlab.lib import colors
    from reportlab.lib.enums import TA_CENTER, TA_JUSTIFY
    from reportlab.lib.pagesizes import LETTER
    from reportlab.lib.styles import ParagraphStyle
    from reportlab.lib.units import inch
    from reportlab.platypus import (
        KeepTogether,
        BaseDocTemplate,
        Frame,
        PageBreak,
        PageTemplate,
        Paragraph,
        Spacer,
        Table,
        TableStyle,
    )

    base = ParagraphStyle(
        "Body",
        fontName="Times-Roman",
        fontSize=12,
        leading=18,
        spaceAfter=10,
        alignment=TA_JUSTIFY,
        hyphenationLang="",
        embeddedHyphenation=0,
        splitLongWords=0,
    )
    title = ParagraphStyle("Title", parent=base, fontName="Times-Bold", fontSize=18,
                           leading=22, alignment=TA_CENTER, spaceAfter=8)
    subtitle = ParagraphStyle("Subtitle", parent=base, alignment=TA_CENTER, spaceAfter=16)
    heading = ParagraphStyle("Heading1", parent=base, fontName="Times-Bold", fontSize=13,
                             leading=18, spaceBefore=10, spaceAfter=6, keepWithNext=1,
                             alignment=0)
    sig = ParagraphStyle("Signature", parent=base, spaceAfter=2, alignment=0)
    party = ParagraphStyle("SignatureParty", parent=sig, spaceBefore=12, spaceAfter=10)
    levels = [
        base,
        ParagraphStyle("Level1", parent=base, leftIndent=0.4 * inch),
        ParagraphStyle("Level2", parent=base, leftIndent=0.8 * inch),
    ]
    cell = ParagraphStyle("Cell", parent=base, fontSize=11, leading=14, spaceAfter=0,
                          alignment=0)

    pages = {"n": 0}

    def draw_header(canv, doc) -> None:
        width, height = LETTER
        canv.saveState()
        canv.setFont("Helvetica", 8.5)
        canv.drawCentredString(width / 2, height - 0.6 * inch, RUNNING_HEADER)
        canv.setLineWidth(0.5)
        canv.line(inch, height - 0.68 * inch, width - inch, height - 0.68 * inch)
        canv.restoreState()

    def draw_footer(canv, doc) -> None:  # at the end of the page, as most PDFs have it
        pages["n"] = canv.getPageNumber()
        canv.saveState()
        canv.setFont("Helvetica", 9)
        total = total_pages if total_pages is not None else 999
        canv.drawCentredString(LETTER[0] / 2, 0.55 * inch,
                               f"Page {canv.getPageNumber()} of {total}")
        canv.restoreState()

    story = []
    pending_keep: list = []
    for b in blocks:
        if b.kind == "title":
            flow = Paragraph(_esc(b.text), title)
        elif b.kind == "subtitle":
            flow = Paragraph(_esc(b.text), subtitle)
        elif b.kind == "heading":
            if b.page_break_before:
                story.append(PageBreak())
            flow = Paragraph(_esc(b.text), heading)
        elif b.kind == "table":
            data = [
                [Paragraph(("<b>%s</b>" if r == 0 else "%s") % _esc(c), cell) for c in row]
                for r, row in enumerate(b.rows)
            ]
            flow = Table(data, colWidths=[3.0 * inch, 2.0 * inch, 1.3 * inch], hAlign="CENTER")
            flow.setStyle(TableStyle([
                ("GRID", (0, 0), (-1, -1), 0.5, colors.black),
                ("BACKGROUND", (0, 0), (-1, 0), colors.Color(0.9, 0.9, 0.9)),
                ("VALIGN", (0, 0), (-1, -1), "TOP"),
                ("TOPPADDING", (0, 0), (-1, -1), 3),
                ("BOTTOMPADDING", (0, 0), (-1, -1), 4),
            ]))
            story.extend([flow, Spacer(1, 8)])
            continue
        else:
            if _is_party_line(b):
                style = party
            elif b.keep_with_next or b.text.startswith("Date:"):
                style = sig
            else:
                style = levels[b.level]
            flow = Paragraph(_markup(b.runs), style)
        if b.keep_with_next:
            pending_keep.append(flow)
            continue
        if pending_keep:
            pending_keep.append(flow)
            story.append(KeepTogether(pending_keep))
            pending_keep = []
            if b.text.startswith("Date:"):
                story.append(Spacer(1, 14))
            continue
        story.append(flow)
    story.extend(pending_keep)

    buf = io.BytesIO()
    doc = BaseDocTemplate(
        buf,
        pagesize=LETTER,
        leftMargin=inch,
        rightMargin=inch,
        topMargin=inch,
        bottomMargin=inch,
        title=DOC_TITLE,
        author=DOC_AUTHOR,
        subject="Quillfeather Analytics, Inc. and Ostrander Cold Chain Logistics LLC",
        creator="kvpage samples/make_samples.py",
        producer="ReportLab PDF Library",
        invariant=1,
    )
    frame = Frame(doc.leftMargin, doc.bottomMargin, doc.width, doc.height, id="body",
                  leftPadding=0, rightPadding=0, topPadding=0, bottomPadding=0)
    doc.addPageTemplates(
        [PageTemplate(id="page", frames=[frame], onPage=draw_header, onPageEnd=draw_footer)]
    )
    doc.build(story)
    return buf.getvalue(), pages["n"]


def write_pdf(blocks: list[Block], path: Path) -> int:
    # Two passes: the first counts the pages so that every footer can say "Page N of M".
    _, n_pages = _pdf_bytes(blocks, None)
    data, n_again = _pdf_bytes(blocks, n_pages)
    assert n_again == n_pages, (n_pages, n_again)
    path.write_bytes(data)
    return n_pages


# ---------------------------------------------------------------------------------------------
# samples/repo extras: binary logo and the git-ignored files
# ---------------------------------------------------------------------------------------------


def _png(width: int, height: int, pixel) -> bytes:
    raw = b"".join(
        b"\x00" + b"".join(bytes(pixel(x, y)) for x in range(width)) for y in range(height)
    )

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _logo_pixel(x: int, y: int) -> tuple[int, int, int]:
    teal, white, ink = (0, 128, 128), (255, 255, 255), (20, 40, 60)
    if x < 4 or y < 4 or x > 59 or y > 59:
        return ink  # frame
    if 16 <= x <= 23 and 14 <= y <= 49:
        return white  # the stem of an "L"
    if 16 <= x <= 47 and 42 <= y <= 49:
        return white  # the foot of the "L"
    return teal


STALE_BUILD_CONFIG = '''"""Configuration for ledgerline (stale build copy of version 0.2.0)."""

from decimal import Decimal

# Old default: changed to 20% in 0.3.0. This file is a leftover build artefact.
DEFAULT_VAT_RATE = Decimal("0.19")
DEFAULT_CURRENCY = "EUR"
PAYMENT_TERMS_DAYS = 14
'''

DEBUG_LOG = """2025-03-14 09:12:03,114 INFO ledgerline.cli: reading examples/items.csv
2025-03-14 09:12:03,118 DEBUG ledgerline.calculator: line SKU-1001 qty=3 unit=19.99 net=59.97
2025-03-14 09:12:03,118 DEBUG ledgerline.calculator: line SKU-2040 qty=60 unit=2.50 bulk discount applied
2025-03-14 09:12:03,119 WARNING ledgerline.config: LEDGERLINE_VAT_RATE=0.21 set in environment, overriding default
2025-03-14 09:12:03,121 INFO ledgerline.cli: invoice INV-2025-00042 total=EUR 440.17
"""


def write_repo_extras() -> list[Path]:
    written = []
    logo = REPO / "assets" / "logo.png"
    logo.parent.mkdir(parents=True, exist_ok=True)
    logo.write_bytes(_png(64, 64, _logo_pixel))
    written.append(logo)
    stale = REPO / "build" / "lib" / "ledgerline" / "config.py"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text(STALE_BUILD_CONFIG, encoding="utf-8")
    written.append(stale)
    log = REPO / "ledgerline-debug.log"
    log.write_text(DEBUG_LOG, encoding="utf-8")
    written.append(log)
    return written


# ---------------------------------------------------------------------------------------------
# Verification (--check)
# ---------------------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return text.split()


def check(n_pages: int) -> list[str]:
    """Return a list of problems (empty when all is well)."""
    import docx
    import pypdf

    problems: list[str] = []
    txt = OUT_TXT.read_text(encoding="utf-8")
    reader = pypdf.PdfReader(str(OUT_PDF))
    if len(reader.pages) != n_pages:
        problems.append(f"PDF has {len(reader.pages)} pages, expected {n_pages}")
    body: list[str] = []
    for i, page in enumerate(reader.pages, start=1):
        lines = page.extract_text().splitlines()
        if not lines or lines[0].strip() != RUNNING_HEADER:
            problems.append(f"page {i}: first line is not the running header: {lines[:1]!r}")
        footer = f"Page {i} of {len(reader.pages)}"
        if footer not in [ln.strip() for ln in lines]:
            problems.append(f"page {i}: no footer {footer!r}")
        body.extend(ln for ln in lines if ln.strip() not in (RUNNING_HEADER, footer))
    pdf_words, txt_words = _words("\n".join(body)), _words(txt)
    if pdf_words != txt_words:
        for k, (a, b) in enumerate(zip(pdf_words, txt_words)):
            if a != b:
                ctx = " ".join(txt_words[max(0, k - 5) : k + 5])
                problems.append(f"PDF text differs at word {k}: pdf={a!r} txt={b!r} near {ctx!r}")
                break
        else:
            problems.append(f"PDF has {len(pdf_words)} words, txt has {len(txt_words)}")
    if any(ch in "\ufb00\ufb01\ufb02\ufb03\ufb04" for ch in "".join(pdf_words)):
        problems.append("ligature characters in PDF text")

    d = docx.Document(str(OUT_DOCX))
    heads = [p.text for p in d.paragraphs if p.style.name.startswith("Heading")]
    md_heads = [b.text for b in parse(SOURCE.read_text(encoding="utf-8")) if b.kind == "heading"]
    if heads != md_heads:
        problems.append(f"DOCX headings {heads[:3]}... differ from contract.md headings")
    docx_words = _words("\n".join(p.text for p in d.paragraphs))
    for t in d.tables:
        for row in t.rows:
            docx_words += _words(" ".join(c.text for c in row.cells))
    if sorted(docx_words) != sorted(txt_words):
        problems.append("DOCX words differ from contract.txt words")
    return problems


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="verify the outputs after writing them")
    ap.add_argument("--repo-only", action="store_true",
                    help="only write samples/repo/ extras (logo, ignored build/ and .log files)")
    args = ap.parse_args(argv)

    for p in write_repo_extras():
        print(f"wrote {p.relative_to(HERE.parent)}")
    if args.repo_only:
        return 0

    blocks = parse(SOURCE.read_text(encoding="utf-8"))
    OUT_TXT.write_text(to_text(blocks), encoding="utf-8", newline="\n")
    write_docx(blocks, OUT_DOCX)
    n_pages = write_pdf(blocks, OUT_PDF)
    n_words = len(_words(OUT_TXT.read_text(encoding="utf-8")))
    for p in (OUT_TXT, OUT_DOCX, OUT_PDF):
        print(f"wrote {p.relative_to(HERE.parent)} ({p.stat().st_size} bytes)")
    print(f"contract: {n_words} words, {n_pages} PDF pages")

    if args.check:
        problems = check(n_pages)
        for msg in problems:
            print(f"CHECK FAILED: {msg}", file=sys.stderr)
        if problems:
            return 1
        print("check: PDF text matches contract.txt word for word; DOCX headings and words match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
