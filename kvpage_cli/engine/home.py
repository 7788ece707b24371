"""The kvpage home folder (`EngineConfig.home`, default ~/.cache/kvpage): converted weights,
compiled kernels and saved KV, all of which kvpage later loads and runs as its user. Folders it
creates there are private (0700) whatever the umask; folders that already exist are left as they
are (native.py refuses to load a library from one that others can write to)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path


def default_home() -> Path:
    return Path.home() / ".cache" / "kvpage"


def private_dir(path: Path) -> Path:
    """Makes `path` and any missing folder above it, each with mode 0700; returns `path`."""
    missing = []
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another process made it meanwhile
            continue
        os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask
    return Path(path)


def fsync_dir(folder: Path) -> None:
    """Makes a rename in `folder` durable (where the file system allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


STALE_SECONDS = 24 * 3600
"""A temporary file or folder this old is a leftover whatever its writer's pid says (pids are reused)."""


def writer_gone(path: Path, pid: int | None) -> bool:
    """Whether the process that was writing `path` (a temporary file or folder named with its pid)
    is gone, or the leftover is older than STALE_SECONDS. Unknown pid: only the age counts."""
    try:
        if time.time() - path.lstat().st_mtime > STALE_SECONDS:
            return True
    except FileNotFoundError:
        return False
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def sweep_leftovers(folder: Path, prefix: str, suffix: str = "") -> list[Path]:
    """Removes what dead processes left in `folder`: entries named `<prefix><pid>-...<suffix>` or
    `<prefix><pid><suffix>` whose writer is gone. Returns what it removed."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        digits = name[len(prefix):len(name) - len(suffix)].split("-")[0]
        if not writer_gone(entry, int(digits) if digits.isdigit() else None):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:
            pass
    return removed
