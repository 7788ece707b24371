"""Shared pieces of the benchmarks: prompts built from the corpus, workers in subprocesses, tables."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CUAD = REPO / "corpus" / "cuad"


def median_seconds(call, repeats: int) -> float:
    """The median wall time of `repeats` calls, after three calls not timed (first-call costs)."""
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def corpus_text() -> str:
    """The 12 CUAD contracts of the corpus, in folder order."""
    return "\n\n".join(p.read_text() for p in sorted(CUAD.glob("*/contract.txt")))


def prompt_ids(tokenizer, length: int, question: str = "\n\nSummarise the obligations of each party.") -> list[int]:
    """Exactly `length` token ids: contract text (repeated as needed), cut, then a question."""
    tail = tokenizer(question, add_special_tokens=False).input_ids
    text = corpus_text()
    # a prefix of the text with room to spare (a token is rarely over 8 characters): the same ids as
    # the whole text's, without the memory of tokenizing all of it counted in a worker's peak RSS
    body_ids: list[int] = list(tokenizer(text[:8 * length + 1024]).input_ids)
    if len(body_ids) < length + 16 and len(text) > 8 * length + 1024:
        body_ids = list(tokenizer(text).input_ids)
    while len(body_ids) < length:
        body_ids += body_ids
    return body_ids[: length - len(tail)] + tail


def peak_rss_mib() -> float:
    """This process's peak resident set (MiB): VmHWM, which starts afresh at exec. (getrusage's
    ru_maxrss does not on Linux: a worker started by a parent holding 1.2 GB reported 1.2 GB.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def read_bandwidth_gbs(mib: int = 1024, device: str = "cpu") -> float:
    """Measured memory read bandwidth (GB/s) of `device`: the median of 9 sums over a buffer far
    larger than the caches (a GPU's: 4 GiB, past its L2)."""
    if device != "cpu":
        mib = max(mib, 4096)
    buffer = torch.randn(mib * 2**20 // 4, device=device)
    times = []
    for _ in range(9):
        sync(device)
        started = time.perf_counter()
        buffer.sum()
        sync(device)
        times.append(time.perf_counter() - started)
    return buffer.numel() * 4 / sorted(times)[len(times) // 2] / 1e9


def bench_device(name: str) -> str:
    """The device a benchmark's workers compute on: auto is CUDA when torch sees a GPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def sync(device) -> None:
    """Waits for the device's queued work, so that a timer around it measures the work (no-op on CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def peak_device_mib(device) -> float | None:
    """Peak memory torch allocated on a CUDA device in this process (MiB); None on the CPU."""
    return torch.cuda.max_memory_allocated() / 2**20 if str(device).startswith("cuda") else None


def run_worker(script: Path, args: list[str], timeout: float = 3600) -> dict:
    """Runs `script --worker ARGS` in a fresh process and returns the JSON it prints last."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, str(script), "--worker", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(lines[-1])


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table: columns are (key, heading); floats get 1 decimal (ratios 2)."""
    def cell(row, key):
        value = row.get(key)
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.2f}" if "ratio" in key or key.endswith("_x") else f"{value:.1f}"
        return str(value)

    cells = [[heading for _, heading in columns]] + [[cell(r, k) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
