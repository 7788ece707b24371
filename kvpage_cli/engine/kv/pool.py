"""The pool: a fixed number of slots per layer on the compute device, and their valid mask.

A slot holds one block of one layer. The pool remembers which block each slot holds (id,
generation and how many of its tokens were filled when copied), so a block still in its slot
is not copied again. A slot's valid bit is 1 only while it holds a completely copied block:
it drops to 0 when a copy into the slot starts and rises when the copy is done (copies started
by the mover run asynchronously; `load` waits for any that an attention step needs).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..config import BLOCK_TOKENS
from ..events import BlocksMoved
from .store import block_bytes_per_layer, decode_rows, head_addresses, stored_block_shape


@dataclass
class Landing:
    """A `load_batch` in flight: its slots, the event its copies record (None: done already),
    and what it moved (emitted when it lands)."""

    slots: list[int]
    event: object
    moved: BlocksMoved


@dataclass
class SlotHolder:
    block_id: int
    generation: int
    filled: int
    pending: object = None  # the mover's handle while the copy is in flight


class SlotPool:
    def __init__(self, num_layers: int, slots_per_layer: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, mover=None, on_event=None, sink: bool = False) -> None:
        """mover: copies blocks ahead of the layer that reads them (selective mode on the pool path);
        on_event: receives BlocksMoved for every load or prefetch that copied blocks; sink: one more
        slot per layer, never valid, that a device step's padding rows write (kv/resident.py)."""
        self.num_layers = num_layers
        self.num_slots = slots_per_layer
        self.sink = sink
        self.block_shape = stored_block_shape(num_kv_heads, head_dim, dtype)  # as kept (int8: with scales)
        self.dtype = dtype
        self.device = device
        self.k: list[torch.Tensor] = []  # per layer: [S, *block_shape], made on first use
        self.v: list[torch.Tensor] = []
        self.valid: list[torch.Tensor] = []  # per layer: [S] int8 (views of valid_all)
        self.valid_all: torch.Tensor | None = None  # [layers, S] int8: every layer's bits, set at once by a device step
        # slots load() handed out whose valid bit was 0 (a copy not done), counted on the device: no
        # host read per block; tests read it
        self.invalid_reads: torch.Tensor | None = None
        self.k_addr: list[torch.Tensor] = []  # per layer: [S, Hkv] addresses of each slot's head rows
        self.v_addr: list[torch.Tensor] = []
        self.holders: list[list[SlotHolder | None]] = [[None] * slots_per_layer for _ in range(num_layers)]
        self.slot_of: list[dict[int, int]] = [{} for _ in range(num_layers)]
        self.recency: list[OrderedDict[int, None]] = [OrderedDict((s, None) for s in range(slots_per_layer)) for _ in range(num_layers)]
        self.slot_bytes = block_bytes_per_layer(num_kv_heads, head_dim, dtype)
        self.on_event = on_event
        self.mover = mover
        self._stream = None  # load_batch's copy stream (CUDA)

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    @property
    def bytes(self) -> int:
        return self.num_layers * (self.num_slots + self.sink) * self.slot_bytes if self.allocated else 0

    def allocate(self) -> None:
        if self.allocated:
            return
        slots = self.num_slots + self.sink
        self.valid_all = torch.zeros(self.num_layers, slots, dtype=torch.int8, device=self.device)
        self.invalid_reads = torch.zeros((), dtype=torch.int64, device=self.device)
        for layer in range(self.num_layers):
            k = torch.zeros((slots, *self.block_shape), dtype=self.dtype, device=self.device)
            v = torch.zeros((slots, *self.block_shape), dtype=self.dtype, device=self.device)
            self.k.append(k)
            self.v.append(v)
            self.valid.append(self.valid_all[layer])
            self.k_addr.append(head_addresses(k, 0))
            self.v_addr.append(head_addresses(v, 0))

    def load(self, layer: int, blocks: list[tuple[int, int, int]], copy_in) -> list[int]:
        """Puts blocks into slots of `layer` and returns their slots, in the same order.

        blocks: (block id, generation, tokens filled) each, at most num_slots of them.
        copy_in(block_id, k_slot, v_slot, tokens): copies a block from the store into a slot.
        On return every returned slot holds its block completely and its valid bit is set; a slot
        whose bit is not set (a copy not done: a bug) adds to `invalid_reads` on the device,
        without a host read per block.
        """
        assert len(blocks) <= self.num_slots, (len(blocks), self.num_slots)
        self.allocate()
        holders = self.holders[layer]
        slots: list[int | None] = []
        wanted: set[int] = set()
        for block_id, generation, filled in blocks:
            slot = self._resident(layer, block_id, generation, filled)
            if slot is not None:
                wanted.add(slot)
            slots.append(slot)
        hits = len(wanted)
        victims = self._victims(layer, wanted)
        moved = moved_bytes = 0
        copy_s = 0.0
        for index, (block_id, generation, filled) in enumerate(blocks):
            if slots[index] is None:
                slot = next(victims)
                nbytes, seconds = self._copy_into(layer, slot, block_id, generation, filled, copy_in)
                moved, moved_bytes, copy_s = moved + 1, moved_bytes + nbytes, copy_s + seconds
                slots[index] = slot
                wanted.add(slot)
        waited = 0.0
        for slot in slots:
            holder = holders[slot]
            if holder.pending is not None:  # prefetched: wait until the copy has landed
                waited += self.mover.wait(holder.pending)
                holder.pending = None
            self.recency[layer].move_to_end(slot)
        self._loaded(layer, slots, BlocksMoved(moved, moved_bytes, waited, len(blocks), hits, copy_s))
        return slots  # type: ignore[return-value]

    def load_batch(self, layer: int, blocks: list[tuple[int, int, int]], slots: list[int], stacked) -> "Landing":
        """Puts each block into the slot given for it (a pass schedule's choice, kv/schedule.py) and
        returns the load in flight: a block its slot already holds (the same generation, rows
        enough) is not copied again; the others come from the store in one piece (`stacked(ids)`
        -> K, V [n, *stored block shape], page-locked on a GPU), with one copy to the device and
        one scatter into their slots each for K and V.
        On a GPU they run on the pool's copy stream, after the work queued before them (which may
        read the slots' last blocks), and return at once; `land` makes the compute stream wait
        for them on the device (no host wait) before the pass reads the slots. On a CPU they are
        done on return. As with `load`, a slot handed out whose bit is not set counts in
        `invalid_reads` (when the load lands)."""
        assert len(blocks) == len(slots) == len(set(slots)) <= self.num_slots, (len(blocks), len(slots))
        self.allocate()
        holders, slot_of = self.holders[layer], self.slot_of[layer]
        copies: list[tuple[int, int]] = []
        moved_bytes = hits = 0
        waited = 0.0
        for (block_id, generation, filled), slot in zip(blocks, slots):
            holder = holders[slot]
            if holder is not None and holder.pending is not None:  # a prefetch into this slot: let it land
                waited += self.mover.wait(holder.pending)
                holder.pending = None
            if (holder is not None and holder.block_id == block_id and holder.generation == generation
                    and holder.filled >= filled and slot_of.get(block_id) == slot):
                hits += 1
            else:
                moved_bytes += self._assign(layer, slot, block_id, generation, filled)
                copies.append((block_id, slot))
            self.recency[layer].move_to_end(slot)
        event, copy_s = None, 0.0
        if copies:
            started = time.perf_counter()
            k, v = stacked([b for b, _ in copies])
            index = torch.tensor([s for _, s in copies], dtype=torch.int64)
            stream = self._copy_stream()
            if stream is None:
                self.scatter(layer, index, k, v)
            else:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.scatter(layer, index, k, v)
                    event = torch.cuda.Event()
                    event.record(stream)
            copy_s = time.perf_counter() - started
        moved = BlocksMoved(len(copies), moved_bytes, waited, len(blocks), hits, copy_s)
        return Landing(list(slots), event, moved)

    def land(self, layer: int, landing: "Landing") -> list[int]:
        """The compute stream waits (on the device) for a `load_batch`'s copies; the load is
        counted as `load` counts one. Returns its slots."""
        if landing.event is not None:
            torch.cuda.current_stream(self.device).wait_event(landing.event)
        self._loaded(layer, landing.slots, landing.moved)
        return landing.slots

    def scatter(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Host pieces of whole blocks as kept (`StoreGroup.stacked`) into the slots `index` (a host
        tensor) of `layer`, their valid bits set; asynchronous from page-locked pieces on a GPU."""
        index = index.to(self.device, non_blocking=True)
        self.k[layer].index_copy_(0, index, k.to(self.device, non_blocking=True))
        self.v[layer].index_copy_(0, index, v.to(self.device, non_blocking=True))
        self.valid[layer].index_fill_(0, index, 1)

    def _copy_stream(self):
        """The stream `load_batch` copies on (CUDA only; made on first use)."""
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _copy_into(self, layer: int, slot: int, block_id: int, generation: int, filled: int,
                   copy_in) -> tuple[int, float]:
        """Gives `slot` to a block and copies it in; returns the bytes moved and the seconds the copy took."""
        moved_bytes = self._assign(layer, slot, block_id, generation, filled)
        started = time.perf_counter()
        copy_in(block_id, self.k[layer][slot], self.v[layer][slot], filled)
        self.valid[layer][slot] = 1
        return moved_bytes, time.perf_counter() - started

    def _loaded(self, layer: int, slots: list[int], event: BlocksMoved) -> None:
        """After a load: the slots handed out whose bit is not set counted on the device; the event."""
        if slots:
            # sent without waiting: a blocking copy would make the host wait for the device's queue
            index = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
            self.invalid_reads += (self.valid[layer].index_select(0, index) == 0).sum()
        if self.on_event is not None:
            self.on_event(event)

    def slots(self, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V values held in `slots` of `layer` (a list, or a device tensor): [n, Hkv, 64, D] copies."""
        index = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        return decode_rows(self.k[layer].index_select(0, index)), decode_rows(self.v[layer].index_select(0, index))

    def prefetch(self, layer: int, blocks: list[tuple[int, int, int]], copy_in) -> int:
        """Starts copying blocks the layer is expected to read into its slots, without waiting.

        Needs a mover. Returns the number of copies started."""
        if self.mover is None:
            return 0
        self.allocate()
        wanted = {s for b, g, f in blocks if (s := self._resident(layer, b, g, f)) is not None}
        victims = self._victims(layer, wanted)
        started = 0
        for block_id, generation, filled in blocks[: self.num_slots]:
            if self._resident(layer, block_id, generation, filled) is not None:
                continue
            slot = next(victims, None)
            if slot is None:
                break
            moved_bytes = self._assign(layer, slot, block_id, generation, filled)
            holder = self.holders[layer][slot]
            k_slot, v_slot = self.k[layer][slot], self.v[layer][slot]
            holder.pending = self.mover.start(lambda b=block_id, k=k_slot, v=v_slot, f=filled: copy_in(b, k, v, f),
                                              self.valid[layer], slot)
            wanted.add(slot)
            started += 1
            if self.on_event is not None:
                self.on_event(BlocksMoved(1, moved_bytes))
        return started

    def _resident(self, layer: int, block_id: int, generation: int, filled: int) -> int | None:
        slot = self.slot_of[layer].get(block_id)
        holder = self.holders[layer][slot] if slot is not None else None
        if holder is not None and holder.generation == generation and holder.filled >= filled:
            return slot
        return None

    def _victims(self, layer: int, wanted: set[int]):
        """Slots to reuse, least recently used first, skipping `wanted` (checked lazily) and slots in flight."""
        holders = self.holders[layer]
        return (s for s in list(self.recency[layer])
                if s not in wanted and (holders[s] is None or holders[s].pending is None))

    def _assign(self, layer: int, slot: int, block_id: int, generation: int, filled: int) -> int:
        """Gives `slot` to a block (its copy is the caller's); returns the bytes the copy moves."""
        holders, slot_of = self.holders[layer], self.slot_of[layer]
        old = holders[slot]
        if old is not None and slot_of.get(old.block_id) == slot:
            del slot_of[old.block_id]
        self.valid[layer][slot] = 0
        holder = SlotHolder(block_id, generation, filled)
        holders[slot] = holder
        slot_of[block_id] = slot
        self.recency[layer].move_to_end(slot)
        return self.slot_bytes * filled // BLOCK_TOKENS

    def reset(self) -> None:
        """Forgets what every slot holds (another owner of the slots takes them: kv/resident.py);
        every valid bit drops to 0."""
        self.allocate()
        for layer in range(self.num_layers):
            for holder in self.holders[layer]:
                if holder is not None and holder.pending is not None:
                    self.mover.wait(holder.pending)
            self.holders[layer] = [None] * self.num_slots
            self.slot_of[layer] = {}
        self.valid_all.zero_()

    def forget(self, group_layers: list[int], block_ids: list[int]) -> None:
        """Drops freed blocks of the given layers from the pool's memory of what it holds."""
        for layer in group_layers:
            slot_of, holders = self.slot_of[layer], self.holders[layer]
            for block_id in block_ids:
                slot = slot_of.pop(block_id, None)
                if slot is not None:
                    if holders[slot] is not None and holders[slot].pending is not None:
                        self.mover.wait(holders[slot].pending)  # let the copy land before the slot is reused
                    holders[slot] = None

