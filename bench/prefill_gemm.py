"""A prompt chunk's matrix products: oneDNN's fp32 linear op (what `quant.matmul_nt` calls on CPUs
with AVX-512) beside torch's default fp32 product (`x @ W.t()`, MKL on x86, what it calls on
others), in one run; the header says which one kvpage uses on this CPU.

Shapes are SmolLM2's long-chunk products by default (M prompt rows; Q/K/V together, O, gate and up
together, down). Reported per shape: the median time of each, GFLOP/s, the ratio, and the largest
difference between the two results against the largest |x| @ |W|^T (both sum fp32 products in
their own order).

    python bench/prefill_gemm.py
    python bench/prefill_gemm.py --rows 64,1024,4096 --shapes 576x960,2048x5632 --json out.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, median_seconds, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,1024,4096", help="prompt rows M")
    parser.add_argument("--shapes", default="576x960,576x576,576x3072,1536x576",
                        help="KxN: inputs x outputs of each weight matrix")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    add_json_option(parser)
    args = parser.parse_args()

    import torch

    from kvpage_cli.engine.model.quant import _ONEDNN_LINEAR

    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN: nothing to compare")
    onednn = torch.ops.mkldnn._linear_pointwise
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; kvpage multiplies through "
          f"{'oneDNN' if _ONEDNN_LINEAR is not None else 'MKL'} here; threads {torch.get_num_threads()}")
    results = []
    gen = torch.Generator().manual_seed(0)
    for m in map(int, args.rows.split(",")):
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            peer = median_seconds(lambda: x @ w.t(), args.repeats)
            ours = median_seconds(lambda: onednn(x, w, None, "none", [], ""), args.repeats)
            scale = float((x.abs() @ w.abs().t()).max())
            diff = float((onednn(x, w, None, "none", [], "") - x @ w.t()).abs().max())
            flop = 2 * m * k * n
            results.append({"rows": m, "k": k, "n": n, "torch_ms": 1e3 * peer, "onednn_ms": 1e3 * ours,
                            "torch_gflops": flop / peer / 1e9, "onednn_gflops": flop / ours / 1e9,
                            "ratio_x": peer / ours, "max_diff_rel": diff / scale})
    print(f"{'M':>5}  {'K x N':>11}  {'MKL ms':>8}  {'oneDNN ms':>9}  {'MKL GFLOP/s':>13}  {'oneDNN GFLOP/s':>14}  "
          f"{'x MKL':>7}  {'max diff / max |x||W|':>21}")
    for r in results:
        print(f"{r['rows']:>5}  {str(r['k']) + 'x' + str(r['n']):>11}  {r['torch_ms']:>8.2f}  {r['onednn_ms']:>9.2f}  "
              f"{r['torch_gflops']:>13.0f}  {r['onednn_gflops']:>14.0f}  {r['ratio_x']:>7.2f}  "
              f"{r['max_diff_rel']:>21.1e}")
    print("x MKL: MKL's time / oneDNN's (above 1: oneDNN faster).")
    write_result("prefill_gemm", args, results, args.json_path)


if __name__ == "__main__":
    main()
