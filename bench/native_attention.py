"""The native CPU decode attention kernel per KV element type, beside torch SDPA, in one run.

Q decode queries (SmolLM2's shape by default: 9 query heads over 3 KV heads of 64) over the same
N random blocks of one layer (Q > 1: forks of one document decoding together, each block read
for all of them), read in place through the address table as the store path reads them, with
the KV blocks in float32, bfloat16 and int8 (with their rows' scales, store.py), and where the
CPU has AMX bfloat16 on tiles too (blocks read by four queries or more; fewer stay fp32
products), a block at a time and in passes of up to TILE_RUN_BLOCKS blocks (what a batch's
generated tokens take); beside it torch's scaled_dot_product_attention over the same values as
one contiguous float32 K/V. A native call is the per-block states and their merge into each
query's output (what a decode step does per layer; SDPA does both in one). Reported per row:
the median time of a call, the bytes of K/V the call reads (the blocks' bytes, measured from the
tensors) over that time, and the time against SDPA's. A kernel bound by memory takes less time
for fewer bytes; one bound by its arithmetic takes the same.

    python bench/native_attention.py --blocks 16,64,128 --queries 1,16 --json out.json
    python bench/native_attention.py --layout store --layers 30   # a decode step's 30 layers, from memory

--layout: blocks in one piece ([N, Hkv, 64, D], as the pool's slots lie) or as the store's arenas
lie ([Hkv, N, 64, D], each KV head's blocks together). --layers L: L copies of the layer, called
one after the other as a decode step calls its layers, so that a call reads blocks from memory
rather than from the cache the previous call filled; the time reported is per layer call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, median_seconds, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="16,64,128", help="blocks of 64 tokens in the context")
    parser.add_argument("--queries", default="1", help="decode queries reading the same blocks")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--layout", choices=("pool", "store"), default="pool")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    add_json_option(parser)
    args = parser.parse_args()

    import torch

    from kvpage_cli.engine import BLOCK_TOKENS, native
    from kvpage_cli.engine.attention.backend import DecodePlan, LayerBlocks, NativeBackend
    from kvpage_cli.engine.config import TILE_RUN_BLOCKS
    from kvpage_cli.engine.home import default_home
    from kvpage_cli.engine.kv.store import decode_rows, encode_rows, head_addresses, row_scales, stored_block_shape

    if args.threads:
        torch.set_num_threads(args.threads)
    lib = native.load(default_home())
    num_heads, num_kv_heads, head_dim = map(int, args.heads.split(","))
    scale = head_dim ** -0.5
    results = []
    for count, queries in [(c, n) for c in map(int, args.blocks.split(",")) for n in map(int, args.queries.split(","))]:
        gen = torch.Generator().manual_seed(count)
        values = torch.randn(2, count, num_kv_heads, BLOCK_TOKENS, head_dim, generator=gen)
        stored = torch.zeros(2, count, *stored_block_shape(num_kv_heads, head_dim, torch.int8), dtype=torch.int8)
        rows, scales = encode_rows(values)
        stored[:, :, :, :BLOCK_TOKENS] = rows
        row_scales(stored)[:] = scales
        decoded = decode_rows(stored).contiguous()
        kinds = {"float32": decoded, "bfloat16": decoded.bfloat16(), "int8": stored}
        block_dim = 0 if args.layout == "pool" else 1

        def laid_out(blocks: torch.Tensor) -> list[torch.Tensor]:
            """--layers copies of K/V blocks [2, N, Hkv, rows, D] in the chosen layout."""
            one = blocks if block_dim == 0 else blocks.transpose(1, 2)
            return [one.contiguous() for _ in range(args.layers)]

        every = (torch.arange(count, dtype=torch.int32), torch.arange(count, dtype=torch.int32))
        plan = DecodePlan.build([every] * queries, [count * BLOCK_TOKENS - 1] * queries)
        q = torch.randn(queries, num_heads, head_dim, generator=gen)
        # the peer: SDPA over the same values, one contiguous K/V [1, Hkv, T, D] for the Q queries
        k_all = decoded[0].permute(1, 0, 2, 3).reshape(1, num_kv_heads, -1, head_dim).contiguous()
        v_all = decoded[1].permute(1, 0, 2, 3).reshape(1, num_kv_heads, -1, head_dim).contiguous()
        peer_layers = [(k_all.clone(), v_all.clone()) for _ in range(args.layers)]

        def peer_step() -> None:
            for k, v in peer_layers:
                torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, None], k.expand(queries, -1, -1, -1), v.expand(queries, -1, -1, -1), scale=scale,
                    enable_gqa=True)

        sdpa = median_seconds(peer_step, args.repeats) / args.layers
        results.append({"blocks": count, "queries": queries, "kind": "torch SDPA (float32)", "ms": 1e3 * sdpa,
                        "bytes": 2 * k_all.numel() * 4, "gbs": 2 * k_all.numel() * 4 / sdpa / 1e9, "vs_sdpa": 1.0})
        tiles = native.prefill_amx(lib, True)
        ways = [(kind, blocks, 0) for kind, blocks in kinds.items()]
        if tiles:  # bfloat16 blocks read by four queries or more: AMX tiles, beside the fp32 products
            ways[2:2] = [("bfloat16", kinds["bfloat16"], 1), ("bfloat16", kinds["bfloat16"], TILE_RUN_BLOCKS)]
        for kind, blocks, on_tiles in ways:
            native.prefill_amx(lib, on_tiles > 0)  # set before the kernel is timed
            backend = NativeBackend(lib, num_heads, num_kv_heads, head_dim, scale, kind)
            copies = laid_out(blocks)
            layers = [LayerBlocks(head_addresses(c[0], block_dim), head_addresses(c[1], block_dim), None) for c in copies]
            states, lse = backend.states(plan.num_pairs, q.device)

            def step() -> None:
                for layer in layers:
                    backend.decode_states(q, plan, layer, 0, states, lse, on_tiles)
                    backend.merge(states, lse, plan)

            seconds = median_seconds(step, args.repeats) / args.layers
            nbytes = blocks.numel() * blocks.element_size()
            name = f"native {kind}" + {0: "", 1: " AMX"}.get(on_tiles, f" AMX, {on_tiles}-block passes")
            results.append({"blocks": count, "queries": queries, "kind": name, "ms": 1e3 * seconds,
                            "bytes": nbytes, "gbs": nbytes / seconds / 1e9, "vs_sdpa": sdpa / seconds})
    native.prefill_amx(lib, True)
    print(f"{'blocks':>6}  {'queries':>7}  {'kernel':>32}  {'ms':>7}  {'MiB read':>8}  {'GB/s':>5}  {'x SDPA':>6}")
    for row in results:
        print(f"{row['blocks']:>6}  {row['queries']:>7}  {row['kind']:>32}  {row['ms']:>7.3f}  {row['bytes'] / 2**20:>8.1f}  "
              f"{row['gbs']:>5.1f}  {row['vs_sdpa']:>6.2f}")
    print("x SDPA: SDPA's time / the kernel's (above 1: faster). GB/s: the K/V bytes read / the median time "
          "(the blocks' bytes once, however many queries read them).")
    write_result("native_attention", args, results, args.json_path)


if __name__ == "__main__":
    main()
