"""Short prompt segments over a long context: the native decode kernel (the segment's rows as
decode queries, one call) beside torch's flash attention, in one run.

The default model on its defaults prefills the sample contract (4,890 tokens); then T query rows
at the context's end attend it in every layer, through each path (the engine's own dispatch,
`prefill_query_rows` set to route them), called alternately. Reported per T: the median time of
the 30 layers' calls, the arithmetic rate (4 x T x keys x heads x head dim, computed) and the
ratio, and the largest difference between the two outputs against the largest output.

    python bench/prefill_rows.py --rows 1,2,4,8,16,24,32,48,64 --json bench/results/prefill_rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,24,32,48,64")
    parser.add_argument("--tokens", type=int, default=4890)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    from kvpage_cli.engine import Engine, EngineConfig

    engine = Engine.load("smollm2", EngineConfig(kv_dtype=args.kv_dtype))
    if engine.backend.name != "native":
        raise SystemExit(f"the native kernels are unavailable here (backend {engine.backend.name})")
    ids = engine.tokenizer((REPO / "samples" / "contract.txt").read_text())["input_ids"][:args.tokens]
    ctx = engine.prefill(ids)
    spec, threshold = engine.spec, engine.backend.prefill_query_rows
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"{engine.name}, {engine.kv_dtype_name} KV, {len(ids):,} tokens of context, {spec.num_layers} layers a call; "
          f"the engine routes segments of up to {threshold} rows to the native kernel")
    for count in [int(r) for r in args.rows.split(",")]:
        q = torch.randn(count, spec.num_heads, spec.head_dim, generator=generator)
        start = len(ids) - count

        def attend(rows: int) -> list[torch.Tensor]:
            engine.backend.prefill_query_rows = rows
            return [engine.dispatch._prefill(layer, q, start, ctx) for layer in range(spec.num_layers)]

        native, flash = attend(count), attend(0)
        error = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(native, flash))
        times = {"native": [], "flash": []}
        for _ in range(args.repeats):
            for name, rows in (("native", count), ("flash", 0)):
                started = time.perf_counter()
                attend(rows)
                times[name].append(time.perf_counter() - started)
        engine.backend.prefill_query_rows = threshold
        medians = {name: statistics.median(t) for name, t in times.items()}
        flops = 4 * count * len(ids) * spec.num_heads * spec.head_dim * spec.num_layers
        row = {"rows": count, "native_ms": medians["native"] * 1e3, "flash_ms": medians["flash"] * 1e3,
               "native_gflops": flops / medians["native"] / 1e9, "flash_gflops": flops / medians["flash"] / 1e9,
               "native_x_flash": medians["flash"] / medians["native"], "max_rel_difference": error}
        rows_out.append(row)
        print(f"  {count:4d} rows: native {row['native_ms']:8.2f} ms ({row['native_gflops']:5.0f} GFLOP/s)  "
              f"flash {row['flash_ms']:8.2f} ms ({row['flash_gflops']:5.0f})  native {row['native_x_flash']:.2f}x  "
              f"difference {error:.1e}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": vars(args), "kv_dtype": engine.kv_dtype_name,
                                                    "threshold": threshold, "rows": rows_out}, indent=2))


if __name__ == "__main__":
    main()
