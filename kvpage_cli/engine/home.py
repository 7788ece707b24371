"""The kvpage home folder (`EngineConfig.home`, default ~/.cache/kvpage): converted weights,
compiled kernels and saved KV, all of which kvpage later loads and runs as its user. Folders it
creates there are private (0700) whatever the umask; folders that already exist are left as they
are (native.py refuses to load a library from one that others can write to)."""

from __future__ import annotations

import os
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
