"""The pool: a fixed number of slots per layer on the compute device, and their valid mask.

A slot holds one block of one layer. The pool remembers which block each slot holds (id,
generation and how many of its tokens were filled when copied), so a block still in its slot
is not copied again; the valid mask marks the slots an attention step may read.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .config import BLOCK_TOKENS


@dataclass
class SlotHolder:
    block_id: int
    generation: int
    filled: int


class SlotPool:
    def __init__(self, num_layers: int, slots_per_layer: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_slots = slots_per_layer
        self.block_shape = (num_kv_heads, BLOCK_TOKENS, head_dim)
        self.dtype = dtype
        self.device = device
        self.k: list[torch.Tensor] = []  # per layer: [S, Hkv, 64, D], made on first use
        self.v: list[torch.Tensor] = []
        self.valid: list[torch.Tensor] = []  # per layer: [S] int8
        self.k_addr: list[torch.Tensor] = []
        self.v_addr: list[torch.Tensor] = []
        self.holders: list[list[SlotHolder | None]] = [[None] * slots_per_layer for _ in range(num_layers)]
        self.slot_of: list[dict[int, int]] = [{} for _ in range(num_layers)]
        self.recency: list[OrderedDict[int, None]] = [OrderedDict((s, None) for s in range(slots_per_layer)) for _ in range(num_layers)]
        element = torch.empty(0, dtype=dtype).element_size()
        self.slot_bytes = 2 * num_kv_heads * BLOCK_TOKENS * head_dim * element
        self.blocks_moved = 0
        self.bytes_moved = 0
        self.hits = 0
        self.lookups = 0

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    @property
    def bytes(self) -> int:
        return self.num_layers * self.num_slots * self.slot_bytes if self.allocated else 0

    def allocate(self) -> None:
        if self.allocated:
            return
        for _ in range(self.num_layers):
            k = torch.zeros((self.num_slots, *self.block_shape), dtype=self.dtype, device=self.device)
            v = torch.zeros((self.num_slots, *self.block_shape), dtype=self.dtype, device=self.device)
            self.k.append(k)
            self.v.append(v)
            self.valid.append(torch.zeros(self.num_slots, dtype=torch.int8, device=self.device))
            step = k[0].numel() * k.element_size()
            rows = torch.arange(self.num_slots, dtype=torch.int64) * step
            self.k_addr.append(rows + k.data_ptr())
            self.v_addr.append(rows + v.data_ptr())

    def load(self, layer: int, blocks: list[tuple[int, int, int]], copy_in) -> list[int]:
        """Puts blocks into slots of `layer` and returns their slots, in the same order.

        blocks: (block id, generation, tokens filled) each, at most num_slots of them.
        copy_in(block_id, k_slot, v_slot, tokens): copies a block from the store into a slot.
        Only the returned slots are valid afterwards.
        """
        assert len(blocks) <= self.num_slots, (len(blocks), self.num_slots)
        self.allocate()
        holders, slot_of, recency = self.holders[layer], self.slot_of[layer], self.recency[layer]
        slots: list[int | None] = []
        wanted: set[int] = set()
        for block_id, generation, filled in blocks:
            self.lookups += 1
            slot = slot_of.get(block_id)
            holder = holders[slot] if slot is not None else None
            if holder is not None and holder.generation == generation and holder.filled >= filled:
                self.hits += 1
                slots.append(slot)
                wanted.add(slot)
            else:
                slots.append(None)
        victims = (s for s in list(recency) if s not in wanted)
        for index, (block_id, generation, filled) in enumerate(blocks):
            if slots[index] is not None:
                continue
            slot = slot_of.get(block_id)
            if slot is None or slot in wanted:
                slot = next(victims)
            old = holders[slot]
            if old is not None and slot_of.get(old.block_id) == slot:
                del slot_of[old.block_id]
            copy_in(block_id, self.k[layer][slot], self.v[layer][slot], filled)
            holders[slot] = SlotHolder(block_id, generation, filled)
            slot_of[block_id] = slot
            slots[index] = slot
            wanted.add(slot)
            self.blocks_moved += 1
            self.bytes_moved += self.slot_bytes * filled // BLOCK_TOKENS
        for slot in slots:
            recency.move_to_end(slot)
        valid = self.valid[layer]
        valid.zero_()
        valid[torch.tensor(slots, dtype=torch.int64, device=valid.device)] = 1
        return slots  # type: ignore[return-value]

    def forget(self, group_layers: list[int], block_ids: list[int]) -> None:
        """Drops freed blocks of the given layers from the pool's memory of what it holds."""
        for layer in group_layers:
            slot_of, holders = self.slot_of[layer], self.holders[layer]
            for block_id in block_ids:
                slot = slot_of.pop(block_id, None)
                if slot is not None:
                    holders[slot] = None
