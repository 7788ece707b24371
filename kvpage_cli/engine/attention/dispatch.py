"""Attention dispatch: which blocks each query of a step reads, and from where.

A step holds the rows of several sequences: decode queries (one token of a sequence) and prefill
chunks (several tokens of one sequence). Decode queries are served together: the distinct blocks
they read are visited once each for all the queries that own them (forks of one document share
its blocks), then each query's per-block states are merged in logical order. A prefill chunk
attends to its own sequence's blocks. In selective mode a policy picks each decode query's blocks.

Blocks are reached in the store where they are ("store" path: only when the store is in the
compute device's memory, as on a CPU) or through the pool ("pool" path: blocks are copied into
slots in passes of at most `slots` blocks, in logical order, and the valid mask marks the slots
of the pass). When a layer reads more blocks than it has slots (streaming), each layer follows a
pass schedule (kv/schedule.py: a resident prefix that keeps its slots from step to step, the rest
through a ring), so that a block is copied again only when the ring's turn comes to it; where
the blocks fit, or a selector picks them (its prefetches choose slots too), the pool keeps the
most recently used. The backend computes the states; what is bit-identical is said in backend.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import BLOCK_TOKENS, SMALL_ROWS, TILE_RUN_BLOCKS
from ..kv.context import Context
from ..kv.pool import SlotPool
from ..kv.schedule import StreamSchedule
from ..kv.store import BlockStore, copy_rows
from ..model.spec import ModelSpec
from . import reference
from .backend import DecodePlan, LayerBlocks

SCORE_QUERY_TOKENS = 16  # a prompt's final tokens whose queries rank blocks ("scores" policy, retrieval)


@dataclass(frozen=True)
class Segment:
    """A sequence's rows in a step: positions start .. start+rows.stop-rows.start-1."""

    ctx: Context
    start: int
    rows: slice

    @property
    def count(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass
class Step:
    """One forward pass over several sequences' rows. Decode segments (one row) come first."""

    segments: list[Segment]
    tiles: bool = False  # its decode rows are a batch's generated tokens: AMX tiles may attend them (backend)
    decode: list[Segment] = field(init=False)
    prefill: list[Segment] = field(init=False)
    plans: dict = field(default_factory=dict)  # store group -> the exact decode queries' plan (and short segments')

    def __post_init__(self) -> None:
        self.decode = [s for s in self.segments if s.count == 1]
        self.prefill = [s for s in self.segments if s.count > 1]
        starts = [s.rows.start for s in self.decode]
        # the decode rows as a slice where they are the first rows (as the engine orders them)
        self.decode_rows = slice(0, len(starts)) if starts == list(range(len(starts))) else torch.tensor(starts)


class AttentionDispatch:
    def __init__(self, spec: ModelSpec, store: BlockStore, pool: SlotPool, backend, kv_path: str,
                 capture_rows: int = 0, observer=None) -> None:
        """capture_rows: keep the queries of the last rows of each prompt (the "scores" policy).
        observer(layer, ctx, step, positions [n], lse [n, Hq]): every decode query's per-block
        log-sum-exp (a draft model's attention feeds the draft policy of the model it drafts for)."""
        self.spec = spec
        self.store = store
        self.pool = pool
        self.backend = backend
        self.kv_path = kv_path
        self.capture_rows = capture_rows
        self.observer = observer
        self.selector = None
        self.kv_read_bytes = 0  # this step's K/V bytes attention read: each block once per layer
        self.captured: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}  # ctx id -> layer -> (q rows, first position)
        self.capture_ids: dict[int, int] = {}  # ctx id -> its prompt's last rows whose queries are kept, whatever the mode
        self.stream_schedule = True  # streaming passes by a schedule per layer (False: least recently used)
        self.schedules: dict[int, StreamSchedule] = {}  # layer -> its schedule, made when it first streams
        self.double_buffered: bool | None = None  # the schedules' ring in halves (None: where there is a copy stream)

    def use_selector(self, selector) -> None:
        """Selective decoding with this selector (None: exact, every block)."""
        self.selector = selector

    # -- a step ----------------------------------------------------------------------------------

    def attend(self, layer: int, q: torch.Tensor, step: Step) -> torch.Tensor:
        """q: [N, Hq, D] rotated queries of the step's rows -> attention output [N, Hq, D] fp32."""
        if not step.prefill and isinstance(step.decode_rows, slice):  # every row is a decode query, in order
            return self._decode(layer, q.float(), step)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if step.decode:
            out[step.decode_rows] = self._decode(layer, q[step.decode_rows].float(), step)
        for segment in step.prefill:
            qs = q[segment.rows]
            rows = self.capture_ids.get(segment.ctx.id) or self.capture_rows
            if rows:
                keep = min(rows, segment.count)
                self.captured.setdefault(segment.ctx.id, {})[layer] = (qs[-keep:].clone(), segment.start + segment.count - keep)
            out[segment.rows] = self._prefill(layer, qs, segment.start, segment.ctx, step)
        return out

    def _decode(self, layer: int, q: torch.Tensor, step: Step) -> torch.Tensor:
        """q: [B, Hq, D] fp32, one query per decode segment -> [B, Hq, D]."""
        group = self.store.group_of(layer)
        plan = self._decode_plan(layer, group, q, step)
        self.kv_read_bytes += plan.item_ids.numel() * group.block_bytes_per_layer
        states, lse = self.backend.states(plan.num_pairs, q.device)
        observed = self.selector is not None or self.observer is not None  # they read each block's lse
        tiles = 0 if not step.tiles else 1 if observed else TILE_RUN_BLOCKS
        if self.kv_path == "store":
            self.backend.decode_states(q, plan, self._store_blocks(layer, group), group.window, states, lse, tiles)
        else:
            for part in self._pool_passes(layer, group, plan):
                self.backend.decode_states(q, part, self._pool_blocks(layer), group.window, states, lse, tiles)
        if observed:
            self._observe(layer, step, plan, lse)
        return self.backend.merge(states, lse, plan)

    def _decode_plan(self, layer: int, group, q: torch.Tensor, step: Step) -> DecodePlan:
        exact = self.selector is None  # (a selector also counts what its exact layers read)
        if exact and group.index in step.plans:
            return step.plans[group.index]
        blocks = []
        for i, segment in enumerate(step.decode):
            ids, positions = segment.ctx.tables[group.index].live_tensors()  # a sliding table holds its window only
            if not exact:
                ids, positions = self.selector.select(layer, q[i], segment.ctx, ids, positions, segment.start)
                if self.pool.mover is not None and layer + 1 < self.spec.num_layers:
                    self._prefetch(layer + 1, segment.ctx, segment.start)
            blocks.append((ids, positions))
        plan = DecodePlan.build(blocks, [s.start for s in step.decode])
        if exact:
            step.plans[group.index] = plan
        return plan

    def _observe(self, layer: int, step: Step, plan: DecodePlan, lse: torch.Tensor) -> None:
        for j, segment in enumerate(step.decode):
            pairs = plan.q_pairs[int(plan.q_off[j]):int(plan.q_off[j + 1])].to(torch.int64)
            items = torch.searchsorted(plan.item_off[1:].to(torch.int64), pairs, right=True)
            positions = plan.item_pos[items]
            if self.selector is not None:
                self.selector.observe(layer, segment.ctx, segment.start, positions, lse[pairs])
            if self.observer is not None:
                self.observer(layer, segment.ctx, segment.start, positions, lse[pairs])

    def _prefill(self, layer: int, q: torch.Tensor, q_start: int, ctx: Context, step: Step) -> torch.Tensor:
        """A chunk's queries [T, Hq, D] at positions q_start.. over the blocks it may see -> [T, Hq, D]."""
        group = self.store.group_of(layer)
        seq_end = q_start + q.shape[0]
        first = max(0, q_start - group.window + 1) // BLOCK_TOKENS if group.window else 0
        ids, positions = ctx.tables[group.index].live(first)
        self.kv_read_bytes += len(ids) * group.block_bytes_per_layer
        if self.kv_path == "store" and self.backend.short_as_queries and q.shape[0] <= SMALL_ROWS:
            key = ("segment", ctx.id, q_start, group.index)
            if key not in step.plans:
                step.plans[key] = self._segment_plan(q_start, q.shape[0], ids, positions, group.window)
            plan = step.plans[key]
            states, lse = self.backend.states(plan.num_pairs, q.device)
            self.backend.decode_states(q.float(), plan, self._store_blocks(layer, group), group.window, states, lse)
            return self.backend.merge(states, lse, plan)
        if self.kv_path == "store":
            pos = self.store.layer_pos[layer]
            runs, index = [], 0
            for run in group.runs(ids):
                k, v = group.run_view(pos, run)
                runs.append((k, v, positions[index]))
                index += run.count
            return self.backend.store_prefill(q, q_start, runs, group.window)
        return self.backend.pool_prefill(q, q_start, self._pool_blocks(layer),
                                         self._passes(layer, group, ids, positions, seq_end), group.window)

    @staticmethod
    def _segment_plan(q_start: int, count: int, ids: list[int], positions: list[int], window: int) -> DecodePlan:
        """A prompt segment's rows as decode queries, each over the blocks it sees (keys up to its
        own position, within the window), so that a row's state does not depend on the segment."""
        ids_t, pos_t = torch.tensor(ids, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32)
        first_key, blocks = pos_t.to(torch.int64) * BLOCK_TOKENS, []
        for p in range(q_start, q_start + count):
            seen = (first_key <= p) & (first_key + BLOCK_TOKENS > (p - window + 1 if window else 0))
            blocks.append((ids_t[seen], pos_t[seen]))
        return DecodePlan.build(blocks, list(range(q_start, q_start + count)))

    # -- where blocks are read ---------------------------------------------------------------------

    def _store_blocks(self, layer: int, group) -> LayerBlocks:
        pos = self.store.layer_pos[layer]
        return LayerBlocks(group.k_addr[pos], group.v_addr[pos], lambda ids: group.gather(pos, ids))

    def _pool_blocks(self, layer: int) -> LayerBlocks:
        pool = self.pool
        pool.allocate()  # the slots' tensors exist from the first load on
        return LayerBlocks(pool.k_addr[layer], pool.v_addr[layer], lambda slots: pool.slots(layer, slots),
                           pool.k[layer], pool.v[layer], pool.valid[layer])

    def _pool_passes(self, layer: int, group, plan: DecodePlan):
        """The plan's items loaded into the pool in passes (logical order): per pass, the plan for
        those items with their slots in place of the block ids."""
        generation = group.allocator.generation
        items = plan.item_ids.tolist()
        positions = plan.item_pos.tolist()
        # the rows of each block written so far: up to the furthest query that reads it
        item_of_pair = torch.repeat_interleave(torch.arange(len(items)), (plan.item_off[1:] - plan.item_off[:-1]).long())
        ends = torch.zeros(len(items), dtype=torch.int64).scatter_reduce_(
            0, item_of_pair, plan.q_end[plan.pair_query.long()], "amax").tolist()

        def blocks(first: int, last: int) -> list[tuple[int, int, int]]:
            return [(b, generation[b], min(BLOCK_TOKENS, end - p * BLOCK_TOKENS))
                    for b, p, end in zip(items[first:last], positions[first:last], ends[first:last])]

        for first, last, slots in self._loaded_passes(layer, group, items, blocks):
            yield plan.items(first, last, torch.tensor(slots, dtype=torch.int32))

    def _passes(self, layer: int, group, ids: list[int], positions: list[int], seq_end: int):
        """Loads blocks into the layer's slots, at most `num_slots` at a time, in logical order.

        Yields (its slots, their logical block indices) per pass."""
        generation = group.allocator.generation

        def blocks(first: int, last: int) -> list[tuple[int, int, int]]:
            return [(b, generation[b], min(BLOCK_TOKENS, seq_end - p * BLOCK_TOKENS))
                    for b, p in zip(ids[first:last], positions[first:last])]

        for first, last, slots in self._loaded_passes(layer, group, ids, blocks):
            yield slots, positions[first:last]

    def _loaded_passes(self, layer: int, group, ids: list[int], blocks):
        """Yields (first, last, slots) per pass over `ids` once the pass's blocks are in its slots
        (blocks(first, last): the (id, generation, rows) of those). Passes of a schedule copy their
        blocks together (`SlotPool.load_batch`), and the next pass's copies are started before
        this pass is read where their slots differ (double buffering: on a GPU the copy stream
        fills one half of the ring while attention reads the other); other passes load as the
        pool chooses."""
        bounds = self._pass_bounds(layer, ids)
        if not bounds or bounds[0][2] is None:
            copy_in = self._copier(layer, group)
            for first, last, _ in bounds:
                yield first, last, self.pool.load(layer, blocks(first, last), copy_in)
            return
        pos, pin = self.store.layer_pos[layer], self.pool.device.type == "cuda"

        def start(bound):
            first, last, slots = bound
            return self.pool.load_batch(layer, blocks(first, last), slots, lambda b: group.stacked(pos, b, pin))

        landing = start(bounds[0])
        for i, (first, last, slots) in enumerate(bounds):
            following = None
            if i + 1 < len(bounds) and set(bounds[i + 1][2]).isdisjoint(slots):
                following = start(bounds[i + 1])  # copied while this pass is read
            yield first, last, self.pool.land(layer, landing)
            if i + 1 < len(bounds):
                landing = following if following is not None else start(bounds[i + 1])

    def _pass_bounds(self, layer: int, ids: list[int]) -> list[tuple[int, int, list[int] | None]]:
        """The passes over `ids` (distinct blocks, logical order) as (first, last, slots): the
        layer's schedule's passes and slots when they stream; else passes of `num_slots` whose
        slots the pool chooses (None)."""
        size = self.pool.num_slots
        if not self.stream_schedule or self.selector is not None or len(ids) <= size:
            return [(first, min(first + size, len(ids)), None) for first in range(0, len(ids), size)]
        schedule = self.schedules.get(layer)
        if schedule is None or schedule.num_slots != size:
            # passes of half the ring where a copy stream fills one half while the other is read;
            # without one (a CPU), the whole ring: fewer passes, the same copies
            double = self.double_buffered if self.double_buffered is not None else self.pool.device.type == "cuda"
            schedule = self.schedules[layer] = StreamSchedule(size, double_buffered=double)
        bounds, first = [], 0
        for part in schedule.passes(ids):
            bounds.append((first, first + len(part.blocks), part.slots))
            first += len(part.blocks)
        return bounds

    def _copier(self, layer: int, group):
        """copy_in(block_id, k_slot, v_slot, tokens) for the pool: a block of `layer` from the store."""
        pos = self.store.layer_pos[layer]

        def copy_in(block_id: int, k_slot: torch.Tensor, v_slot: torch.Tensor, tokens: int) -> None:
            copy_rows(k_slot, group.k_block(pos, block_id), tokens, non_blocking=True)
            copy_rows(v_slot, group.v_block(pos, block_id), tokens, non_blocking=True)

        return copy_in

    def _prefetch(self, layer: int, ctx: Context, written: int) -> None:
        """Starts copying the blocks `layer` is predicted to read into its slots (the mover runs
        them): those whose rows are all in the store (`written` tokens have K/V there), not the one
        `layer` writes this step's row into before it reads it (copied then, it would lack the row)."""
        predicted = self.selector.predicted(layer, ctx)
        if predicted is None:
            return
        group = self.store.group_of(layer)
        ids = ctx.tables[group.index].ids
        generation = group.allocator.generation
        blocks = [(ids[p], generation[ids[p]], BLOCK_TOKENS)
                  for p in predicted if (p + 1) * BLOCK_TOKENS <= written and ids[p] is not None]
        self.pool.prefetch(layer, blocks, self._copier(layer, group))

    # -- the scores policy -------------------------------------------------------------------------

    def take_step_counts(self) -> tuple[int, int, int]:
        """What the step just run read: (K/V bytes, selective mode's chosen blocks, their
        candidates), each counted per layer; the counters start again from zero."""
        read, self.kv_read_bytes = self.kv_read_bytes, 0
        if self.selector is None:
            return read, 0, 0
        return read, *self.selector.take_counts()

    def take_captured(self, ctx: Context) -> dict[int, tuple[torch.Tensor, int]] | None:
        """The final queries of the prompt `ctx` just ran (layer -> (q [t, Hq, D], first position))."""
        return self.captured.pop(ctx.id, None)

    def block_relevance(self, ctx: Context, queries: dict[int, tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """Per layer, [blocks up to the queries' end] the share of attention the captured queries
        (layer -> (q [t, Hq, D], first position)) pay each block, summed over them and the heads;
        0 for blocks a layer no longer holds."""
        scores = []
        for layer in range(self.spec.num_layers):
            q, start = queries[layer]
            end = start + q.shape[0]
            num_blocks = -(-end // BLOCK_TOKENS)
            group = self.store.group_of(layer)
            ids, positions = ctx.tables[group.index].live()
            kept = [(b, p) for b, p in zip(ids, positions) if p < num_blocks]  # blocks decoded since: not scored
            ids, positions = [b for b, _ in kept], [p for _, p in kept]
            k, v = group.gather(self.store.layer_pos[layer], ids)
            # the queries were kept on the compute device (a GPU's): scored where the blocks are
            qh, row_pos = reference.rows(q.to(k.device), torch.arange(start, end), self.spec.num_kv_heads)
            _, lse = self.backend.block_states(qh, row_pos, k, v, torch.tensor(positions), end, group.window)  # [n, Hkv, R]
            share = torch.softmax(lse, dim=0).sum(dim=(1, 2))  # [n]
            table = torch.zeros(num_blocks)
            table[torch.tensor(positions, dtype=torch.int64)] = share
            scores.append(table)
        return scores
