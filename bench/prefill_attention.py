"""Prefill attention: the native bfloat16 kernel (prefill.c) beside torch's float32 flash attention, in one run.

R query rows per KV head (a prefill chunk's tokens times the query heads a KV head serves) over S
keys, every key visible, SmolLM2's heads by default (3 KV heads of 64); K and V are bfloat16, as
the store keeps them beside quantized weights. The peer is what the native backend ran before:
torch's CPU flash attention in float32 over the same values (K and V converted, as it was
called). Where the CPU has AMX, the native kernel runs both ways, on AMX tiles ("native") and with
the AVX512-BF16 dot products ("dot products"). Reported per shape: the median time of a call, the
work it did as fp32-equivalent
GFLOP/s (4 R S D per KV head, computed), the time against torch's, and how far each result is
from float64 attention, as a share of the largest output.

    python bench/prefill_attention.py
    python bench/prefill_attention.py --rows 45,240,1536 --keys 6500 --heads 1,256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, median_seconds, table, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="3,45,240,1536", help="query rows per KV head")
    parser.add_argument("--keys", default="1024,6500", help="keys every row sees")
    parser.add_argument("--heads", default="3,64", help="KV heads, head dim")
    parser.add_argument("--repeats", type=int, default=20)
    add_json_option(parser)
    args = parser.parse_args()

    import torch

    from kvpage_cli.engine import native
    from kvpage_cli.engine.home import default_home

    lib = native.load(default_home())
    if not native.has_bf16_prefill(lib):
        sys.exit("this CPU has no AVX512-BF16: prefill.c does not run here")
    amx = native.prefill_amx(lib, True)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    num_kv_heads, head_dim = map(int, args.heads.split(","))
    scale = head_dim ** -0.5
    rows_out = []
    for keys in map(int, args.keys.split(",")):
        for rows in map(int, args.rows.split(",")):
            gen = torch.Generator().manual_seed(rows * 7 + keys)
            qh = torch.randn(num_kv_heads, rows, head_dim, generator=gen) * 2
            k = (torch.randn(num_kv_heads, keys, head_dim, generator=gen) * 2).bfloat16()
            v = torch.randn(num_kv_heads, keys, head_dim, generator=gen).bfloat16()
            logits = (qh.double() @ k.double().transpose(1, 2)) * scale
            truth = torch.softmax(logits, -1) @ v.double()

            def peer():
                return flash(qh.unsqueeze(0), k.float().unsqueeze(0), v.float().unsqueeze(0), scale=scale)[0][0]

            def ours():
                return native.attend_all_bf16(lib, qh, [(k, v)], scale)[0]

            work = 4 * num_kv_heads * rows * keys * head_dim
            row = {"keys": keys, "rows": rows}
            systems = (("torch", peer, True), ("native", ours, True), ("dot", ours, False))
            for name, call, tiles in systems[:3 if amx else 2]:
                native.prefill_amx(lib, tiles)  # the kernel's way to multiply, set before it is timed
                seconds = median_seconds(call, args.repeats)
                row[f"{name}_ms"] = 1e3 * seconds
                row[f"{name}_gflops"] = work / seconds / 1e9
                row[f"{name}_error"] = float((call().double() - truth).abs().max() / truth.abs().max())
            native.prefill_amx(lib, True)
            row["torch_ratio"] = row["torch_ms"] / row["native_ms"]
            if amx:
                row["dot_ratio"] = row["dot_ms"] / row["native_ms"]
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    systems = ("torch", "native", "dot") if amx else ("torch", "native")
    shown = [{**r, **{f"{key}_error_shown": f"{r[key + '_error']:.2e}" for key in systems},
              **{f"{key}_ms_shown": f"{r[key + '_ms']:.3f}" for key in systems}} for r in rows_out]
    columns = [("keys", "keys"), ("rows", "rows"), ("torch_ms_shown", "torch ms"), ("native_ms_shown", "native ms")]
    columns += [("dot_ms_shown", "dot products ms"), ("dot_ratio", "x dot products")] if amx else []
    columns += [("torch_ratio", "x torch"), ("torch_gflops", "torch GFLOP/s"), ("native_gflops", "native GFLOP/s"),
                ("torch_error_shown", "torch error"), ("native_error_shown", "native error")]
    columns += [("dot_error_shown", "dot products error")] if amx else []
    print(("native: AMX tiles; dot products: the same kernel with AVX512-BF16 dot products\n" if amx else "")
          + table(shown, columns))
    print("GFLOP/s: 4 R S D per KV head over the median time (computed). error: the largest difference from float64 "
          "attention over the largest output.")
    write_result("prefill_attention", args, rows_out, args.json_path)


if __name__ == "__main__":
    main()
