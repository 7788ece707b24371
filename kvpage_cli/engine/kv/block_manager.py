"""The block manager: the one owner of "which block is where".

It keeps every context's block tables (one per store group), allocates blocks as contexts grow,
forks them (copy-on-write: shared blocks are never copied, except the partly filled last block
when a fork writes into it), releases them, drops blocks that fell out of every sliding window,
and writes every K/V row, rotating K by RoPE on the way in ("baking"), so that a block is
self-contained. Whoever keeps per-block metadata (the pool's residency, selective mode's key
bounds) is told through the callbacks given at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch

from .. import native
from ..config import BLOCK_TOKENS
from .context import BlockTable
from .store import BlockStore, encode_rows, row_scales

_NATIVE_KINDS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8"}
"""The store element types whose rows the native kernels write (native.write_rows)."""


class BlockWatcher(Protocol):
    """Per-block metadata that follows the blocks (selective mode's key bounds, a policy's memory)."""

    def written(self, layer: int, block_id: int, k: torch.Tensor, first_rows: bool) -> None: ...

    def copied(self, group_layers: list[int], src: int, dst: int) -> None: ...


@dataclass(frozen=True)
class Write:
    """Rows `rows` of a step's K/V go to positions start .. start+len(rows)-1 of a context."""

    tables: list[BlockTable]
    start: int
    rows: slice


class BlockManager:
    def __init__(self, store: BlockStore, on_free: Callable[[list[int], list[int]], None],
                 watchers: Iterable[BlockWatcher] = (), native_lib=None) -> None:
        """on_free(group layers, freed block ids): blocks became free (the pool forgets them).
        watchers: told of every K write and every copy-on-write copy. K is rotated by the model's
        own rotation (`RopeAt.apply`) here as in a device step's writes into pool slots, so that a
        block has the same bits whichever path wrote it (device_step.py).
        native_lib: the native kernels, whose row writer puts a layer's rows into their blocks in
        one call each for K and V (float32, bfloat16 or int8 blocks: the bits torch's conversion
        gives)."""
        self.store = store
        self.on_free = on_free
        self.watchers = list(watchers)
        self.on_copy: Callable[[list[int], int, int, int], None] | None = None  # (group layers, src, dst, rows):
        # a shared block copied on write (the device's resident slots copy it too)
        self.native_lib = native_lib

    # -- tables ----------------------------------------------------------------------------------

    def new_tables(self) -> list[BlockTable]:
        return [BlockTable() for _ in self.store.groups]

    def fork(self, tables: list[BlockTable]) -> list[BlockTable]:
        """Copies of the tables that share their blocks (one more reference each)."""
        copies = [table.copy() for table in tables]
        for group, table in zip(self.store.groups, copies):
            group.allocator.incref(table.live()[0])
        return copies

    def release(self, tables: list[BlockTable]) -> None:
        for group, table in zip(self.store.groups, tables):
            ids = [b for b in table.ids if b is not None]
            table.ids = []
            table.changed()
            self._free(group, group.allocator.decref(ids))

    def reserve(self, tables: list[BlockTable], total_tokens: int) -> None:
        """Makes room in the arenas for a context growing to `total_tokens`, so that its blocks
        come from one arena (one run: one view for attention) where possible."""
        for group, table in zip(self.store.groups, tables):
            if not group.window:
                group.reserve(-(-total_tokens // BLOCK_TOKENS) - len(table.ids) + 1)

    def make_room(self, tables: list[BlockTable], start: int, count: int) -> None:
        """Blocks for positions start .. start+count-1: a shared, partly filled block at `start` is
        copied first (copy-on-write), missing blocks are allocated."""
        last_block = (start + count - 1) // BLOCK_TOKENS
        offset = start % BLOCK_TOKENS
        for group, table in zip(self.store.groups, tables):
            if offset and start // BLOCK_TOKENS < len(table.ids):
                index = start // BLOCK_TOKENS
                shared = table.ids[index]
                if shared is not None and group.allocator.refcount[shared] > 1:
                    fresh = group.allocate(1)[0]
                    group.copy_block(shared, fresh, offset)
                    for watcher in self.watchers:
                        watcher.copied(group.layers, shared, fresh)
                    if self.on_copy is not None:
                        self.on_copy(group.layers, shared, fresh, offset)
                    group.allocator.decref([shared])
                    table.ids[index] = fresh
                    table.changed()
            missing = last_block + 1 - len(table.ids)
            if missing > 0:
                table.ids.extend(group.allocate(missing))
                table.changed()

    def share(self, group, block_ids: list[int]) -> None:
        """One more reference to blocks of a group (held outside any table, e.g. by an index;
        given back with `release` of tables that list them)."""
        group.allocator.incref(block_ids)

    def restore(self, tables: list[BlockTable], first_block: int, count: int,
                saved: list[tuple[list[int], torch.Tensor]]) -> None:
        """Appends logical blocks first_block .. first_block+count-1 to every table, filled with
        saved K (already rotated) and V: per group, (the logical blocks saved, data
        [layers, 2, n, *stored block shape]). A sliding-window group keeps only the blocks a query after
        them can still see. Watchers are told of every restored K as of a written one."""
        end = (first_block + count) * BLOCK_TOKENS
        for group, table, (indices, data) in zip(self.store.groups, tables, saved):
            first_visible = max(0, end - group.window + 1) // BLOCK_TOKENS if group.window else 0
            wanted = [(row, b) for row, b in enumerate(indices) if b >= first_visible]
            ids = group.allocate(len(wanted))
            where = dict(zip((b for _, b in wanted), ids))
            table.ids.extend(where.get(b) for b in range(first_block, first_block + count))
            for pos, layer in enumerate(group.layers):
                for (row, _), block_id in zip(wanted, ids):
                    group.k_block(pos, block_id).copy_(data[pos, 0, row])
                    group.v_block(pos, block_id).copy_(data[pos, 1, row])
                    for watcher in self.watchers:
                        watcher.written(layer, block_id, group.k_values(pos, block_id), True)
            if group.window:
                self._free(group, group.allocator.decref(table.drop_before(first_visible)))
            table.changed()

    def append_moved(self, tables: list[BlockTable], deltas: list[int], rope: dict, layer_specs, read) -> None:
        """Appends len(deltas) blocks to every table. Full-attention groups get blocks read
        elsewhere (`read(group, layer_pos)` -> K, V [n, Hkv, 64, D]), each moved by `deltas`
        positions: its K rows rotated once more (RoPE is baked in, so a move is a rotation), V as
        it is (values; int8 blocks are encoded again after the rotation). Sliding-window groups get
        holes: their layers see only what follows.
        rope: rope key -> RopeParams; layer_specs: the model's LayerSpec per layer."""
        for group, table in zip(self.store.groups, tables):
            if group.window:
                table.ids.extend([None] * len(deltas))
            elif deltas:
                moved = group.allocate(len(deltas))
                self._copy_moved(group, moved, deltas, rope, layer_specs, lambda pos: read(group, pos))
                table.ids.extend(moved)
            table.changed()

    def _copy_moved(self, group, target: list[int], deltas: list[int], rope: dict, layer_specs, read) -> None:
        from ..model.rope import rotate, rotation

        delta = torch.tensor(deltas, dtype=torch.int64).repeat_interleave(BLOCK_TOKENS)  # [n*64]
        tables = {key: rotation(delta, rope[key]) for key in {layer_specs[layer].rope_key for layer in group.layers}}
        num_kv_heads, _, head_dim = group.block_shape
        for pos, layer in enumerate(group.layers):
            k, v = read(pos)
            rows = k.permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)  # [Hkv, n*64, D]
            key = layer_specs[layer].rope_key
            moved = rotate(rows, delta, rope[key], tables[key])
            moved = moved.reshape(num_kv_heads, len(target), BLOCK_TOKENS, head_dim).permute(1, 0, 2, 3)
            if group.quantized:
                for i, block_id in enumerate(target):
                    put_block(group.k_block(pos, block_id), moved[i])
                    put_block(group.v_block(pos, block_id), v[i])
            else:
                group.put(pos, target, moved, v)
            for watcher in self.watchers:
                for block_id in target:
                    watcher.written(layer, block_id, group.k_values(pos, block_id), True)

    def drop_outside_windows(self, tables: list[BlockTable], num_cached: int) -> None:
        """Frees the blocks no query after position num_cached-1 can see in a sliding-window group."""
        for group, table in zip(self.store.groups, tables):
            if not group.window:
                continue
            first_visible = max(0, num_cached - group.window + 1)
            dropped = table.drop_before(first_visible // BLOCK_TOKENS)
            if dropped:
                self._free(group, group.allocator.decref(dropped))

    def _free(self, group, freed: list[int]) -> None:
        if freed:
            self.on_free(group.layers, freed)

    # -- writes ----------------------------------------------------------------------------------

    def plan_writes(self, writes: list[Write]) -> list["WritePlan"]:
        """Where each of a step's rows goes, per store group (the same for every layer of a group)."""
        return [WritePlan.of(group, writes) for group in self.store.groups]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, rope, plans: list["WritePlan"]) -> None:
        """k, v: [N, Hkv, D] of one step's rows -> their blocks, RoPE baked into K.

        rope: the step's RopeAt (cos/sin of every row's position; whether k is rotated already);
        plans: from `plan_writes`."""
        group = self.store.group_of(layer)
        pos = self.store.layer_pos[layer]
        plan = plans[group.index]
        k = rope.apply(k).to(device=group.device)
        v = v.to(device=group.device)
        kind = _NATIVE_KINDS.get(group.dtype)
        if kind is not None and self.native_lib is not None and not self.watchers and group.device.type == "cpu":
            ids, offsets = plan.row_blocks()
            native.write_rows(self.native_lib, kind, k, group.k_addr[pos], ids, offsets)
            native.write_rows(self.native_lib, kind, v, group.v_addr[pos], ids, offsets)
            return
        if group.quantized:
            (k, k_scale), (v, v_scale) = encode_rows(k), encode_rows(v)
        else:  # rounded here where the KV dtype is narrower
            k, v = k.to(group.dtype), v.to(group.dtype)
        for arena, rows, offsets, select in plan.parts:
            ks, vs = (k, v) if select is None else (k[select], v[select])
            # arena [Hkv, A, 64, D][:, rows, offsets] <- [Hkv, n, D]
            group.k_arenas[pos][arena][:, rows, offsets] = ks.transpose(0, 1)
            group.v_arenas[pos][arena][:, rows, offsets] = vs.transpose(0, 1)
            if group.quantized:
                k_scales, v_scales = (k_scale, v_scale) if select is None else (k_scale[select], v_scale[select])
                row_scales(group.k_arenas[pos][arena])[:, rows, offsets] = k_scales.transpose(0, 1)
                row_scales(group.v_arenas[pos][arena])[:, rows, offsets] = v_scales.transpose(0, 1)
        if group.quantized and self.watchers:  # the watchers see the values kept
            k = k.float() * k_scale[..., None]
        for write in plan.writes if self.watchers else ():
            self._tell_watchers(layer, group, write, k[write.rows])

    def landed(self, layer: int, block_id: int, k: torch.Tensor) -> None:
        """A block's rows written elsewhere (a device step's) are now in the store: K [Hkv, rows,
        D] from row 0; watchers are told as of rows written."""
        for watcher in self.watchers:
            watcher.written(layer, block_id, k, True)

    def _tell_watchers(self, layer: int, group, write: Write, k: torch.Tensor) -> None:
        """k: [t, Hkv, D] rotated rows of one write, told block by block."""
        ids = write.tables[group.index].ids
        done, total = 0, k.shape[0]
        while done < total:
            block, offset = divmod(write.start + done, BLOCK_TOKENS)
            count = min(BLOCK_TOKENS - offset, total - done)
            rows = k[done:done + count].transpose(0, 1)
            for watcher in self.watchers:
                watcher.written(layer, ids[block], rows, offset == 0)
            done += count


def put_block(stored: torch.Tensor, values: torch.Tensor) -> None:
    """Writes a block's values [Hkv, 64, D] into a stored block (int8 blocks: encoded, with scales)."""
    if stored.dtype != torch.int8:
        stored.copy_(values)
        return
    rows, scales = encode_rows(values)
    stored[:, :BLOCK_TOKENS].copy_(rows)
    row_scales(stored).copy_(scales)


@dataclass
class WritePlan:
    """One store group's destinations for a step's rows: per arena, (arena, rows [n], offsets [n],
    the step rows that go there [n] or None for all), and the writes themselves."""

    writes: list[Write]
    parts: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]]
    arenas: list[int]
    rows: list[int]
    offsets: list[int]
    block_ids: list[int]
    _row_blocks: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, group, writes: list[Write]) -> "WritePlan":
        arenas, rows, offsets, block_ids = [], [], [], []
        for write in writes:
            ids = write.tables[group.index].ids
            for position in range(write.start, write.start + write.rows.stop - write.rows.start):
                block_id = ids[position // BLOCK_TOKENS]
                block_ids.append(block_id)
                arenas.append(group.arena_of[block_id])
                rows.append(group.row_of[block_id])
                offsets.append(position % BLOCK_TOKENS)
        parts = []
        for arena in sorted(set(arenas)):
            mine = [i for i, a in enumerate(arenas) if a == arena]
            select = torch.tensor(mine) if len(mine) != len(arenas) else None
            parts.append((arena, torch.tensor([rows[i] for i in mine]), torch.tensor([offsets[i] for i in mine]), select))
        return cls(writes, parts, arenas, rows, offsets, block_ids)

    def row_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's block id int64 [N], its offset in the block int32 [N]), made once a step."""
        if self._row_blocks is None:
            self._row_blocks = (torch.tensor(self.block_ids, dtype=torch.int64),
                                torch.tensor(self.offsets, dtype=torch.int32))
        return self._row_blocks
