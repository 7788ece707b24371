"""Shared pieces of the benchmarks: prompts built from the corpus, workers in subprocesses, tables,
and the one way a benchmark writes its result (`write_result`: a JSON document stamped with the
commit, machine and library versions it was measured with)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CUAD = REPO / "corpus" / "cuad"
RESULTS = REPO / "bench" / "results"
SCHEMA = 1  # the layout of a result file; raised when a field of the stamp changes its meaning


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
        said = done.stderr.strip().splitlines()
        if done.returncode < 0:  # killed by a signal: its name ("SIGILL": an illegal instruction)
            return {"error": f"killed by {signal.Signals(-done.returncode).name}" + (f": {said[-1][:160]}" if said else "")}
        return {"error": (said or [f"failed (exit {done.returncode})"])[-1][:200]}
    return json.loads(lines[-1])


def import_error(name: str, error: ImportError) -> str:
    """A peer's row's error where importing it failed: "not installed" where the package `name`
    itself is missing (its rows are then left out), else what failed, so that a package installed
    without what it needs (llama-cpp-python installed with --no-deps lacks diskcache) says so."""
    return "not installed" if error.name == name else f"{name} does not import: {error}"


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


# -- results: one JSON document per run, stamped like llama-bench's rows --------------------------

# The instruction sets kvpage's native kernels choose between (native/*.c, model/quant.py).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
# Distributions whose versions a result records (None where one is not installed).
VERSIONS = {"torch": "torch", "triton": "triton", "transformers": "transformers", "llama_cpp": "llama_cpp_python"}
# (vendor, family) -> [(first model, last model, tag)]: the microarchitecture in a result's file name,
# from the ranges Linux uses (arch/x86/kernel/cpu/amd.c bsp_init_amd, intel-family.h): a VM's
# model name often says only "AMD EPYC".
MICROARCHS = {
    ("AuthenticAMD", 0x17): [(0x00, 0x2f, "zen"), (0x50, 0x5f, "zen"), (0x30, 0x4f, "zen2"), (0x60, 0x7f, "zen2"),
                             (0x90, 0x91, "zen2"), (0xa0, 0xaf, "zen2")],
    ("AuthenticAMD", 0x19): [(0x00, 0x0f, "zen3"), (0x20, 0x5f, "zen3"), (0x10, 0x1f, "zen4"), (0x60, 0xaf, "zen4")],
    ("AuthenticAMD", 0x1a): [(0x00, 0x2f, "zen5"), (0x40, 0x4f, "zen5"), (0x60, 0x7f, "zen5"), (0x50, 0x5f, "zen6"),
                             (0x80, 0xaf, "zen6"), (0xc0, 0xcf, "zen6")],
    ("GenuineIntel", 6): [(0x55, 0x55, "skx"), (0x6a, 0x6c, "icx"), (0x8f, 0x8f, "spr"), (0xcf, 0xcf, "emr"),
                          (0xad, 0xae, "gnr")],
}


def cpu_info() -> dict:
    """The CPU as /proc/cpuinfo names it (its first processor), the short tag a result's file name
    carries (MICROARCHS, else the model name's words), the CPU_FLAGS it has (None where they
    cannot be read) and the kernels torch dispatches to on it."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and fields:
                break  # the first processor's block
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    flags = fields.get("flags", fields.get("Features"))
    vendor, model = fields.get("vendor_id"), fields.get("model name") or platform.processor() or None
    family, number = (int(fields[k]) if fields.get(k, "").isdigit() else None for k in ("cpu family", "model"))
    return {"model": model, "vendor": vendor, "family": family, "model_number": number,
            "tag": cpu_tag(vendor, family, number, model),
            "flags": None if flags is None else {f: f in flags.split() for f in CPU_FLAGS},
            "torch_capability": torch.backends.cpu.get_cpu_capability()}


def cpu_tag(vendor: str | None, family: int | None, model_number: int | None, model: str | None) -> str:
    """The microarchitecture MICROARCHS gives this vendor, family and model, else the first words of
    the model's name ("AMD EPYC 9R14 96-Core Processor" -> "epyc-9r14"), else "cpu"."""
    for first, last, name in MICROARCHS.get((vendor, family), []):
        if model_number is not None and first <= model_number <= last:
            return name
    words = re.sub(r"\((r|tm)\)|\b(intel|amd|cpu|processor|\d+-core)\b|@.*", " ", (model or "").lower())
    return "-".join(re.findall(r"[a-z0-9]+", words)[:3]) or "cpu"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _checkout() -> tuple[str | None, bool | None]:
    """The commit checked out and whether the tree differs from it (files under bench/results
    aside); None where git or the repository is not there."""
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    status = _git("status", "--porcelain", "--", ".", ":(exclude)bench/results") if commit else None
    return commit, None if status is None else bool(status.strip())


# Taken when a benchmark starts (it imports this module first): a commit made while it runs is
# not the code it measured.
STARTED = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
COMMIT, DIRTY = _checkout()


def stamp(args) -> dict:
    """What a result was measured with: the commit and whether the tree differed from it (files
    under bench/results aside) and the date (UTC), all three as the run started; the CPU, the
    logical CPUs this process may use and torch's threads, the GPUs torch sees, library versions,
    the command line and its parsed arguments."""
    versions = {"python": platform.python_version()}
    for name, distribution in VERSIONS.items():
        try:
            versions[name] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    gpu = None
    if torch.cuda.is_available():
        gpu = {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    script = Path(sys.argv[0]).resolve()
    command = [str(script.relative_to(REPO)) if script.is_relative_to(REPO) else sys.argv[0], *sys.argv[1:]]
    return {
        "migrated": False,
        "commit": COMMIT,
        "dirty": DIRTY,
        "date": STARTED,
        "machine": None,  # a person's name for it; migrated results carry the README's
        "cpu": cpu_info(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": gpu,
        "versions": versions,
        "command": shlex.join(["python", *command]),
        "args": {k: v for k, v in vars(args).items() if k != "worker"} if args is not None else None,
    }


def result_path(bench: str, stamped: dict) -> Path:
    """bench/results/<bench>/<date>-<cpu tag>[-<gpu>]-<commit7>[-dirty].json; a second result of
    the same day, machine and commit gets -2, -3, ... rather than replacing the first."""
    gpu = stamped["gpu"]
    tag = stamped["cpu"]["tag"] + (f"-{gpu_tag(gpu['name'])}" if gpu else "")
    name = f"{stamped['date'][:10]}-{tag}-{(stamped['commit'] or 'nocommit')[:7]}" + ("-dirty" if stamped["dirty"] else "")
    path, count = RESULTS / bench / f"{name}.json", 1
    while path.exists():
        count += 1
        path = RESULTS / bench / f"{name}-{count}.json"
    return path


def gpu_tag(name: str) -> str:
    """The word of a GPU's name that has a digit in it: "NVIDIA H100 80GB HBM3" -> "h100"."""
    words = re.findall(r"[a-z0-9]+", name.lower().replace("nvidia", "").replace("geforce", ""))
    return next((w for w in words if re.search(r"\d", w)), "-".join(words[:2]) or "gpu")


def add_json_option(parser) -> None:
    """--json PATH: where write_result puts the result instead of bench/results/<bench>/."""
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="write the result (JSON, stamped) to PATH instead of bench/results/<bench>/")


def write_result(bench: str, args, payload, path: str | Path | None = None) -> Path:
    """Writes `payload` (the benchmark's rows, as it has always written them) as one JSON document
    {"schema", "bench", "stamp": stamp(args), "results": payload} to `path` (a benchmark's --json)
    or to result_path(); says where on stderr and returns the path."""
    stamped = stamp(args)
    target = Path(path) if path else result_path(bench, stamped)
    target.parent.mkdir(parents=True, exist_ok=True)
    document = {"schema": SCHEMA, "bench": bench, "stamp": stamped, "results": payload}
    target.write_text(json.dumps(document, indent=1, default=str) + "\n")
    shown = target.resolve().relative_to(REPO) if target.resolve().is_relative_to(REPO) else target
    print(f"wrote {shown}", file=sys.stderr)
    return target
