"""Where a decode step's time goes: torch's profiler around kvpage's greedy decoding, batch 1 or B
forks of one document, on the CPU or a GPU.

Prints the operators (and, on a GPU, the host-device copies and synchronisations) that took the
most host time over the measured steps, with their call counts per step: on a GPU a small model's
step is bound by the host issuing work, so the counts say what to fuse or move off the host.

    python bench/profile_decode.py --model smollm2 --context 1024
    python bench/profile_decode.py --model FILE.gguf --device cuda --batch 16 --pool-mib 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, bench_device, prompt_ids, sync, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=1024, help="document tokens before the decoded ones")
    parser.add_argument("--batch", type=int, default=1, help="forks of the document decoded together")
    parser.add_argument("--steps", type=int, default=16, help="decode steps measured")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--pool-mib", type=float, default=64.0)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--rows", type=int, default=25, help="operators listed")
    add_json_option(parser)
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.engine.engine import Request

    device = bench_device(args.device)
    engine = Engine.load(args.model, EngineConfig(device=device, pool_mib=args.pool_mib, weights=args.weights,
                                                  max_batch=max(args.batch, 1)))
    ids = prompt_ids(engine.tokenizer, args.context, question="")
    doc = engine.prefill(ids)

    def decode(steps: int) -> float:
        requests = [Request(engine.fork(doc), [ids[i % len(ids)]], steps, stop=()) for i in range(args.batch)]
        sync(device)
        started = time.perf_counter()
        list(engine.run(requests, max_batch=args.batch))
        sync(device)
        return time.perf_counter() - started

    decode(4)  # warm-up: kernels compiled, first calls
    plain = decode(args.steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        profiled = decode(args.steps)
    path = f"{engine.backend.name}/{engine.stats().kv_path}"
    print(f"{args.model} on {device} ({path}), {args.context}-token document, "
          f"batch {args.batch}: {args.steps} steps in {plain:.3f} s unprofiled ({1000 * plain / args.steps:.1f} ms a "
          f"step, measured), {profiled:.3f} s profiled")
    events = prof.key_averages()
    operators = [{"operator": e.key, "calls_per_step": e.count / args.steps,
                  "host_ms_per_step": e.self_cpu_time_total / 1000 / args.steps,
                  "gpu_ms_per_step": getattr(e, "self_device_time_total", 0) / 1000 / args.steps if device == "cuda" else None}
                 for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.rows]]
    print(f"{'operator':<48} {'calls/step':>10} {'host ms/step':>12}" + (f" {'GPU ms/step':>11}" if device == "cuda" else ""))
    for op in operators:
        line = f"{op['operator'][:48]:<48} {op['calls_per_step']:>10.1f} {op['host_ms_per_step']:>12.2f}"
        if device == "cuda":
            line += f" {op['gpu_ms_per_step']:>11.2f}"
        print(line)
    result = {"device": device, "path": path, "context": args.context, "batch": args.batch, "steps": args.steps,
              "unprofiled_s": plain, "step_ms": 1000 * plain / args.steps, "profiled_s": profiled, "operators": operators}
    if device == "cuda":
        result["calls_per_step"] = {}
        for name in ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernel", "aten::item",
                     "aten::_local_scalar_dense"):
            match = [e for e in events if e.key == name]
            if match:
                result["calls_per_step"][name] = match[0].count / args.steps
                print(f"{name}: {match[0].count / args.steps:.1f} a step")
        result["gpu_busy_ms_per_step"] = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1000 / args.steps
        print(f"GPU busy {result['gpu_busy_ms_per_step']:.2f} ms a step of {1000 * profiled / args.steps:.1f} ms (profiled)")
    write_result("profile_decode", args, result, args.json_path)


if __name__ == "__main__":
    main()
