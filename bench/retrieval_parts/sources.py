"""The question set (bench/retrieval_questions.json) and its sources: each fetched once into the
cache (pinned sdists from PyPI, a Debian package's PDF manual, CUAD contracts; sha256 checked) and
read with kvpage's own ingest; where each question's evidence lies in its document."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from common import REPO

QUESTIONS = Path(__file__).resolve().parents[1] / "retrieval_questions.json"
DEFAULT_CACHE = Path.home() / ".cache" / "kvpage-bench"
CUAD_JSONL = REPO.parent / "shared" / "cuad" / "contracts.jsonl"


def load_question_set(path: Path = QUESTIONS) -> dict:
    """{"sources": {id: {...}}, "questions": [{id, source, question, answer, regexes, evidence}]}."""
    return json.loads(path.read_text(encoding="utf-8"))


def is_right(answer: str, regexes: list[str]) -> bool:
    """Every key fact's regex matches the answer (case-insensitive)."""
    return all(re.search(rx, answer, re.IGNORECASE) for rx in regexes)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def fetch_source(source_id: str, spec: dict, cache: Path, cuad_jsonl: Path = CUAD_JSONL) -> Path:
    """The path kvpage should read for a source: fetched and checked on first use.

    pypi: `pip download --no-deps --no-binary :all: NAME==VERSION` into cache/sdist, sha256
    checked, unpacked into cache/src; the path is `root` inside it. corpus: a file of this
    repository. cuad: a contract's text from CUAD's contracts.jsonl, written to cache/cuad. deb:
    a file of a Debian package (a long PDF manual), see _fetch_deb."""
    kind = spec["kind"]
    if kind == "corpus":
        return REPO / spec["path"]
    if kind == "cuad":
        target = cache / "cuad" / spec["file"]
        if not target.exists():
            text = None
            with open(cuad_jsonl, encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line)
                    if row["cuad_filename"] == spec["cuad_filename"]:
                        text = row["text"]
                        break
            if text is None:
                raise SystemExit(f"{source_id}: {spec['cuad_filename']} is not in {cuad_jsonl}")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        if _sha256(target) != spec["sha256"]:
            raise SystemExit(f"{source_id}: {target} does not have the recorded sha256")
        return target
    if kind == "deb":
        return _fetch_deb(source_id, spec, cache)
    if kind != "pypi":
        raise SystemExit(f"{source_id}: unknown source kind {kind!r}")
    name, version = spec["package"], spec["version"]
    sdists = cache / "sdist"
    sdist = sdists / f"{name}-{version}.tar.gz"
    if not sdist.exists():
        sdists.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"{name}=={version}", "-d", str(sdists)], check=True)
    if _sha256(sdist) != spec["sha256"]:
        raise SystemExit(f"{source_id}: {sdist} does not have the recorded sha256 {spec['sha256']}")
    unpacked = cache / "src"
    top = spec["root"].split("/")[0]
    if not (unpacked / top).is_dir():
        unpacked.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as archive:
            archive.extractall(unpacked, filter="data")
    return unpacked / spec["root"]


def _fetch_deb(source_id: str, spec: dict, cache: Path) -> Path:
    """deb: a Debian package from `url` (sha256 checked) into cache/deb, and its file `member`
    (a path in the package's data archive) written to cache/deb/<file>."""
    import io
    import urllib.request

    folder = cache / "deb"
    package = folder / spec["url"].rsplit("/", 1)[1]
    target = folder / spec["file"]
    if not package.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(spec["url"], timeout=120) as response:
            package.write_bytes(response.read())
    if _sha256(package) != spec["sha256"]:
        raise SystemExit(f"{source_id}: {package} does not have the recorded sha256 {spec['sha256']}")
    if not target.exists():
        data = package.read_bytes()
        if not data.startswith(b"!<arch>\n"):
            raise SystemExit(f"{source_id}: {package} is not a Debian package")
        at = 8
        while at + 60 <= len(data):  # ar members: a 60-byte header (name, ..., size), the data, padded to even
            name, size = data[at:at + 16].decode().strip().rstrip("/"), int(data[at + 48:at + 58])
            body = data[at + 60:at + 60 + size]
            at += 60 + size + size % 2
            if name.startswith("data.tar"):
                with tarfile.open(fileobj=io.BytesIO(body)) as archive:
                    member = archive.extractfile(spec["member"])
                    if member is None:
                        raise SystemExit(f"{source_id}: {spec['member']} is not in {package}")
                    target.write_bytes(member.read())
                break
        else:
            raise SystemExit(f"{source_id}: {package} has no data archive")
    return target


def evidence_spans(doc, ev: dict) -> list:
    """The spans of `doc` an evidence item points at: its file's line, or (PDF) its page."""
    same_file = [s for s in doc.spans if s.file == ev["file"] or Path(s.file).name == ev["file"]]
    if "page" in ev:
        return [s for s in same_file if s.page == ev["page"]]
    return [s for s in same_file if s.line == ev["line"]]


def evidence_place(ev: dict) -> str:
    return f"{ev['file']}:{ev['line']}" if "line" in ev else f"{ev['file']} page {ev['page']}"


def evidence_ranges(doc, evidence: list[dict]) -> list[tuple[int, int]]:
    """Character ranges of doc.text holding each evidence quote (file:line, or file and page, as in
    the question set)."""
    found = []
    for ev in evidence:
        for span in evidence_spans(doc, ev):
            at = doc.text.find(ev["quote"], span.start, span.end)
            if at >= 0:
                found.append((at, at + len(ev["quote"])))
                break
        else:
            raise SystemExit(f"{evidence_place(ev)}: evidence not found (run the check part)")
    return found


def evidence_attended(wanted: list[tuple[int, int]], ranges: list[tuple[int, int]] | None) -> bool:
    """Every evidence quote lies whole inside the attended ranges (None: the whole document)."""
    if ranges is None:
        return True
    merged: list[list[int]] = []
    for a, b in sorted(ranges):  # neighbouring chunks join (a quote may cross their boundary)
        if merged and a <= merged[-1][1] + 2:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    ranges = merged
    return all(any(a <= start and end <= b for a, b in ranges) for start, end in wanted)
