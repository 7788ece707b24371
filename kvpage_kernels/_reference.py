"""Plain-torch building blocks of the attention references (fp32, no Triton)."""

from __future__ import annotations

import torch

from .constants import BLOCK_TOKENS


def gather_blocks(k_pool, v_pool, valid, slot_ids, block_pos):
    """Keys, values and positions of the readable entries of one block list.

    An entry is readable when its slot id is in the pool and the slot's valid bit is set; the
    others are never indexed, so whatever an invalid slot holds cannot reach the result.
    slot_ids, block_pos: [M] -> k, v: [N*64, Hkv, D] fp32, pos: [N*64] int64
    """
    num_slots, num_kv_heads, _, head_dim = k_pool.shape
    slots = slot_ids.long()
    in_pool = (slots >= 0) & (slots < num_slots)
    readable = in_pool.clone()
    readable[in_pool] = valid[slots[in_pool]].to(torch.bool)
    slots = slots[readable]
    first = block_pos.long()[readable] * BLOCK_TOKENS
    # k_pool[slots]: [N, Hkv, 64, D] -> [N, 64, Hkv, D] -> [N*64, Hkv, D]
    k = k_pool[slots].float().transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    v = v_pool[slots].float().transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    pos = (first[:, None] + torch.arange(BLOCK_TOKENS, device=first.device)).reshape(-1)
    return k, v, pos


def attend(q, k, v, q_pos, k_pos, scale: float, window: int):
    """Masked softmax attention in fp32 with GQA; rows that see no key get out=0, lse=-inf.

    q: [T, Hq, D], k, v: [N, Hkv, D], q_pos: [T], k_pos: [N] -> out: [T, Hq, D], lse: [T, Hq]
    """
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [N, Hq, D]
    v = v.float().repeat_interleave(group, dim=1)
    q_pos = q_pos.long()[:, None]
    k_pos = k_pos.long()[None, :]
    visible = k_pos <= q_pos  # [T, N]
    if window > 0:
        visible &= k_pos > q_pos - window
    scores = torch.einsum("thd,nhd->thn", q.float(), k) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, Hq]
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
    out = torch.einsum("thn,nhd->thd", probs, v)
    out = out.masked_fill(empty[..., None], 0.0)
    return out, lse
