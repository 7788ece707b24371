"""Causal attention of a chunk of query tokens of one sequence over pool slots (chunked prefill)."""

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


@jit
def _paged_prefill_attention_kernel(
    q_ptr, q_pos_ptr, k_pool_ptr, v_pool_ptr, valid_ptr, slot_ids_ptr, block_pos_ptr,
    out_ptr, lse_ptr,
    num_tokens, num_slots, num_entries, qk_scale_log2, window,
    stride_qt, stride_qh,
    stride_qpos,
    stride_ks, stride_kh, stride_kt,
    stride_vs, stride_vh, stride_vt,
    stride_valid,
    stride_se,
    stride_pe,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # One program: BLOCK_Q query tokens of one query head.
    pid_q = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    r_mask = rows < num_tokens

    q_pos = tl.load(q_pos_ptr + rows * stride_qpos, mask=r_mask, other=-1)  # [BLOCK_Q]
    key_lo = q_pos * 0  # first visible key of each row
    if window > 0:
        key_lo = q_pos - window + 1
    tile_hi = tl.max(tl.where(r_mask, q_pos, -1), axis=0)
    tile_lo = tl.min(tl.where(r_mask, key_lo, 2147483647), axis=0)

    # q: [BLOCK_Q, HEAD_DIM]
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=r_mask[:, None], other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    k_head = k_pool_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_pool_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)

    for e in range(0, num_entries):
        slot = tl.load(slot_ids_ptr + e * stride_se)
        first = tl.load(block_pos_ptr + e * stride_pe) * BLOCK_T
        in_pool = (slot >= 0) & (slot < num_slots)
        flag = tl.load(valid_ptr + slot * stride_valid, mask=in_pool, other=0)
        visible = (flag != 0) & (first <= tile_hi) & (first + BLOCK_T - 1 >= tile_lo)
        # An invalid slot is never loaded: it may hold garbage, NaN included.
        if visible:
            slot64 = slot.to(tl.int64)
            # kt: [HEAD_DIM, BLOCK_T], v: [BLOCK_T, HEAD_DIM]
            kt = tl.load(k_head + slot64 * stride_ks + offs_t[None, :] * stride_kt + offs_d[:, None])
            v = tl.load(v_head + slot64 * stride_vs + offs_t[:, None] * stride_vt + offs_d[None, :])
            if UPCAST_DOT:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, kt, input_precision="ieee") * qk_scale_log2  # [BLOCK_Q, BLOCK_T]
            k_pos = first + offs_t
            keep = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= key_lo[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # Rows that have seen no key yet keep m = -inf; shift them by 0 to avoid inf - inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out, mask=r_mask[:, None],
    )
    tl.store(lse_ptr + rows * stride_lt + head * stride_lh, lse, mask=r_mask)


def _check_inputs(fn, q, q_pos, k_pool, v_pool, valid, slot_ids, block_pos, scale, window):
    num_slots, num_kv_heads, head_dim = check_pool(fn, k_pool, v_pool, valid)
    check_tensor(fn, "q", q, ndim=3, dtypes=(k_pool.dtype,))
    check_unit_last_stride(fn, "q", q)
    num_tokens, num_q_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ValueError(f"{fn}: q head_dim {q_dim} differs from the pool's head_dim {head_dim}")
    group = check_group(fn, num_q_heads, num_kv_heads)
    check_tensor(fn, "q_pos", q_pos, ndim=1, dtypes=(torch.int32,))
    if q_pos.shape[0] != num_tokens:
        raise ValueError(f"{fn}: q_pos must be [T={num_tokens}], got {tuple(q_pos.shape)}")
    check_tensor(fn, "slot_ids", slot_ids, ndim=1, dtypes=(torch.int32,))
    check_tensor(fn, "block_pos", block_pos, ndim=1, dtypes=(torch.int32,))
    if block_pos.shape != slot_ids.shape:
        raise ValueError(
            f"{fn}: slot_ids and block_pos must both be [M], got {tuple(slot_ids.shape)} and "
            f"{tuple(block_pos.shape)}"
        )
    check_scale_window(fn, scale, window)
    device = check_same_device(
        fn, q=q, q_pos=q_pos, k_pool=k_pool, v_pool=v_pool, valid=valid, slot_ids=slot_ids,
        block_pos=block_pos,
    )
    return num_tokens, num_q_heads, head_dim, num_slots, group, device


def paged_prefill_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    valid: torch.Tensor,
    slot_ids: torch.Tensor,
    block_pos: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of T query tokens of one sequence over the blocks its list names.

    q: [T, Hq, D] (pool dtype, last-dim stride 1); q_pos: [T] int32 absolute positions;
    k_pool, v_pool: [S, Hkv, 64, D]; valid: [S]; slot_ids, block_pos: [M] int32 (slot -1 =
    padding). A key at position p is visible to a query at position t iff p <= t and, when
    window > 0, p > t - window. Returns out: [T, Hq, D] fp32 (normalised) and lse: [T, Hq] fp32
    natural-log sum-exp (-inf, out 0, for a row that sees nothing).
    """
    fn = "paged_prefill_attention"
    num_tokens, num_q_heads, head_dim, num_slots, group, device = _check_inputs(
        fn, q, q_pos, k_pool, v_pool, valid, slot_ids, block_pos, scale, window
    )
    require_launchable(_paged_prefill_attention_kernel, fn, device)
    num_entries = slot_ids.shape[0]
    if num_tokens == 0 or num_entries == 0:
        out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=device)
        return out, torch.full(out.shape[:-1], float("-inf"), dtype=torch.float32, device=device)
    # every row of out and lse is written by the kernel
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=device)
    if valid.dtype != torch.uint8:
        valid = valid.view(torch.uint8)
    # tl.dot needs >= 16 rows; bf16 dots run in fp32 under the interpreter, which mishandles them.
    block_q = min(64 if head_dim <= 128 else 32, max(16, next_power_of_2(num_tokens)))
    upcast = k_pool.dtype == torch.float32 or is_interpreted(_paged_prefill_attention_kernel)
    grid = (-(-num_tokens // block_q), num_q_heads)
    _paged_prefill_attention_kernel[grid](
        q, q_pos, k_pool, v_pool, valid, slot_ids, block_pos,
        out, lse,
        num_tokens, num_slots, num_entries, float(scale) * _LOG2E, window,
        q.stride(0), q.stride(1),
        q_pos.stride(0),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        valid.stride(0),
        slot_ids.stride(0),
        block_pos.stride(0),
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_Q=block_q,
        BLOCK_T=BLOCK_TOKENS,
        UPCAST_DOT=upcast,
        num_warps=4 if head_dim <= 128 else 8,
    )
    return out, lse


def paged_prefill_attention_ref(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    valid: torch.Tensor,
    slot_ids: torch.Tensor,
    block_pos: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch reference of `paged_prefill_attention`."""
    _check_inputs(
        "paged_prefill_attention_ref", q, q_pos, k_pool, v_pool, valid, slot_ids, block_pos, scale, window
    )
    k, v, k_pos = gather_blocks(k_pool, v_pool, valid, slot_ids, block_pos)
    return attend(q, k, v, q_pos, k_pos, scale, window)


__all__ = ["paged_prefill_attention", "paged_prefill_attention_ref"]
