"""Log-sum-exp merge of partial attention states (split-KV results, streamed blocks, ragged groups)."""

from __future__ import annotations

import math

import torch

from ._checks import check_same_device, check_tensor, check_unit_last_stride, next_power_of_2
from ._triton import jit, require_launchable, tl

_BLOCK_N = 16
_BLOCK_ROWS = 16
_MERGE_TILE = 8192  # values of out one program of merge_attention_states loads at a time


@jit
def _merge_attention_states_kernel(
    out_ptr, lse_ptr, merged_out_ptr, merged_lse_ptr,
    num_rows, num_states, num_inner, head_dim,
    stride_oa, stride_on, stride_oc,
    stride_la, stride_ln, stride_lc,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_ROWS rows (a, c) of out [A, N, C, D], each merged over its N states,
    # BLOCK_N states at a time (every row's arithmetic is what it is alone).
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_mask = rows < num_rows
    a = (rows // num_inner).to(tl.int64)
    c = (rows % num_inner).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    out_rows = out_ptr + a * stride_oa + c * stride_oc  # [R]
    lse_rows = lse_ptr + a * stride_la + c * stride_lc

    m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, num_states, BLOCK_N):
        n = n0 + offs_n
        lse = tl.load(lse_rows[:, None] + n[None, :] * stride_ln,
                      mask=r_mask[:, None] & (n < num_states)[None, :], other=float("-inf"))  # [R, N]
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe[:, None])  # [R, N], 0 for empty states
        # An empty state's out is never read, so garbage there cannot leak.
        o = tl.load(
            out_rows[:, None, None] + n[None, :, None] * stride_on + offs_d[None, None, :],
            mask=(lse > float("-inf"))[:, :, None] & d_mask[None, None, :], other=0.0,
        )  # [R, N, D]
        total = total * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        m = m_new

    seen = total > 0
    merged = acc / tl.where(seen, total, 1.0)[:, None]
    merged_lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(merged_out_ptr + rows.to(tl.int64)[:, None] * head_dim + offs_d[None, :], merged,
             mask=r_mask[:, None] & d_mask[None, :])
    tl.store(merged_lse_ptr + rows, merged_lse, mask=r_mask)


@jit
def _merge_two_states_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, merged_out_ptr, merged_lse_ptr,
    num_rows, head_dim,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Rows of contiguous [R, D] states; one program merges BLOCK_ROWS of them.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = rows < num_rows
    mask = r_mask[:, None] & (offs_d < head_dim)[None, :]
    lse_a = tl.load(lse_a_ptr + rows, mask=r_mask, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + rows, mask=r_mask, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    offs = rows.to(tl.int64)[:, None] * head_dim + offs_d[None, :]
    o_a = tl.load(out_a_ptr + offs, mask=mask & (lse_a > float("-inf"))[:, None], other=0.0)
    o_b = tl.load(out_b_ptr + offs, mask=mask & (lse_b > float("-inf"))[:, None], other=0.0)
    total = w_a + w_b
    seen = total > 0
    inv = 1.0 / tl.where(seen, total, 1.0)
    merged = (w_a * inv)[:, None] * o_a + (w_b * inv)[:, None] * o_b
    merged_lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(merged_out_ptr + offs, merged, mask=mask)
    tl.store(merged_lse_ptr + rows, merged_lse, mask=r_mask)


@jit
def _merge_ragged_states_kernel(
    out_ptr, lse_ptr, offsets_ptr, indices_ptr, merged_out_ptr, merged_lse_ptr,
    num_heads, head_dim,
    stride_on, stride_oh,
    stride_ln, stride_lh,
    stride_mj, stride_mh,
    stride_kj, stride_kh,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: one group j, one head h, merged over the states indices[offsets[j]:offsets[j+1]].
    j = tl.program_id(0)
    h = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    first = tl.load(offsets_ptr + j)
    last = tl.load(offsets_ptr + j + 1)
    out_head = out_ptr + h.to(tl.int64) * stride_oh
    lse_head = lse_ptr + h.to(tl.int64) * stride_lh

    # Two passes, as the torch and C merges do: the largest lse, then the weights relative to it.
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    for n0 in range(first, last, BLOCK_N):
        n = n0 + offs_n
        index = tl.load(indices_ptr + n, mask=n < last, other=0).to(tl.int64)
        lse = tl.load(lse_head + index * stride_ln, mask=n < last, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, axis=0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(first, last, BLOCK_N):
        n = n0 + offs_n
        index = tl.load(indices_ptr + n, mask=n < last, other=0).to(tl.int64)
        lse = tl.load(lse_head + index * stride_ln, mask=n < last, other=float("-inf"))
        w = tl.exp(lse - m_safe)  # [BLOCK_N], 0 for empty states
        # An empty state's out is never read, so garbage there cannot leak.
        o = tl.load(
            out_head + index[:, None] * stride_on + offs_d[None, :],
            mask=(lse > float("-inf"))[:, None] & d_mask[None, :], other=0.0,
        )
        total += tl.sum(w, axis=0)
        acc += tl.sum(w[:, None] * o, axis=0)

    seen = total > 0
    merged = acc / tl.where(seen, total, 1.0)
    merged_lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(merged_out_ptr + j.to(tl.int64) * stride_mj + h * stride_mh + offs_d, merged, mask=d_mask)
    tl.store(merged_lse_ptr + j.to(tl.int64) * stride_kj + h * stride_kh + tl.arange(0, 1), merged_lse)


def _check_state(fn: str, out, lse, suffix: str = ""):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{fn}: out{suffix} must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() < 2:
        raise ValueError(f"{fn}: out{suffix} must be [..., D] with at least 2 dims, got {tuple(out.shape)}")
    check_tensor(fn, f"out{suffix}", out, ndim=out.dim(), dtypes=(torch.float32,))
    check_tensor(fn, f"lse{suffix}", lse, ndim=out.dim() - 1, dtypes=(torch.float32,))
    if out.shape[:-1] != lse.shape:
        raise ValueError(
            f"{fn}: out{suffix} must be lse{suffix}'s shape plus a head_dim, got {tuple(out.shape)} "
            f"and {tuple(lse.shape)}"
        )


def _normalise_dim(fn: str, dim: int, ndim: int) -> int:
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{fn}: dim must index one of lse's {ndim} dims, got {dim!r}")
    return dim % ndim


def merge_attention_states(
    out: torch.Tensor, lse: torch.Tensor, dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial attention states along `dim` (a dim of lse; out has one more, head_dim).

    out: [..., N, ..., D] fp32, lse: [..., N, ...] fp32 natural-log sum-exp; an empty state
    (lse = -inf) contributes nothing and its out is not read. Returns out with `dim` removed and
    lse likewise; where every state is empty, out = 0 and lse = -inf.
    Decode: `merge_attention_states(out, lse, dim=1)` turns [B, splits, Hq, D] into [B, Hq, D].
    """
    fn = "merge_attention_states"
    _check_state(fn, out, lse)
    dim = _normalise_dim(fn, dim, lse.dim())
    device = check_same_device(fn, out=out, lse=lse)
    require_launchable(_merge_attention_states_kernel, fn, device)
    head_dim = out.shape[-1]
    num_states = lse.shape[dim]
    outer = math.prod(lse.shape[:dim])
    inner = math.prod(lse.shape[dim + 1 :])
    kept_shape = lse.shape[:dim] + lse.shape[dim + 1 :]
    # out: [A, N, C, D], lse: [A, N, C] (views when the inputs are contiguous)
    out3 = out.reshape(outer, num_states, inner, head_dim)
    lse3 = lse.reshape(outer, num_states, inner)
    if out3.stride(-1) != 1:
        out3 = out3.contiguous()
    merged_out = torch.empty(*kept_shape, head_dim, dtype=torch.float32, device=device)
    merged_lse = torch.empty(kept_shape, dtype=torch.float32, device=device)
    if merged_lse.numel() == 0:
        return merged_out, merged_lse
    if num_states == 0:
        return merged_out.zero_(), merged_lse.fill_(float("-inf"))
    rows = outer * inner
    block_d = next_power_of_2(head_dim)
    block_rows = max(1, _MERGE_TILE // (_BLOCK_N * block_d))  # the [rows, states, D] tile a program holds
    _merge_attention_states_kernel[(-(-rows // block_rows),)](
        out3, lse3, merged_out, merged_lse,
        rows, num_states, inner, head_dim,
        out3.stride(0), out3.stride(1), out3.stride(2),
        lse3.stride(0), lse3.stride(1), lse3.stride(2),
        BLOCK_ROWS=block_rows,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
    )
    return merged_out, merged_lse


def merge_two_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states of one shape: out [..., D] fp32, lse [...] fp32 -> (out, lse)."""
    fn = "merge_two_states"
    _check_state(fn, out_a, lse_a, "_a")
    _check_state(fn, out_b, lse_b, "_b")
    if out_a.shape != out_b.shape:
        raise ValueError(f"{fn}: the states differ in shape: {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    device = check_same_device(fn, out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    require_launchable(_merge_two_states_kernel, fn, device)
    head_dim = out_a.shape[-1]
    merged_out = torch.empty(out_a.shape, dtype=torch.float32, device=device)
    merged_lse = torch.empty(lse_a.shape, dtype=torch.float32, device=device)
    num_rows = lse_a.numel()
    if num_rows == 0:
        return merged_out, merged_lse
    _merge_two_states_kernel[(-(-num_rows // _BLOCK_ROWS),)](
        out_a.contiguous(), lse_a.contiguous(), out_b.contiguous(), lse_b.contiguous(),
        merged_out, merged_lse,
        num_rows, head_dim,
        BLOCK_ROWS=_BLOCK_ROWS,
        BLOCK_D=next_power_of_2(head_dim),
    )
    return merged_out, merged_lse


def _check_ragged(fn: str, out, lse, offsets, indices):
    _check_state(fn, out, lse)
    if out.dim() != 3:
        raise ValueError(f"{fn}: out must be [N, H, D], got {tuple(out.shape)}")
    check_unit_last_stride(fn, "out", out)
    for name, t in (("offsets", offsets), ("indices", indices)):
        check_tensor(fn, name, t, ndim=1, dtypes=(torch.int32,))
        check_unit_last_stride(fn, name, t)
    if offsets.shape[0] < 1:
        raise ValueError(f"{fn}: offsets must be [G+1] (at least one entry), got {tuple(offsets.shape)}")
    return check_same_device(fn, out=out, lse=lse, offsets=offsets, indices=indices)


def merge_ragged_states(
    out: torch.Tensor, lse: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ragged groups of attention states, one launch for all the groups.

    out: [N, H, D] fp32 (last-dim stride 1), lse: [N, H] fp32 natural-log sum-exp; offsets:
    [G+1] int32, indices: [M] int32: group j merges the states indices[offsets[j]:offsets[j+1]]
    (a decode query's pairs in logical block order). An empty state (lse = -inf) contributes
    nothing and its out is not read. Returns merged out [G, H, D] and lse [G, H] fp32; a group with
    no state, or only empty ones, gets out 0 and lse -inf.
    """
    fn = "merge_ragged_states"
    device = _check_ragged(fn, out, lse, offsets, indices)
    require_launchable(_merge_ragged_states_kernel, fn, device)
    num_groups = offsets.shape[0] - 1
    num_heads, head_dim = out.shape[1], out.shape[2]
    merged_out = torch.empty(num_groups, num_heads, head_dim, dtype=torch.float32, device=device)
    merged_lse = torch.empty(num_groups, num_heads, dtype=torch.float32, device=device)
    if merged_lse.numel() == 0:
        return merged_out, merged_lse
    _merge_ragged_states_kernel[(num_groups, num_heads)](
        out, lse, offsets, indices, merged_out, merged_lse,
        num_heads, head_dim,
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        merged_out.stride(0), merged_out.stride(1),
        merged_lse.stride(0), merged_lse.stride(1),
        BLOCK_N=_BLOCK_N,
        BLOCK_D=next_power_of_2(head_dim),
    )
    return merged_out, merged_lse


def merge_attention_states_ref(
    out: torch.Tensor, lse: torch.Tensor, dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch reference of `merge_attention_states`."""
    fn = "merge_attention_states_ref"
    _check_state(fn, out, lse)
    dim = _normalise_dim(fn, dim, lse.dim())
    if lse.shape[dim] == 0:
        kept = lse.shape[:dim] + lse.shape[dim + 1 :]
        return out.new_zeros(*kept, out.shape[-1]), lse.new_full(kept, -math.inf)
    m = lse.amax(dim=dim, keepdim=True)
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    w = torch.exp(lse - m_safe)  # 0 for empty states
    total = w.sum(dim=dim)
    part = torch.where((w > 0).unsqueeze(-1), w.unsqueeze(-1) * out.float(), 0.0)
    seen = total > 0
    merged = part.sum(dim=dim) / torch.where(seen, total, 1.0).unsqueeze(-1)
    merged_lse = torch.where(seen, m_safe.squeeze(dim) + torch.log(torch.where(seen, total, 1.0)), -math.inf)
    return merged, merged_lse


def merge_two_states_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch reference of `merge_two_states`."""
    return merge_attention_states_ref(
        torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]), dim=0
    )


def merge_ragged_states_ref(
    out: torch.Tensor, lse: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch reference of `merge_ragged_states` (one group at a time)."""
    _check_ragged("merge_ragged_states_ref", out, lse, offsets, indices)
    merged = [
        merge_attention_states_ref(out[chosen], lse[chosen], dim=0)
        for chosen in (indices[int(a):int(b)].long() for a, b in zip(offsets[:-1], offsets[1:]))
    ]
    if not merged:
        return out.new_zeros(0, *out.shape[1:]), lse.new_zeros(0, lse.shape[1])
    return torch.stack([m[0] for m in merged]), torch.stack([m[1] for m in merged])


__all__ = [
    "merge_attention_states",
    "merge_attention_states_ref",
    "merge_ragged_states",
    "merge_ragged_states_ref",
    "merge_two_states",
    "merge_two_states_ref",
]
