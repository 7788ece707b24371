"""Selective mode: per layer and decode step, the blocks attention may read.

The budget is the pool: `slots` blocks per layer. Always kept: the first block (attention
sink), the last `recent_blocks` blocks, and all blocks of a sliding-window layer (its table
holds only its window). The policy's best-scored blocks fill the rest of the budget.
"""

from __future__ import annotations

import torch

from ..kv.store import BlockStore
from ..model.spec import ModelSpec
from .policy import DraftPolicy, Policy, always_kept, choose


class Selector:
    """shard: a tensor-parallel rank's part (parallel.py): a policy's per-head scores are summed
    over the ranks, so that every rank keeps the same blocks."""

    def __init__(self, spec: ModelSpec, store: BlockStore, policy: Policy, budget: int, recent_blocks: int,
                 shard=None) -> None:
        self.spec = spec
        self.shard = shard
        self.store = store
        self.policy = policy
        self.budget = budget
        self.recent_blocks = recent_blocks
        self.draft_layers = policy.draft_layers if isinstance(policy, DraftPolicy) else 0
        self.selected = 0  # blocks chosen by decode steps since the last take_counts (per layer)
        self.candidates = 0  # the live blocks they were chosen from

    def take_counts(self) -> tuple[int, int]:
        counts = (self.selected, self.candidates)
        self.selected = self.candidates = 0
        return counts

    def exact_layer(self, layer: int) -> bool:
        """Layers that always read every block: sliding-window layers and the draft layers."""
        return bool(self.store.group_of(layer).window) or layer < self.draft_layers

    def select(self, layer: int, q: torch.Tensor, ctx, ids: torch.Tensor, positions: torch.Tensor,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [Hq, D]; ids, positions: [n] int32 live blocks in logical order -> the chosen subset."""
        n = ids.numel()
        self.candidates += n
        if self.exact_layer(layer) or n <= self.budget:
            chosen_ids, chosen_pos = ids, positions
        elif self.policy.static and self._same_inputs(layer, ctx, ids, positions):
            chosen_ids, chosen_pos = ctx.selection[layer][1]  # same candidates, same scores: same choice
        else:
            keep = always_kept(positions, ctx.num_blocks, self.recent_blocks)
            scores = self.policy.scores(layer, q, ids, positions, ctx)
            if self.shard is not None and self.policy.per_head:
                scores = self.shard.all_reduce(scores)
            chosen_ids, chosen_pos = choose(ids, positions, scores, keep, self.budget)
            if self.policy.static:
                ctx.selection[layer] = ((ctx.score_queries, ctx.num_blocks, ids.clone(), positions.clone()),
                                        (chosen_ids, chosen_pos))
        self.selected += chosen_ids.numel()
        self.policy.attended(layer, chosen_ids.tolist(), step)
        ctx.attended[layer] = chosen_pos
        return chosen_ids, chosen_pos

    def _same_inputs(self, layer: int, ctx, ids: torch.Tensor, positions: torch.Tensor) -> bool:
        entry = ctx.selection.get(layer)
        if entry is None:
            return False
        queries, num_blocks, last_ids, last_pos = entry[0]
        return (queries is ctx.score_queries and num_blocks == ctx.num_blocks and torch.equal(last_ids, ids)
                and torch.equal(last_pos, positions))

    def predicted(self, layer: int, ctx) -> list[int] | None:
        """Logical blocks `layer` will likely read next: what it read last step, plus the newest block."""
        last = ctx.attended.get(layer)
        if last is None:
            return None
        newest = ctx.num_blocks - 1
        positions = last.tolist()
        return positions if newest in positions else positions + [newest]

    def observe(self, layer: int, ctx, step: int, positions: torch.Tensor, lse: torch.Tensor) -> None:
        """Per-block lse [n, Hq] of a decode query of `ctx` in an exact draft layer (feeds the draft policy)."""
        if layer < self.draft_layers:
            self.policy.observe(ctx, step, positions, lse)
