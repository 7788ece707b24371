"""Rotate K with RoPE exactly as Hugging Face does and write K and V into pool slots, in one pass."""

from __future__ import annotations

import torch

from ._checks import check_same_device, check_tensor, check_unit_last_stride, next_power_of_2
from ._triton import jit, require_launchable, tl
from .constants import BLOCK_TOKENS


@jit
def _round_to_bf16(x):
    # fp32 -> nearest-even bf16 value, kept in fp32. Bit arithmetic, the same as torch's
    # (c10::BFloat16): the interpreter's own fp32->bf16 cast truncates instead of rounding.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@jit
def _rope_bake_store_kernel(
    k_ptr, v_ptr, positions_ptr, inv_freq_ptr, k_pool_ptr, v_pool_ptr, slot_ids_ptr, offsets_ptr,
    num_kv_heads, num_slots, attention_scaling,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_pos, stride_freq, stride_slot, stride_off,
    stride_kps, stride_kph, stride_kpt,
    stride_vps, stride_vph, stride_vpt,
    HALF_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    # One program: one token, all its KV heads.
    t = tl.program_id(0)
    slot = tl.load(slot_ids_ptr + t * stride_slot)
    offset = tl.load(offsets_ptr + t * stride_off)
    if (slot >= 0) & (slot < num_slots):
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HALF_DIM)
        mask = (offs_h < num_kv_heads)[:, None]

        # freqs: [HALF_DIM], fp32 as HF: pos.float() * inv_freq; emb = cat(freqs, freqs)
        pos = tl.load(positions_ptr + t * stride_pos).to(tl.float32)
        freqs = pos * tl.load(inv_freq_ptr + offs_d * stride_freq)
        cos = tl.cos(freqs) * attention_scaling
        sin = tl.sin(freqs) * attention_scaling

        # x1, x2: [HEADS_PAD, HALF_DIM], the two halves of each head's K
        k_row = k_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
        x1 = tl.load(k_row, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_row + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
        # HF: k * cos + rotate_half(k) * sin, rotate_half(k) = cat(-x2, x1), in k's dtype
        if ROUND_BF16:
            # Round after every op, as bf16 torch ops do (products of bf16 values are exact in fp32).
            cos = _round_to_bf16(cos)
            sin = _round_to_bf16(sin)
            y1 = _round_to_bf16(_round_to_bf16(x1 * cos) - _round_to_bf16(x2 * sin))
            y2 = _round_to_bf16(_round_to_bf16(x2 * cos) + _round_to_bf16(x1 * sin))
        else:
            y1 = x1 * cos - x2 * sin
            y2 = x2 * cos + x1 * sin

        slot64 = slot.to(tl.int64)
        k_dst = (k_pool_ptr + slot64 * stride_kps + offs_h[:, None] * stride_kph
                 + offset * stride_kpt + offs_d[None, :])
        tl.store(k_dst, y1.to(k_pool_ptr.dtype.element_ty), mask=mask)
        tl.store(k_dst + HALF_DIM, y2.to(k_pool_ptr.dtype.element_ty), mask=mask)

        v_row = v_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        v_dst = (v_pool_ptr + slot64 * stride_vps + offs_h[:, None] * stride_vph
                 + offset * stride_vpt + offs_d[None, :])
        tl.store(v_dst, tl.load(v_row, mask=mask, other=0.0), mask=mask)
        tl.store(v_dst + HALF_DIM, tl.load(v_row + HALF_DIM, mask=mask, other=0.0), mask=mask)


def _check_inputs(fn, k, v, positions, inv_freq, k_pool, v_pool, slot_ids, offsets, attention_scaling):
    dtypes = (torch.float32, torch.bfloat16)
    check_tensor(fn, "k", k, ndim=3, dtypes=dtypes)
    check_tensor(fn, "v", v, ndim=3, dtypes=(k.dtype,))
    check_tensor(fn, "k_pool", k_pool, ndim=4, dtypes=(k.dtype,))
    check_tensor(fn, "v_pool", v_pool, ndim=4, dtypes=(k.dtype,))
    if v.shape != k.shape:
        raise ValueError(
            f"{fn}: k and v must have one shape [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = k.shape
    if head_dim % 2 or head_dim < 2:
        raise ValueError(f"{fn}: head_dim must be even, got {head_dim}")
    expected = (num_kv_heads, BLOCK_TOKENS, head_dim)
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if tuple(pool.shape[1:]) != expected:
            raise ValueError(
                f"{fn}: {name} must be [S, {num_kv_heads}, {BLOCK_TOKENS}, {head_dim}] to match k, "
                f"got {tuple(pool.shape)}"
            )
    if v_pool.shape[0] != k_pool.shape[0]:
        raise ValueError(f"{fn}: k_pool and v_pool differ in slots: {k_pool.shape[0]} and {v_pool.shape[0]}")
    for name, t in (("k", k), ("v", v), ("k_pool", k_pool), ("v_pool", v_pool)):
        check_unit_last_stride(fn, name, t)
    check_tensor(fn, "positions", positions, ndim=1, dtypes=(torch.int32, torch.int64))
    check_tensor(fn, "inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,))
    check_tensor(fn, "slot_ids", slot_ids, ndim=1, dtypes=(torch.int32,))
    check_tensor(fn, "offsets", offsets, ndim=1, dtypes=(torch.int32,))
    if inv_freq.shape[0] != head_dim // 2:
        raise ValueError(f"{fn}: inv_freq must be [D/2={head_dim // 2}], got {tuple(inv_freq.shape)}")
    for name, t in (("positions", positions), ("slot_ids", slot_ids), ("offsets", offsets)):
        if t.shape[0] != num_tokens:
            raise ValueError(f"{fn}: {name} must be [T={num_tokens}], got {tuple(t.shape)}")
    if not isinstance(attention_scaling, (int, float)) or isinstance(attention_scaling, bool):
        raise TypeError(
            f"{fn}: attention_scaling must be a Python float, got {type(attention_scaling).__name__}"
        )
    return check_same_device(
        fn, k=k, v=v, positions=positions, inv_freq=inv_freq, k_pool=k_pool, v_pool=v_pool,
        slot_ids=slot_ids, offsets=offsets,
    )


def rope_bake_store(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    attention_scaling: float = 1.0,
) -> None:
    """Write k_pool[slot, h, off] = rope(k[t, h]) and v_pool[slot, h, off] = v[t, h] for every t.

    k, v: [T, Hkv, D] (fp32 or bf16, last-dim stride 1); positions: [T] int32/int64; inv_freq:
    [D/2] fp32; k_pool, v_pool: [S, Hkv, 64, D] of k's dtype, any strides but the last;
    slot_ids, offsets: [T] int32 (slot -1: token not stored). RoPE as Hugging Face computes it:
    fp32 angles, cos/sin scaled by attention_scaling and cast to k's dtype, then
    k * cos + rotate_half(k) * sin with k's dtype's rounding after each op.
    Offsets are not range-checked on the device: each must be in [0, 64).
    """
    fn = "rope_bake_store"
    device = _check_inputs(
        fn, k, v, positions, inv_freq, k_pool, v_pool, slot_ids, offsets, attention_scaling
    )
    require_launchable(_rope_bake_store_kernel, fn, device)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _rope_bake_store_kernel[(num_tokens,)](
        k, v, positions, inv_freq, k_pool, v_pool, slot_ids, offsets,
        num_kv_heads, k_pool.shape[0], float(attention_scaling),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        positions.stride(0), inv_freq.stride(0), slot_ids.stride(0), offsets.stride(0),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        HALF_DIM=head_dim // 2,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        ROUND_BF16=k.dtype == torch.bfloat16,
    )


def rope_k_ref(
    k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> torch.Tensor:
    """HF's rotary embedding of k: [T, Hkv, D] at positions [T], in k's dtype -> [T, Hkv, D]."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_scaling).to(k.dtype)[:, None, :]  # [T, 1, D]
    sin = (emb.sin() * attention_scaling).to(k.dtype)[:, None, :]
    half = k.shape[-1] // 2
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return k * cos + rotated * sin


def rope_bake_store_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    attention_scaling: float = 1.0,
) -> None:
    """Torch reference of `rope_bake_store` (writes the pools in place)."""
    _check_inputs(
        "rope_bake_store_ref", k, v, positions, inv_freq, k_pool, v_pool, slot_ids, offsets, attention_scaling
    )
    rotated = rope_k_ref(k, positions, inv_freq, attention_scaling)
    keep = (slot_ids >= 0) & (slot_ids < k_pool.shape[0])
    slots = slot_ids[keep].long()
    offs = offsets[keep].long()
    # advanced indices split by a slice: k_pool[slots, :, offs] is [n, Hkv, D]
    k_pool[slots, :, offs] = rotated[keep]
    v_pool[slots, :, offs] = v[keep]


__all__ = ["rope_bake_store", "rope_bake_store_ref", "rope_k_ref"]
