"""Paged attention in torch: per-block partial states and their merge.

Every block is attended on its own: its scores, its softmax max and sum, and its output
normalised by that sum, kept as (output, log-sum-exp) in fp32. The states of all blocks are
then merged in logical block order. Because no arithmetic crosses a block boundary before the
merge, the result does not depend on how blocks were grouped into passes through the pool or
which slots held them (DESIGN.md section 2).

Rows: the T query tokens of Hq = Hkv * G heads are arranged per KV head as R = T * G rows,
row r = t * G + g, so grouped-query attention needs no repeated K/V.
"""

from __future__ import annotations

import torch

from .config import BLOCK_TOKENS

_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def query_rows(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q: [T, Hq, D] -> [Hkv, T*G, D] fp32."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    return q.float().view(num_tokens, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv_heads, num_tokens * group, head_dim)


def rows_to_tokens(x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """x: [Hkv, T*G, D] -> [T, Hq, D]."""
    num_kv_heads, rows, head_dim = x.shape
    group = rows // num_tokens
    return x.view(num_kv_heads, num_tokens, group, head_dim).permute(1, 0, 2, 3).reshape(num_tokens, num_kv_heads * group, head_dim)


def block_states(
    qh: torch.Tensor,
    row_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_pos: torch.Tensor,
    seq_end: int,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query rows over n blocks, one state per block.

    qh: [Hkv, R, D] fp32 query rows; row_pos: [R] absolute position of each row; k, v:
    [n, Hkv, 64, D]; block_pos: [n] logical block indices. A key at position p is visible to a
    row at position qp iff p <= qp, p < seq_end and (window == 0 or p > qp - window).
    Returns out: [n, Hkv, R, D] fp32 (each block's output normalised by its own softmax sum)
    and lse: [n, Hkv, R] fp32 (-inf where a block has nothing visible to a row; out is 0 there).
    """
    if _flash_cpu is not None and k.device.type == "cpu":
        return _block_states_flash(qh, row_pos, k, v, block_pos, seq_end, window, scale)
    return _block_states_matmul(qh, row_pos, k, v, block_pos, seq_end, window, scale)


def _visible_range(row_pos: torch.Tensor, seq_end: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first and last visible key position."""
    last = torch.clamp(row_pos, max=seq_end - 1)
    first = torch.clamp(row_pos - window + 1, min=0) if window > 0 else torch.zeros_like(row_pos)
    return first, last


def _block_states_flash(qh, row_pos, k, v, block_pos, seq_end, window, scale):
    # Blocks as the batch dimension of torch's CPU flash-attention kernel: each block is one
    # independent softmax over its 64 keys, which returns exactly the per-block state.
    num_kv_heads, rows, head_dim = qh.shape
    n = k.shape[0]
    kf, vf = k.float(), v.float()
    first, last = _visible_range(row_pos, seq_end, window)
    key_first = block_pos.to(torch.int64) * BLOCK_TOKENS
    key_last = key_first + BLOCK_TOKENS - 1
    whole = (key_last <= int(last.min())) & (key_first >= int(first.max()))  # [n] visible to every row in full
    none = (key_first[:, None] > last[None, :]) | (key_last[:, None] < first[None, :])  # [n, R]

    out = torch.empty(n, num_kv_heads, rows, head_dim)
    lse = torch.empty(n, num_kv_heads, rows)
    whole_idx = torch.nonzero(whole).flatten().tolist()
    lo, hi = (whole_idx[0], whole_idx[-1] + 1) if whole_idx else (n, n)
    if hi - lo != len(whole_idx):  # not one contiguous stretch: mask them all
        lo, hi = n, n
    q4 = qh.unsqueeze(0)
    if hi > lo:
        o, l = _flash_cpu(q4.expand(hi - lo, -1, -1, -1), kf[lo:hi], vf[lo:hi], scale=scale)
        out[lo:hi], lse[lo:hi] = o, l
    for a, b in ((0, lo), (hi, n)):
        if b <= a:
            continue
        key_pos = key_first[a:b, None] + torch.arange(BLOCK_TOKENS)  # [m, 64]
        visible = (key_pos[:, None, :] <= last[None, :, None]) & (key_pos[:, None, :] >= first[None, :, None])
        mask = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))
        o, l = _flash_cpu(q4.expand(b - a, -1, -1, -1), kf[a:b], vf[a:b], attn_mask=mask[:, None], scale=scale)
        out[a:b], lse[a:b] = o, l
    if bool(none.any()):
        lse.masked_fill_(none[:, None, :], float("-inf"))
        out.masked_fill_(none[:, None, :, None], 0.0)
    return out, lse


def _block_states_matmul(qh, row_pos, k, v, block_pos, seq_end, window, scale):
    num_kv_heads, rows, head_dim = qh.shape
    n = k.shape[0]
    kf = k.float().permute(1, 0, 2, 3).reshape(num_kv_heads, n * BLOCK_TOKENS, head_dim)
    scores = torch.matmul(qh, kf.transpose(1, 2)) * scale  # [Hkv, R, n*64]
    first, last = _visible_range(row_pos, seq_end, window)
    key_pos = (block_pos.to(torch.int64)[:, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS, device=k.device)).reshape(-1)
    hidden = (key_pos[None, :] > last[:, None]) | (key_pos[None, :] < first[:, None])
    scores.masked_fill_(hidden, float("-inf"))
    scores = scores.view(num_kv_heads, rows, n, BLOCK_TOKENS)
    block_max = scores.amax(-1)  # [Hkv, R, n]
    block_max = torch.where(torch.isinf(block_max), torch.zeros_like(block_max), block_max)
    probs = torch.exp(scores - block_max[..., None])
    block_sum = probs.sum(-1)  # [Hkv, R, n]
    vf = v.float().permute(1, 0, 2, 3)  # [Hkv, n, 64, D]
    out = torch.matmul(probs.permute(0, 2, 1, 3), vf)  # [Hkv, n, R, D]
    out = out / block_sum.permute(0, 2, 1).clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    lse = block_max + torch.log(block_sum)  # -inf where the block sum is 0
    return out.permute(1, 0, 2, 3), lse.permute(2, 0, 1)


def merge_states(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merges states along dim 0 in order. out: [n, ..., D], lse: [n, ...] -> [..., D] fp32."""
    top = lse.amax(0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)  # 0 for empty states
    total = weights.sum(0)
    merged = (weights[..., None] * out).sum(0)
    return merged / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
