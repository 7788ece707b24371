"""The decode step on a compute device: static buffers, one upload, one readback, CUDA graphs.

The host plans, the device runs. A decode step over B sequences whose blocks are all resident in
the pool (kv/resident.py) is one function of static-shape device tensors: the token ids, their
positions, where each new K/V row goes (slot and row of the tail block, per store group), and per
group the (block, query) pairs attention reads, padded to a capacity. The host packs that
metadata into one pinned buffer and sends it with one non-blocking copy; the layers write their
K/V rows into the slots and attend over them with no value read back; the next tokens are chosen
on the device (greedy), and reading them is the step's one synchronisation. The step is captured
as a CUDA graph per padded batch size (1, 2, 4, 8, 16, 24, 32, 48, 64, ...) and pair capacity,
and replayed; `eager` runs the same function without capture (and is what runs on a CPU, where
the same code is tested with the torch backend and the Triton interpreter).

What is bit-identical: with the Triton backend the step launches the kernels the per-layer path
does, on the same items and pairs in the same order, so a sequence's logits are the same bits as
that path's, padded or not, captured or not (padding adds items with no pairs and rows nobody
reads). The torch backend computes the pairs' states in one batch (`reference.pair_states`), exact
to rounding against its per-block path, not the same bits. A padded batch multiplies the weights
with more rows: where the matrix library chooses its kernel by row count, a real row may round
otherwise than unpadded (README: tested for equal tokens and close logits).

In selective mode (the quest and scores policies) each layer's blocks are chosen on the device
too (device_select.py).

Steps the device path does not take (a prompt chunk that keeps its queries, the lru and draft
policies, sampling with a temperature, a draft model, tensor parallelism, int8 KV, or blocks that
do not fit the pool) run on the per-layer path, after the device's rows are copied back to the
store.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import hostreads
from .attention import reference
from .attention.backend import LayerBlocks
from .config import BLOCK_TOKENS
from .device_select import DEVICE_POLICIES, SlotBounds, candidates, choose, pair_scores, quest_scores, scores_table
from .events import BlocksMoved, EngineWarning, emit
from .kv.resident import ResidentSlots
from .model.runner import Rows

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MIN_PAIRS = 64  # the smallest pair capacity; capacities are powers of two above it


def padded_batch(count: int) -> int:
    """The captured batch size that holds `count` sequences."""
    return next((size for size in BATCH_SIZES if size >= count), count)


def capacity(count: int) -> int:
    """A pair (or item) capacity: the power of two at least count + 1 (one padding entry at least)."""
    size = MIN_PAIRS
    while size < count + 1:
        size *= 2
    return size


@dataclass
class GroupPlan:
    """One store group's (block, query) pairs for a batch, as DecodePlan numbers them: items are
    the distinct blocks in logical order, pairs numbered item by item, each query's pairs in
    logical order at q_pairs[q_off[j]:q_off[j+1]]. Host arrays (numpy), no tensors."""

    item_ids: np.ndarray
    item_pos: np.ndarray
    item_off: np.ndarray
    pair_query: np.ndarray
    q_off: np.ndarray
    q_pairs: np.ndarray
    pair_item: np.ndarray
    per_query: int = 0  # the most pairs one query has

    @classmethod
    def build(cls, blocks: list[tuple[list[int], list[int]]]) -> "GroupPlan":
        """blocks[j]: (block ids, logical indices) of query j, in logical order."""
        counts = np.array([len(ids) for ids, _ in blocks], dtype=np.int64)
        ids = np.fromiter((b for ids, _ in blocks for b in ids), dtype=np.int64, count=int(counts.sum()))
        pos = np.fromiter((p for _, positions in blocks for p in positions), dtype=np.int64, count=int(counts.sum()))
        owner = np.repeat(np.arange(len(blocks), dtype=np.int64), counts)
        span = int(ids.max()) + 1 if ids.size else 1
        keys, entry_item = np.unique(pos * span + ids, return_inverse=True)  # items sorted by (position, id)
        order = np.argsort(entry_item * max(1, len(blocks)) + owner, kind="stable")  # entries in pair order
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        item_off = np.zeros(keys.size + 1, dtype=np.int64)
        item_off[1:] = np.cumsum(np.bincount(entry_item, minlength=keys.size))
        q_off = np.zeros(len(blocks) + 1, dtype=np.int64)
        q_off[1:] = np.cumsum(counts)
        return cls(item_ids=keys % span, item_pos=keys // span, item_off=item_off, pair_query=owner[order],
                   q_off=q_off, q_pairs=rank, pair_item=entry_item[order], per_query=int(counts.max(initial=0)))

    @property
    def num_items(self) -> int:
        return self.item_ids.size

    @property
    def num_pairs(self) -> int:
        return self.pair_query.size


@dataclass(frozen=True)
class Selection:
    """Selective mode's choice on the device: the policy, the budget and recent blocks a query
    keeps, per group the chosen pairs' width a query (0: the group reads every pair: a sliding
    window, or a budget no query exceeds), and per group the layers the scores policy's packed
    scores are for (none for quest)."""

    policy: str
    budget: int
    recent: int
    widths: tuple[int, ...]
    score_layers: tuple[tuple[int, ...], ...]


class Layout:
    """Where each field of a step's metadata lies in the packed int32 buffer, for one shape key
    (padded batch, per group (item capacity, pair capacity, pairs per query), selective mode's
    choice). The scores policy's scores are float32 bits in it."""

    def __init__(self, batch: int, caps: tuple[tuple[int, int, int], ...], selection: Selection | None = None) -> None:
        self.batch = batch
        self.caps = caps
        self.selection = selection
        self.fields: dict[str, slice] = {}
        self.size = 0
        for name in ("tokens", "positions", "q_end", "write_off"):
            self._add(name, batch)
        for g, (items, pairs, per_query) in enumerate(caps):
            self._add(f"write_slot{g}", batch)
            self._add(f"item_slots{g}", items)
            self._add(f"item_pos{g}", items)
            self._add(f"item_off{g}", items + 1)
            self._add(f"pair_query{g}", pairs)
            self._add(f"q_off{g}", batch + 1)
            self._add(f"q_pairs{g}", pairs)
            self._add(f"pair_slot{g}", pairs)
            self._add(f"pair_pos{g}", pairs)
            self._add(f"dense{g}", batch * per_query)
            if selection is not None and selection.score_layers[g]:
                self._add(f"score{g}", len(selection.score_layers[g]) * pairs)

    def _add(self, name: str, count: int) -> None:
        self.fields[name] = slice(self.size, self.size + count)
        self.size += count


class StepBuffers:
    """The static tensors of one shape key: the pinned host buffer, its device twin and views of
    it, the states' scratch, the step's outputs."""

    def __init__(self, layout: Layout, device: torch.device, num_heads: int, head_dim: int) -> None:
        self.layout = layout
        pinned = device.type == "cuda"
        self.host = torch.zeros(layout.size, dtype=torch.int32, pin_memory=pinned)
        self.host_np = hostreads.host_array(self.host)
        self.meta = torch.zeros(layout.size, dtype=torch.int32, device=device)
        self.view = {name: self.meta[part] for name, part in layout.fields.items()}
        self.states = [torch.zeros(pairs, num_heads, head_dim, device=device) for _, pairs, _ in layout.caps]
        self.lse = [torch.full((pairs, num_heads), float("-inf"), device=device) for _, pairs, _ in layout.caps]
        self.logit_rows = torch.arange(layout.batch, device=device)
        # the step's one readback: the next tokens, then (selective mode) the blocks chosen
        self.out = torch.zeros(layout.batch + 1, dtype=torch.int64, device=device)
        self.next_tokens = self.out[:layout.batch]
        self.chosen = self.out[layout.batch]
        self.select: list[dict | None] = []  # per group: selective mode's static index tensors
        selection = layout.selection
        for g, (_, pairs, _) in enumerate(layout.caps):
            width = selection.widths[g] if selection is not None else 0
            if not width:
                self.select.append(None)
                continue
            count = layout.batch * width
            numbers = torch.arange(count + 1, dtype=torch.int32, device=device)
            self.select.append(dict(item_off=numbers, pairs=numbers[:count], q_off=numbers[::width].contiguous(),
                                    dense=numbers[:count].view(layout.batch, width),
                                    states=torch.zeros(count, num_heads, head_dim, device=device),
                                    lse=torch.full((count, num_heads), float("-inf"), device=device)))
            if selection.score_layers[g]:
                part = layout.fields[f"score{g}"]
                self.view[f"score{g}"] = self.meta[part].view(torch.float32).view(len(selection.score_layers[g]), pairs)
        self.logits: torch.Tensor | None = None  # the step's logits [batch, V] (static under a graph)
        self.candidates: dict[int, tuple] = {}  # a step's per selecting group: what its layers choose from
        self.graph = None  # torch.cuda.CUDAGraph once captured; False where capture failed
        self.field = {name: self.host_np[part] for name, part in layout.fields.items()}  # numpy views of host
        for name in self.field:
            if name.startswith("score"):
                self.field[name] = self.field[name].view(np.float32)
        # per group what was packed: (plan, slots' generation, the scores policy's tables)
        self.packed: list[tuple | None] = [None] * len(layout.caps)

    def put(self, name: str, values, pad: int = 0) -> None:
        """A field's values, the rest of its capacity `pad`."""
        field = self.field[name]
        count = len(values)
        field[:count] = values
        field[count:] = pad

    def pack_scores(self, g: int, scores: np.ndarray) -> None:
        """The scores policy's [layers, P] scores of a group's pairs (the pads' never taken)."""
        field = self.field[f"score{g}"].reshape(scores.shape[0], -1)
        field[:, :scores.shape[1]] = scores
        field[:, scores.shape[1]:] = np.inf

    def pack_plan(self, g: int, plan: GroupPlan, slot_of: dict[int, int]) -> None:
        """The fields of a group's plan: the items' slots and positions, the pairs, padded."""
        count = plan.q_off.size - 1
        item_slots = np.fromiter((slot_of[b] for b in plan.item_ids.tolist()), dtype=np.int64, count=plan.num_items)
        self.put(f"item_slots{g}", item_slots, -1)
        self.put(f"item_pos{g}", plan.item_pos)
        self.put(f"item_off{g}", plan.item_off, plan.num_pairs)
        self.put(f"pair_query{g}", plan.pair_query)
        self.put(f"q_off{g}", plan.q_off, plan.num_pairs)
        self.put(f"q_pairs{g}", plan.q_pairs)
        self.put(f"pair_slot{g}", item_slots[plan.pair_item], -1)
        self.put(f"pair_pos{g}", plan.item_pos[plan.pair_item])
        per_query = self.layout.caps[g][2]
        dense = np.full((self.layout.batch, per_query), plan.num_pairs, dtype=np.int32)  # pair P: lse -inf
        lengths = np.diff(plan.q_off)
        rows = np.repeat(np.arange(count), lengths)
        cols = np.arange(plan.num_pairs) - np.repeat(plan.q_off[:-1], lengths)
        dense[rows, cols] = plan.q_pairs
        self.field[f"dense{g}"][:] = dense.reshape(-1)


class DeviceDecode:
    """Runs decode steps on the device for an engine (see the module docstring)."""

    def __init__(self, engine, graphs: bool) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.store = engine.store
        self.pool = engine.pool
        self.backend = engine.backend
        self.spec = engine.spec
        self.device = engine.device
        self.graphs = graphs and self.device.type == "cuda"
        self.resident = ResidentSlots(self.store, self.pool)
        self.buffers: dict[tuple, StepBuffers] = {}
        self.admitted: set[int] = set()  # contexts whose blocks were admitted since the pool became resident
        self.invalid_reads = torch.zeros((), dtype=torch.int64, device=self.device)  # items attention found not valid
        self.group_layers = [torch.tensor(g.layers, device=self.device) for g in self.store.groups]
        self.one = torch.ones((), dtype=torch.int8, device=self.device)
        self._plans: dict[int, tuple[list, GroupPlan]] = {}  # group -> (the tables' versions, its plan)
        self.windows = any(g.window for g in self.store.groups)  # sliding-window groups drop old blocks
        self._events = None
        self._warned = False
        self.prefilled_rows = 0  # prompt rows run here (`prefill`)
        self._said_too_small = False
        self.bounds: SlotBounds | None = None  # the quest policy's key bounds per slot (device_select.py)
        self._tables: dict[int, tuple] = {}  # ctx id -> (its block scores, as one array): the scores policy
        self.step_counts = (0, 0)  # the last step's blocks attended and candidates, per layer (selective mode)

    # -- which steps -------------------------------------------------------------------------------

    def _plain(self, prompt: bool) -> bool:
        """Whether the engine's steps can run here: no draft or observer reads a step's attention;
        a decode step's policy (selective mode) is one the device applies; a prompt has none and
        keeps no queries."""
        engine = self.engine
        if engine.draft is not None or engine.dispatch.observer is not None:
            return False
        if prompt:
            return engine.policy is None and not engine.dispatch.capture_rows
        return engine.policy is None or engine.policy.name in DEVICE_POLICIES

    def takes(self, requests) -> bool:
        """Whether this step's requests (each decoding one generated token) run here."""
        if not self._plain(prompt=False):
            return False
        if any(r.temperature > 0 or r.all_logits or r.pool_values for r in requests):
            return False
        resident = self.resident
        admitted = resident.active and all(r.ctx.id in self.admitted for r in requests)
        if admitted and all(len(g.free) >= len(requests) for g in resident.groups):  # a new block each at most
            return True
        needed = resident.needed([r.ctx.tables for r in requests])
        if needed > self.pool.num_slots:
            self._too_small(needed)
            return False
        return not admitted  # admitted with no slot free: others' blocks hold them (the host path hands them back)

    def _too_small(self, slots: int) -> None:
        """Says once that the pool cannot hold the `slots` blocks per layer a step reads (its steps
        stream through the pool on the host's path), and what pool would."""
        if self._said_too_small:
            return
        self._said_too_small = True
        pool = self.pool
        per_slot = pool.slot_bytes * pool.num_layers / 2**20
        emit(self.engine.scheduler.listener, EngineWarning(
            f"a step reads {slots:,} blocks per layer and the {pool.num_slots * per_slot:,.1f} MiB pool holds "
            f"{pool.num_slots:,}: such steps stream through the pool on the host's path; --pool-mib "
            f"{math.ceil(2 * slots * per_slot):,} (twice what this step reads, room for the context to grow) keeps "
            f"them on the device"))

    def takes_prefill(self, work) -> bool:
        """Whether a step of prompt chunks runs here: work as `Scheduler.step` takes it, (context,
        rows, logits kept, request) each. Every chunk has two rows at least (a one-row segment is a
        decode query on the per-layer path, with other bits), keeps the last row's logits or none,
        and no one asks for the queries or the value rows; the blocks the chunks read and write fit
        the slots."""
        if not self._plain(prompt=True) or not work:
            return False
        capture = self.engine.dispatch.capture_ids
        for ctx, rows, keep, request in work:
            if len(rows) < 2 or keep == "all" or ctx.id in capture or (request is not None and request.pool_values):
                return False
        # the blocks the chunks add, and the partly filled one each may copy on write
        new = sum(-(-(ctx.num_cached + len(rows)) // BLOCK_TOKENS) - ctx.num_cached // BLOCK_TOKENS
                  for ctx, rows, _, _ in work)
        needed = self.resident.needed([ctx.tables for ctx, _, _, _ in work], new)
        if needed > self.pool.num_slots:
            self._too_small(needed)
            return False
        return True

    # -- a step ------------------------------------------------------------------------------------

    def decode(self, requests) -> tuple[list[int], float]:
        """One decode step over the requests' last tokens: writes their K/V, sets each context's
        logits, and returns the greedy next tokens (not yet appended) and the step's seconds."""
        engine, blocks, resident = self.engine, self.engine.blocks, self.resident
        self._keep_bounds(engine.policy is not None and engine.policy.name == "quest")
        resident.settle()  # the copies back of the step before are in the store before blocks are copied on write
        starts = [r.ctx.num_cached for r in requests]
        for request, start in zip(requests, starts):
            blocks.make_room(request.ctx.tables, start, 1)
        if not resident.active:
            self.admitted.clear()
            self._plans.clear()
        joining = [r for r in requests if r.ctx.id not in self.admitted]
        if joining:
            evicted = resident.evicted_blocks
            moved, moved_bytes = resident.admit([r.ctx.tables for r in joining], [r.ctx.num_cached for r in joining])
            if resident.evicted_blocks != evicted:  # others' blocks left: they are admitted again when they return
                self.admitted = {r.ctx.id for r in requests}
            self.admitted.update(r.ctx.id for r in joining)
            if moved:
                self._plans.clear()
                engine._emit(engine.scheduler.listener, BlocksMoved(moved, moved_bytes, lookups=moved))
        bufs, kv_bytes = self._prepare(requests, starts)
        seconds, tokens, chosen = self._run(bufs, len(requests))
        self.step_counts = (0, 0)
        if engine.policy is not None:  # selective mode: what the device chose is what was read
            kv_bytes, *counts = self._selected(bufs, chosen)
            self.step_counts = tuple(counts)
        logits = bufs.logits[:len(requests)].clone()  # the static outputs change at the next step
        windows = self.windows
        for request, start, row in zip(requests, starts, logits.unbind(0)):
            ctx = request.ctx
            ctx.num_cached = start + 1
            if windows:
                blocks.drop_outside_windows(ctx.tables, ctx.num_cached)
            ctx.last_logits = row
        resident.mirror(full_only=True)
        self.kv_read_bytes = kv_bytes
        return tokens, seconds

    def _prepare(self, requests, starts: list[int]) -> tuple[StepBuffers, int]:
        """Plans the step on the host and packs it into its buffers (no device value is read). What
        comes from a group's plan is packed again only when the plan or the slots changed (a block
        added or moved: once in 64 steps for a sequence); per step, the tokens, positions and the
        slots the new rows go to."""
        count = len(requests)
        batch = padded_batch(count)
        resident = self.resident
        plans, caps, kv_bytes = [], [], 0
        for index, group in enumerate(self.store.groups):
            plan = self._plan(index, requests)
            plans.append(plan)
            caps.append((capacity(plan.num_items), capacity(plan.num_pairs), capacity(plan.per_query)))
            kv_bytes += plan.num_items * group.block_bytes_per_layer * len(group.layers)
        selection = self._selection(plans)
        key = (batch, tuple(caps), selection)
        bufs = self.buffers.get(key)
        if bufs is None:
            bufs = self.buffers[key] = StepBuffers(Layout(batch, tuple(caps), selection), self.device,
                                                   self.spec.num_heads, self.spec.head_dim)
        tables = self._score_tables(requests) if selection is not None and selection.policy == "scores" else ()
        positions = np.array(starts, dtype=np.int64)
        offsets = positions % BLOCK_TOKENS
        bufs.put("tokens", [r.ctx.tokens[s] for r, s in zip(requests, starts)])
        bufs.put("positions", positions)
        bufs.put("q_end", positions + 1)
        bufs.put("write_off", offsets)
        ends = (offsets + 1).tolist()
        tail_of = (positions // BLOCK_TOKENS).tolist()
        for index, plan in enumerate(plans):
            tails = [r.ctx.tables[index].ids[t] for r, t in zip(requests, tail_of)]
            bufs.put(f"write_slot{index}", resident.place_rows(index, tails, ends), resident.sink)
            slots = resident.groups[index]
            packed = bufs.packed[index]
            if (packed is None or packed[0] is not plan or packed[1] != slots.generation
                    or any(a is not b for a, b in zip(packed[2], tables))):
                bufs.pack_plan(index, plan, slots.slot_of)
                if selection is not None and selection.score_layers[index]:
                    bufs.pack_scores(index, pair_scores(plan, selection.score_layers[index], tables))
                bufs.packed[index] = (plan, slots.generation, tables)
        return bufs, kv_bytes

    def _selection(self, plans: list[GroupPlan]) -> Selection | None:
        """Selective mode's choice for a step over these plans; None where every query reads every
        pair (no policy, or no query has more candidates than the budget)."""
        policy, selector = self.engine.policy, self.engine.dispatch.selector
        if policy is None or selector is None:
            return None
        widths, score_layers = [], []
        for group, plan in zip(self.store.groups, plans):
            if group.window or plan.per_query <= selector.budget:  # the selector's exact layers, or nothing to drop
                widths.append(0)
                score_layers.append(())
                continue
            widths.append(min(capacity(plan.per_query), max(selector.budget, selector.recent_blocks + 1)))
            score_layers.append(tuple(group.layers) if policy.name == "scores" else ())
        if not any(widths):
            return None
        return Selection(policy.name, selector.budget, selector.recent_blocks, tuple(widths), tuple(score_layers))

    def _score_tables(self, requests) -> tuple:
        """The scores policy's tables of each request's context, as one array each (made once
        per prompt's scores; None where a context has none)."""
        tables, kept = [], {}
        for request in requests:
            raw = self.engine.block_scores(request.ctx)
            entry = self._tables.get(request.ctx.id)
            if entry is None or entry[0] is not raw:
                entry = (raw, scores_table(raw, self.spec.num_layers))
            kept[request.ctx.id] = entry
            tables.append(entry[1])
        self._tables = kept
        return tuple(tables)

    def _keep_bounds(self, wanted: bool) -> None:
        """The quest policy's per-slot key bounds, kept while it is the policy: made with the
        resident blocks handed back (each is loaded again, and its bounds with it)."""
        resident = self.resident
        if wanted == (self.bounds is not None):
            return
        self.buffers.clear()  # steps captured with the bounds (or without) are made again
        if wanted:
            self.release()
            selecting = [layer for group in self.store.groups if not group.window for layer in group.layers]
            self.bounds = SlotBounds(self.pool, selecting)
            resident.on_loaded, resident.on_copied = self.bounds.loaded, self.bounds.copied
        else:
            self.bounds = resident.on_loaded = resident.on_copied = None

    def _selected(self, bufs: StepBuffers, chosen: int) -> tuple[int, int, int]:
        """A selective step's K/V bytes read, blocks attended and candidates, each per layer: a
        group that chose reads its `chosen` pairs, one whose queries read every pair its blocks."""
        selection = bufs.layout.selection
        read = attended = candidates = 0
        for index, group in enumerate(self.store.groups):
            plan, layers = self._plans[index][1], len(group.layers)
            candidates += plan.num_pairs * layers
            if selection is None or not selection.widths[index]:
                attended += plan.num_pairs * layers
                read += plan.num_items * layers * group.block_bytes_per_layer
        return read + chosen * self.store.groups[0].block_bytes_per_layer, attended + chosen, candidates

    def _plan(self, index: int, requests) -> GroupPlan:
        """The group's pairs for these requests' tables, made again only when one changed."""
        versions = [(r.ctx.id, r.ctx.tables[index].version) for r in requests]
        cached = self._plans.get(index)
        if cached is not None and cached[0] == versions:
            return cached[1]
        plan = GroupPlan.build([r.ctx.tables[index].live() for r in requests])
        self._plans[index] = (versions, plan)
        return plan

    def prefill(self, segments, token_ids: list[int], logit_rows: torch.Tensor, logit_counts: list[int],
                tiles: bool) -> tuple[torch.Tensor, float]:
        """One step of prompt chunks on the device (`takes_prefill` said yes; the block manager made
        room for them): each chunk's K/V rows baked into their blocks' slots, each chunk attending
        over its sequence's resident blocks in one pass (the per-layer pool path's call, one pass:
        the same bits), nothing read back. segments: dispatch.Segment per chunk, in row order; the
        rows of the logits kept (a host tensor) and their counts per chunk, and tiles, as
        `Scheduler.step` gives them to `ModelRunner.forward`. Returns the logits of `logit_rows` and the step's
        seconds. The rows written are copied back to the store asynchronously (`ResidentSlots.mirror`)."""
        engine, resident, pool, device = self.engine, self.resident, self.pool, self.device
        if not resident.active:
            self.admitted.clear()
            self._plans.clear()
        # every chunk's blocks get slots: those not resident are loaded (up to the chunk's start),
        # the blocks the chunk adds take free ones
        evicted = resident.evicted_blocks
        moved, moved_bytes = resident.admit([s.ctx.tables for s in segments], [s.start for s in segments])
        if resident.evicted_blocks != evicted:  # others' blocks left: they are admitted again when they return
            self.admitted = set()
        self.admitted.update(s.ctx.id for s in segments)
        if moved:
            engine._emit(engine.scheduler.listener, BlocksMoved(moved, moved_bytes, lookups=moved))
        # the host's plan, in one int64 buffer sent with one copy: per group the slot each row
        # writes, then per chunk and group the slots and positions of the blocks it reads
        pos = np.concatenate([np.arange(s.start, s.start + s.count, dtype=np.int64) for s in segments])
        logit_index = hostreads.host_array(logit_rows).astype(np.int64)
        parts = [np.asarray(token_ids, dtype=np.int64), pos, pos % BLOCK_TOKENS, logit_index]
        kv_bytes = 0
        for index, group in enumerate(self.store.groups):
            row_slots = []
            for segment in segments:
                table = segment.ctx.tables[index]
                end = segment.start + segment.count
                for block in range(segment.start // BLOCK_TOKENS, (end - 1) // BLOCK_TOKENS + 1):
                    first_row = max(segment.start, block * BLOCK_TOKENS)
                    last_row = min(end, (block + 1) * BLOCK_TOKENS)
                    slot = resident.place_new(index, table.ids[block])
                    resident.wrote(index, table.ids[block], last_row - block * BLOCK_TOKENS)
                    row_slots += [slot] * (last_row - first_row)
            parts.append(np.asarray(row_slots, dtype=np.int64))
            slot_of = resident.groups[index].slot_of
            for segment in segments:
                first = max(0, segment.start - group.window + 1) // BLOCK_TOKENS if group.window else 0
                ids, block_pos = segment.ctx.tables[index].live(first)
                parts += [np.fromiter((slot_of[b] for b in ids), dtype=np.int64, count=len(ids)),
                          np.asarray(block_pos, dtype=np.int64)]
                kv_bytes += len(ids) * group.block_bytes_per_layer * len(group.layers)
        sizes = [p.size for p in parts]
        packed = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
        fields = list(packed.split(sizes))
        tokens, row_pos, write_off, logit_index = fields[:4]
        per_group = 1 + 2 * len(segments)
        write_slots, read_slots = [], {}
        for index in range(len(self.store.groups)):
            base = 4 + index * per_group
            write_slots.append(fields[base])
            for j in range(len(segments)):
                read_slots[index, j] = (fields[base + 1 + 2 * j], fields[base + 2 + 2 * j])
        for index, group in enumerate(self.store.groups):
            pool.valid_all.index_put_((self.group_layers[index][:, None], write_slots[index][None, :]), self.one)
            for j in range(len(segments)):
                slots = read_slots[index, j][0]
                self.invalid_reads += (pool.valid[group.layers[0]].index_select(0, slots) == 0).sum()
        layer_group, backend = self.store.layer_group, self.backend

        def write_kv(layer: int, k: torch.Tensor, v: torch.Tensor, rope) -> None:
            slots = write_slots[layer_group[layer]]
            pool.k[layer][slots, :, write_off] = rope.apply(k).to(pool.dtype)
            pool.v[layer][slots, :, write_off] = v.to(pool.dtype)

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            index = layer_group[layer]
            window = self.store.groups[index].window
            blocks = LayerBlocks(pool.k_addr[layer], pool.v_addr[layer], lambda slots: pool.slots(layer, slots),
                                 pool.k[layer], pool.v[layer], pool.valid[layer])
            q = q.float()
            if len(segments) == 1:
                return backend.pool_prefill(q, segments[0].start, blocks, [read_slots[index, 0]], window)
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            for j, segment in enumerate(segments):
                out[segment.rows] = backend.pool_prefill(q[segment.rows], segment.start, blocks, [read_slots[index, j]],
                                                         window)
            return out

        cuda = device.type == "cuda"
        if cuda:
            if self._events is None:
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        started = time.perf_counter()
        hostreads.phase("forward")
        logits = self.runner.forward(tokens, row_pos, Rows.of([s.count for s in segments], tiles), write_kv, attend,
                                     logit_index, Rows.of(logit_counts, tiles))
        hostreads.phase(None)
        seconds = time.perf_counter() - started
        if cuda:  # the chunk's time on the device: its end waited for (the one wait of a chunk)
            self._events[1].record()
            self._events[1].synchronize()
            seconds = self._events[0].elapsed_time(self._events[1]) / 1000
        self.prefilled_rows += len(token_ids)
        engine.dispatch.kv_read_bytes += kv_bytes
        return logits, seconds

    def after_prefill(self) -> None:
        """After a prefill step's bookkeeping (sliding windows dropped): the filled blocks copied back."""
        self.resident.mirror(full_only=True)

    def _run(self, bufs: StepBuffers, count: int) -> tuple[float, list[int], int]:
        """Uploads the metadata, runs the step (its graph where captured), reads the tokens back
        (and the blocks chosen in selective mode, 0 otherwise)."""
        cuda = self.device.type == "cuda"
        if cuda:
            if self._events is None:
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            started = time.perf_counter()
        bufs.meta.copy_(bufs.host, non_blocking=True)  # the step's one upload
        if self.graphs and bufs.graph is None:
            self._capture(bufs)
        hostreads.phase("forward")
        if bufs.graph:
            bufs.graph.replay()
        else:
            self._forward(bufs)
        hostreads.phase("readback")
        if cuda:
            self._events[1].record()
        values = bufs.out.tolist()  # the one readback (the tokens, the blocks chosen): it waits for the step
        hostreads.phase(None)
        seconds = self._events[0].elapsed_time(self._events[1]) / 1000 if cuda else time.perf_counter() - started
        return seconds, values[:count], values[-1]

    def _forward(self, bufs: StepBuffers) -> None:
        """The step itself: device work only, on static tensors (what a CUDA graph captures)."""
        view = bufs.view
        tokens = view["tokens"].long()
        positions = view["positions"].long()
        write_off = view["write_off"].long()
        write_slots = [view[f"write_slot{g}"].long() for g in range(len(self.store.groups))]
        rows = Rows.of([1] * bufs.layout.batch)
        layer_group = self.store.layer_group
        pool = self.pool
        bounds = self.bounds

        def write_kv(layer: int, k: torch.Tensor, v: torch.Tensor, rope) -> None:
            slots = write_slots[layer_group[layer]]
            kept = rope.apply(k).to(pool.dtype)
            pool.k[layer][slots, :, write_off] = kept
            pool.v[layer][slots, :, write_off] = v.to(pool.dtype)
            if bounds is not None:
                bounds.wrote(layer, slots, write_off, kept)

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            return self._attend(layer, q.float().contiguous(), bufs)

        bufs.chosen.zero_()
        # what each selecting group's layers choose from: the same in every layer of the step
        bufs.candidates = {g: self._candidates(bufs, g) for g, select in enumerate(bufs.select) if select is not None}

        for g, group in enumerate(self.store.groups):
            # the rows written now make their slots valid in every layer of the group (the sink too,
            # which no item reads); then any item attention reads from a slot still not valid counts
            pool.valid_all.index_put_((self.group_layers[g][:, None], write_slots[g][None, :]), self.one)
            items = view[f"item_slots{g}"]
            slots = torch.where(items >= 0, items, 0).long()
            self.invalid_reads += ((pool.valid[group.layers[0]].index_select(0, slots) == 0) & (items >= 0)).sum()
        logits = self.runner.forward(tokens, positions, rows, write_kv, attend, bufs.logit_rows, rows)
        if bufs.logits is None or bufs.logits.shape != logits.shape:
            bufs.logits = torch.empty_like(logits)
        bufs.logits.copy_(logits)
        torch.argmax(logits, dim=-1, out=bufs.next_tokens)

    def _attend(self, layer: int, q: torch.Tensor, bufs: StepBuffers) -> torch.Tensor:
        """q [Bp, Hq, D] fp32 over the group's pairs -> [Bp, Hq, D] fp32."""
        g = self.store.layer_group[layer]
        group = self.store.groups[g]
        view, pool, backend = bufs.view, self.pool, self.backend
        if bufs.select[g] is not None:
            return self._attend_chosen(layer, g, q, bufs)
        if backend.name == "triton":
            states, lse = bufs.states[g], bufs.lse[g]
            backend.ops.shared_decode_states(
                q, pool.k[layer], pool.v[layer], pool.valid[layer], view[f"item_slots{g}"], view[f"item_pos{g}"],
                view[f"item_off{g}"], view[f"pair_query{g}"], view["positions"], view["q_end"],
                scale=backend.scale, window=group.window, out=states, lse=lse)
            return backend.ops.merge_ragged_states(states, lse, view[f"q_off{g}"], view[f"q_pairs{g}"])[0]
        out, lse = reference.pair_states(q, pool.k[layer], pool.v[layer], view[f"pair_slot{g}"], view[f"pair_pos{g}"],
                                         view[f"pair_query{g}"], view["positions"], view["q_end"], group.window,
                                         backend.scale)
        per_query = bufs.layout.caps[g][2]
        return reference.merge_pairs(out, lse, view[f"dense{g}"].view(bufs.layout.batch, per_query))

    def _attend_chosen(self, layer: int, g: int, q: torch.Tensor, bufs: StepBuffers) -> torch.Tensor:
        """Selective mode: each query's blocks chosen on the device (device_select.py), attention
        over those pairs only, merged in logical order."""
        selection, view, pool, backend = bufs.layout.selection, bufs.view, self.pool, self.backend
        window = self.store.groups[g].window
        pair_slot, pair_pos, pair_query = view[f"pair_slot{g}"], view[f"pair_pos{g}"], view[f"pair_query{g}"]
        if selection.policy == "quest":
            scores = quest_scores(q, self.bounds, layer, pair_slot, pair_query)
        else:
            scores = view[f"score{g}"][selection.score_layers[g].index(layer)]
        pad = pair_slot.shape[0] - 1  # a pad entry: capacities hold one at least
        chosen, count = choose(scores, *bufs.candidates[g], selection.budget, selection.widths[g], pad)
        bufs.chosen += count
        index = chosen.reshape(-1)
        slots, pos, query = (t.index_select(0, index) for t in (pair_slot, pair_pos, pair_query))
        select = bufs.select[g]
        if backend.name == "triton":
            backend.ops.shared_decode_states(
                q, pool.k[layer], pool.v[layer], pool.valid[layer], slots, pos, select["item_off"], query,
                view["positions"], view["q_end"], scale=backend.scale, window=window, out=select["states"],
                lse=select["lse"])
            return backend.ops.merge_ragged_states(select["states"], select["lse"], select["q_off"], select["pairs"])[0]
        out, lse = reference.pair_states(q, pool.k[layer], pool.v[layer], slots, pos, query, view["positions"],
                                         view["q_end"], window, backend.scale)
        return reference.merge_pairs(out, lse, select["dense"])

    def _candidates(self, bufs: StepBuffers, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A selecting group's queries' pairs and which are always kept (device_select.candidates)."""
        view = bufs.view
        pair_slot, pair_pos, pair_query = view[f"pair_slot{g}"], view[f"pair_pos{g}"], view[f"pair_query{g}"]
        dense = view[f"dense{g}"].view(bufs.layout.batch, bufs.layout.caps[g][2])
        blocks = (view["positions"].long() + BLOCK_TOKENS - 1) // BLOCK_TOKENS  # the context's blocks before the row
        recent = bufs.layout.selection.recent
        keep = (pair_pos == 0) | (pair_pos.long() >= blocks.index_select(0, pair_query.long()) - recent)
        real = pair_slot.index_select(0, dense.reshape(-1).long()).view(dense.shape) >= 0
        return candidates(dense, real, keep)

    def _capture(self, bufs: StepBuffers) -> None:
        """Captures the step as a CUDA graph (after two eager runs, which compile the kernels);
        a step that cannot be captured runs eagerly from then on, with one warning."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bufs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._forward(bufs)
            bufs.graph = graph
        except RuntimeError as exc:
            bufs.graph = False
            if not self._warned:
                self._warned = True
                emit(self.engine.scheduler.listener, EngineWarning(f"the decode step could not be captured as a CUDA "
                                                                   f"graph ({exc}); running it eagerly"))

    # -- leaving ---------------------------------------------------------------------------------------

    def release(self) -> None:
        """Before a step on the per-layer path: the device's rows copied back, the pool handed over."""
        if self.resident.active:
            self.resident.release()
            self.admitted.clear()
            self._plans.clear()

    def sync(self) -> None:
        """After a run (and before the saved-KV cache reads a chunk): the store holds every row the
        device wrote (the pool stays resident)."""
        if self.resident.active:
            self.resident.mirror(full_only=False)
            self.resident.settle()
