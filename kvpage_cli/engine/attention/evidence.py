"""Attention mass per token: how much attention some query rows (an answer's tokens, a question's)
paid each token of a context, read from the stored blocks with the torch reference's arithmetic.

It runs after an answer, off the decode path: the answer is appended to a copy of the context it
was asked in, keeping every row's queries (`Engine.append_with_queries`), and each key's softmax
share is summed over those rows, the heads and the full-attention layers (a sliding-window layer
sees only the last tokens before each row, the question's and the answer's, not the document).
Tasks turn the mass of the document's tokens into the lines an answer rests on (tasks/evidence.py).
"""

from __future__ import annotations

import torch

from ..config import BLOCK_TOKENS
from ..kv.context import Context
from .reference import rows as query_rows

MAX_SCORE_ELEMENTS = 1 << 24  # logits held at once per layer (64 MiB of fp32): query rows go in slices


def token_mass(engine, ctx: Context, queries: dict[int, tuple[torch.Tensor, int]],
               layers: list[int] | None = None) -> torch.Tensor:
    """[ctx.num_cached] fp32: per position of `ctx`, the attention the query rows paid it, summed
    over the rows, the query heads and `layers` (default: every full-attention layer, or every
    layer where the model has none). queries: layer -> (q [T, Hq, D] rotated, position of its
    first row), rows at consecutive positions inside the context. Each row sees the positions up
    to its own (and, in a sliding-window layer, its window), as it did when it was computed; each
    row's shares sum to 1 per head and layer."""
    spec = engine.spec
    length = ctx.num_cached
    total = torch.zeros(length)
    if layers is None:
        full = [i for i, layer in enumerate(spec.layers) if not layer.window]
        layers = full or list(range(spec.num_layers))
    for layer in layers:
        if layer not in queries:
            continue
        q, start = queries[layer]
        group = engine.store.group_of(layer)
        ids, blocks = ctx.tables[group.index].live()
        if not ids:
            continue
        pos = engine.store.layer_pos[layer]
        k = torch.stack([group.k_values(pos, b) for b in ids]).float()  # [n, Hkv, 64, D]
        q = q.to(k.device)  # kept on the compute device (a GPU's), scored where the blocks are
        num_kv_heads, head_dim = k.shape[1], k.shape[3]
        k = k.permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)  # [Hkv, n*64, D]
        key_pos = (torch.tensor(blocks, dtype=torch.int64)[:, None] * BLOCK_TOKENS
                   + torch.arange(BLOCK_TOKENS)).reshape(-1)  # [n*64]
        qh, row_pos = query_rows(q, torch.arange(start, start + q.shape[0]), num_kv_heads)  # [Hkv, R, D], [R]
        step = max(1, MAX_SCORE_ELEMENTS // max(1, num_kv_heads * key_pos.numel()))
        for a in range(0, qh.shape[1], step):
            rows, at = qh[:, a:a + step], row_pos[a:a + step]
            logits = torch.matmul(rows, k.transpose(1, 2)) * spec.attn_scale  # [Hkv, r, n*64]
            hidden = (key_pos[None, :] > at[:, None]) | (key_pos[None, :] >= length)
            if group.window:
                hidden |= key_pos[None, :] <= at[:, None] - group.window
            logits.masked_fill_(hidden, float("-inf"))
            share = torch.softmax(logits, dim=-1).sum(dim=(0, 1))  # [n*64]
            inside = key_pos < length
            total.index_add_(0, key_pos[inside], share[inside])
    shard = engine.runner.shard
    return shard.all_reduce(total) if shard is not None else total  # every rank's heads
