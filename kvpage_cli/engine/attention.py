"""Paged attention in torch: per-block partial states and their merge.

Every block is attended on its own: its scores, its softmax max and sum, and its output
normalised by that sum, kept as (output, log-sum-exp) in fp32. The states of all blocks are
then merged in logical block order. Because no arithmetic crosses a block boundary before the
merge, the result does not depend on how blocks were grouped into passes through the pool or
which slots held them (DESIGN.md section 2).
"""

from __future__ import annotations

import torch

from .config import BLOCK_TOKENS


def block_states(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_pos: torch.Tensor,
    seq_end: int,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of T query tokens over n blocks, one state per block.

    q: [T, Hq, D]; q_pos: [T] absolute positions; k, v: [n, Hkv, 64, D]; block_pos: [n] logical
    block indices. A key at position p is visible to a query at qp iff p <= qp, p < seq_end and
    (window == 0 or p > qp - window).
    Returns out: [n, T, Hq, D] fp32 (each block's output normalised by its own softmax sum) and
    lse: [n, T, Hq] fp32 (-inf where a block has nothing visible; its output is 0 there).
    """
    num_tokens, num_heads, head_dim = q.shape
    n, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    rows = num_tokens * group
    # qh: [Hkv, T*G, D], row r = t*G + g
    qh = q.float().view(num_tokens, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv_heads, rows, head_dim)
    # kf: [Hkv, n*64, D]
    kf = k.float().permute(1, 0, 2, 3).reshape(num_kv_heads, n * BLOCK_TOKENS, head_dim)
    scores = torch.matmul(qh, kf.transpose(1, 2)) * scale  # [Hkv, T*G, n*64]

    key_pos = (block_pos.to(torch.int64)[:, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS, device=k.device)).reshape(-1)
    row_pos = q_pos.to(torch.int64).repeat_interleave(group)[:, None]  # [T*G, 1]
    hidden = (key_pos[None, :] > row_pos) | (key_pos[None, :] >= seq_end)
    if window > 0:
        hidden |= key_pos[None, :] <= row_pos - window
    scores.masked_fill_(hidden, float("-inf"))

    scores = scores.view(num_kv_heads, rows, n, BLOCK_TOKENS)
    block_max = scores.amax(-1)  # [Hkv, T*G, n]
    block_max = torch.where(torch.isinf(block_max), torch.zeros_like(block_max), block_max)
    probs = torch.exp(scores - block_max[..., None])
    block_sum = probs.sum(-1)  # [Hkv, T*G, n]
    vf = v.float().permute(1, 0, 2, 3)  # [Hkv, n, 64, D]
    out = torch.matmul(probs.permute(0, 2, 1, 3), vf)  # [Hkv, n, T*G, D]
    out = out / block_sum.permute(0, 2, 1).clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    lse = block_max + torch.log(block_sum)  # -inf where the block sum is 0

    out = out.view(num_kv_heads, n, num_tokens, group, head_dim).permute(1, 2, 0, 3, 4).reshape(n, num_tokens, num_heads, head_dim)
    lse = lse.view(num_kv_heads, num_tokens, group, n).permute(3, 1, 0, 2).reshape(n, num_tokens, num_heads)
    return out, lse


def merge_states(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merges states along dim 0 in order. out: [n, T, H, D], lse: [n, T, H] -> [T, H, D] fp32."""
    top = lse.amax(0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)  # [n, T, H]; 0 for empty states
    total = weights.sum(0)
    merged = (weights[..., None] * out).sum(0)
    return merged / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
