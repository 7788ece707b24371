"""Hostile inputs built in code (nothing big is committed): DOCX files that amplify, inflate or
nest without end, a repository full of traps, and a helper that reads a document in a fresh
interpreter and reports its peak memory."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
REPO = Path(__file__).resolve().parents[1]

_CONTENT_TYPES = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
    '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
    '<Default Extension="xml" ContentType="application/xml"/>'
    '<Override PartName="/word/document.xml" '
    'ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/>'
    '</Types>'
)
_RELS = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
    '<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument" '
    'Target="word/document.xml"/></Relationships>'
)


def document_xml(body: str, doctype: str = "") -> str:
    return f'<?xml version="1.0" encoding="UTF-8"?>{doctype}<w:document xmlns:w="{W}"><w:body>{body}</w:body></w:document>'


def paragraph(text: str, num_id: str | None = None) -> str:
    numbered = f'<w:pPr><w:numPr><w:ilvl w:val="0"/><w:numId w:val="{num_id}"/></w:numPr></w:pPr>' if num_id else ""
    return f"<w:p>{numbered}<w:r><w:t xml:space=\"preserve\">{text}</w:t></w:r></w:p>"


def docx_bytes(document: str, numbering: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", _CONTENT_TYPES)
        archive.writestr("_rels/.rels", _RELS)
        archive.writestr("word/document.xml", document)
        if numbering is not None:
            archive.writestr("word/numbering.xml", numbering)
    return buffer.getvalue()


def numbering_bomb(start: int = 10**9, paragraphs: int = 100, fmt: str = "lowerLetter") -> bytes:
    """A list that starts at `start`, numbered in letters: Word's "aa...a" would be start/26 letters."""
    numbering = (
        f'<?xml version="1.0" encoding="UTF-8"?><w:numbering xmlns:w="{W}">'
        f'<w:abstractNum w:abstractNumId="0"><w:lvl w:ilvl="0"><w:start w:val="{start}"/>'
        f'<w:numFmt w:val="{fmt}"/><w:lvlText w:val="%1."/></w:lvl></w:abstractNum>'
        '<w:num w:numId="1"><w:abstractNumId w:val="0"/></w:num></w:numbering>'
    )
    body = "".join(paragraph(f"Clause text {i}.", num_id="1") for i in range(paragraphs))
    return docx_bytes(document_xml(body), numbering)


def zip_bomb(inflated: int = 2**30) -> bytes:
    """A DOCX of about 1 MB whose word/document.xml inflates to `inflated` bytes (well-formed XML:
    one paragraph of spaces)."""
    head = f'<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w="{W}"><w:body><w:p><w:r><w:t>'.encode()
    tail = b"</w:t></w:r></w:p></w:body></w:document>"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", _CONTENT_TYPES)
        archive.writestr("_rels/.rels", _RELS)
        with archive.open("word/document.xml", "w", force_zip64=True) as part:
            part.write(head)
            chunk = b" " * 2**22
            left = inflated - len(head) - len(tail)
            while left > 0:
                part.write(chunk[:left])
                left -= len(chunk)
            part.write(tail)
    return buffer.getvalue()


def nesting_bomb(depth: int = 1500) -> bytes:
    """One paragraph whose text sits inside `depth` nested hyperlinks."""
    run = '<w:r><w:t>deep text</w:t></w:r>'
    body = "<w:p>" + "<w:hyperlink>" * depth + run + "</w:hyperlink>" * depth + "</w:p>"
    return docx_bytes(document_xml(paragraph("1. Scope. The supplier delivers.") + body))


def hostile_repo(folder: Path) -> Path:
    """A repository under `folder` with a '!' and a '\\' line in .gitignore, a link to a file
    outside it (folder/outside-secret.txt), a directory link loop, a FIFO and a link to its
    gitignored .env."""
    outside = folder / "outside-secret.txt"
    outside.write_text("the password outside the repository\n")
    repo = folder / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / ".gitignore").write_text("!\n.env\n\\\n*.log\n")
    (repo / ".env").write_text("API_KEY=ignored-secret\n")
    (repo / "debug.log").write_text("ignored by the valid line after the invalid ones\n")
    (repo / "src" / "app.py").write_text("RATE = 0.2\n")
    (repo / "outside.txt").symlink_to(outside)
    (repo / "settings.txt").symlink_to(repo / ".env")
    (repo / "src" / "loop").symlink_to(repo / "src", target_is_directory=True)
    os.mkfifo(repo / "pipe.txt")
    return repo


def read_in_child(path: Path) -> dict:
    """Reads `path` with kvpage's ingest in a fresh interpreter: {"ok", "error" (one line), "chars",
    "traceback", "peak_mib"} (the peak resident memory of that interpreter: VmHWM on Linux)."""
    script = f"""
import json, resource, sys
from kvpage_cli.errors import KvpageError
from kvpage_cli.ingest import load
out = {{"ok": False, "error": None, "chars": 0}}
try:
    doc = load({str(path)!r})
    out.update(ok=True, chars=len(doc.text))
except KvpageError as exc:
    out["error"] = str(exc)
try:  # this process's own peak (ru_maxrss would start from the forking parent's, pytest with torch)
    with open("/proc/self/status") as status:
        out["peak_mib"] = next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) / 1024
except OSError:
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    result = json.loads(done.stdout) if done.returncode == 0 else {"ok": False, "error": None, "peak_mib": 0.0}
    result["traceback"] = "Traceback" in done.stderr
    result["stderr"] = done.stderr
    return result


def pdf_bytes(pages: list[list[str]]) -> bytes:
    """A valid PDF whose pages show the given lines (Helvetica, one text line per entry)."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", None, "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for lines in pages:
        shown = "".join(f"({_pdf_escape(line)}) Tj 0 -14 Td " for line in lines)
        stream = f"BT /F1 10 Tf 40 800 Td {shown}ET".encode("latin-1")
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream.decode('latin-1')}\nendstream")
        content = len(objects)
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] /Contents {content} 0 R "
                       "/Resources << /Font << /F1 3 0 R >> >> >>")
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def _pdf_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
