"""Residency policies for selective mode: which blocks a decode step attends to.

A policy scores a layer's candidate blocks; the selector keeps the always-kept blocks (the
first block, the last `recent_blocks` blocks, every block of a sliding-window layer's window)
and fills the rest of the layer's budget with the best-scored blocks, ties broken by position,
so a selection is deterministic given the same inputs.

| policy | score of a block                                                         |
|--------|--------------------------------------------------------------------------|
| lru    | the last step at which the block was attended (or written)               |
| quest  | upper bound of q.k from the block's element-wise key min and max, summed over the query heads |
| draft  | attention mass the draft (the model's first layers) put on the block this step |
| scores | relevance from the attention the prompt's final tokens pay, computed after each prompt |
"""

from __future__ import annotations

import torch


class Policy:
    """Scores blocks for one layer at one decode step (higher = more worth attending)."""

    name = "policy"
    static = False  # True: scores depend only on the context and the candidates, not on the step
    ranks_by_prompt = False  # True: needs Engine.block_scores of each prompt (computed as the prompt runs)
    per_head = True  # scores are sums over the heads this process holds (tensor parallel: summed over ranks)

    def scores(self, layer: int, q: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """q: [Hq, D] this step's rotated query; ids, positions: [n] candidates -> [n] float scores."""
        raise NotImplementedError

    def attended(self, layer: int, ids: list[int], step: int) -> None:
        """The blocks a layer attended at `step` (policies with memory use it)."""

    def written(self, layer: int, block_id: int, k: torch.Tensor, first_rows: bool) -> None:
        """Rows k: [Hkv, t, D] (rotated) were written into `block_id` of `layer` (`first_rows`: from row 0)."""

    def copied(self, group_layers: list[int], src: int, dst: int) -> None:
        """A block was copied (copy-on-write); per-block metadata follows it."""


class LruPolicy(Policy):
    name = "lru"
    per_head = False  # the same on every rank

    def __init__(self, num_layers: int) -> None:
        self.last_used: list[dict[int, int]] = [{} for _ in range(num_layers)]

    def scores(self, layer, q, ids, positions, ctx):
        used = self.last_used[layer]
        return torch.tensor([float(used.get(int(b), -1)) for b in ids], dtype=torch.float32)

    def attended(self, layer, ids, step):
        used = self.last_used[layer]
        for block_id in ids:
            used[block_id] = step

    def copied(self, group_layers, src, dst):
        for layer in group_layers:
            if src in self.last_used[layer]:
                self.last_used[layer][dst] = self.last_used[layer][src]


class QuestPolicy(Policy):
    """Quest (Tang et al., 2024): per block and KV head, the element-wise min and max of its keys."""

    name = "quest"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, group_size: int) -> None:
        self.kmin: list[torch.Tensor] = [torch.empty(0, num_kv_heads, head_dim) for _ in range(num_layers)]
        self.kmax: list[torch.Tensor] = [torch.empty(0, num_kv_heads, head_dim) for _ in range(num_layers)]
        self.group_size = group_size

    def _ensure(self, layer: int, block_id: int) -> None:
        size = self.kmin[layer].shape[0]
        if block_id >= size:
            grow = max(block_id + 1, 2 * size, 64) - size
            shape = (grow, *self.kmin[layer].shape[1:])
            self.kmin[layer] = torch.cat([self.kmin[layer], torch.full(shape, float("inf"))])
            self.kmax[layer] = torch.cat([self.kmax[layer], torch.full(shape, float("-inf"))])

    def written(self, layer, block_id, k, first_rows):
        self._ensure(layer, block_id)
        rows_min = k.float().amin(dim=1)  # [Hkv, D]
        rows_max = k.float().amax(dim=1)
        if first_rows:
            self.kmin[layer][block_id] = rows_min
            self.kmax[layer][block_id] = rows_max
        else:
            torch.minimum(self.kmin[layer][block_id], rows_min, out=self.kmin[layer][block_id])
            torch.maximum(self.kmax[layer][block_id], rows_max, out=self.kmax[layer][block_id])

    def copied(self, group_layers, src, dst):
        for layer in group_layers:
            if src < self.kmin[layer].shape[0]:
                self._ensure(layer, dst)
                self.kmin[layer][dst] = self.kmin[layer][src]
                self.kmax[layer][dst] = self.kmax[layer][src]

    def scores(self, layer, q, ids, positions, ctx):
        index = ids.to(torch.int64)
        kmin, kmax = self.kmin[layer][index], self.kmax[layer][index]  # [n, Hkv, D]
        qg = q.float().to(kmin.device).view(kmin.shape[1], self.group_size, -1)  # [Hkv, G, D], where the bounds are
        return key_bound(qg[None], kmin, kmax).sum(dim=(1, 2))


def key_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q.k over a block's keys, from their element-wise min and max: per
    dimension the larger of q*min and q*max, summed. q [n or 1, Hkv, R, D] (R query rows per KV
    head), kmin, kmax [n, Hkv, D] -> [n, Hkv, R] fp32."""
    q = q.float()
    return (q.clamp(min=0) @ kmax.float()[..., None] + q.clamp(max=0) @ kmin.float()[..., None])[..., 0]


class DraftPolicy(Policy):
    """The model's first `draft_layers` layers (or a separate draft model) attend to every block;
    the attention mass they put on each block this step ranks the blocks for the layers after them."""

    name = "draft"

    def __init__(self, draft_layers: int) -> None:
        self.draft_layers = draft_layers

    def observe(self, ctx, step: int, positions: torch.Tensor, lse: torch.Tensor) -> None:
        """Per-block log-sum-exp [n, Hq] of a draft layer's exact attention at `step` of a context
        (the draft's own context for a separate draft model); kept with that context."""
        seen, mass = ctx.draft_mass
        if step != seen:
            mass = {}
            ctx.draft_mass = (step, mass)
        weights = torch.softmax(lse.float(), dim=0).sum(dim=1)  # attention mass per block, summed over heads
        for position, weight in zip(positions.tolist(), weights.tolist()):
            mass[position] = mass.get(position, 0.0) + weight

    def scores(self, layer, q, ids, positions, ctx):
        mass = (ctx.draft if ctx.draft is not None else ctx).draft_mass[1]
        return torch.tensor([mass.get(int(p), 0.0) for p in positions], dtype=torch.float32)


class ScoresPolicy(Policy):
    """Static per-block relevance, computed after the prompt (prefill, or appended tokens) and kept
    with the context."""

    name = "scores"
    static = True  # the same candidates of the same context get the same scores at every step
    ranks_by_prompt = True
    per_head = False  # Engine.block_scores are already summed over the ranks

    def __init__(self, relevance) -> None:
        self.relevance = relevance  # ctx -> per-layer tables or None (Engine.block_scores)

    def scores(self, layer, q, ids, positions, ctx):
        tables = self.relevance(ctx)
        table = tables[layer] if tables is not None else None
        out = torch.full((len(positions),), float("inf"))  # blocks written after the scoring: keep
        if table is not None:
            known = positions.to(torch.int64) < table.shape[0]
            out[known] = table[positions.to(torch.int64)[known]]
        return out


def choose(candidate_ids: torch.Tensor, candidate_pos: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor,
           budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept blocks plus the best-scored others, within `budget` blocks, in logical order.

    Candidates come in logical order. Ties are broken by position (later first), so the choice
    is deterministic."""
    n = candidate_ids.numel()
    if n <= budget:
        return candidate_ids, candidate_pos
    free = max(0, budget - int(keep.sum()))
    chosen = keep.clone()
    if free:
        rest = (~keep).nonzero().flatten().flip(0)  # later blocks first, so a stable sort breaks ties by position
        order = torch.argsort(scores[rest], descending=True, stable=True)
        chosen[rest[order[:free]]] = True
    index = chosen.nonzero().flatten()
    return candidate_ids[index], candidate_pos[index]


def always_kept(positions: torch.Tensor, num_blocks: int, recent_blocks: int) -> torch.Tensor:
    """[n] bool: the first block (attention sink) and the last `recent_blocks` blocks."""
    return (positions == 0) | (positions >= num_blocks - recent_blocks)



def make_policy(name: str, spec, draft_layers: int, relevance=None) -> Policy:
    """The policy called `name` for a model of this spec."""
    if name == "lru":
        return LruPolicy(spec.num_layers)
    if name == "quest":
        return QuestPolicy(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.group_size)
    if name == "draft":
        if not 0 <= draft_layers < spec.num_layers:  # 0: a separate draft model supplies the attention
            raise ValueError(f"draft_layers must be between 1 and {spec.num_layers - 1}, got {draft_layers}")
        return DraftPolicy(draft_layers)
    if name == "scores":
        return ScoresPolicy(relevance or (lambda ctx: None))
    raise ValueError(f"unknown policy {name!r}")
