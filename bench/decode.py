"""Decode benchmark: exact mode against each selective policy, at long contexts.

One prompt per context length (contract text from corpus/), prefilled once; then exact mode and
every policy (pool = 1/8 of the context's blocks by default) decode the same number of tokens
from forks of it. Reported per row: decode tokens/s (measured, step boundaries), speed-up over
exact, KV read per token (blocks attended x block bytes, all layers), blocks moved into the pool
per token (pool path only), and how many of the tokens equal exact mode's.

    python bench/decode.py --model smollm2 --lengths 4096,16384,32768
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, prompt_ids, table, write_result  # noqa: E402

POLICIES = ("lru", "quest", "draft", "scores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="4096,16384,32768")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--fraction", type=int, default=8, help="pool = context blocks / N")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-path", default="auto", choices=["auto", "store", "pool"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--home", default=None)
    add_json_option(parser)
    args = parser.parse_args()

    from kvpage_cli.engine import Engine, EngineConfig

    lengths = [int(n) for n in args.lengths.split(",")]
    engine = Engine.load(args.model, EngineConfig(
        mode="selective", policy="quest", pool_mib=4096, home=args.home, device=args.device, kv_path=args.kv_path,
        dtype=args.dtype, max_context=max(lengths) + args.new_tokens,
    ), on_event=lambda e: print(e, file=sys.stderr) if type(e).__name__ == "EngineWarning" else None)
    block_bytes = sum(g.block_bytes for g in engine.store.groups) / engine.spec.num_layers  # K+V of a block, one layer
    rows = []
    for length in lengths:
        doc = engine.prefill(prompt_ids(engine.tokenizer, length))
        exact_tokens = exact_speed = None
        for policy in (None, *args.policies.split(",")):
            budget = max(4, -(-doc.num_blocks // args.fraction))
            engine.set_selection(policy, budget)
            engine.block_scores(doc)  # "scores": its one pass per prompt, kept out of the decode timing
            engine.reset_stats()
            tokens = list(engine.generate(engine.fork(doc), max_new_tokens=args.new_tokens, stop=()))
            stats = engine.stats()
            steps = args.new_tokens - 1
            speed = stats.decode_tokens / stats.decode_seconds
            if policy is None:
                exact_tokens, exact_speed = tokens, speed
                attended = doc.num_blocks * engine.spec.num_layers  # every block in every layer (approx.: windows)
            else:
                attended = stats.blocks_attended / max(1, steps)
            rows.append({
                "context": length, "policy": policy or "exact", "pool": f"1/{args.fraction}" if policy else "all",
                "decode_tok_s": speed, "speedup_x": speed / exact_speed,
                "kv_read_mib_per_token": attended * block_bytes / 2**20,
                "moved_per_token": stats.blocks_moved / max(1, steps), "hit_rate": stats.pool_hit_rate,
                "same_tokens": sum(a == b for a, b in zip(tokens, exact_tokens)), "path": f"{stats.backend}/{stats.kv_path}",
            })
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del doc
    print(table(rows, [("context", "ctx"), ("policy", "policy"), ("pool", "pool"), ("decode_tok_s", "decode tok/s"),
                       ("speedup_x", "x exact"), ("kv_read_mib_per_token", "KV read MiB/tok"),
                       ("moved_per_token", "moved blocks/tok"), ("same_tokens", f"same of {args.new_tokens}"),
                       ("path", "path")]))
    print(f"model {args.model} ({args.dtype}, {args.device}); weights {engine.stats().weight_bytes / 2**20:.0f} MiB; "
          f"KV read per token counts blocks attended x block bytes (computed from measured counts)")
    write_result("decode", args, {"rows": rows}, args.json_path)


if __name__ == "__main__":
    main()
