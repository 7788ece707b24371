"""A decode step's weight products at 1, 4, 16 and 64 rows (one row per sequence of a batch):
kvpage's native few-row kernel on the model's own weights (SmolLM2: the GGUF file's Q4_1 and Q8_0
blocks, `QuantMatrix.matmul`), its rows' path and, where the CPU has AMX, its tiles (8 rows or
more), and its long-chunk path (each matrix dequantized to float32, then `quant.matmul_nt`:
oneDNN, or MKL on CPUs without AVX-512; what a prompt chunk of more than 64 rows took before
tiles), beside torch's products of the same matrices dequantized once, in float32 (what
transformers runs) and in bfloat16 (oneDNN; AMX where the CPU has it), in one run. `--rows
256,1024` sets them side by side at a prompt chunk's rows.

Per row count: the median time of one step's products (every layer's Q/K/V, O, gate/up and down,
then the LM head), its GFLOP/s, and its throughput against the same system at one row ("x 1 row":
rows x t(1 row) / t(rows)). The products are most of a decode step: what they gain here with more
rows is what a batch can gain from reading each weight once for many sequences (the README's batch
section sets it beside `bench/batch.py`'s steps).

    python bench/decode_gemm.py
    python bench/decode_gemm.py --rows 1,16 --json out.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, median_seconds, table, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", default="1,4,16,64", help="rows of each product (sequences in a batch)")
    parser.add_argument("--repeats", type=int, default=7)
    add_json_option(parser)
    args = parser.parse_args()

    import torch

    from kvpage_cli.engine import Engine, EngineConfig
    from kvpage_cli.engine.model.quant import QuantLinear

    engine = Engine.load(args.model, EngineConfig(device="cpu"))
    runner = engine.runner
    lib = runner.native
    linears = [lin for layer in runner.layers for lin in (layer.qkv_t, layer.o_t, layer.gate_up_t, layer.down_t)]
    head = runner.lm_head_t
    if lib is None or not all(isinstance(lin, QuantLinear) for lin in linears + [head]):
        raise SystemExit(f"{args.model} is not held in a block format here "
                         "(its products are not kvpage's few-row kernel)")
    matrices = [part for lin in linears for part in lin.parts]
    floats = [m.dequantize(lib) for m in matrices]
    head_float = [p.dequantize(lib) for p in head.parts]
    bf16 = [w.bfloat16() for w in floats]
    head_bf16 = [w.bfloat16() for w in head_float]
    macs = sum(m.rows * m.cols for m in matrices) + sum(p.rows * p.cols for p in head.parts)
    formats = sorted({m.format for m in matrices + head.parts})

    def native(xs):
        for m in matrices + head.parts:
            m.matmul(lib, xs[m.cols], True, tiles=True)  # on tiles where qgemm_tiles is on (below)

    def dequantized(xs):
        for m in matrices + head.parts:
            m.matmul(lib, xs[m.cols], False)

    def torch_products(weights, head_weights, dtype):
        def run(xs):
            xs = {cols: x.to(dtype) for cols, x in xs.items()}
            for w in weights + head_weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)
        return run

    from kvpage_cli.engine import native as kernels

    tiles = kernels.qgemm_tiles(lib)
    systems = [("kvpage rows' path (" + "/".join(formats) + ")", native, False)]
    if tiles:
        systems.append(("kvpage AMX tiles (" + "/".join(formats) + ")", native, True))
    from kvpage_cli.engine.model.quant import _ONEDNN_LINEAR

    systems.append((f"kvpage dequantized, {'oneDNN' if _ONEDNN_LINEAR is not None else 'MKL'}", dequantized, False))
    systems += [("torch float32", torch_products(floats, head_float, torch.float32), None),
                ("torch bfloat16", torch_products(bf16, head_bf16, torch.bfloat16), None)]
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for name, call, on_tiles in systems:
        if on_tiles is not None:
            kernels.qgemm_tiles(lib, on_tiles)  # set before the system is timed
        one = None
        for rows in rows_list:
            xs = {cols: torch.randn(rows, cols) for cols in {m.cols for m in matrices + head.parts}}
            seconds = median_seconds(lambda call=call, xs=xs: call(xs), args.repeats)
            one = seconds if rows == 1 else one
            results.append({"system": name, "rows": rows, "step_ms": seconds * 1e3,
                            "gflop_s": 2 * macs * rows / seconds / 1e9,
                            "x_1_row_x": rows * one / seconds if one else None})
            print(f"{name}: {rows} rows {seconds * 1e3:.2f} ms", file=sys.stderr, flush=True)

    print(f"{args.model}: one decode step's weight products ({len(runner.layers)} layers and the LM head, "
          f"{macs / 1e6:.0f}M "
          f"multiply-adds per row), {torch.get_num_threads()} threads, median of {args.repeats} (measured)")
    print(table(results, [("system", "system"), ("rows", "rows"), ("step_ms", "ms per step"),
                          ("gflop_s", "GFLOP/s"), ("x_1_row_x", "x 1 row")]))
    write_result("decode_gemm", args, {"model": args.model, "threads": torch.get_num_threads(), "rows": results},
                 args.json_path)


if __name__ == "__main__":
    main()
