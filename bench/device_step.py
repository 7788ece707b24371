"""The decode step's host side, on the CPU: what the host spends preparing a step, and how many
tensor operations a step dispatches, for the device path (engine/device_step.py) beside the
per-layer host path, on a 30-layer random model whose compute is negligible (SmolLM2's heads: 9
query and 3 KV heads of 64, a hidden size of 72).

    python bench/device_step.py                                   # batch 64 over a 1K document
    python bench/device_step.py --batch 16 --context 4096 --steps 20 --json out.json
    python bench/device_step.py --policy scores --budget 8         # selective mode, 8 blocks a query

Host preparation: per decode step, the wall time of everything the device path does on the host
(blocks made room for, the pool's bookkeeping, the plan packed into the step's buffer), that is
the step's time less its device work and readback, measured around them; twice: with the torch
backend's step run between (on this CPU, the same core: the host's work after it finds its
caches cold) and with no device work between steps after each buffer's first (fixed tokens), as a
GPU leaves the host's core to the host. Operations: aten
operations dispatched during one steady decode step (TorchDispatchMode), per layer, for both
paths. The torch backend runs the attention (the Triton interpreter would count its emulation).
Prompt chunks: the document prefilled in chunks of `--chunk` tokens on each path, the host's reads
of tensor values (engine/hostreads.py) and the aten operations per chunk per layer. With
`--policy`, selective mode: each layer's blocks chosen on the device within `--budget` blocks a
query (its prompts run on the per-layer path, which keeps their queries: no prompt-chunk counts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from common import write_result  # noqa: E402

LAYERS = 30


def model():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=72, intermediate_size=64, num_hidden_layers=LAYERS,
                                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=320,
                                  max_position_embeddings=65536)
    return AutoModelForCausalLM.from_config(config).eval()


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


SELECTION: tuple[str, int] | None = None  # selective mode's policy and budget (--policy, --budget)


def engine_for(step: str, pool_mib: float, batch: int):
    from kvpage_cli.engine import Engine, EngineConfig

    extra = dict(mode="selective", policy=SELECTION[0]) if SELECTION else {}
    engine = Engine.load(model(), EngineConfig(device="cpu", backend="torch", kv_path="pool", pool_mib=pool_mib,
                                               decode_step=step, kv_cache=False, max_batch=batch, **extra))
    if SELECTION:
        engine.set_selection(*SELECTION)
    return engine


def requests(engine, batch: int, context: int, new_tokens: int):
    from kvpage_cli.engine.engine import Request

    doc = engine.prefill([(i * 7919) % 300 + 10 for i in range(context)])
    return [Request(engine.fork(doc), [5 + i % 200], max_new_tokens=new_tokens, stop=()) for i in range(batch)]


def steady(engine, batch: int, context: int, steps: int):
    """The run's generator advanced past its prompt step and first decode step."""
    run = engine.run(requests(engine, batch, context, steps + 4))
    for _ in range(2 * batch):
        next(run)
    return run


def host_preparation(batch: int, context: int, steps: int, pool_mib: float, device_work: bool = True) -> list[float]:
    """Seconds of host work per device decode step: decode() less its _run (upload, device work,
    readback). device_work False: _run does no work after a buffer's first step (it returns
    fixed tokens), as on a GPU, where the step's work runs on the device: on a CPU the torch
    backend's step runs on the core that times the host, and the host's work after it finds
    its caches cold."""
    engine = engine_for("eager", pool_mib, batch)
    device = engine.device_decode
    spent = {"run": 0.0}
    real_run = device._run

    def run_step(bufs, count):
        if device_work or bufs.logits is None:
            return real_run(bufs, count)
        return 0.0, [7] * count, 0

    def timed_run(bufs, count):
        started = time.perf_counter()
        try:
            return run_step(bufs, count)
        finally:
            spent["run"] += time.perf_counter() - started

    device._run = timed_run
    decode = device.decode
    host = []

    def timed_decode(reqs):
        spent["run"] = 0.0
        started = time.perf_counter()
        result = decode(reqs)
        host.append(time.perf_counter() - started - spent["run"])
        return result

    device.decode = timed_decode
    run = steady(engine, batch, context, steps)
    host.clear()
    for _ in range(steps * batch):
        next(run)
    return host


def ops_per_layer(step: str, batch: int, context: int, pool_mib: float) -> float:
    engine = engine_for(step, pool_mib, batch)
    run = steady(engine, batch, context, 4)
    with Ops() as ops:
        for _ in range(batch):
            next(run)
    if step != "host":
        assert engine.device_decode.resident.active, "the step did not run on the device path"
        if SELECTION:
            assert any(key[2] is not None for key in engine.device_decode.buffers), "no step chose on the device"
    return ops.count / LAYERS


def prefill_counts(step: str, context: int, chunk: int, pool_mib: float) -> tuple[float, float, dict]:
    """(host reads of tensor values per prompt chunk, aten ops per chunk per layer, the reads'
    sites) while the document is prefilled in chunks of `chunk` tokens. The torch backend's block
    states on CPU tensors take torch's CPU flash kernel, whose masks are chosen on the host (reads
    a GPU's tensors do not take: there the same function multiplies on the device)."""
    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.engine.hostreads import HostReads

    def prefilled(counter):  # a fresh engine each time, so that both counts see the same work
        engine = Engine.load(model(), EngineConfig(device="cpu", backend="torch", kv_path="pool", pool_mib=pool_mib,
                                                   decode_step=step, kv_cache=False, prefill_chunk=chunk))
        with counter:
            engine.prefill([(i * 7919) % 300 + 10 for i in range(context)])
        if step != "host":
            assert engine.device_decode.prefilled_rows == context, "the chunks did not run on the device path"
        return counter

    chunks = -(-context // chunk)
    reads, ops = prefilled(HostReads()), prefilled(Ops())  # apart: nested, one would name the other's frames
    return reads.count / chunks, ops.count / chunks / LAYERS, dict(reads.sites.most_common(5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pool-mib", type=float, default=4096.0)
    parser.add_argument("--chunk", type=int, default=256, help="prompt chunk tokens for the prefill counts")
    parser.add_argument("--policy", choices=["quest", "scores"], default=None,
                        help="selective mode with this policy (the device chooses each layer's blocks)")
    parser.add_argument("--budget", type=int, default=8, help="selective mode's blocks a query reads")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    global SELECTION
    SELECTION = (args.policy, args.budget) if args.policy else None
    torch.set_num_threads(1)
    host = host_preparation(args.batch, args.context, args.steps, args.pool_mib)
    alone = host_preparation(args.batch, args.context, args.steps, args.pool_mib, device_work=False)
    device_ops = ops_per_layer("eager", args.batch, args.context, args.pool_mib)
    host_ops = ops_per_layer("host", args.batch, args.context, args.pool_mib)
    device_reads = device_chunk_ops = host_reads = host_chunk_ops = None
    device_sites = host_sites = {}
    if not SELECTION:
        device_reads, device_chunk_ops, device_sites = prefill_counts("eager", args.context, args.chunk, args.pool_mib)
        host_reads, host_chunk_ops, host_sites = prefill_counts("host", args.context, args.chunk, args.pool_mib)
    result = {
        "batch": args.batch, "context": args.context, "layers": LAYERS, "steps": len(host),
        "policy": args.policy, "budget_blocks": args.budget if args.policy else None,
        "host_prep_us_median": statistics.median(host) * 1e6, "host_prep_us_p90": sorted(host)[int(0.9 * len(host))] * 1e6,
        "host_prep_alone_us_median": statistics.median(alone) * 1e6,
        "host_prep_alone_us_p90": sorted(alone)[int(0.9 * len(alone))] * 1e6,
        "aten_ops_per_layer_device_step": device_ops, "aten_ops_per_layer_host_path": host_ops,
        "prefill_chunk": args.chunk, "prefill_host_reads_per_chunk_device": device_reads,
        "prefill_host_reads_per_chunk_host_path": host_reads, "prefill_aten_ops_per_chunk_layer_device": device_chunk_ops,
        "prefill_aten_ops_per_chunk_layer_host_path": host_chunk_ops,
        "prefill_read_sites_device": device_sites, "prefill_read_sites_host_path": host_sites,
    }
    mode = f", selective mode ({args.policy}, {args.budget} blocks a query)" if args.policy else ""
    print(f"batch {args.batch}, {args.context}-token document, {LAYERS} layers, {len(host)} steps{mode}")
    print(f"host preparation per device step: median {result['host_prep_us_median']:.0f} us, "
          f"p90 {result['host_prep_us_p90']:.0f} us (the torch backend's step run between on the same core); "
          f"with no device work between steps (as a GPU runs it): median {result['host_prep_alone_us_median']:.0f} us, "
          f"p90 {result['host_prep_alone_us_p90']:.0f} us")
    print(f"aten ops per decode step per layer: device step {device_ops:.1f}, host path {host_ops:.1f}")
    if not SELECTION:
        print(f"prompt chunks of {args.chunk} tokens: host reads per chunk: device {device_reads:.1f}, host path "
              f"{host_reads:.1f}; aten ops per chunk per layer: device {device_chunk_ops:.1f}, host path "
              f"{host_chunk_ops:.1f}")
        print(f"  the device path's reads by site: {device_sites}")
    write_result("device_step", args, result, args.json_path)


if __name__ == "__main__":
    main()
