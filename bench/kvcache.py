"""Saved-KV cache and disk tier benchmark: a document asked about twice, and decode with half its KV on disk.

The same document (CUAD contracts, `--doc-tokens` tokens) and question go through separate
processes sharing one kvpage home:

  first ask    empty cache: the document is prefilled and its segments are saved
  second ask   the document's KV is loaded from the cache; only its tail and the question run
  decode RAM   the store all in RAM (document restored from the cache), `--new-tokens` greedy steps
  decode disk  the same with `host_mib` = half the document's KV: the rest in memory-mapped files
  decode cold  as "decode disk", the disk tier's pages pushed out of memory (MADV_PAGEOUT) before
               every step, as when the machine has no RAM to spare for them

Time to first answer token (TTFT) is taken inside the process from the call to prefill to the
first generated token; model loading is reported beside it. Run:

    python bench/kvcache.py                              # SmolLM2, 8000-token document
    python bench/kvcache.py --doc-tokens 4000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, peak_rss_mib, prompt_ids, run_worker, table, write_result  # noqa: E402

QUESTION = "\n\nWhich party may terminate the agreement, and on what notice?"
MADV_PAGEOUT = 21  # Linux 5.4+


def _engine(model: str, home: str, dtype: str, host_mib: float | None, kv_cache: bool = True):
    from kvpage_cli.engine import Engine, EngineConfig

    started = time.perf_counter()
    engine = Engine.load(model, EngineConfig(home=home, dtype=dtype, host_mib=host_mib, kv_cache=kv_cache))
    return engine, time.perf_counter() - started


def _document(engine, doc_tokens: int) -> tuple[list[int], list[int]]:
    question = engine.tokenizer(QUESTION, add_special_tokens=False).input_ids
    return prompt_ids(engine.tokenizer, doc_tokens, question=""), question


def worker_prepare(model: str, home: str, dtype: str) -> dict:
    """Converts the weights and builds the native kernels once, so that no timed run does it."""
    engine, load_s = _engine(model, home, dtype, None, kv_cache=False)
    list(engine.generate(engine.prefill([1, 2, 3]), max_new_tokens=2, stop=()))
    return {"run": "prepare", "load_s": load_s, "kv_bytes_per_token": engine.kv_bytes_per_token()}


def worker_ask(model: str, home: str, dtype: str, doc_tokens: int, new_tokens: int) -> dict:
    engine, load_s = _engine(model, home, dtype, None)
    document, question = _document(engine, doc_tokens)
    started = time.perf_counter()
    ctx = engine.prefill(document, label="bench-document")
    tokens, ttft = [], None
    for token in engine.generate(ctx, question, max_new_tokens=new_tokens, stop=()):
        if ttft is None:
            ttft = time.perf_counter() - started
        tokens.append(token)
    stats = engine.stats()
    return {
        "ttft_s": ttft, "load_s": load_s, "cached_tokens": ctx.cached_prefix, "doc_tokens": len(document),
        "cache_load_s": stats.cache_load_seconds, "prefill_s": stats.prefill_seconds,
        "decode_tok_s": stats.decode_tokens_per_s, "store_mib": stats.store_bytes / 2**20,
        "store_disk_mib": stats.store_disk_bytes / 2**20, "peak_rss_mib": peak_rss_mib(), "tokens": tokens,
    }


def worker_decode(model: str, home: str, dtype: str, doc_tokens: int, new_tokens: int, host_mib: float | None,
                  cold: bool) -> dict:
    engine, load_s = _engine(model, home, dtype, host_mib)
    document, question = _document(engine, doc_tokens)
    ctx = engine.prefill(document, label="bench-document")
    list(engine.generate(ctx, question, max_new_tokens=1, stop=()))
    engine.reset_stats()
    pageout = _pageout(engine) if cold else None
    tokens = []
    for token in engine.generate(ctx, max_new_tokens=new_tokens, stop=(),
                                 on_event=(lambda event: pageout()) if pageout else None):
        tokens.append(token)
    stats = engine.stats()
    return {
        "load_s": load_s, "cached_tokens": ctx.cached_prefix, "decode_tok_s": stats.decode_tokens_per_s,
        "store_mib": stats.store_bytes / 2**20, "store_disk_mib": stats.store_disk_bytes / 2**20,
        "peak_rss_mib": peak_rss_mib(), "tokens": tokens,
    }


def _pageout(engine):
    """A function that asks the kernel to write out and drop the disk tier's pages."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ranges = []
    for group in engine.store.groups:
        for arena, on_disk in enumerate(group.arena_on_disk):
            if on_disk:
                first = group.k_arenas[0][arena]  # [layers, 2, Hkv, A, ...] starts with layer 0's K
                size = first.numel() * first.element_size() * 2 * len(group.layers)
                ranges.append((first.data_ptr(), size))

    def pageout() -> None:
        for address, size in ranges:
            if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), MADV_PAGEOUT) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_PAGEOUT) failed")

    return pageout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--doc-tokens", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--home", default=None, help="kvpage home to use (default: a temporary one, removed after)")
    parser.add_argument("--no-cold", action="store_true", help="skip the 'decode cold' run")
    add_json_option(parser)
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker is not None:
        kind, home = args.worker[0], args.worker[1]
        if kind == "prepare":
            result = worker_prepare(args.model, home, args.dtype)
        elif kind == "ask":
            result = worker_ask(args.model, home, args.dtype, args.doc_tokens, args.new_tokens)
        else:
            host_mib = None if args.worker[2] == "none" else float(args.worker[2])
            result = worker_decode(args.model, home, args.dtype, args.doc_tokens, args.new_tokens, host_mib, kind == "cold")
        print(json.dumps(result))
        return

    home = args.home or tempfile.mkdtemp(prefix="kvpage-bench-")
    common = ["--model", args.model, "--doc-tokens", str(args.doc_tokens), "--new-tokens", str(args.new_tokens),
              "--dtype", args.dtype]
    script = Path(__file__)
    try:
        shutil.rmtree(Path(home) / "kv", ignore_errors=True)  # the first ask must find an empty cache
        prepared = run_worker(script, ["prepare", home, *common])
        if "error" in prepared:
            sys.exit(f"prepare failed: {prepared['error']}")
        half_mib = args.doc_tokens * prepared["kv_bytes_per_token"] / 2 / 2**20
        runs = [("first ask", ["ask", home]), ("second ask", ["ask", home]),
                ("decode RAM", ["ram", home, "none"]), ("decode disk", ["disk", home, f"{half_mib:.3f}"])]
        if not args.no_cold:
            runs.append(("decode cold", ["cold", home, f"{half_mib:.3f}"]))
        rows = []
        for name, worker in runs:
            result = run_worker(script, worker + common)
            rows.append({"run": name, **result})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
    finally:
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)

    first, second = rows[0], rows[1]
    summary = {}
    if first.get("ttft_s") and second.get("ttft_s"):
        summary["second_over_first_ttft"] = second["ttft_s"] / first["ttft_s"]
        summary["same_answer"] = first.get("tokens") == second.get("tokens")
    decodes = {r["run"]: r for r in rows[2:]}
    if decodes.get("decode RAM", {}).get("tokens") is not None:
        summary["same_decode_tokens"] = all(r.get("tokens") == decodes["decode RAM"]["tokens"] for r in decodes.values())
    columns = [
        ("run", "run"), ("ttft_s", "TTFT s"), ("load_s", "load s"), ("cached_tokens", "cached tok"),
        ("cache_load_s", "cache read s"), ("prefill_s", "prefill s"), ("decode_tok_s", "decode tok/s"),
        ("store_mib", "store MiB"), ("store_disk_mib", "on disk MiB"), ("peak_rss_mib", "peak RSS MiB"), ("error", "error"),
    ]
    print()
    print(f"{args.model}, {args.dtype}, document {args.doc_tokens} tokens, {args.new_tokens} new tokens; "
          f"host_mib for the disk runs: {half_mib:.1f} (half the document's KV)")
    print(table(rows, columns))
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    write_result("kvcache", args, {"rows": rows, "summary": summary}, args.json_path)


if __name__ == "__main__":
    main()
