"""Reading a code repository: .gitignore rules, skipped files, sorted order, line spans."""

import re
from pathlib import Path

import pytest

from kvpage_cli.ingest import NothingReadable, load, read_repo

from .hostile import hostile_repo


def build_tree(root):
    files = {
        ".gitignore": "*.log\n!keep.log\nsecret/\n/build-output.txt\n",
        "README.md": "# Demo\n\nA small project.\n",
        "keep.log": "kept although *.log is ignored\n",
        "debug.log": "ignored\n",
        "build-output.txt": "ignored at the root only\n",
        "secret/key.txt": "ignored directory\n",
        "src/app.py": "import os\n\n\ndef main():\n    return os.getcwd()\n",
        "src/.gitignore": "generated_*.py\n!generated_keep.py\n",
        "src/generated_a.py": "ignored by the nested .gitignore\n",
        "src/generated_keep.py": "kept = True\n",
        "src/build-output.txt": "not ignored: the root pattern is anchored\n",
        "src/util/helpers.py": "def helper():\n    pass\n",
        "node_modules/lib/index.js": "module.exports = 1;\n",
        "dist/bundle.js": "var a=1;\n",
        "package-lock.json": "{}\n",
        "static/app.min.js": "var a=1;\n",
        "docs/notes.txt": "Plain notes.\n",
        ".git/config": "[core]\n",
        "empty.txt": "",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (root / "blob.dat2").write_bytes(bytes(range(256)) * 8)
    (root / "big.txt").write_text("x" * 80 + "\n" * 1000)
    (root / "src" / "latin.txt").write_bytes("Café crème\n".encode("cp1252"))


def test_repo_reads_exactly_the_readable_files(tmp_path):
    build_tree(tmp_path)
    doc = read_repo(tmp_path, max_file_bytes=1000, display="demo")
    headers = re.findall(r"^==> (.+) <==$", doc.text, flags=re.M)
    assert headers == [
        ".gitignore", "README.md", "docs/notes.txt", "keep.log", "src/.gitignore", "src/app.py",
        "src/build-output.txt", "src/generated_keep.py", "src/latin.txt", "src/util/helpers.py",
    ]
    assert doc.kind == "repo" and doc.source == "demo/"
    assert "Café crème" in doc.text
    warnings = " / ".join(doc.warnings)
    for skipped in ("logo.png", "blob.dat2", "big.txt", "package-lock.json", "app.min.js",
                    "node_modules/", "dist/"):
        assert skipped in warnings
    assert "debug.log" not in warnings and ".git/" not in warnings  # ignored quietly
    assert "src/latin.txt (cp1252)" in warnings


def test_repo_spans_name_file_and_line(tmp_path):
    build_tree(tmp_path)
    doc = read_repo(tmp_path)
    start = doc.text.index("return os.getcwd()")
    (span,) = doc.locate(start, start + 5)
    assert (span.file, span.line) == ("src/app.py", 5)
    assert span.where() == "src/app.py line 5"
    header = doc.text.index("==> src/app.py <==")
    assert doc.locate(header, header + 3)[0].where() == "src/app.py"
    # every non-blank character is covered by a span
    covered = set()
    for s in doc.spans:
        covered.update(range(s.start, s.end))
    assert all(i in covered for i, c in enumerate(doc.text) if not c.isspace())


def test_total_limit_and_summaries(tmp_path):
    for i in range(12):
        (tmp_path / f"img{i:02d}.png").write_bytes(b"\x89PNG" + bytes(10))
        (tmp_path / f"f{i:02d}.txt").write_text("line\n" * 40)
    doc = read_repo(tmp_path, max_total_bytes=1000)
    assert len(re.findall(r"^==> ", doc.text, flags=re.M)) == 5
    assert any("skipped 12 files (binary)" in w and "and 7 more" in w for w in doc.warnings)
    assert any("past the 1000 bytes total" in w for w in doc.warnings)


def test_nothing_readable(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG")
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "x.js").write_text("x\n")
    with pytest.raises(NothingReadable) as info:
        load(str(tmp_path))
    assert str(info.value).endswith("/ has no readable text files")


def test_a_hostile_repository_is_read_warned_and_nothing_followed_out(tmp_path):
    """Invalid .gitignore lines, a link to a file outside, a directory link loop, a FIFO and a
    link to a gitignored .env: the rest is read, each is warned about, nothing outside is read
    and nothing blocks (a FIFO opened for reading waits for a writer forever)."""
    import subprocess
    import sys

    repo = hostile_repo(tmp_path)

    script = (f"from kvpage_cli.ingest import read_repo\n"
              f"doc = read_repo({str(repo)!r})\n"
              "print(repr(doc.text)); print('\\n'.join(doc.warnings))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    text, *warnings = done.stdout.splitlines()
    assert "RATE = 0.2" in text
    for secret in ("password outside", "ignored-secret", "ignored by the valid line"):
        assert secret not in text
    assert ".gitignore line 1: '!' is not a valid pattern; ignored it (git ignores it too)" in warnings
    assert ".gitignore line 3: '\\\\' is not a valid pattern; ignored it (git ignores it too)" in warnings
    assert "skipped 3 files (symbolic links, not followed): outside.txt, settings.txt, src/loop" in warnings
    assert "skipped 1 file (not regular files): pipe.txt" in warnings
