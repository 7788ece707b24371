"""Paged attention in torch: per-block partial states and their merge.

Every block is attended on its own: its scores, its softmax max and sum, and its output
normalised by that sum, kept as (output, log-sum-exp) in fp32. The states of all blocks are
then merged in logical block order. Because no arithmetic crosses a block boundary before the
merge, the result does not depend on how blocks were grouped into passes through the pool or
which slots held them (docs/exactness.md).

Rows: the T query tokens of Hq = Hkv * G heads are arranged per KV head as R = T * G rows,
row r = t * G + g, so grouped-query attention needs no repeated K/V.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..config import BLOCK_TOKENS

_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

# Query rows over keys read in place: (qh [Hkv, R, D], [(k, v) [Hkv, n, D] views, together the keys
# in order], causal, group[, window]) -> (out [Hkv, R, D], lse [Hkv, R]) fp32, or None where it does
# not apply (torch's flash attention then runs). causal None: every row sees every key; causal c:
# row r (token r // group) sees keys 0 .. c + r // group, the last `window` of them where window > 0.
AttendAll = Callable[..., "tuple[torch.Tensor, torch.Tensor] | None"]


def query_rows(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q: [T, Hq, D] -> [Hkv, T*G, D] fp32."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    return q.float().reshape(num_tokens, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv_heads, num_tokens * group, head_dim)


def rows(q: torch.Tensor, positions: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D] at positions [T] -> query rows [Hkv, T*G, D] fp32 and each row's position [T*G]."""
    group = q.shape[1] // num_kv_heads
    return query_rows(q, num_kv_heads), positions.to(torch.int64).repeat_interleave(group)


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
    n = k.shape[0]
    kf, vf = k.float(), v.float()
    first, last = _visible_range(row_pos, seq_end, window)
    key_first = block_pos.to(torch.int64) * BLOCK_TOKENS
    key_last = key_first + BLOCK_TOKENS - 1
    whole = ((key_last <= int(last.min())) & (key_first >= int(first.max()))).tolist()  # visible to every row in full
    q4 = qh.unsqueeze(0)
    outs, lses = [], []
    start = 0
    while start < n:  # consecutive stretches of blocks that are all whole, or all not
        end = start
        while end < n and whole[end] == whole[start]:
            end += 1
        batch = q4.expand(end - start, -1, -1, -1)
        if whole[start]:
            o, l = _flash_cpu(batch, kf[start:end], vf[start:end], scale=scale)
        else:
            key_pos = key_first[start:end, None] + torch.arange(BLOCK_TOKENS)  # [m, 64]
            visible = (key_pos[:, None, :] <= last[None, :, None]) & (key_pos[:, None, :] >= first[None, :, None])
            mask = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))
            o, l = _flash_cpu(batch, kf[start:end], vf[start:end], attn_mask=mask[:, None], scale=scale)
            none = ~visible.any(-1)  # [m, R]: rows that see nothing of a block (the kernel gives lse 0 there)
            if bool(none.any()):
                l = l.masked_fill(none[:, None, :], float("-inf"))
                o = o.masked_fill(none[:, None, :, None], 0.0)
        outs.append(o)
        lses.append(l)
        start = end
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def range_attention(
    qh: torch.Tensor,
    row_pos: torch.Tensor,
    runs: list[tuple[torch.Tensor, torch.Tensor, int]],
    seq_end: int,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query rows over a context's blocks read where they lie, as one state.

    runs: (k, v [Hkv, n*64, D] views of consecutive blocks, logical index of the first), in
    logical order, together the blocks the rows may see (consecutive logical indices). The blocks
    every row sees whole go through one unmasked flash-attention call (over a view when they lie
    in one run, as fast as attention over a contiguous cache; gathered when they do not); the edge
    blocks (causal and window boundaries) get per-block masked calls; the pieces are merged in
    logical order. The split is fixed by the positions alone, so the result depends only on the
    context, not on where its blocks are stored. Returns out: [Hkv, R, D], lse: [Hkv, R].
    """
    num_kv_heads, _, head_dim = qh.shape
    if not runs:
        return torch.zeros(qh.shape), torch.full(qh.shape[:2], float("-inf"))
    first, last = _visible_range(row_pos, seq_end, window)
    first_block = runs[0][2]
    n = sum(k.shape[1] for k, _, _ in runs) // BLOCK_TOKENS
    key_first = (first_block + torch.arange(n, dtype=torch.int64)) * BLOCK_TOKENS
    whole = ((key_first + BLOCK_TOKENS - 1 <= int(last.min())) & (key_first >= int(first.max()))).tolist()
    if _flash_cpu is None or qh.device.type != "cpu":
        whole = [False] * n
    lo = whole.index(True) if True in whole else n
    hi = lo
    while hi < n and whole[hi]:
        hi += 1
    outs, lses = [], []
    for a, b, is_whole in ((0, lo, False), (lo, hi, True), (hi, n, False)):
        if b <= a:
            continue
        k, v = _blocks(runs, a, b)  # [Hkv, (b-a)*64, D]
        if is_whole:
            o, l = _flash_cpu(qh.unsqueeze(0), k.float().unsqueeze(0), v.float().unsqueeze(0), scale=scale)
        else:
            # [Hkv, m*64, D] -> [m, Hkv, 64, D] (a view) for per-block states
            kb = k.reshape(num_kv_heads, b - a, BLOCK_TOKENS, head_dim).transpose(0, 1)
            vb = v.reshape(num_kv_heads, b - a, BLOCK_TOKENS, head_dim).transpose(0, 1)
            o, l = block_states(qh, row_pos, kb, vb, first_block + torch.arange(a, b), seq_end, window, scale)
        outs.append(o)
        lses.append(l)
    return merge_states_with_lse(torch.cat(outs), torch.cat(lses))


def causal_attention(q: torch.Tensor, runs: list[tuple[torch.Tensor, torch.Tensor, int]], q_start: int,
                     scale: float) -> torch.Tensor | None:
    """A prefill chunk's causal attention over its context, full-attention layers, keys read where
    they lie: q [T, Hq, D] at positions q_start.. over runs (as in range_attention) holding keys
    0 .. q_start+T-1. Two flash-attention calls (the keys before the chunk, all visible; the chunk
    itself, causal) and one merge: what an attention over a contiguous cache does. Returns
    [T, Hq, D] fp32, or None where the CPU flash kernel is not available."""
    if _flash_cpu is None or q.device.type != "cpu":
        return None
    num_tokens = q.shape[0]
    qh = q.float().transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]: the kernel pairs Hq heads with Hkv (GQA)
    k, v = _tokens(runs, q_start, q_start + num_tokens)
    out, lse = _flash_cpu(qh, k.float().unsqueeze(0), v.float().unsqueeze(0), is_causal=True, scale=scale)
    if q_start:
        k, v = _tokens(runs, 0, q_start)
        before, before_lse = _flash_cpu(qh, k.float().unsqueeze(0), v.float().unsqueeze(0), scale=scale)
        out, lse = merge_states_with_lse(torch.stack([before, out]), torch.stack([before_lse, lse]))
    return out[0].transpose(0, 1)  # [T, Hq, D]


def token_views(runs: list[tuple[torch.Tensor, torch.Tensor, int]], a: int, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) [Hkv, n, D] views of the context's tokens at positions a .. b-1, in order (runs: (k, v,
    logical index of the first block))."""
    views = []
    for k, v, first_block in runs:
        lo, hi = first_block * BLOCK_TOKENS, first_block * BLOCK_TOKENS + k.shape[1]
        if max(a, lo) < min(b, hi):
            views.append((k[:, max(a, lo) - lo:min(b, hi) - lo], v[:, max(a, lo) - lo:min(b, hi) - lo]))
    return views


def _joined(views: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One K, V [Hkv, n, D]: the view itself when there is one, else gathered."""
    if len(views) == 1:
        return views[0]
    return torch.cat([k for k, _ in views], dim=1), torch.cat([v for _, v in views], dim=1)


def _tokens(runs: list[tuple[torch.Tensor, torch.Tensor, int]], a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [Hkv, b-a, D] of the context's tokens a .. b-1: a view when they lie in one run, else gathered."""
    return _joined(token_views(runs, a, b))


def _blocks(runs: list[tuple[torch.Tensor, torch.Tensor, int]], a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [Hkv, (b-a)*64, D] of the context's blocks a .. b-1 (counted from the first run): a
    view when they lie in one run, else gathered."""
    views, offset = [], 0
    for k, v, _ in runs:
        count = k.shape[1] // BLOCK_TOKENS
        lo, hi = max(a, offset), min(b, offset + count)
        if lo < hi:
            views.append((k[:, (lo - offset) * BLOCK_TOKENS:(hi - offset) * BLOCK_TOKENS],
                          v[:, (lo - offset) * BLOCK_TOKENS:(hi - offset) * BLOCK_TOKENS]))
        offset += count
    return _joined(views)


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
    return merge_states_with_lse(out, lse)[0]


def merge_states_with_lse(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As merge_states, also returning the merged log-sum-exp (-inf where every state is empty)."""
    top = lse.amax(0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)  # 0 for empty states
    total = weights.sum(0)
    merged = (weights[..., None] * out).sum(0)
    return merged / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None], top + torch.log(total)


def pair_states(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, pair_slot: torch.Tensor,
                pair_pos: torch.Tensor, pair_query: torch.Tensor, q_pos: torch.Tensor, q_end: torch.Tensor,
                window: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode states of (block, query) pairs in one batch, with no host read (a device step's
    torch attention; the Triton kernel `shared_decode_states` is its fast twin).

    q: [Nq, Hq, D] fp32; k_slots, v_slots: [S, Hkv, 64, D] (the pool's slots); pair_slot,
    pair_pos, pair_query: [P] int (the slot holding the pair's block, -1 for none; its logical
    index; the query); q_pos, q_end: [Nq] as in `block_states`. Returns out [P, Hq, D] and lse
    [P, Hq] fp32, -inf (out 0) where a pair sees no key."""
    num_pairs = pair_slot.shape[0]
    num_kv_heads, head_dim = k_slots.shape[1], k_slots.shape[3]
    group = q.shape[1] // num_kv_heads
    present = pair_slot >= 0
    slots = torch.where(present, pair_slot, 0).long()
    k = k_slots.index_select(0, slots)[:, :, :BLOCK_TOKENS].float()  # [P, Hkv, 64, D]
    v = v_slots.index_select(0, slots)[:, :, :BLOCK_TOKENS].float()
    query = pair_query.long()
    qp = q.index_select(0, query).view(num_pairs, num_kv_heads, group, head_dim)
    scores = torch.matmul(qp, k.transpose(-1, -2)) * scale  # [P, Hkv, G, 64]
    key_pos = pair_pos.long()[:, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS, device=q.device)  # [P, 64]
    row_pos = q_pos.long().index_select(0, query)[:, None]
    seen = (key_pos <= row_pos) & (key_pos < q_end.long().index_select(0, query)[:, None]) & present[:, None]
    if window > 0:
        seen &= key_pos > row_pos - window
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    block_max = scores.amax(-1)
    block_max = torch.where(torch.isinf(block_max), torch.zeros_like(block_max), block_max)
    probs = torch.exp(scores - block_max[..., None])
    block_sum = probs.sum(-1)  # [P, Hkv, G]
    out = torch.matmul(probs, v) / block_sum.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    lse = block_max + torch.log(block_sum)
    return out.reshape(num_pairs, num_kv_heads * group, head_dim), lse.reshape(num_pairs, num_kv_heads * group)


def merge_pairs(out: torch.Tensor, lse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Each query's pairs merged in logical order: dense [Nq, K] lists them (padded with a pair
    whose lse is -inf). out [P, Hq, D], lse [P, Hq] -> [Nq, Hq, D] fp32 (0 for a query of none)."""
    index = dense.long()
    lse_q = lse[index].transpose(0, 1)  # [K, Nq, Hq]
    out_q = out[index].transpose(0, 1)  # [K, Nq, Hq, D]
    return merge_states(out_q, lse_q)
