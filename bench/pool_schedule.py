"""The streaming regime's block copies: the pass schedule (kv/schedule.py, a resident prefix and a
ring) beside the least-recently-used pool it replaces, simulated over whole decode steps (no
tensor is touched: the counts are the policies' own; tests/test_pool_schedule.py checks the old
pool's count against kv/pool.py's SlotPool).

A document of CONTEXT tokens is shared by BATCH forks, each with its own tail block; SmolLM2's
shape (30 layers, 3 KV heads of 64) with bfloat16 blocks (a GPU's), so a pool of P MiB has
P / (30 layers x 48 KiB) slots per layer. Reported per decode step (the mean of steps 2..STEPS):
blocks copied per layer and the bytes that cross the link for all layers.

    python bench/pool_schedule.py
    python bench/pool_schedule.py --contexts 1024,8192,131072 --pools 8,64 --batches 1,16,64 --steps 64

--engine runs the engine itself instead (the pool path on this machine's device, the model's own
KV format): BATCH forks of a document of CONTEXT random tokens decode STEPS tokens each with the
pass schedule and again with the least-recently-used pool, the same tokens asserted; reported per
decode step: blocks the pool copied (counted from the engine's events, all layers) and seconds.

    python bench/pool_schedule.py --engine --contexts 4096 --pools 8 --batches 1,8 --steps 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_result  # noqa: E402
from kvpage_cli.engine.kv.schedule import LeastRecentlyUsed, StreamSchedule, simulate  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, ELEMENT = 30, 3, 64, 2
BLOCK_BYTES = 2 * KV_HEADS * 64 * HEAD_DIM * ELEMENT  # K and V of one block in one layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,8192,131072")
    parser.add_argument("--pools", default="8,64", help="pool sizes in MiB")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--engine", action="store_true", help="measure the engine's pool path (see above)")
    parser.add_argument("--model", default="smollm2", help="--engine: the model")
    args = parser.parse_args()
    if args.engine:
        write_result("pool_schedule", args, {"rows": engine_rows(args)}, args.json_path)
        return
    rows = []
    print(f"{'context':>8} {'pool MiB':>8} {'slots':>5} {'batch':>5} {'blocks read':>11} "
          f"{'LRU copies':>10} {'schedule':>9} {'LRU MB/step':>11} {'schedule MB/step':>16}")
    for context in map(int, args.contexts.split(",")):
        for pool in map(float, args.pools.split(",")):
            slots = int(pool * 2**20) // (LAYERS * BLOCK_BYTES)
            for batch in map(int, args.batches.split(",")):
                blocks = context // 64
                lru = simulate(LeastRecentlyUsed(slots), blocks, batch, args.steps)[1:]
                ours = simulate(StreamSchedule(slots), blocks, batch, args.steps)[1:]
                row = dict(context=context, pool_mib=pool, slots=slots, batch=batch, blocks_read=blocks + batch,
                           lru_copies=sum(lru) / len(lru), schedule_copies=sum(ours) / len(ours))
                row["lru_mb"] = row["lru_copies"] * LAYERS * BLOCK_BYTES / 1e6
                row["schedule_mb"] = row["schedule_copies"] * LAYERS * BLOCK_BYTES / 1e6
                rows.append(row)
                print(f"{context:>8} {pool:>8.0f} {slots:>5} {batch:>5} {blocks + batch:>11} {row['lru_copies']:>10.1f} "
                      f"{row['schedule_copies']:>9.1f} {row['lru_mb']:>11.1f} {row['schedule_mb']:>16.1f}")
    write_result("pool_schedule", args, {"rows": rows}, args.json_path)


def engine_rows(args) -> list[dict]:
    """The engine's own copies and step time, schedule against least recently used (--engine)."""
    import random
    import time

    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.engine.events import BlocksMoved, StepDone
    from kvpage_cli.engine.scheduler import Request

    rows = []
    print(f"{'context':>8} {'pool MiB':>8} {'slots':>5} {'batch':>5} {'LRU copies':>10} {'schedule':>9} "
          f"{'LRU s/step':>10} {'schedule s/step':>15}")
    for context in map(int, args.contexts.split(",")):
        for pool in map(float, args.pools.split(",")):
            engines = {}
            for policy in ("lru", "schedule"):
                engine = Engine.load(args.model, EngineConfig(kv_path="pool", pool_mib=pool))
                engine.dispatch.stream_schedule = policy == "schedule"
                engines[policy] = engine
            vocab = engines["lru"].spec.vocab_size
            rng = random.Random(context)
            document = [rng.randrange(100, vocab) for _ in range(context)]
            for batch in map(int, args.batches.split(",")):
                measured, tokens = {}, {}
                questions = [[rng.randrange(100, vocab)] for _ in range(batch)]  # each fork's own next token
                for policy, engine in engines.items():
                    doc = engine.prefill(document)
                    asked = [engine.append(engine.fork(doc), question) for question in questions]
                    requests = [Request(ctx, [], max_new_tokens=args.steps, stop=()) for ctx in asked]
                    copies, times = [0], [time.perf_counter()]

                    def count(event, copies=copies, times=times):
                        if isinstance(event, BlocksMoved):
                            copies[-1] += event.blocks
                        elif isinstance(event, StepDone):
                            copies.append(0)
                            times.append(time.perf_counter())

                    out = {id(r): [] for r in requests}
                    for request, token in engine.run(requests, on_event=count):
                        out[id(request)].append(token)
                    tokens[policy] = [out[id(r)] for r in requests]
                    steps = copies[1:-1]  # past the first step (it fills the pool)
                    seconds = [b - a for a, b in zip(times[1:], times[2:])]
                    measured[policy] = (sum(steps) / max(1, len(steps)), sum(seconds) / max(1, len(seconds)))
                    for ctx in asked + [doc]:
                        engine.release(ctx)
                assert tokens["lru"] == tokens["schedule"], "the schedule changed the tokens"
                row = dict(context=context, pool_mib=pool, slots=engines["lru"].pool.num_slots, batch=batch,
                           lru_copies=measured["lru"][0], schedule_copies=measured["schedule"][0],
                           lru_step_s=measured["lru"][1], schedule_step_s=measured["schedule"][1],
                           device=str(engines["lru"].device), model=args.model)
                rows.append(row)
                print(f"{context:>8} {pool:>8.0f} {row['slots']:>5} {batch:>5} {row['lru_copies']:>10.1f} "
                      f"{row['schedule_copies']:>9.1f} {row['lru_step_s']:>10.3f} {row['schedule_step_s']:>15.3f}")
    return rows


if __name__ == "__main__":
    main()
