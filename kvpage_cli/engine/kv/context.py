"""Context: a sequence's tokens and, per store group, its block table."""

from __future__ import annotations

import itertools

import torch

from ..config import BLOCK_TOKENS

_ids = itertools.count(1)


class BlockTable:
    """Logical block index -> block id in one store group (None: dropped from a sliding window).

    The same table serves every layer of the group: those layers hold the same tokens."""

    def __init__(self, ids: list[int | None] | None = None) -> None:
        self.ids: list[int | None] = ids if ids is not None else []
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._first_live = 0
        self.version = 0  # counts changes: a plan made from the table is good while it stays

    def copy(self) -> "BlockTable":
        table = BlockTable(list(self.ids))
        table._first_live = self._first_live
        return table

    def changed(self) -> None:
        self._tensors = None
        self.version += 1

    def live(self, first_block: int = 0) -> tuple[list[int], list[int]]:
        """(block ids, logical indices) of the live blocks from `first_block` on."""
        start = max(first_block, self._first_live)
        ids, positions = [], []
        for index in range(start, len(self.ids)):
            block_id = self.ids[index]
            if block_id is not None:
                ids.append(block_id)
                positions.append(index)
        return ids, positions

    def live_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 tensors (ids, logical indices) of every live block, cached until the table changes."""
        if self._tensors is None:
            ids, positions = self.live()
            self._tensors = (torch.tensor(ids, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32))
        return self._tensors

    def drop_before(self, first_block: int) -> list[int]:
        """Forgets blocks before `first_block`; returns their ids (for the caller to release)."""
        dropped = []
        for index in range(self._first_live, min(first_block, len(self.ids))):
            if self.ids[index] is not None:
                dropped.append(self.ids[index])
                self.ids[index] = None
        self._first_live = max(self._first_live, first_block)
        if dropped:
            self.changed()
        return dropped


class Context:
    """A document's tokens and block tables. Create with Engine.prefill; copy with Engine.fork.

    `tokens` holds every token of the sequence; the first `num_cached` of them have their K/V
    in blocks. Generated tokens join `tokens` as they are yielded and are written into blocks
    when the next step runs.
    """

    def __init__(self, tables: list[BlockTable], tokens: list[int] | None = None, num_cached: int = 0) -> None:
        self.id = next(_ids)
        self.tables = tables
        self.tokens: list[int] = tokens if tokens is not None else []
        self.num_cached = num_cached
        self.last_logits: torch.Tensor | None = None  # [vocab] fp32, logits after the last cached token
        self.released = False
        self.cached_prefix = 0  # tokens whose KV came from the saved-KV cache
        # the "scores" policy: the newest prompt's final queries (layer -> (q, first position)), and the
        # per-layer block relevance computed from them when the policy first asks (Engine.block_scores)
        self.score_queries: dict[int, tuple[torch.Tensor, int]] | None = None
        self.block_scores: list[torch.Tensor] | None = None
        self.draft: Context | None = None  # the draft model's context over the same tokens
        # selective mode, per layer: the logical blocks attended at the last step, and a static
        # policy's last (inputs, choice); the draft policy's (step, block -> attention mass)
        self.attended: dict[int, torch.Tensor] = {}
        self.selection: dict[int, tuple] = {}
        self.draft_mass: tuple[int, dict[int, float]] = (-1, {})

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        return (self.num_cached + BLOCK_TOKENS - 1) // BLOCK_TOKENS

    def __repr__(self) -> str:
        return f"Context(id={self.id}, tokens={len(self.tokens)}, cached={self.num_cached})"
