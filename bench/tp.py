"""Tensor parallelism on CPU: one process with 2 threads against 2 ranks with 1 thread each.

The same prompt token ids (contract text, bench/common.prompt_ids) go through SmolLM2 in exact
mode: one process (`--tp 1`, 2 threads) and two ranks joined by gloo (`--tp 2`, 1 thread each,
started by kvpage_cli.engine.model.parallel.spawn, as `kvpage --tp 2` starts them). Prefill and decode
are timed around whole runs after a warm-up; each rank also measures the time it spends in the
collectives (the all-reduces after attention and the MLP, the vocabulary's all-gather, waiting for
the slower rank included: SmolLM2's 3 KV heads split 2 and 1). On two cores little gain is
expected: the figures are the communication share and the check that the tokens are the same.

    python bench/tp.py                          # SmolLM2 at 1K and 8K
    python bench/tp.py --contexts 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, peak_rss_mib, prompt_ids, run_worker, table, write_result  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(model: str, length: int, new_tokens: int, tp: int, threads: int) -> dict:
    import torch

    from kvpage_cli.engine import Engine, EngineConfig

    torch.set_num_threads(threads)
    engine = Engine.load(model, EngineConfig(tp=tp, threads=threads, pool_mib=8))
    ids = prompt_ids(engine.tokenizer, length - new_tokens)
    list(engine.generate(engine.prefill(ids[:80]), max_new_tokens=2, stop=()))  # warm-up
    shard = engine.runner.shard
    comm0 = shard.comm_seconds if shard else 0.0
    started = time.perf_counter()
    ctx = engine.prefill(ids)
    prefill_s = time.perf_counter() - started
    comm1 = shard.comm_seconds if shard else 0.0
    started = time.perf_counter()
    tokens = list(engine.generate(ctx, max_new_tokens=new_tokens, stop=()))
    decode_s = time.perf_counter() - started
    comm2 = shard.comm_seconds if shard else 0.0
    return {"tp": tp, "threads": threads, "prompt_tokens": len(ids), "prefill_tok_s": len(ids) / prefill_s,
            "decode_tok_s": new_tokens / decode_s, "prefill_comm_pct": 100 * (comm1 - comm0) / prefill_s,
            "decode_comm_pct": 100 * (comm2 - comm1) / decode_s, "tokens": tokens,
            "weight_mib": engine.runner.weight_bytes / 2**20, "store_mib": engine.stats().store_bytes / 2**20,
            "peak_rss_mib": peak_rss_mib()}


def _rank(rank: int, model: str, length: int, new_tokens: int, out: str) -> None:
    Path(f"{out}.{rank}").write_text(json.dumps(measure(model, length, new_tokens, 2, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--new-tokens", type=int, default=32)
    add_json_option(parser)
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        model, length, new_tokens, tp = args.worker
        if tp == "1":
            print(json.dumps(measure(model, int(length), int(new_tokens), 1, 2)))
        else:
            from kvpage_cli.engine.model.parallel import spawn

            with tempfile.TemporaryDirectory() as folder:
                out = str(Path(folder) / "rank")
                spawn(_rank, 2, (model, int(length), int(new_tokens), out))
                ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
            print(json.dumps({"ranks": ranks}))
        return
    rows = []
    for length in [int(c) for c in args.contexts.split(",")]:
        alone = run_worker(Path(__file__), [args.model, str(length), str(args.new_tokens), "1"])
        split = run_worker(Path(__file__), [args.model, str(length), str(args.new_tokens), "2"])
        if "error" in alone or "error" in split:
            raise SystemExit(f"{length}: {alone.get('error') or split.get('error')}")
        r0, r1 = split["ranks"]
        rows.append({"context": length, "prefill_1x2": alone["prefill_tok_s"], "prefill_2x1": r0["prefill_tok_s"],
                     "prefill_ratio": r0["prefill_tok_s"] / alone["prefill_tok_s"],
                     "decode_1x2": alone["decode_tok_s"], "decode_2x1": r0["decode_tok_s"],
                     "decode_ratio": r0["decode_tok_s"] / alone["decode_tok_s"],
                     "comm_prefill": f"{r0['prefill_comm_pct']:.0f}/{r1['prefill_comm_pct']:.0f}",
                     "comm_decode": f"{r0['decode_comm_pct']:.0f}/{r1['decode_comm_pct']:.0f}",
                     "same_tokens": f"{sum(a == b for a, b in zip(alone['tokens'], r0['tokens']))}/{len(alone['tokens'])}",
                     "weights": f"{alone['weight_mib']:.0f} | {r0['weight_mib']:.0f}+{r1['weight_mib']:.0f}",
                     "rss": f"{alone['peak_rss_mib']:.0f} | {r0['peak_rss_mib']:.0f}+{r1['peak_rss_mib']:.0f}",
                     "alone": alone, "ranks": [r0, r1]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("alone", "ranks")}), flush=True)
    print(table(rows, [("context", "ctx"), ("prefill_1x2", "prefill 1x2"), ("prefill_2x1", "prefill 2x1"),
                       ("prefill_ratio", "ratio"), ("decode_1x2", "decode 1x2"), ("decode_2x1", "decode 2x1"),
                       ("decode_ratio", "ratio"), ("comm_prefill", "comm % prefill r0/r1"),
                       ("comm_decode", "comm % decode r0/r1"), ("same_tokens", "same tokens"),
                       ("weights", "weights MiB 1 | r0+r1"), ("rss", "peak RSS MiB 1 | r0+r1")]))
    write_result("tp", args, rows, args.json_path)


if __name__ == "__main__":
    main()
