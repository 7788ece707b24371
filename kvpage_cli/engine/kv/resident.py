"""Resident slots: the pool as the home of the blocks a device decode step reads.

When every block the running sequences need fits in the pool (the usual case on an 80-140 GB
card), each block of a store group gets one slot, the same in every layer of the group, and keeps
it while it lives: a decode step then reads its blocks where they are and writes its new K/V rows
straight into the tail block's slot, and nothing crosses the link per step. The host store stays
the blocks' backing copy: a block is loaded into its slot once (when a sequence joins), and the
rows a step writes on the device are copied back to the store in batches, when the engine leaves
the device path (the end of a run, a step the device does not take) and whenever enough filled
blocks wait (`mirror`). A copy back is one gather on the device and one asynchronous copy into
page-locked staging (on a GPU: it runs behind the step's work, no host wait); its rows are put
into the store by `settle`, which waits for it, before anything reads the store (a step's start,
handing the pool over, the end of a run, loading blocks).

Bookkeeping happens on events: a sequence joins (its blocks are admitted), a block is added to a
table (a slot is taken), a shared block is copied on write (slot to slot on the device), a block
is freed (its slot is free again). Nothing here runs per layer, and nothing reads a device value.

Slot `num_slots` of every layer is a sink: padding rows of a padded batch write there, and no
step reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import BLOCK_TOKENS

MIRROR_BATCH = 16  # filled blocks waiting before they are copied back to the store together


@dataclass
class Mirror:
    """A copy back in flight: a group's blocks, their rows written on the device, the staged K and
    V [layers, n, *block shape] (page-locked on a GPU), the event that marks the copy done (None
    on a CPU), and the blocks freed since (their rows are not put back)."""

    resident: "ResidentGroup"
    block_ids: list[int]
    rows: list[int]
    k: torch.Tensor
    v: torch.Tensor
    event: object = None
    freed: set[int] = field(default_factory=set)


class ResidentGroup:
    """One store group's blocks in their slots (the same slot in every layer of the group)."""

    def __init__(self, group, num_slots: int) -> None:
        self.group = group
        self.num_slots = num_slots
        self.slot_of: dict[int, int] = {}  # block id -> slot
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.rows: dict[int, int] = {}  # block id -> rows of it on the device written since the store's copy
        self.full: set[int] = set()  # blocks of `rows` whose 64 rows are all written
        self.generation = 0  # counts changes of slot_of: what was packed from it holds while it stands

    def take(self, block_id: int) -> int:
        slot = self.free.pop()
        self.slot_of[block_id] = slot
        self.generation += 1
        return slot

    def give_back(self, block_id: int) -> int | None:
        """The block's slot to the free list (its unmirrored rows forgotten); None where it had none."""
        slot = self.slot_of.pop(block_id, None)
        self.rows.pop(block_id, None)
        self.full.discard(block_id)
        if slot is not None:
            self.free.append(slot)
            self.generation += 1
        return slot

    def clear(self) -> None:
        self.slot_of.clear()
        self.rows.clear()
        self.full.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.generation += 1


class ResidentSlots:
    """The resident regime's map of blocks to slots, for a `SlotPool` and its `BlockStore`."""

    def __init__(self, store, pool) -> None:
        self.store = store
        self.pool = pool
        self.groups = [ResidentGroup(g, pool.num_slots) for g in store.groups]
        self.active = False  # the pool's slots hold resident blocks (not the streaming path's)
        self.loaded_blocks = 0  # blocks copied from the store into slots (admissions)
        self.mirrored_blocks = 0  # blocks copied back to the store
        self.evicted_blocks = 0  # blocks that gave their slots to others'
        self.pending: list[Mirror] = []  # copies back not yet put into the store (`settle`)
        # hooks: blocks loaded into slots (layers, slots, rows each), a slot copied on write
        # (layers, src slot, dst slot), a block's rows put back into the store (layer, block id,
        # K [Hkv, rows, D]): selective mode's bounds follow the blocks (device_select.py)
        self.on_loaded = None
        self.on_copied = None
        self.on_landed = None

    @property
    def sink(self) -> int:
        return self.pool.num_slots

    def needed(self, tables_per_seq: list[list], new: int | None = None) -> int:
        """The slots these contexts' live blocks and `new` blocks more (default: one each, a decode
        step's) take in the group that needs the most: they fit where it is at most the pool's slots."""
        new = len(tables_per_seq) if new is None else new
        most = 0
        for index in range(len(self.groups)):
            blocks = set()
            for tables in tables_per_seq:
                blocks.update(tables[index].live()[0])
            most = max(most, len(blocks) + new)
        return most

    def activate(self) -> None:
        """Takes the pool's slots over from the streaming path (whose memory of them is dropped)."""
        if not self.active:
            self.pool.reset()
            self.active = True

    def admit(self, tables_per_seq: list[list], ends: list[int]) -> tuple[int, int]:
        """Every live block of these contexts gets a slot; those not resident are copied there from
        the store, their first `end` rows (ends: each context's tokens with K/V), in one gather and
        one copy per layer. Blocks resident for no one here may be evicted for them (copied back
        first where the device holds rows the store lacks). Returns the blocks and bytes copied."""
        self.activate()
        self.settle()  # a block copied back and evicted before may be loaded again from the store
        moved = moved_bytes = 0
        for index, resident in enumerate(self.groups):
            wanted: dict[int, int] = {}  # block id -> rows to load
            for tables, end in zip(tables_per_seq, ends):
                ids, positions = tables[index].live()
                for block_id, position in zip(ids, positions):
                    rows = max(0, min(BLOCK_TOKENS, end - position * BLOCK_TOKENS))
                    wanted[block_id] = max(wanted.get(block_id, 0), rows)
            missing = [b for b in wanted if b not in resident.slot_of]
            if not missing:
                continue
            if len(missing) > len(resident.free):
                self._evict(resident, len(missing) - len(resident.free), keep=set(wanted))
            slots = [resident.take(b) for b in missing]
            # a block with no rows before `end` (added for the rows a step writes) takes its slot only
            loaded = [(b, s) for b, s in zip(missing, slots) if wanted[b]]
            if loaded:
                self._load(resident, [b for b, _ in loaded], [s for _, s in loaded], [wanted[b] for b, _ in loaded])
            self.loaded_blocks += len(loaded)
            moved += len(loaded)
            moved_bytes += len(loaded) * self.pool.slot_bytes * len(resident.group.layers)
        return moved, moved_bytes

    def place_new(self, index: int, block_id: int) -> int:
        """A slot for a block just added to a table (nothing to copy: its rows come from the step)."""
        resident = self.groups[index]
        slot = resident.slot_of.get(block_id)
        return slot if slot is not None else resident.take(block_id)

    def slot(self, index: int, block_id: int) -> int:
        return self.groups[index].slot_of[block_id]

    def wrote(self, index: int, block_id: int, rows: int) -> None:
        """A step wrote rows 0 .. rows-1 of a block on the device (it is now ahead of the store)."""
        resident = self.groups[index]
        rows = max(resident.rows.get(block_id, 0), rows)
        resident.rows[block_id] = rows
        if rows >= BLOCK_TOKENS:
            resident.full.add(block_id)

    def place_rows(self, index: int, block_ids: list, ends: list[int]) -> list[int]:
        """A decode step's writes in one group: the slot of each sequence's tail block (taken for a
        block just added to its table; the sink for a sliding-window block already dropped), which
        is then ahead of the store up to row `end` (exclusive, within the block)."""
        slots = []
        for block_id, end in zip(block_ids, ends):
            if block_id is None:
                slots.append(self.sink)
                continue
            slots.append(self.place_new(index, block_id))
            self.wrote(index, block_id, end)
        return slots

    def copied_on_write(self, group_layers: list[int], src: int, dst: int, rows: int) -> None:
        """The block manager copied a shared, partly filled block `src` into `dst`: the device copy
        too, where `src` is resident (its device rows may be newer than the store's)."""
        index = next(i for i, r in enumerate(self.groups) if r.group.layers == group_layers)
        resident = self.groups[index]
        if not self.active or src not in resident.slot_of:
            return
        src_slot, dst_slot = resident.slot_of[src], self.place_new(index, dst)
        for layer in group_layers:
            self.pool.k[layer][dst_slot].copy_(self.pool.k[layer][src_slot])
            self.pool.v[layer][dst_slot].copy_(self.pool.v[layer][src_slot])
        if self.on_copied is not None:
            self.on_copied(group_layers, src_slot, dst_slot)
        self.wrote(index, dst, rows)

    def forget(self, group_layers: list[int], block_ids: list[int]) -> None:
        """Freed blocks give their slots back (their rows are gone with them, those of a copy
        back in flight too: the store may give the ids to other blocks before it lands)."""
        for resident in self.groups:
            if resident.group.layers != group_layers:
                continue
            for block_id in block_ids:
                resident.give_back(block_id)
            for mirror in self.pending:
                if mirror.resident is resident:
                    mirror.freed.update(block_ids)

    def mirror(self, full_only: bool = True) -> None:
        """Copies the rows the device holds ahead of the store back to it. full_only: only once
        MIRROR_BATCH blocks have filled (a decode step's bookkeeping), and only those."""
        for resident in self.groups:
            if full_only:
                if len(resident.full) < MIRROR_BATCH:
                    continue
                ready = list(resident.full)
            else:
                ready = list(resident.rows)
            if ready:
                self._store(resident, ready)

    def release(self) -> None:
        """Gives the pool back to the streaming path: every block copied back first."""
        if not self.active:
            return
        self.mirror(full_only=False)
        self.settle()
        for resident in self.groups:
            resident.clear()
        self.pool.reset()
        self.active = False

    # -- copies -----------------------------------------------------------------------------------

    def _load(self, resident: ResidentGroup, block_ids: list[int], slots: list[int], rows: list[int]) -> None:
        """Store -> slots for every layer of the group (the blocks' first `rows` rows are theirs):
        per layer one gather on the host into a page-locked piece (on a GPU: the copy is
        asynchronous) and `SlotPool.scatter`."""
        group, pool = resident.group, self.pool
        index = torch.tensor(slots, dtype=torch.int64)
        pin = pool.device.type == "cuda"
        for pos, layer in enumerate(group.layers):
            pool.scatter(layer, index, *group.stacked(pos, block_ids, pin))
        if self.on_loaded is not None:
            self.on_loaded(group.layers, slots, rows)

    def _store(self, resident: ResidentGroup, block_ids: list[int]) -> None:
        """Slots -> store for the rows the device wrote: the slots of every layer of the group
        gathered on the device, then one copy each for K and V into staging, asynchronous on a
        GPU; `settle` puts the rows into the store."""
        group, pool = resident.group, self.pool
        slots = torch.tensor([resident.slot_of[b] for b in block_ids], dtype=torch.int64).to(pool.device,
                                                                                              non_blocking=True)
        rows = [resident.rows.pop(b) for b in block_ids]
        k = torch.stack([pool.k[layer].index_select(0, slots) for layer in group.layers])
        v = torch.stack([pool.v[layer].index_select(0, slots) for layer in group.layers])
        cuda = pool.device.type == "cuda"
        staged_k = torch.empty(k.shape, dtype=k.dtype, pin_memory=cuda)
        staged_v = torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda)
        staged_k.copy_(k, non_blocking=cuda)
        staged_v.copy_(v, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append(Mirror(resident, list(block_ids), rows, staged_k, staged_v, event))
        for block_id in block_ids:
            resident.full.discard(block_id)
        self.mirrored_blocks += len(block_ids)

    def settle(self) -> None:
        """Waits for the copies back in flight and puts their rows into the store (blocks freed
        since excepted)."""
        for mirror in self.pending:
            if mirror.event is not None:
                mirror.event.synchronize()
            group = mirror.resident.group
            for pos in range(len(group.layers)):
                for i, (block_id, count) in enumerate(zip(mirror.block_ids, mirror.rows)):
                    if block_id not in mirror.freed:
                        group.k_block(pos, block_id)[:, :count].copy_(mirror.k[pos, i, :, :count])
                        group.v_block(pos, block_id)[:, :count].copy_(mirror.v[pos, i, :, :count])
                        if self.on_landed is not None:
                            self.on_landed(group.layers[pos], block_id, group.k_block(pos, block_id)[:, :count])
        self.pending.clear()

    def _evict(self, resident: ResidentGroup, count: int, keep: set[int]) -> None:
        victims = [b for b in resident.slot_of if b not in keep][:count]
        dirty = [b for b in victims if b in resident.rows]
        if dirty:
            self._store(resident, dirty)
        for block_id in victims:
            resident.give_back(block_id)
        self.evicted_blocks += len(victims)
