"""Selective mode in the device's decode step: each layer's blocks chosen on the device.

The per-layer path's `Selector` (attention/selector.py) scores a query's candidate blocks on the
host and keeps the first block, the last `recent_blocks` blocks and the best-scored others within
the budget. The device step (device_step.py) makes the same choice on the device, per layer, over
the step's (block, query) pairs, with no host read:

- scores: the quest policy's bound from each slot's element-wise key min and max, kept beside the
  pool (`SlotBounds`: set when a block is loaded into its slot, carried by a copy on write, updated
  by every row a step writes); or the scores policy's per-block relevance, which the host packs
  with the step's plan (it changes only with the plan or a new prompt);
- the choice: per query a stable two-key sort (kept blocks first, then by score, ties to the later
  block, as `policy.choose` breaks them), the first max(budget, kept) taken;
- attention reads only the chosen pairs, each query's in logical order, merged as the per-layer
  path merges them: with the Triton kernels, the same bits (pads after a query's pairs add empty
  states, which change no bit); the torch backend computes them in one batch, exact to rounding.

The count of blocks chosen comes back with the step's tokens, in its one readback. Where a score
ties with another's within rounding, the device may choose otherwise than the host (its bound is
computed in other batch shapes); the tests compare choices on blocks that do not tie.

Policies with memory of past steps or with a step's own attention (lru, draft) run on the
per-layer path, as do steps whose blocks do not all fit the pool: a choice made on the device
cannot bring blocks from the host without the host waiting for it.
"""

from __future__ import annotations

import numpy as np
import torch

from .attention.policy import key_bound
from .config import BLOCK_TOKENS

DEVICE_POLICIES = ("quest", "scores")


class SlotBounds:
    """Per layer and slot (the sink included) the element-wise min and max of the keys a resident
    block holds, fp32 from the values as kept: the host's QuestPolicy computes its bounds from the
    same values, and min and max do not round. Only for `layers` (those that select: sliding-window
    layers read their whole window)."""

    def __init__(self, pool, layers: list[int]) -> None:
        pool.allocate()
        self.pool = pool
        slots, heads, _, dim = pool.k[0].shape
        device = pool.device
        self.kmin = {layer: torch.full((slots, heads, dim), float("inf"), device=device) for layer in layers}
        self.kmax = {layer: torch.full((slots, heads, dim), float("-inf"), device=device) for layer in layers}

    def loaded(self, layers: list[int], slots: list[int], rows: list[int]) -> None:
        """Blocks just loaded into `slots` of every layer in `layers`, their first `rows` rows theirs."""
        layers = [layer for layer in layers if layer in self.kmin]
        if not layers:
            return
        device = self.pool.device
        index = torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
        count = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        unwritten = (torch.arange(BLOCK_TOKENS, device=device) >= count[:, None])[:, None, :, None]  # [n, 1, 64, 1]
        for layer in layers:
            k = self.pool.k[layer].index_select(0, index).float()  # [n, Hkv, 64, D]
            self.kmin[layer].index_copy_(0, index, k.masked_fill(unwritten, float("inf")).amin(dim=2))
            self.kmax[layer].index_copy_(0, index, k.masked_fill(unwritten, float("-inf")).amax(dim=2))

    def copied(self, layers: list[int], src: int, dst: int) -> None:
        for layer in (layer for layer in layers if layer in self.kmin):
            self.kmin[layer][dst].copy_(self.kmin[layer][src])
            self.kmax[layer][dst].copy_(self.kmax[layer][src])

    def wrote(self, layer: int, slots: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor) -> None:
        """A step's rows k [B, Hkv, D] (as kept) written at `offsets` of `slots` (device, [B]); a
        row at offset 0 starts its block's bounds. Padding rows all go to the sink, never read."""
        if layer not in self.kmin:
            return
        row = k.float()
        first = (offsets == 0)[:, None, None]
        low = torch.where(first, row, torch.minimum(self.kmin[layer].index_select(0, slots), row))
        high = torch.where(first, row, torch.maximum(self.kmax[layer].index_select(0, slots), row))
        self.kmin[layer].index_copy_(0, slots, low)
        self.kmax[layer].index_copy_(0, slots, high)


def quest_scores(q: torch.Tensor, bounds: SlotBounds, layer: int, pair_slot: torch.Tensor,
                 pair_query: torch.Tensor) -> torch.Tensor:
    """Quest's bound per pair, summed over the query heads: q [Nq, Hq, D] fp32 -> [P] fp32 (pads
    read slot 0: their scores are never taken)."""
    slots = torch.where(pair_slot >= 0, pair_slot, 0).long()
    kmin = bounds.kmin[layer].index_select(0, slots)  # [P, Hkv, D]
    kmax = bounds.kmax[layer].index_select(0, slots)
    heads, dim = kmin.shape[1], kmin.shape[2]
    qg = q.index_select(0, pair_query.long()).view(slots.shape[0], heads, -1, dim)  # [P, Hkv, G, D]
    return key_bound(qg, kmin, kmax).sum(dim=(1, 2))


def candidates(dense: torch.Tensor, real: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What every layer of a group chooses from, made once a step: dense [Nq, K] each query's
    pairs in logical order (pads: entries not `real`), keep [P] the always-kept pairs -> (dense
    as int64, [Nq, K] each entry's kind with the later blocks first: 1 kept, 0 other, -1 none)."""
    index = dense.long()
    return index, torch.where(real, keep[index].to(torch.int32), -1).flip(1)


def choose(scores: torch.Tensor, index: torch.Tensor, kind: torch.Tensor, budget: int, width: int,
           pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's chosen pairs, as `policy.choose` picks them: scores [P] per pair; index, kind
    from `candidates`; the kept pairs and the best-scored others within `budget` pairs a query
    (all the kept ones where they are more), ties to the later block. Returns ([Nq, width] the
    chosen pairs in logical order, `pad` after them; the number chosen, a device scalar)."""
    by_score = torch.sort(scores[index].flip(1), dim=1, descending=True, stable=True).indices
    by_kind = torch.sort(kind.gather(1, by_score), dim=1, descending=True, stable=True).indices
    order = by_score.gather(1, by_kind)  # columns of the flipped rows, the first to take first
    limit = torch.clamp((kind == 1).sum(dim=1), min=budget)
    take = torch.arange(index.shape[1], device=index.device)[None, :] < limit[:, None]
    chosen = (torch.zeros_like(take).scatter_(1, order, take) & (kind >= 0)).flip(1)
    column = torch.where(chosen, chosen.cumsum(dim=1) - 1, width)  # width: a column dropped below
    out = torch.full((index.shape[0], width + 1), pad, dtype=torch.int64, device=index.device)
    out.scatter_(1, column, index)
    return out[:, :width], chosen.sum()


def scores_table(tables, num_layers: int) -> np.ndarray | None:
    """The scores policy's per-layer tables of a context (Engine.block_scores) as one [layers,
    blocks] array; None where the context has none (every block scores +inf: all kept by rank)."""
    if tables is None:
        return None
    return np.stack([tables[layer].numpy() for layer in range(num_layers)]).astype(np.float32)


def pair_scores(plan, layers: list[int], tables: list[np.ndarray | None]) -> np.ndarray:
    """[len(layers), P] the scores policy's score of each pair of a group's plan: its query's
    context's relevance of the block, +inf where that context has none for it (blocks written
    after its prompt), as `ScoresPolicy.scores` gives it."""
    positions = plan.item_pos[plan.pair_item]
    out = np.full((len(layers), plan.num_pairs), np.inf, dtype=np.float32)
    rows = np.asarray(layers, dtype=np.int64)
    for query, table in enumerate(tables):
        if table is None:
            continue
        pairs = np.flatnonzero(plan.pair_query == query)
        pos = positions[pairs]
        known = pos < table.shape[1]
        out[:, pairs[known]] = table[rows[:, None], pos[known][None, :]]
    return out
