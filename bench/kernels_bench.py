"""Paged decode attention on CUDA, measured beside its peers in one run.

For each shape and context length: the split-KV kernel (and kernel + merge) over a pool whose slots
are shuffled and ~10% invalid, reported as GB/s over the bytes of the valid slots it reads; the
device-to-device copy bandwidth of the same GPU (`Tensor.copy_` of a large buffer, read + write
bytes); torch SDPA on the same K/V made contiguous; and a copy-overlap run: blocks copied
host (pinned) -> pool on a side stream while the kernel runs on the default stream, reporting the
share of the copy time that was hidden. Times are CUDA-event medians after a device sync.

    python bench/kernels_bench.py [--json PATH]

Without CUDA it prints "no CUDA: skipped" and exits 0 (nothing is timed under the interpreter), and
writes a result only where --json names a file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from kvpage_kernels import BLOCK_TOKENS

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_option, write_result  # noqa: E402

SHAPES = [
    # (name, query heads, KV heads, head_dim)
    ("gemma3-270m-like", 4, 1, 256),
    ("hq32-hkv8-d128", 32, 8, 128),
]
CONTEXTS = [32 * 1024, 128 * 1024]
INVALID_SHARE = 0.10
DTYPE = torch.bfloat16


def _median_ms(fn, *, warmup: int = 3, runs: int = 15) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph_ms(fn, *, calls: int = 20) -> float | None:
    """Median GPU time of one call, replayed from a CUDA graph of `calls` calls (no launch gaps)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as e:  # report eager times only
        print(f"CUDA graph capture failed ({e}); reporting eager times only")
        return None
    return _median_ms(graph.replay) / calls


def _gbps(num_bytes: int, ms: float | None) -> float | None:
    if ms is None:
        return None
    return num_bytes / (ms * 1e-3) / 1e9


def _copy_bandwidth(num_bytes: int = 1 << 30) -> dict:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return {"bytes": num_bytes, "ms": ms, "gbps_read_plus_write": _gbps(2 * num_bytes, ms)}


def _build_pool(context: int, num_kv_heads: int, head_dim: int, spare_slots: int, *, seed: int = 0,
                device: str = "cuda"):
    """Pool with the context's blocks in shuffled slots, ~10% invalid slots, and spare slots.

    k_pool, v_pool: [S, Hkv, 64, D]; the block list names every non-spare slot (invalid ones
    interleaved, as selective mode leaves non-resident blocks in the list) in logical order.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = -(-context // BLOCK_TOKENS)
    num_invalid = round(num_blocks * INVALID_SHARE / (1 - INVALID_SHARE))
    num_listed = num_blocks + num_invalid
    num_slots = num_listed + spare_slots
    shape = (num_slots, num_kv_heads, BLOCK_TOKENS, head_dim)
    k_pool = torch.randn(shape, dtype=DTYPE, device=device)
    v_pool = torch.randn(shape, dtype=DTYPE, device=device)
    slots = torch.randperm(num_listed, generator=g)  # entry i -> slot
    invalid_entries = torch.randperm(num_listed, generator=g)[:num_invalid]
    valid = torch.ones(num_slots, dtype=torch.int8)
    valid[slots[invalid_entries]] = 0
    valid[num_listed:] = 0  # spare slots: copy targets, never read
    is_block = torch.ones(num_listed, dtype=torch.bool)
    is_block[invalid_entries] = False
    block_pos = torch.zeros(num_listed, dtype=torch.int32)
    block_pos[is_block] = torch.arange(num_blocks, dtype=torch.int32)
    return dict(
        k_pool=k_pool,
        v_pool=v_pool,
        valid=valid.to(device),
        slot_ids=slots.to(torch.int32)[None].to(device),
        block_pos=block_pos[None].to(device),
        seq_lens=torch.tensor([context], dtype=torch.int32, device=device),
        num_blocks=num_blocks,
        num_listed=num_listed,
    )


def _contiguous_kv(pool: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid blocks in logical order: [1, Hkv, N, D] each."""
    listed = pool["slot_ids"][0].long()
    readable = pool["valid"][listed] != 0
    order = torch.argsort(pool["block_pos"][0][readable])
    slots = listed[readable][order]
    k = pool["k_pool"][slots].permute(1, 0, 2, 3).flatten(1, 2)[None].contiguous()
    v = pool["v_pool"][slots].permute(1, 0, 2, 3).flatten(1, 2)[None].contiguous()
    return k, v


def _bench_shape(kk, name: str, num_q_heads: int, num_kv_heads: int, head_dim: int, context: int,
                 copy_info: dict) -> dict:
    spare = 256
    pool = _build_pool(context, num_kv_heads, head_dim, spare)
    q = torch.randn(1, num_q_heads, head_dim, dtype=DTYPE, device="cuda")
    scale = head_dim**-0.5
    args = (q, pool["k_pool"], pool["v_pool"], pool["valid"], pool["slot_ids"], pool["block_pos"], pool["seq_lens"])
    num_splits = kk.default_num_splits(pool["num_listed"])
    elem = torch.finfo(DTYPE).bits // 8
    valid_bytes = 2 * pool["num_blocks"] * num_kv_heads * BLOCK_TOKENS * head_dim * elem

    def kernel():
        return kk.paged_decode_attention(*args, scale=scale, num_splits=num_splits)

    def decode():
        out, lse = kernel()
        return kk.merge_attention_states(out, lse, dim=1)

    # eager: what one engine step sees (launcher checks included); graph: the GPU work alone
    kernel_ms = _median_ms(kernel)
    decode_ms = _median_ms(decode)
    kernel_graph_ms = _graph_ms(kernel)
    decode_graph_ms = _graph_ms(decode)

    k, v = _contiguous_kv(pool)
    q4 = q[:, :, None, :]  # [1, Hq, 1, D]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    sdpa_ms = _median_ms(sdpa)
    merged, _ = decode()
    max_diff = (merged - sdpa()[:, :, 0].float()).abs().max().item()
    k = v = None  # frees the contiguous copy before the copy benchmark

    overlap = _copy_overlap(kernel, kernel_ms, pool, spare)
    return {
        "shape": name,
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": str(DTYPE).removeprefix("torch."),
        "context_tokens": context,
        "num_splits": num_splits,
        "valid_bytes": valid_bytes,
        "kernel_eager_ms": kernel_ms,
        "kernel_eager_gbps": _gbps(valid_bytes, kernel_ms),
        "kernel_plus_merge_eager_ms": decode_ms,
        "kernel_ms": kernel_graph_ms,
        "kernel_gbps": _gbps(valid_bytes, kernel_graph_ms),
        "kernel_plus_merge_ms": decode_graph_ms,
        "kernel_plus_merge_gbps": _gbps(valid_bytes, decode_graph_ms),
        "sdpa_contiguous_ms": sdpa_ms,
        "sdpa_contiguous_gbps": _gbps(valid_bytes, sdpa_ms),
        "device_copy_gbps_read_plus_write": copy_info["gbps_read_plus_write"],
        "kernel_share_of_copy_bandwidth": _gbps(valid_bytes, kernel_graph_ms or kernel_ms)
        / copy_info["gbps_read_plus_write"],
        "max_abs_diff_vs_sdpa": max_diff,
        "copy_overlap": overlap,
    }


def _copy_overlap(kernel, kernel_ms: float, pool: dict, spare: int) -> dict:
    """Copy `spare` blocks host -> spare pool slots on a side stream while kernels run."""
    first = pool["num_listed"]
    k_dst = pool["k_pool"][first : first + spare]
    v_dst = pool["v_pool"][first : first + spare]
    k_src = torch.empty(k_dst.shape, dtype=k_dst.dtype, pin_memory=True).normal_()
    v_src = torch.empty(v_dst.shape, dtype=v_dst.dtype, pin_memory=True).normal_()
    side = torch.cuda.Stream()

    def copy():
        k_dst.copy_(k_src, non_blocking=True)
        v_dst.copy_(v_src, non_blocking=True)

    copy_ms = _median_ms(copy)
    reps = max(1, round(copy_ms / max(kernel_ms, 1e-3)))

    def kernels():
        for _ in range(reps):
            kernel()

    kernels_ms = _median_ms(kernels)

    def both():
        start = torch.cuda.Event()
        start.record()
        side.wait_event(start)
        with torch.cuda.stream(side):
            copy()
            done = torch.cuda.Event()
            done.record(side)
        kernels()
        torch.cuda.current_stream().wait_event(done)

    both_ms = _median_ms(both)
    hidden = (copy_ms + kernels_ms - both_ms) / copy_ms
    copy_bytes = k_src.numel() * k_src.element_size() * 2
    return {
        "copy_blocks": spare,
        "copy_bytes": copy_bytes,
        "copy_ms": copy_ms,
        "copy_h2d_gbps": _gbps(copy_bytes, copy_ms),
        "kernel_launches": reps,
        "kernels_ms": kernels_ms,
        "both_ms": both_ms,
        "copy_share_hidden": max(0.0, min(1.0, hidden)),
    }


def run(args: argparse.Namespace) -> dict:
    """Run every measurement; return the results, written by write_result (a skipped run only to
    --json's file)."""
    results = _run() if torch.cuda.is_available() else None
    if results is None:
        print("no CUDA: skipped")
        results = {"skipped": "no CUDA"}
    if args.json_path or "skipped" not in results:
        write_result("kernels_bench", args, results, args.json_path)
    return results


def _run() -> dict:
    import kvpage_kernels as kk

    if not kk.HAS_TRITON:
        print("no Triton: skipped")
        return {"skipped": "no Triton"}
    copy_info = _copy_bandwidth()
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "device_copy": copy_info,
        "decode": [],
    }
    for name, num_q_heads, num_kv_heads, head_dim in SHAPES:
        for context in CONTEXTS:
            row = _bench_shape(kk, name, num_q_heads, num_kv_heads, head_dim, context, copy_info)
            results["decode"].append(row)
            graph_gbps = row["kernel_gbps"] or float("nan")
            print(
                f"{name:18s} ctx={context:>6d} splits={row['num_splits']:>3d} "
                f"kernel {graph_gbps:.0f} GB/s (eager {row['kernel_eager_ms']:.3f} ms, "
                f"{row['kernel_eager_gbps']:.0f} GB/s) | "
                f"+merge eager {row['kernel_plus_merge_eager_ms']:.3f} ms | "
                f"sdpa {row['sdpa_contiguous_gbps']:.0f} GB/s | "
                f"d2d copy {copy_info['gbps_read_plus_write']:.0f} GB/s | "
                f"copy hidden {row['copy_overlap']['copy_share_hidden']:.0%} | "
                f"max|diff| {row['max_abs_diff_vs_sdpa']:.1e}"
            )
            torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_option(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
