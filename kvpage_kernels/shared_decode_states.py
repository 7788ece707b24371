"""Per-(block, query) decode states, each block read once for every query that reads it.

Decode queries that share a prefix (forks of one document) read the same blocks. The work is
listed as items, each one block (a pool slot at a logical position) with the queries that read
it, as pairs numbered item by item (CSR: item i owns pairs item_off[i] .. item_off[i+1]). One
program loads an item's K and V for one KV head once and computes the state of every pair from
them; `merge_ragged_states` then folds each query's pairs into its output.
"""

from __future__ import annotations

import torch

from ._checks import (
    ATTENTION_DTYPES,
    check_group,
    check_pool,
    check_same_device,
    check_scale_window,
    check_tensor,
    check_unit_last_stride,
    next_power_of_2,
)
from ._reference import attend, gather_blocks
from ._triton import jit, require_launchable, tl
from .constants import BLOCK_TOKENS

_LOG2E = 1.4426950408889634
POSITION_DTYPES = (torch.int32, torch.int64)


@jit
def _shared_decode_states_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, valid_ptr,
    item_slots_ptr, item_pos_ptr, item_off_ptr, pair_query_ptr, q_pos_ptr, q_end_ptr,
    out_ptr, lse_ptr,
    num_slots, qk_scale_log2, window,
    stride_qn, stride_qh,
    stride_ks, stride_kh, stride_kt,
    stride_vs, stride_vh, stride_vt,
    stride_valid,
    stride_op, stride_oh,
    stride_lp, stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # One program: one item (a block), one KV head; each of the item's pairs is one query's
    # GROUP query heads (rows of a [GROUP_PAD, HEAD_DIM] tile; padded rows are 0, never stored).
    item = tl.program_id(0)
    h = tl.program_id(1)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    q_heads = h * GROUP + offs_g

    slot = tl.load(item_slots_ptr + item)
    first = tl.load(item_pos_ptr + item).to(tl.int64) * BLOCK_T
    in_pool = (slot >= 0) & (slot < num_slots)
    flag = tl.load(valid_ptr + slot * stride_valid, mask=in_pool, other=0)
    readable = offs_t < tl.where(flag != 0, BLOCK_T, 0)  # [BLOCK_T]: all, or none when the slot is invalid
    # An invalid slot is never loaded: it may hold garbage, NaN included. Its pairs see no key.
    slot64 = tl.where(in_pool, slot, 0).to(tl.int64)
    # kt: [HEAD_DIM, BLOCK_T], v: [BLOCK_T, HEAD_DIM], loaded once for all the item's pairs
    kt = tl.load(
        k_pool_ptr + slot64 * stride_ks + h.to(tl.int64) * stride_kh
        + offs_t[None, :] * stride_kt + offs_d[:, None],
        mask=readable[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0,
    ).to(tl.float32)
    v = tl.load(
        v_pool_ptr + slot64 * stride_vs + h.to(tl.int64) * stride_vh
        + offs_t[:, None] * stride_vt + offs_d[None, :],
        mask=readable[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0,
    ).to(tl.float32)
    k_pos = first + offs_t

    pair_first = tl.load(item_off_ptr + item).to(tl.int64)  # int64 pair numbers: out offsets may pass 2**31
    pair_last = tl.load(item_off_ptr + item + 1).to(tl.int64)
    for pair in range(pair_first, pair_last):
        query = tl.load(pair_query_ptr + pair).to(tl.int64)
        q = tl.load(
            q_ptr + query * stride_qn + q_heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None], other=0.0,
        ).to(tl.float32)
        q_pos = tl.load(q_pos_ptr + query).to(tl.int64)
        key_hi = tl.minimum(q_pos, tl.load(q_end_ptr + query).to(tl.int64) - 1)  # last visible key
        key_lo = q_pos * 0  # first visible key
        if window > 0:
            key_lo = q_pos - window + 1
        keep = readable & (k_pos <= key_hi) & (k_pos >= key_lo)  # [BLOCK_T]

        s = tl.dot(q, kt, input_precision="ieee") * qk_scale_log2  # [GROUP_PAD, BLOCK_T], log2 domain
        s = tl.where(keep[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)
        seen = m > float("-inf")
        p = tl.exp2(s - tl.where(seen, m, 0.0)[:, None])  # 0 on every key of a row that sees none
        total = tl.sum(p, axis=1)
        acc = tl.dot(p, v, input_precision="ieee")  # [GROUP_PAD, HEAD_DIM]
        out = acc / tl.where(seen, total, 1.0)[:, None]
        lse = tl.where(seen, (m + tl.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(out_ptr + pair * stride_op + q_heads[:, None] * stride_oh + offs_d[None, :], out,
                 mask=g_mask[:, None])
        tl.store(lse_ptr + pair * stride_lp + q_heads * stride_lh, lse, mask=g_mask)


def _check_inputs(fn, q, k_pool, v_pool, valid, item_slots, item_pos, item_off, pair_query, q_pos, q_end,
                  scale, window, out, lse):
    num_slots, num_kv_heads, head_dim = check_pool(fn, k_pool, v_pool, valid)
    check_tensor(fn, "q", q, ndim=3, dtypes=ATTENTION_DTYPES)
    check_unit_last_stride(fn, "q", q)
    num_queries, num_q_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ValueError(f"{fn}: q head_dim {q_dim} differs from the pool's head_dim {head_dim}")
    group = check_group(fn, num_q_heads, num_kv_heads)
    for name, t in (("item_slots", item_slots), ("item_pos", item_pos), ("item_off", item_off),
                    ("pair_query", pair_query)):
        check_tensor(fn, name, t, ndim=1, dtypes=(torch.int32,))
        check_unit_last_stride(fn, name, t)
    num_items = item_slots.shape[0]
    if item_pos.shape[0] != num_items or item_off.shape[0] != num_items + 1:
        raise ValueError(
            f"{fn}: item_pos must be [I={num_items}] and item_off [I+1], got {tuple(item_pos.shape)} "
            f"and {tuple(item_off.shape)}"
        )
    for name, t in (("q_pos", q_pos), ("q_end", q_end)):
        check_tensor(fn, name, t, ndim=1, dtypes=POSITION_DTYPES)
        check_unit_last_stride(fn, name, t)
        if t.shape[0] != num_queries:
            raise ValueError(f"{fn}: {name} must be [Nq={num_queries}], got {tuple(t.shape)}")
    check_scale_window(fn, scale, window)
    num_pairs = pair_query.shape[0]
    if (out is None) != (lse is None):
        raise ValueError(f"{fn}: pass both out and lse, or neither")
    if out is not None:
        check_tensor(fn, "out", out, ndim=3, dtypes=(torch.float32,))
        check_tensor(fn, "lse", lse, ndim=2, dtypes=(torch.float32,))
        check_unit_last_stride(fn, "out", out)
        if out.shape != (num_pairs, num_q_heads, head_dim) or lse.shape != (num_pairs, num_q_heads):
            raise ValueError(
                f"{fn}: out and lse must be [P={num_pairs}, Hq={num_q_heads}, D={head_dim}] and [P, Hq], "
                f"got {tuple(out.shape)} and {tuple(lse.shape)}"
            )
    outputs = {} if out is None else dict(out=out, lse=lse)
    device = check_same_device(
        fn, q=q, k_pool=k_pool, v_pool=v_pool, valid=valid, item_slots=item_slots, item_pos=item_pos,
        item_off=item_off, pair_query=pair_query, q_pos=q_pos, q_end=q_end, **outputs,
    )
    return num_pairs, num_q_heads, head_dim, num_slots, num_kv_heads, group, num_items, device


def _outputs(out, lse, num_pairs, num_q_heads, head_dim, device):
    if out is not None:
        return out, lse
    return (torch.zeros(num_pairs, num_q_heads, head_dim, dtype=torch.float32, device=device),
            torch.full((num_pairs, num_q_heads), float("-inf"), dtype=torch.float32, device=device))


def shared_decode_states(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    valid: torch.Tensor,
    item_slots: torch.Tensor,
    item_pos: torch.Tensor,
    item_off: torch.Tensor,
    pair_query: torch.Tensor,
    q_pos: torch.Tensor,
    q_end: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention state per (block, query) pair, every block loaded once for all its queries.

    q: [Nq, Hq, D] fp32 or bf16 (last-dim stride 1; products are computed in fp32); k_pool,
    v_pool: [S, Hkv, 64, D] (any strides but the last); valid: [S] int8/uint8/bool.
    Items: item_slots, item_pos: [I] int32, the slot holding each block and its logical index;
    item_off: [I+1] int32, item i owns pairs item_off[i] .. item_off[i+1]-1; pair_query: [P]
    int32, each pair's query. q_pos, q_end: [Nq] int32/int64: a query sees the keys at
    positions p with p <= q_pos, p < q_end and (window == 0 or p > q_pos - window).
    Returns out: [P, Hq, D] fp32, each pair's output normalised by its block's softmax sum, and
    lse: [P, Hq] fp32 natural-log sum-exp of the pair's scaled scores; a pair that sees no key
    (its slot invalid or out of the pool, or every key masked) gets out 0 and lse -inf. Only the
    pairs item_off[0] .. item_off[I]-1 are written: into `out` and `lse` when given (the other
    pairs keep their values), else into new tensors whose other pairs are empty (0, -inf).
    Merge each query's pairs with `merge_ragged_states`.
    """
    fn = "shared_decode_states"
    (num_pairs, num_q_heads, head_dim, num_slots, num_kv_heads, group, num_items, device) = _check_inputs(
        fn, q, k_pool, v_pool, valid, item_slots, item_pos, item_off, pair_query, q_pos, q_end, scale, window,
        out, lse)
    require_launchable(_shared_decode_states_kernel, fn, device)
    out, lse = _outputs(out, lse, num_pairs, num_q_heads, head_dim, device)
    if num_items == 0 or num_pairs == 0:
        return out, lse
    if valid.dtype != torch.uint8:
        valid = valid.view(torch.uint8)
    _shared_decode_states_kernel[(num_items, num_kv_heads)](
        q, k_pool, v_pool, valid,
        item_slots, item_pos, item_off, pair_query, q_pos, q_end,
        out, lse,
        num_slots, float(scale) * _LOG2E, window,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        valid.stride(0),
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=head_dim,
        BLOCK_T=BLOCK_TOKENS,
        num_warps=4 if head_dim <= 128 else 8,
    )
    return out, lse


def shared_decode_states_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    valid: torch.Tensor,
    item_slots: torch.Tensor,
    item_pos: torch.Tensor,
    item_off: torch.Tensor,
    pair_query: torch.Tensor,
    q_pos: torch.Tensor,
    q_end: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch reference of `shared_decode_states` (one pair at a time)."""
    fn = "shared_decode_states_ref"
    num_pairs, num_q_heads, head_dim, _, _, _, num_items, device = _check_inputs(
        fn, q, k_pool, v_pool, valid, item_slots, item_pos, item_off, pair_query, q_pos, q_end, scale, window,
        out, lse)
    out, lse = _outputs(out, lse, num_pairs, num_q_heads, head_dim, device)
    for i in range(num_items):
        k, v, k_pos = gather_blocks(k_pool, v_pool, valid, item_slots[i:i + 1], item_pos[i:i + 1])
        for pair in range(int(item_off[i]), int(item_off[i + 1])):
            j = int(pair_query[pair])
            seen = k_pos < q_end[j]
            o, s = attend(q[j:j + 1].float(), k[seen], v[seen], q_pos[j:j + 1], k_pos[seen], scale, window)
            out[pair], lse[pair] = o[0], s[0]
    return out, lse


__all__ = ["shared_decode_states", "shared_decode_states_ref"]
