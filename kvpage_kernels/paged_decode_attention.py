"""Split-KV decode attention over pool slots: one query token per sequence."""

from __future__ import annotations

import torch

from ._checks import (
    check_group,
    check_pool,
    check_same_device,
    check_scale_window,
    check_tensor,
    check_unit_last_stride,
    next_power_of_2,
)
from ._reference import attend, gather_blocks
from ._triton import is_interpreted, jit, require_launchable, tl
from .constants import BLOCK_TOKENS

_LOG2E = 1.4426950408889634
_MIN_ENTRIES_PER_SPLIT = 4
_MAX_SPLITS = 256


def default_num_splits(num_entries: int) -> int:
    """Splits for `num_entries` block-list entries: >= 4 entries (256 tokens) each, at most 256.

    Decode at long context is bound by memory bandwidth; many splits keep every SM streaming even
    when batch x KV heads is small (a single sequence of a 1-KV-head model).
    """
    return max(1, min(_MAX_SPLITS, -(-num_entries // _MIN_ENTRIES_PER_SPLIT)))


def entries_per_split(num_entries: int, num_splits: int) -> int:
    """Split s covers entries [s*E, min((s+1)*E, M)) with E = ceil(M / num_splits)."""
    return max(1, -(-num_entries // num_splits))


@jit
def _paged_decode_attention_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, valid_ptr, slot_ids_ptr, block_pos_ptr, seq_lens_ptr,
    out_ptr, lse_ptr,
    num_kv_heads, num_slots, num_entries, split_entries, qk_scale_log2, window,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kt,
    stride_vs, stride_vh, stride_vt,
    stride_valid,
    stride_sb, stride_se,
    stride_pb, stride_pe,
    stride_lens,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls, stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # One program: one sequence, one KV head (its GROUP query heads as rows), one split.
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // num_kv_heads
    h = pid_bh % num_kv_heads

    offs_g = tl.arange(0, GROUP_PAD)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    q_heads = h * GROUP + offs_g

    # q: [GROUP_PAD, HEAD_DIM]; padded rows are 0 and never stored
    q = tl.load(
        q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None], other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    q_pos = tl.load(seq_lens_ptr + b * stride_lens) - 1
    key_lo = q_pos * 0  # first visible key position
    if window > 0:
        key_lo = q_pos - window + 1

    k_head = k_pool_ptr + h.to(tl.int64) * stride_kh
    v_head = v_pool_ptr + h.to(tl.int64) * stride_vh

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max, log2 domain
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

    start = split * split_entries
    end = tl.minimum(start + split_entries, num_entries)
    # List order, fixed 64-token boundaries: the result does not depend on which slot holds a block.
    for e in range(start, end):
        slot = tl.load(slot_ids_ptr + b * stride_sb + e * stride_se)
        first = tl.load(block_pos_ptr + b * stride_pb + e * stride_pe) * BLOCK_T
        in_pool = (slot >= 0) & (slot < num_slots)
        flag = tl.load(valid_ptr + slot * stride_valid, mask=in_pool, other=0)
        visible = (flag != 0) & (first <= q_pos) & (first + BLOCK_T - 1 >= key_lo)
        # An invalid slot is never loaded: it may hold garbage, NaN included.
        if visible:
            slot64 = slot.to(tl.int64)
            # kt: [HEAD_DIM, BLOCK_T], v: [BLOCK_T, HEAD_DIM]
            kt = tl.load(k_head + slot64 * stride_ks + offs_t[None, :] * stride_kt + offs_d[:, None])
            v = tl.load(v_head + slot64 * stride_vs + offs_t[:, None] * stride_vt + offs_d[None, :])
            if UPCAST_DOT:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, kt, input_precision="ieee") * qk_scale_log2  # [GROUP_PAD, BLOCK_T]
            k_pos = first + offs_t
            keep = (k_pos <= q_pos) & (k_pos >= key_lo)
            s = tl.where(keep[None, :], s, float("-inf"))
            # A visible block keeps at least one key, so m_new is finite on every row.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(
        out_ptr + b * stride_ob + split * stride_os + q_heads[:, None] * stride_oh + offs_d[None, :],
        out, mask=g_mask[:, None],
    )
    tl.store(lse_ptr + b * stride_lb + split * stride_ls + q_heads * stride_lh, lse, mask=g_mask)


def _check_inputs(fn, q, k_pool, v_pool, valid, slot_ids, block_pos, seq_lens, scale, window, num_splits):
    num_slots, num_kv_heads, head_dim = check_pool(fn, k_pool, v_pool, valid)
    check_tensor(fn, "q", q, ndim=3, dtypes=(k_pool.dtype,))
    check_unit_last_stride(fn, "q", q)
    batch, num_q_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ValueError(f"{fn}: q head_dim {q_dim} differs from the pool's head_dim {head_dim}")
    group = check_group(fn, num_q_heads, num_kv_heads)
    check_tensor(fn, "slot_ids", slot_ids, ndim=2, dtypes=(torch.int32,))
    check_tensor(fn, "block_pos", block_pos, ndim=2, dtypes=(torch.int32,))
    check_tensor(fn, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    if slot_ids.shape[0] != batch or block_pos.shape != slot_ids.shape:
        raise ValueError(
            f"{fn}: slot_ids and block_pos must both be [B={batch}, M], got {tuple(slot_ids.shape)} "
            f"and {tuple(block_pos.shape)}"
        )
    if seq_lens.shape[0] != batch:
        raise ValueError(f"{fn}: seq_lens must be [B={batch}], got {tuple(seq_lens.shape)}")
    check_scale_window(fn, scale, window)
    num_entries = slot_ids.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(num_entries)
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"{fn}: num_splits must be an int >= 1, got {num_splits!r}")
    device = check_same_device(
        fn, q=q, k_pool=k_pool, v_pool=v_pool, valid=valid, slot_ids=slot_ids,
        block_pos=block_pos, seq_lens=seq_lens,
    )
    return batch, num_q_heads, head_dim, num_slots, num_kv_heads, group, num_entries, num_splits, device


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    valid: torch.Tensor,
    slot_ids: torch.Tensor,
    block_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query token per sequence over the blocks its list names, split-KV.

    q: [B, Hq, D] (pool dtype, last-dim stride 1); k_pool, v_pool: [S, Hkv, 64, D] (any strides
    but the last); valid: [S] int8/uint8/bool; slot_ids, block_pos: [B, M] int32 (slot -1 =
    padding); seq_lens: [B] int32, tokens including the query (query position = seq_len - 1).
    Returns out: [B, num_splits, Hq, D] fp32, each split normalised by its own softmax sum, and
    lse: [B, num_splits, Hq] fp32 natural-log sum-exp of the scaled scores (-inf, out 0, for a
    split that sees nothing). Merge the splits with `merge_attention_states(out, lse, dim=1)`.
    """
    fn = "paged_decode_attention"
    (batch, num_q_heads, head_dim, num_slots, num_kv_heads, group, num_entries, num_splits,
     device) = _check_inputs(fn, q, k_pool, v_pool, valid, slot_ids, block_pos, seq_lens, scale,
                             window, num_splits)
    require_launchable(_paged_decode_attention_kernel, fn, device)

    if batch == 0 or num_entries == 0:
        out = torch.zeros(batch, num_splits, num_q_heads, head_dim, dtype=torch.float32, device=device)
        return out, torch.full(out.shape[:-1], float("-inf"), dtype=torch.float32, device=device)
    # every row of out and lse is written by the kernel
    out = torch.empty(batch, num_splits, num_q_heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(batch, num_splits, num_q_heads, dtype=torch.float32, device=device)
    if valid.dtype != torch.uint8:
        valid = valid.view(torch.uint8)
    # tl.dot needs >= 16 rows; the interpreter mishandles bf16 dots, so it computes them in fp32
    # (bf16 values are exact in fp32, only p is then kept at fp32 instead of bf16).
    upcast = k_pool.dtype == torch.float32 or is_interpreted(_paged_decode_attention_kernel)
    grid = (batch * num_kv_heads, num_splits)
    _paged_decode_attention_kernel[grid](
        q, k_pool, v_pool, valid, slot_ids, block_pos, seq_lens,
        out, lse,
        num_kv_heads, num_slots, num_entries, entries_per_split(num_entries, num_splits),
        float(scale) * _LOG2E, window,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        valid.stride(0),
        slot_ids.stride(0), slot_ids.stride(1),
        block_pos.stride(0), block_pos.stride(1),
        seq_lens.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_T=BLOCK_TOKENS,
        UPCAST_DOT=upcast,
        num_warps=4 if head_dim <= 128 else 8,
    )
    return out, lse


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    valid: torch.Tensor,
    slot_ids: torch.Tensor,
    block_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch reference of `paged_decode_attention` (same split partition and outputs)."""
    fn = "paged_decode_attention_ref"
    batch, num_q_heads, head_dim, _, _, _, num_entries, num_splits, device = _check_inputs(
        fn, q, k_pool, v_pool, valid, slot_ids, block_pos, seq_lens, scale, window, num_splits
    )
    out = torch.zeros(batch, num_splits, num_q_heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((batch, num_splits, num_q_heads), float("-inf"), dtype=torch.float32, device=device)
    step = entries_per_split(num_entries, num_splits)
    for b in range(batch):
        q_pos = seq_lens[b : b + 1].long() - 1
        for split in range(num_splits):
            part = slice(split * step, min((split + 1) * step, num_entries))
            k, v, k_pos = gather_blocks(k_pool, v_pool, valid, slot_ids[b, part], block_pos[b, part])
            o, s = attend(q[b : b + 1], k, v, q_pos, k_pos, scale, window)
            out[b, split], lse[b, split] = o[0], s[0]
    return out, lse


__all__ = [
    "default_num_splits",
    "paged_decode_attention",
    "paged_decode_attention_ref",
]
