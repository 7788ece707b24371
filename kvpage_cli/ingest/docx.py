"""DOCX files: the accepted text of the body, tables, content controls, text boxes and notes."""

from __future__ import annotations

import io
import os
import posixpath
import re
import zipfile
from dataclasses import dataclass

from lxml import etree

from kvpage_cli.ingest.document import Document, Span, check_text_size, read_source
from kvpage_cli.ingest.errors import BrokenDocument, DocumentTooLarge, EmptyDocument

_W_TRANSITIONAL = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
_W_STRICT = "http://purl.oclc.org/ooxml/wordprocessingml/main"
_MC = "http://schemas.openxmlformats.org/markup-compatibility/2006"
_MATH = "http://schemas.openxmlformats.org/officeDocument/2006/math"
_REL = "http://schemas.openxmlformats.org/package/2006/relationships"
# What the XML parts read (document, styles, numbering, notes, relationships) may inflate to: a
# few MiB of zip can hold gigabytes of XML. Sizes are the zip's own: zipfile never inflates a
# part past the size its directory declares.
_MAX_PART_BYTES = 64 * 2**20
_MAX_PARTS_BYTES = 128 * 2**20  # all of them together
_MAX_INFLATE_RATIO = 200  # past _RATIO_GRACE_BYTES; the corpus DOCX parts deflate 2-32 fold, zip bombs ~1000
_RATIO_GRACE_BYTES = 2**20
_MAX_LABEL_CHARS = 64  # a list label ("1.2.3", "(iv)") longer than this is cut
_MAX_LETTER_NUMBER = 26 * 30  # letter numbering up to 30 repeated letters ("zzz..."), then digits
_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
_NOTE_SKIP_TYPES = {"separator", "continuationSeparator", "continuationNotice"}
_HEADING_STYLE = re.compile(r"^(heading\s*[1-9]|title)$", re.IGNORECASE)
# libxml2's own limits stay on (no huge_tree): elements nested at most 256 deep, text nodes of at
# most 10 MB, bounded entity amplification. Entities are not expanded at all.
_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, remove_comments=True)


def read_docx(source: str | os.PathLike | bytes, display: str | None = None) -> Document:
    """Read a DOCX file (or its bytes) into a Document with one span per paragraph.

    The text is what Word shows with every tracked change accepted: insertions kept, deletions
    dropped. Tables (nested ones too), content controls, text boxes, hyperlinks and field results
    are kept; footnotes and endnotes follow the body, each marked where it is referenced.
    Automatically numbered paragraphs get their number ("1.", "2.1", "(a)") in front.
    Raises BrokenDocument for a file that is not a DOCX, EmptyDocument when there is no text.
    """
    if display is None:
        display = "-" if isinstance(source, (bytes, bytearray)) else os.fspath(source)
    package = _Package.open(source, display)
    reader = _BodyReader(package)
    try:
        reader.read_body()
    except RecursionError:  # libxml2 stops nesting at 256 levels; this is a second guard
        raise BrokenDocument(display, "its content is nested too deeply") from None
    lines = reader.lines
    warnings = list(reader.warnings)
    if not any(piece.text.strip() for line in lines for piece in line):
        raise EmptyDocument(display)
    text, spans = _assemble(lines, display)
    return Document(source=display, kind="docx", text=text, spans=spans, warnings=warnings)


@dataclass
class _Piece:
    """One paragraph's text, ready to be placed on a line."""

    text: str
    paragraph: int | None
    kind: str = "text"
    xml_paragraph: int | None = None  # Span.xml_paragraph


def _assemble(lines: list[list[_Piece]], display: str) -> tuple[str, list[Span]]:
    parts: list[str] = []
    spans: list[Span] = []
    pos = 0
    for line in lines:
        pieces = [p for p in line if p.text.strip()]
        if not pieces:
            continue
        if parts:
            parts.append("\n")
            pos += 1
        for j, piece in enumerate(pieces):
            text = piece.text.strip()
            # table cells share a line: "cell | cell"; each cell's span takes its " |"
            cell = text + (" |" if j + 1 < len(pieces) else "")
            parts.append(cell)
            spans.append(Span(pos, pos + len(cell), display, paragraph=piece.paragraph,
                              kind=piece.kind, xml_paragraph=piece.xml_paragraph))
            pos += len(cell)
            if j + 1 < len(pieces):
                parts.append(" ")
                pos += 1
    return "".join(parts), spans


class _Package:
    """The parts of a DOCX zip that hold text, found through the package relationships."""

    def __init__(self, archive: zipfile.ZipFile, display: str):
        self.archive = archive
        self.display = display
        self.inflated = 0  # bytes of XML read so far
        main = self._target("_rels/.rels", "/officeDocument") or "word/document.xml"
        if main not in archive.namelist():
            main = "word/document.xml"
        if main not in archive.namelist():
            raise BrokenDocument(display, "it is not a DOCX file (no word/document.xml)")
        rels = posixpath.join(posixpath.dirname(main), "_rels", posixpath.basename(main) + ".rels")
        base = posixpath.dirname(main)

        def part(kind: str, default: str) -> str:
            target = self._target(rels, kind, base)
            return target or posixpath.join(base, default)

        self.document = self.xml(main)
        if self.document is None:
            raise BrokenDocument(display, "it is not a DOCX file (no word/document.xml)")
        self.styles = self.xml(part("/styles", "styles.xml"))
        self.numbering = self.xml(part("/numbering", "numbering.xml"))
        self.footnotes = self.xml(part("/footnotes", "footnotes.xml"))
        self.endnotes = self.xml(part("/endnotes", "endnotes.xml"))
        namespace = etree.QName(self.document).namespace
        self.w = namespace if namespace in (_W_TRANSITIONAL, _W_STRICT) else _W_TRANSITIONAL

    @classmethod
    def open(cls, source, display: str) -> _Package:
        data = read_source(source, display)
        if data.startswith(_OLE_MAGIC):
            raise BrokenDocument(
                display, "it is a password-protected or legacy Word file, not DOCX; "
                "save an unprotected copy as .docx")
        try:
            archive = zipfile.ZipFile(io.BytesIO(data))
        except (zipfile.BadZipFile, ValueError):
            raise BrokenDocument(display, "it is not a DOCX file (not a zip archive)") from None
        return cls(archive, display)

    def xml(self, name: str):
        try:
            info = self.archive.getinfo(name)
        except KeyError:
            return None
        self._check_size(name, info)
        self.inflated += info.file_size
        try:
            return etree.fromstring(self.archive.read(info), _PARSER)
        except etree.XMLSyntaxError as e:
            if "depth" in str(e).lower():
                raise BrokenDocument(self.display, f"{name} nests its elements more than 256 levels deep") from None
            raise BrokenDocument(self.display, f"{name} is damaged (XMLSyntaxError)") from None
        except Exception as e:  # zlib, CRC and XML errors alike mean a damaged file
            raise BrokenDocument(self.display, f"{name} is damaged ({type(e).__name__})") from None

    def _check_size(self, name: str, info: zipfile.ZipInfo) -> None:
        """Refuses a part before inflating it when it would inflate too far (a zip bomb)."""
        size = info.file_size
        ratio = size / max(info.compress_size, 1)
        if size > _RATIO_GRACE_BYTES and ratio > _MAX_INFLATE_RATIO:
            raise DocumentTooLarge(self.display, f"{name} would inflate {ratio:,.0f}-fold, to {_mib(size)} "
                                                 f"(at most {_MAX_INFLATE_RATIO}-fold is read): a zip bomb?")
        if size > _MAX_PART_BYTES:
            raise DocumentTooLarge(self.display, f"{name} would inflate to {_mib(size)} "
                                                 f"(at most {_mib(_MAX_PART_BYTES)} is read)")
        if self.inflated + size > _MAX_PARTS_BYTES:
            raise DocumentTooLarge(self.display, f"its XML parts would inflate to over {_mib(_MAX_PARTS_BYTES)}")

    def _target(self, rels_name: str, type_suffix: str, base: str = "") -> str | None:
        rels = self.xml(rels_name)
        if rels is None:
            return None
        for rel in rels.iter(f"{{{_REL}}}Relationship"):
            if rel.get("Type", "").endswith(type_suffix) and rel.get("TargetMode") != "External":
                target = rel.get("Target", "")
                if target.startswith("/"):
                    return target.lstrip("/")
                return posixpath.normpath(posixpath.join(base, target))
        return None


@dataclass
class _Level:
    start: int = 1
    fmt: str = "decimal"
    text: str = "%1."
    legal: bool = False
    style: str | None = None


@dataclass
class _Num:
    abstract: str
    levels: dict[int, _Level]
    restarts: bool  # has start overrides: counts on its own


@dataclass
class _Style:
    name: str = ""
    based_on: str | None = None
    outline: int | None = None
    num_id: str | None = None
    ilvl: int | None = None


class _BodyReader:
    """Walks the body in document order and produces lines of paragraph pieces."""

    def __init__(self, package: _Package):
        self.package = package
        self.w = package.w
        self.lines: list[list[_Piece]] = []
        self.warnings: list[str] = []
        self.chars = 0  # characters of text read so far (bounded by MAX_TEXT_CHARS)
        self.paragraph_count = 0
        self.styles = self._read_styles()
        self.default_style = self._default_paragraph_style()
        self.nums, self.abstracts = self._read_numbering()
        self.counters: dict[object, list[int | None]] = {}
        self.fields: list[str] = []
        self.carry: list[str] = []  # accepted text of paragraphs whose mark was deleted: joins the next
        self.tracked_changes = False
        self.notes: dict[str, list[tuple[str, int]]] = {"footnote": [], "endnote": []}
        self.note_numbers: dict[tuple[str, str], int] = {}
        self.unplaced_notes: list[tuple[str, int]] = []  # (kind, index in notes[kind]) awaiting a paragraph
        self.xml_paragraphs: dict | None = None  # w:p element -> its index (Span.xml_paragraph), made once

    def q(self, tag: str) -> str:
        return f"{{{self.w}}}{tag}"

    # ----- the walk -----

    def read_body(self) -> None:
        body = self.package.document.find(self.q("body"))
        if body is None:
            return
        for line in self._blocks(body):
            self.lines.append(line)
        carried = "".join(self.carry)
        if carried.strip():
            self.paragraph_count += 1
            self._count(carried)
            self.lines.append([_Piece(carried, self.paragraph_count)])
            self.carry = []
        self._read_notes("footnote", self.package.footnotes, "Footnotes", "")
        self._read_notes("endnote", self.package.endnotes, "Endnotes", "e")
        if self.tracked_changes:
            self.warnings.append(
                f"{self.package.display} has tracked changes that are not accepted; "
                "read as if all were accepted (insertions kept, deletions dropped)")

    def _blocks(self, container):
        """Yield lines for block-level content: paragraphs, tables, content controls."""
        for child in container:
            tag = child.tag
            if tag == self.q("p"):
                yield from self._paragraph(child)
            elif tag == self.q("tbl"):
                yield from self._table(child)
            elif tag in (self.q("sdt"),):
                content = child.find(self.q("sdtContent"))
                if content is not None:
                    yield from self._blocks(content)
            elif tag in (self.q("customXml"), self.q("ins"), self.q("moveTo"),
                         self.q("sdtContent")):
                yield from self._blocks(child)
            elif tag == f"{{{_MC}}}AlternateContent":
                choice = child.find(f"{{{_MC}}}Choice")
                if choice is not None:
                    yield from self._blocks(choice)
            elif tag in (self.q("del"), self.q("moveFrom")):
                self.tracked_changes = True
            elif tag == self.q("altChunk"):
                self.warnings.append(
                    f"{self.package.display} embeds content in another format (altChunk); "
                    "it was left out")

    def _paragraph(self, p):
        pPr = p.find(self.q("pPr"))
        runs: list[str] = []
        floating: list = []
        self._inline(p, runs, floating)
        text = "".join(runs)
        mark_deleted = self._mark_changed(pPr, "del")
        if self._mark_changed(pPr, "ins"):
            self.tracked_changes = True
        if mark_deleted:
            self.tracked_changes = True
            self.carry.append(text)
            yield from self._floating(floating)
            return
        text = "".join(self.carry) + text
        self.carry = []
        if text.strip():
            # Word shows a number on an empty list paragraph too, but documents refer to their
            # sections as if it were not there (an empty heading carrying a section break).
            label = self._number_label(pPr)
            if label:
                text = f"{label} {text.lstrip()}"
            self.paragraph_count += 1
            self._count(text)
            kind = "heading" if self._is_heading(pPr) else "text"
            piece = _Piece(text, self.paragraph_count, kind, self._xml_index(p))
            self._note_refs_paragraph(piece.paragraph)
            yield [piece]
        yield from self._floating(floating)

    def _xml_index(self, p) -> int | None:
        """The place of `p` among the main part's w:p elements (None for a note's paragraph)."""
        if self.xml_paragraphs is None:
            # keyed by the elements themselves: lxml keeps one proxy per element only while it is referenced
            self.xml_paragraphs = {e: i for i, e in enumerate(self.package.document.iter(self.q("p")))}
        return self.xml_paragraphs.get(p)

    def _floating(self, floating):
        for content in floating:
            yield from self._blocks(content)

    def _mark_changed(self, pPr, change: str) -> bool:
        if pPr is None:
            return False
        rPr = pPr.find(self.q("rPr"))
        return rPr is not None and rPr.find(self.q(change)) is not None

    def _inline(self, element, out: list[str], floating: list) -> None:
        """Append the accepted, visible text of the runs under `element` to `out`."""
        q = self.q
        for child in element:
            tag = child.tag
            if tag == q("r"):
                self._run(child, out, floating)
            elif tag in (q("del"), q("moveFrom")):
                self.tracked_changes = True
                # deleted field characters still open and close fields
                for fld in child.iter(q("fldChar")):
                    self._field_char(fld)
            elif tag in (q("ins"), q("moveTo")):
                self.tracked_changes = True
                self._inline(child, out, floating)
            elif tag in (q("hyperlink"), q("smartTag"), q("customXml"), q("fldSimple"),
                         q("bdo"), q("dir"), q("sdtContent")):
                self._inline(child, out, floating)
            elif tag == q("sdt"):
                content = child.find(q("sdtContent"))
                if content is not None:
                    self._inline(content, out, floating)
            elif tag == f"{{{_MC}}}AlternateContent":
                choice = child.find(f"{{{_MC}}}Choice")
                if choice is not None:
                    self._inline(choice, out, floating)
            elif tag in (f"{{{_MATH}}}oMath", f"{{{_MATH}}}oMathPara"):
                if self._visible():
                    out.append("".join(_text(t) for t in child.iter(f"{{{_MATH}}}t")))

    def _run(self, run, out: list[str], floating: list) -> None:
        q = self.q
        for child in run:
            tag = child.tag
            if tag == q("fldChar"):
                self._field_char(child)
            elif not self._visible():
                continue
            elif tag == q("t"):
                out.append(_text(child))
            elif tag in (q("tab"), q("ptab")):
                out.append("\t")
            elif tag in (q("br"), q("cr")):
                out.append("\n" if child.get(q("type")) in (None, "textWrapping") else " ")
            elif tag == q("noBreakHyphen"):
                out.append("-")
            elif tag == q("sym"):
                char = child.get(q("char"), "")
                code = int(char, 16) if re.fullmatch(r"[0-9A-Fa-f]{1,6}", char) else 0
                if code and not 0xE000 <= code <= 0xF8FF:  # private use: a Symbol-font glyph
                    out.append(chr(code))
            elif tag == q("footnoteReference"):
                out.append(self._note_marker("footnote", child.get(q("id"), ""), ""))
            elif tag == q("endnoteReference"):
                out.append(self._note_marker("endnote", child.get(q("id"), ""), "e"))
            elif tag == q("ruby"):
                base = child.find(q("rubyBase"))
                if base is not None:
                    self._inline(base, out, floating)
            elif tag in (q("drawing"), q("pict"), f"{{{_MC}}}AlternateContent"):
                floating.extend(self._text_boxes(child))

    def _text_boxes(self, element) -> list:
        """The text-box contents under a drawing, skipping the VML fallback copies."""
        found = []
        for child in element:
            if child.tag == f"{{{_MC}}}Fallback":
                continue
            if child.tag == self.q("txbxContent"):
                found.append(child)
            else:
                found.extend(self._text_boxes(child))
        return found

    def _field_char(self, fld) -> None:
        follow_field(self.fields, fld.get(self.q("fldCharType")))

    def _visible(self) -> bool:
        """Outside field codes (the result of a field is shown, its instruction is not)."""
        return "code" not in self.fields

    def _table(self, tbl):
        for row in self._rows(tbl):
            trPr = row.find(self.q("trPr"))
            if trPr is not None and trPr.find(self.q("del")) is not None:
                self.tracked_changes = True
                continue
            cells = [list(self._blocks(cell)) for cell in self._cells(row)]
            simple = all(len([ln for ln in cell if _has_text(ln)]) <= 1 for cell in cells) \
                and all(len(ln) == 1 for cell in cells for ln in cell)
            if simple:
                pieces = [ln[0] for cell in cells for ln in cell if _has_text(ln)]
                if pieces:
                    yield pieces
            else:
                for cell in cells:
                    yield from cell

    def _rows(self, tbl):
        for child in tbl:
            if child.tag == self.q("tr"):
                yield child
            elif child.tag in (self.q("sdt"), self.q("customXml"), self.q("sdtContent")):
                inner = child.find(self.q("sdtContent")) if child.tag == self.q("sdt") else child
                if inner is not None:
                    yield from self._rows(inner)

    def _cells(self, row):
        for child in row:
            if child.tag == self.q("tc"):
                yield child
            elif child.tag in (self.q("sdt"), self.q("customXml"), self.q("sdtContent")):
                inner = child.find(self.q("sdtContent")) if child.tag == self.q("sdt") else child
                if inner is not None:
                    yield from self._cells(inner)

    # ----- notes -----

    def _note_marker(self, kind: str, note_id: str, prefix: str) -> str:
        key = (kind, note_id)
        if key not in self.note_numbers:
            self.note_numbers[key] = len(self.notes[kind]) + 1
            self.unplaced_notes.append((kind, len(self.notes[kind])))
            self.notes[kind].append((note_id, -1))
        return f"[^{prefix}{self.note_numbers[key]}]"

    def _note_refs_paragraph(self, paragraph: int) -> None:
        """The notes referenced since the last paragraph are referenced from this one."""
        for kind, index in self.unplaced_notes:
            self.notes[kind][index] = (self.notes[kind][index][0], paragraph)
        self.unplaced_notes = []

    def _read_notes(self, kind: str, part, title: str, prefix: str) -> None:
        refs = self.notes[kind]
        if part is None or not refs:
            return
        by_id = {
            note.get(self.q("id")): note
            for note in part.iter(self.q(kind))
            if note.get(self.q("type"), "normal") not in _NOTE_SKIP_TYPES
        }
        lines = []
        for note_id, paragraph in refs:
            note = by_id.get(note_id)
            if note is None:
                continue
            self.fields = []
            texts = [" ".join(p.text.split()) for line in self._blocks(note) for p in line]
            text = " ".join(t for t in texts if t)
            if text:
                self._count(text)
                number = self.note_numbers[kind, note_id]
                lines.append([_Piece(f"[^{prefix}{number}] {text}",
                                     paragraph if paragraph > 0 else None, "footnote")])
        if lines:
            self.lines.append([_Piece(title, None, "footnote")])
            self.lines.extend(lines)

    def _count(self, text: str) -> None:
        self.chars += len(text)
        check_text_size(self.chars, self.package.display)

    # ----- styles, headings, numbering -----

    def _read_styles(self) -> dict[str, _Style]:
        styles: dict[str, _Style] = {}
        root = self.package.styles
        if root is None:
            return styles
        for s in root.iter(self.q("style")):
            if s.get(self.q("type")) not in (None, "paragraph"):
                continue
            style = _Style()
            name = s.find(self.q("name"))
            style.name = name.get(self.q("val"), "") if name is not None else ""
            based = s.find(self.q("basedOn"))
            style.based_on = based.get(self.q("val")) if based is not None else None
            pPr = s.find(self.q("pPr"))
            if pPr is not None:
                style.outline = self._int(pPr.find(self.q("outlineLvl")))
                numPr = pPr.find(self.q("numPr"))
                if numPr is not None:
                    num_id = numPr.find(self.q("numId"))
                    style.num_id = num_id.get(self.q("val")) if num_id is not None else None
                    style.ilvl = self._int(numPr.find(self.q("ilvl")))
            styles[s.get(self.q("styleId"), "")] = style
        return styles

    def _default_paragraph_style(self) -> str | None:
        root = self.package.styles
        if root is None:
            return None
        for s in root.iter(self.q("style")):
            if s.get(self.q("type")) == "paragraph" and s.get(self.q("default")) in ("1", "true"):
                return s.get(self.q("styleId"))
        return None

    def _style_chain(self, style_id: str | None):
        seen = set()
        while style_id and style_id in self.styles and style_id not in seen:
            seen.add(style_id)
            yield style_id, self.styles[style_id]
            style_id = self.styles[style_id].based_on

    def _style_of(self, pPr) -> str | None:
        if pPr is not None:
            ps = pPr.find(self.q("pStyle"))
            if ps is not None:
                return ps.get(self.q("val"))
        return self.default_style

    def _is_heading(self, pPr) -> bool:
        if pPr is not None:
            level = self._int(pPr.find(self.q("outlineLvl")))
            if level is not None:
                return level < 9
        for _, style in self._style_chain(self._style_of(pPr)):
            if _HEADING_STYLE.match(style.name.strip()):
                return True
            if style.outline is not None:
                return style.outline < 9
        return False

    def _int(self, element) -> int | None:
        if element is None:
            return None
        try:
            return int(element.get(self.q("val")))
        except (TypeError, ValueError):
            return None

    def _read_numbering(self):
        nums: dict[str, _Num] = {}
        abstracts: dict[str, dict[int, _Level]] = {}
        links: dict[str, str] = {}  # abstractNum id -> numbering style it takes its levels from
        root = self.package.numbering
        if root is None:
            return nums, abstracts
        for a in root.iter(self.q("abstractNum")):
            aid = a.get(self.q("abstractNumId"))
            abstracts[aid] = {self._int_attr(lvl, "ilvl"): self._level(lvl)
                              for lvl in a.findall(self.q("lvl"))}
            link = a.find(self.q("numStyleLink"))
            if link is not None:
                links[aid] = link.get(self.q("val"))
        for n in root.iter(self.q("num")):
            ref = n.find(self.q("abstractNumId"))
            if ref is None:
                continue
            aid = ref.get(self.q("val"))
            levels = dict(abstracts.get(aid, {}))
            restarts = False
            for override in n.findall(self.q("lvlOverride")):
                ilvl = self._int_attr(override, "ilvl")
                lvl = override.find(self.q("lvl"))
                if lvl is not None:
                    levels[ilvl] = self._level(lvl)
                start = self._int(override.find(self.q("startOverride")))
                if start is not None:
                    base = levels.get(ilvl, _Level())
                    levels[ilvl] = _Level(start, base.fmt, base.text, base.legal, base.style)
                    restarts = True
            nums[n.get(self.q("numId"))] = _Num(aid, levels, restarts)
        # numStyleLink: the abstract's levels live in the list the numbering style points to
        for num in nums.values():
            style_id = links.get(num.abstract)
            if style_id and not num.levels:
                target = next((s.num_id for _, s in self._style_chain(style_id) if s.num_id), None)
                if target in nums and target is not None:
                    num.levels = dict(nums[target].levels)
                    num.abstract = nums[target].abstract
        return nums, abstracts

    def _int_attr(self, element, name: str) -> int:
        try:
            return int(element.get(self.q(name), "0"))
        except ValueError:
            return 0

    def _level(self, lvl) -> _Level:
        level = _Level()
        start = self._int(lvl.find(self.q("start")))
        level.start = 1 if start is None else start
        fmt = lvl.find(self.q("numFmt"))
        level.fmt = fmt.get(self.q("val"), "decimal") if fmt is not None else "decimal"
        text = lvl.find(self.q("lvlText"))
        level.text = text.get(self.q("val"), "") if text is not None else ""
        level.legal = lvl.find(self.q("isLgl")) is not None
        style = lvl.find(self.q("pStyle"))
        level.style = style.get(self.q("val")) if style is not None else None
        return level

    def _number_label(self, pPr) -> str:
        """The list label Word shows in front of the paragraph ("1.", "2.1", "(a)"), or ""."""
        num_id, ilvl = None, None
        if pPr is not None:
            numPr = pPr.find(self.q("numPr"))
            if numPr is not None:
                node = numPr.find(self.q("numId"))
                num_id = node.get(self.q("val")) if node is not None else None
                ilvl = self._int(numPr.find(self.q("ilvl")))
        style_id = self._style_of(pPr)
        if num_id is None:
            for sid, style in self._style_chain(style_id):
                if style.num_id is not None:
                    num_id = style.num_id
                    if ilvl is None:
                        ilvl = style.ilvl
                    break
        if num_id is None or num_id == "0" or num_id not in self.nums:
            return ""
        num = self.nums[num_id]
        if ilvl is None:
            ilvl = next((i for i, lv in num.levels.items() if lv.style == style_id), 0)
        if ilvl not in num.levels or not 0 <= ilvl < 10:
            return ""
        key = ("num", num_id) if num.restarts else ("abstract", num.abstract)
        counters = self.counters.setdefault(key, [None] * 10)
        level = num.levels[ilvl]
        counters[ilvl] = level.start if counters[ilvl] is None else counters[ilvl] + 1
        for deeper in range(ilvl + 1, len(counters)):
            counters[deeper] = None
        if level.fmt == "bullet":
            return "-" if level.text.strip() == "-" else "\u2022"
        if level.fmt == "none":
            return re.sub(r"%\d", "", level.text).strip()[:_MAX_LABEL_CHARS]

        def render(match: re.Match) -> str:
            i = int(match.group(1)) - 1
            lv = num.levels.get(i, _Level())
            value = counters[i] if counters[i] is not None else lv.start
            return _format_number(value, "decimal" if level.legal else lv.fmt)

        return re.sub(r"%([1-9])", render, level.text).strip()[:_MAX_LABEL_CHARS]


def follow_field(fields: list[str], kind: str | None) -> None:
    """A w:fldChar of `kind` (begin, separate, end) seen: `fields` holds the open fields, each
    "code" until its separator (a field's code is not shown), then "result" (its result is)."""
    if kind == "begin":
        fields.append("code")
    elif kind == "separate" and fields:
        fields[-1] = "result"
    elif kind == "end" and fields:
        fields.pop()


def _text(element) -> str:
    """The text of a w:t or m:t, with the text after an (unexpanded) entity reference in it: the
    entity is kept as written ("&name;"); element.text alone stops at the first one."""
    return "".join(element.itertext())


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def _has_text(line: list[_Piece]) -> bool:
    return any(p.text.strip() for p in line)


def _format_number(value: int, fmt: str) -> str:
    if fmt in ("lowerLetter", "upperLetter"):
        letter = _letters(value)
        return letter if fmt == "upperLetter" else letter.lower()
    if fmt in ("lowerRoman", "upperRoman"):
        roman = _roman(value)
        return roman if fmt == "upperRoman" else roman.lower()
    if fmt == "decimalZero":
        return f"{value:02d}"
    if fmt == "ordinal":
        suffix = "th" if 10 <= value % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(value % 10,
                                                                                    "th")
        return f"{value}{suffix}"
    return str(value)


def _letters(value: int) -> str:
    """Word's letter numbering: A..Z, then AA..ZZ, then AAA... (digits past _MAX_LETTER_NUMBER: a
    list that starts at 10^9 would otherwise be numbered with 38 million letters a paragraph)."""
    if not 1 <= value <= _MAX_LETTER_NUMBER:
        return str(value)
    letter = chr(ord("A") + (value - 1) % 26)
    return letter * ((value - 1) // 26 + 1)


def _roman(value: int) -> str:
    if not 0 < value < 4000:
        return str(value)
    out = []
    for number, numeral in ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"),
                            (90, "XC"), (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"),
                            (4, "IV"), (1, "I")):
        while value >= number:
            out.append(numeral)
            value -= number
    return "".join(out)
