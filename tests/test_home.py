"""The kvpage home folder: private folders, and what killed runs leave behind swept away."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvpage_cli.engine.home import STALE_SECONDS, private_dir, sweep_leftovers
from kvpage_cli.engine.model.gguf import ensure_converted


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_folders_are_made_private_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        made = private_dir(tmp_path / "home" / "native")
    finally:
        os.umask(old)
    assert (tmp_path / "home").stat().st_mode & 0o777 == 0o700
    assert made.stat().st_mode & 0o777 == 0o700


def test_a_conversion_killed_before_it_finished_is_swept(tmp_path):
    """A .tmp folder of a conversion whose process is gone (Ctrl-C during dequantizing, a kill)
    goes the next time a model is resolved; one of a live process, or a fresh one, stays."""
    models = tmp_path / "models"
    target = models / "converted-model"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"already converted")
    dead = models / f".tmp-{dead_pid()}-abc123"
    live = models / f".tmp-{os.getpid()}-def456"
    old = models / ".tmp-unknown"
    for folder in (dead, live, old):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half written")
    stale = time.time() - STALE_SECONDS - 60
    os.utime(old, (stale, stale))
    assert ensure_converted(tmp_path / "model.gguf", target) == target
    assert not dead.exists() and not old.exists() and live.exists()


def test_an_assembled_gguf_of_a_stopped_run_is_swept(tmp_path):
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    dead = gguf / f"gemma-3-270m-q4_k_m-{dead_pid()}.gguf"
    live = gguf / f"gemma-3-270m-q4_k_m-{os.getpid()}.gguf"
    other = gguf / "notes.txt"
    for path in (dead, live, other):
        path.write_bytes(b"partial")
    assert sweep_leftovers(gguf, "gemma-3-270m-q4_k_m-", ".gguf") == [dead]
    assert live.exists() and other.exists()
