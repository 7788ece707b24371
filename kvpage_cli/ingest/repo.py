"""Code repositories: the readable text files of a directory tree, as one document."""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from pathlib import Path

import pathspec

from kvpage_cli.ingest.document import Document, Span, format_size
from kvpage_cli.ingest.errors import BinaryDocument, DocumentNotFound, NothingReadable
from kvpage_cli.ingest.text import decode_text, line_spans

DEFAULT_MAX_FILE_BYTES = 256 * 1024
DEFAULT_MAX_TOTAL_BYTES = 8 * 1024 * 1024

# Directories of dependencies, build output and caches: not the project's own text.
_SKIP_DIRS = {
    ".git", ".hg", ".svn", ".bzr", "node_modules", "bower_components", "jspm_packages", "vendor",
    "third_party", "third-party", "thirdparty", "dist", "build", "target",
    ".venv", "venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox",
    ".nox", ".eggs", ".gradle", ".idea", ".next", ".nuxt", ".svelte-kit", ".parcel-cache",
    ".cache", ".terraform", "coverage", "htmlcov", ".coverage", "Pods", "DerivedData",
    "site-packages", ".yarn", ".pnpm-store", ".angular", "_build",
}
_LOCK_FILES = {
    "package-lock.json", "npm-shrinkwrap.json", "yarn.lock", "pnpm-lock.yaml", "bun.lockb",
    "poetry.lock", "Pipfile.lock", "pdm.lock", "uv.lock", "Cargo.lock", "composer.lock",
    "Gemfile.lock", "go.sum", "mix.lock", "flake.lock", "packages.lock.json", "Podfile.lock",
    "pubspec.lock", "gradle.lockfile",
}
_BINARY_SUFFIXES = {
    ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".icns", ".webp", ".tif", ".tiff", ".psd",
    ".pdf", ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx", ".odt", ".ods", ".odp",
    ".zip", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".rar", ".tar", ".jar", ".war",
    ".whl", ".egg", ".so", ".dylib", ".dll", ".exe", ".o", ".a", ".lib", ".obj", ".class",
    ".pyc", ".pyo", ".wasm", ".bin", ".dat", ".db", ".sqlite", ".sqlite3", ".mp3", ".mp4",
    ".wav", ".ogg", ".flac", ".mov", ".avi", ".mkv", ".webm", ".ttf", ".otf", ".woff",
    ".woff2", ".eot", ".pkl", ".pickle", ".npy", ".npz", ".pt", ".pth", ".safetensors",
    ".gguf", ".onnx", ".h5", ".parquet", ".arrow", ".iso", ".dmg",
}
_MINIFIED_SUFFIXES = (".min.js", ".min.css", ".min.mjs", ".js.map", ".css.map", ".map")


def read_repo(
    directory: str | os.PathLike,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    display: str | None = None,
) -> Document:
    """Read the text files of a repository into one Document, in sorted path order.

    Each file appears as a header line `==> relative/path <==` followed by its text; spans give
    the relative path and line numbers. `.gitignore` files (root and nested) and
    `.git/info/exclude` are honoured; `.git`, dependency and build directories, lock files,
    minified and binary files and files over `max_file_bytes` are skipped, as is everything
    after `max_total_bytes` of text. Symbolic links are not followed (git stores a link, not what
    it points to; a target inside the directory is read under its own path) and only regular files
    are read, never a FIFO or a device. Skipped files, and `.gitignore` lines git would ignore as
    invalid, are summarised in the warnings. Raises NothingReadable when no file could be read.
    """
    root = Path(directory)
    display = display or os.fspath(directory)
    if not display.endswith("/"):
        display += "/"
    if not root.is_dir():
        raise DocumentNotFound(display.rstrip("/"))
    skipped: dict[str, list[str]] = defaultdict(list)
    bad_patterns: list[str] = []
    files = sorted(_walk(root, skipped, bad_patterns), key=lambda rel: rel.split("/"))

    parts: list[str] = []
    spans: list[Span] = []
    pos = 0
    total = 0
    guessed: list[str] = []
    for rel in files:
        try:
            data = _read_regular_file(root / rel, max_file_bytes)
        except OSError:
            skipped["unreadable"].append(rel)
            continue
        if data is None:
            skipped["not regular files"].append(rel)  # replaced by a FIFO or a device since the walk
            continue
        size = len(data)
        if size > max_file_bytes:
            skipped[f"over {format_size(max_file_bytes)}"].append(rel)
            continue
        if size == 0:
            continue
        if total + size > max_total_bytes:
            skipped[f"past the {format_size(max_total_bytes)} total"].append(rel)
            continue
        try:
            text, encoding = decode_text(data, rel)
        except BinaryDocument:
            skipped["binary"].append(rel)
            continue
        text = text.lstrip("\ufeff").rstrip()
        if not text.strip():
            continue
        if _looks_minified(text):
            skipped["minified or generated"].append(rel)
            continue
        if encoding:
            guessed.append(f"{rel} ({encoding})")
        total += size
        header = f"==> {rel} <=="
        if parts:
            parts.append("\n\n")
            pos += 2
        parts.append(header + "\n")
        spans.append(Span(pos, pos + len(header), rel, kind="heading", show_file=True))
        pos += len(header) + 1
        parts.append(text)
        spans.extend(line_spans(text, rel, offset=pos, show_file=True))
        pos += len(text)

    warnings = [f"{line} (git ignores it too)" for line in bad_patterns[:3]]
    if len(bad_patterns) > 3:
        warnings.append(f"... and {len(bad_patterns) - 3} more invalid ignore patterns")
    warnings += [_summary(reason, sorted(names, key=lambda rel: rel.split("/"))) for reason, names in skipped.items()]
    if guessed:
        warnings.append(_summary("not UTF-8, encoding guessed", guessed, verb="read"))
    if not parts:
        raise NothingReadable(display)
    return Document(source=display, kind="repo", text="".join(parts), spans=spans,
                    warnings=warnings)


def _walk(root: Path, skipped: dict[str, list[str]], bad_patterns: list[str]):
    """Yield the relative posix paths of the candidate files under `root` (iteratively: a tree
    nested thousands of folders deep is no recursion)."""
    specs: list[tuple[str, pathspec.GitIgnoreSpec]] = []
    exclude = root / ".git" / "info" / "exclude"
    if exclude.is_file() and not exclude.is_symlink():
        specs.append(("", _spec(exclude, ".git/info/exclude", bad_patterns)))
    todo = [(root, "", specs)]
    while todo:
        directory, prefix, specs = todo.pop()
        yield from _walk_dir(directory, prefix, specs, skipped, bad_patterns, todo)


def _walk_dir(directory: Path, prefix: str, specs, skipped, bad_patterns, todo):
    gitignore = directory / ".gitignore"
    if gitignore.is_file() and not gitignore.is_symlink():
        specs = specs + [(prefix, _spec(gitignore, prefix + ".gitignore", bad_patterns))]
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        skipped["unreadable"].append(prefix or ".")
        return
    for entry in entries:
        rel = prefix + entry.name
        if entry.name == ".git":
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_link = entry.is_symlink()
            is_file = entry.is_file(follow_symlinks=False)
        except OSError:
            continue
        if is_dir:
            if _ignored(rel + "/", specs):
                continue
            if entry.name in _SKIP_DIRS or entry.name.endswith(".egg-info"):
                skipped["vendored or generated directories"].append(rel + "/")
                continue
            todo.append((Path(entry.path), rel + "/", specs))
            continue
        if _ignored(rel, specs):
            continue
        if is_link:
            skipped["symbolic links, not followed"].append(rel)
            continue
        if not is_file:
            skipped["not regular files"].append(rel)  # FIFOs, sockets, devices: reading one may block
            continue
        reason = _skip_reason(entry.name)
        if reason:
            skipped[reason].append(rel)
            continue
        yield rel


def _spec(path: Path, rel: str, bad_patterns: list[str]) -> pathspec.GitIgnoreSpec:
    """The patterns of an ignore file. Lines git itself ignores as invalid ("!", a trailing
    backslash) are left out, each noted in `bad_patterns`; the rest still apply."""
    try:
        data = _read_regular_file(path, DEFAULT_MAX_FILE_BYTES)
    except OSError:
        data = None
    lines = (data or b"").decode("utf-8", errors="replace").splitlines()
    try:
        return pathspec.GitIgnoreSpec.from_lines(lines)
    except ValueError:
        pass
    valid = []
    for number, line in enumerate(lines, start=1):
        try:
            pathspec.GitIgnoreSpec.from_lines([line])
        except ValueError:
            bad_patterns.append(f"{rel} line {number}: {line.strip()!r} is not a valid pattern; ignored it")
            continue
        valid.append(line)
    return pathspec.GitIgnoreSpec.from_lines(valid)


def _read_regular_file(path: Path, limit: int) -> bytes | None:
    """The first limit + 1 bytes of `path` if it is a regular file (None if it is not: a FIFO
    opened without O_NONBLOCK would wait for a writer forever). Links are not followed. Reading
    through the open file bounds it even if it grew after the walk sized it."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if os.path.islink(path):
            return None
        raise
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return file.read(limit + 1)


def _ignored(rel: str, specs) -> bool:
    """Git's rule: the last matching pattern wins, deeper .gitignore files over higher ones."""
    ignored = False
    for base, spec in specs:
        if not rel.startswith(base):
            continue
        result = spec.check_file(rel[len(base):])
        if result.include is not None:
            ignored = result.include
    return ignored


def _skip_reason(name: str) -> str | None:
    lower = name.lower()
    if name in _LOCK_FILES or lower.endswith(".lock"):
        return "lock files"
    if lower.endswith(_MINIFIED_SUFFIXES):
        return "minified or generated"
    if Path(lower).suffix in _BINARY_SUFFIXES:
        return "binary"
    return None


def _looks_minified(text: str) -> bool:
    lines = text.split("\n")
    longest = max(len(line) for line in lines)
    return longest > 2000 and len(text) / len(lines) > 300


def _summary(reason: str, names: list[str], verb: str = "skipped", keep: int = 5) -> str:
    shown = ", ".join(names[:keep])
    more = f" and {len(names) - keep} more" if len(names) > keep else ""
    noun = "file" if len(names) == 1 else "files"
    if reason.endswith("directories"):
        return f"{verb} {reason}: {shown}{more}"
    return f"{verb} {len(names)} {noun} ({reason}): {shown}{more}"
