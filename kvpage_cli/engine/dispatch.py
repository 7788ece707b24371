"""Attention dispatch: which blocks a step reads, how they are reached, and which kernels run.

Blocks are reached either in the store where they are ("store" path: only when the store is in
the compute device's memory, as on a CPU) or through the pool ("pool" path: blocks are copied
into slots in passes of at most `slots` blocks, in logical order, and the valid mask marks the
slots of the pass). Either way every block yields its own partial state, and the states are
merged in logical order at the end, so both paths and every pool size give the same bits.
"""

from __future__ import annotations

import time

import torch

from . import attention as torch_attention
from . import native
from .config import BLOCK_TOKENS
from .context import Context
from .pool import SlotPool
from .spec import ModelSpec
from .store import BlockStore


class AttentionDispatch:
    def __init__(self, spec: ModelSpec, store: BlockStore, pool: SlotPool, backend: str, kv_path: str,
                 native_lib=None, triton_ops=None) -> None:
        self.spec = spec
        self.store = store
        self.pool = pool
        self.backend = backend
        self.kv_path = kv_path
        self.native_lib = native_lib
        self.triton_ops = triton_ops
        self.bf16 = store.groups[0].dtype == torch.bfloat16
        self.copy_seconds = 0.0
        self._states: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None
        self.capture_rows = 0  # keep the queries of the last rows of each prefill chunk ("scores" policy)
        self.captured: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> (q [t, Hq, D], first position)
        self.selector = None  # set by selective mode
        self.observer = None  # (layer, step, positions, lse) after each decode step's per-block states: (layer, q, ctx, ids, positions) -> (ids, positions)

    def blocks_for(self, layer: int, ctx: Context, q_start: int) -> tuple[list[int], list[int]]:
        """(ids, logical indices) of the blocks a query chunk starting at `q_start` may see."""
        group = self.store.group_of(layer)
        first = 0
        if group.window:
            first = max(0, q_start - group.window + 1) // BLOCK_TOKENS
        return ctx.tables[group.index].live(first)

    def attend(self, layer: int, q: torch.Tensor, q_start: int, ctx: Context) -> torch.Tensor:
        """q: [T, Hq, D] at positions q_start.. -> attention output [T, Hq, D] fp32."""
        group = self.store.group_of(layer)
        seq_end = q_start + q.shape[0]
        if self.capture_rows and q.shape[0] > 1:
            keep = min(self.capture_rows, q.shape[0])
            self.captured[layer] = (q[-keep:].clone(), seq_end - keep)
        if q.shape[0] == 1 and (self.selector is not None or self.observer is not None or self.backend in ("native", "triton")):
            return self._decode(layer, q, q_start, group, ctx)
        ids, positions = self.blocks_for(layer, ctx, q_start)
        if self.kv_path == "store":
            return self._attend_store(layer, q, q_start, seq_end, group, ids, positions)
        return self._attend_pool(layer, q, q_start, seq_end, group, ids, positions)

    def _decode(self, layer: int, q: torch.Tensor, q_start: int, group, ctx: Context) -> torch.Tensor:
        """One query token over per-block states: every live block, or the selector's choice."""
        ids, positions = ctx.tables[group.index].live_tensors()  # a sliding table holds only its window
        if self.selector is not None:
            ids, positions = self.selector.select(layer, q[0], ctx, ids, positions, q_start)
            if self.pool.mover is not None and layer + 1 < self.spec.num_layers:
                self._prefetch(layer + 1, ctx, q_start + 1)
        if self.kv_path == "store":
            states, lse = self._store_states(layer, q, q_start, group, ids, positions)
        else:
            states, lse = self._pool_states(layer, q, q_start, group, ids.tolist(), positions.tolist())
        if self.selector is not None:
            self.selector.observe(layer, q_start, positions, lse)
        if self.observer is not None:
            self.observer(layer, q_start, positions, lse)
        if self.native_lib is not None:
            out = torch.empty(self.spec.num_heads, self.spec.head_dim)
            native.merge_states(self.native_lib, states, lse, out)
            return out[None]
        if self.backend == "triton":
            return self.triton_ops.merge_attention_states(states, lse, dim=0)[0][None]
        return torch_attention.merge_states(states, lse)[None]

    def bake(self, layer: int, k: torch.Tensor, v: torch.Tensor, rope, block_ids: list[int], offsets: list[int]) -> None:
        """Triton: rotates k [T, Hkv, D] and writes k, v into their store rows in one kernel per arena."""
        group = self.store.group_of(layer)
        pos = self.store.layer_pos[layer]
        arenas = [group.arena_of[b] for b in block_ids]
        rows = torch.tensor([group.row_of[b] for b in block_ids], dtype=torch.int32, device=k.device)
        offs = torch.tensor(offsets, dtype=torch.int32, device=k.device)
        for arena in sorted(set(arenas)):
            mine = torch.tensor([a == arena for a in arenas], device=k.device)
            slot_ids = torch.where(mine, rows, torch.full_like(rows, -1))  # -1: not in this arena, skipped
            self.triton_ops.rope_bake_store(
                k.contiguous(), v.contiguous(), rope.positions.to(torch.int32), rope.params.inv_freq.to(k.device),
                group.k_arenas[pos][arena], group.v_arenas[pos][arena], slot_ids, offs,
                attention_scaling=rope.params.attention_scaling,
            )

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
            pos = self.store.layer_pos[layer]
            k = torch.stack([group.k_block(pos, b) for b in ids])
            v = torch.stack([group.v_block(pos, b) for b in ids])
            qh, row_pos = self._rows(q, start)
            _, lse = torch_attention.block_states(qh, row_pos, k, v, torch.tensor(positions), end,
                                                  group.window, self.spec.attn_scale)  # [n, Hkv, R]
            share = torch.softmax(lse, dim=0).sum(dim=(1, 2))  # [n]
            table = torch.zeros(num_blocks)
            table[torch.tensor(positions)] = share
            scores.append(table)
        return scores

    def _store_states(self, layer, q, q_start, group, ids, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block states [n, Hq, D] and lse [n, Hq] of one query token, blocks read in place."""
        pos = self.store.layer_pos[layer]
        seq_end = q_start + 1
        if self.backend == "native":
            states, lse = self._scratch(ids.numel())
            native.decode_block_states(
                self.native_lib, q[0].float().contiguous(), group.k_addr[pos], group.v_addr[pos], ids, positions,
                self.spec.num_kv_heads, q_start, seq_end, group.window, self.spec.attn_scale, states, lse, self.bf16,
            )
            return states, lse
        id_list = ids.tolist()
        k = torch.stack([group.k_block(pos, b) for b in id_list]) if id_list else torch.empty(0, *group.block_shape)
        v = torch.stack([group.v_block(pos, b) for b in id_list]) if id_list else torch.empty(0, *group.block_shape)
        qh, row_pos = self._rows(q, q_start)
        out, lse = torch_attention.block_states(qh, row_pos, k, v, positions.to(torch.int64), seq_end, group.window,
                                                self.spec.attn_scale)
        return out.reshape(len(id_list), self.spec.num_heads, self.spec.head_dim), lse.reshape(len(id_list), self.spec.num_heads)

    def _attend_store(self, layer, q, q_start, seq_end, group, ids, positions) -> torch.Tensor:
        pos = self.store.layer_pos[layer]
        num_tokens = q.shape[0]
        qh, row_pos = self._rows(q, q_start)
        block_pos = torch.tensor(positions, dtype=torch.int64)
        runs = group.runs(ids)
        if not runs:
            return torch.zeros(q.shape, dtype=torch.float32)
        views = [group.run_view(pos, run) for run in runs]
        if len(views) == 1:
            k, v = views[0]
        else:  # gather the context's blocks so that the split below depends on positions only
            k = torch.cat([kv[0] for kv in views])
            v = torch.cat([kv[1] for kv in views])
        out, _ = torch_attention.range_attention(qh, row_pos, k, v, block_pos, seq_end, group.window, self.spec.attn_scale)
        return torch_attention.rows_to_tokens(out, num_tokens)

    def _rows(self, q: torch.Tensor, q_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Query rows [Hkv, T*G, D] fp32 and their positions [T*G]."""
        group = self.spec.group_size
        row_pos = torch.arange(q_start, q_start + q.shape[0], device=q.device).repeat_interleave(group)
        return torch_attention.query_rows(q, self.spec.num_kv_heads), row_pos

    def _copier(self, layer: int, group):
        """copy_in(block_id, k_slot, v_slot, tokens) for the pool: a block of `layer` from the store."""
        pos = self.store.layer_pos[layer]

        def copy_in(block_id: int, k_slot: torch.Tensor, v_slot: torch.Tensor, tokens: int) -> None:
            started = time.perf_counter()
            k_slot[:, :tokens].copy_(group.k_block(pos, block_id)[:, :tokens], non_blocking=True)
            v_slot[:, :tokens].copy_(group.v_block(pos, block_id)[:, :tokens], non_blocking=True)
            self.copy_seconds += time.perf_counter() - started

        return copy_in

    def _prefetch(self, layer: int, ctx: Context, seq_end: int) -> None:
        """Starts copying the blocks `layer` is predicted to read into its slots (the mover runs them)."""
        predicted = self.selector.predicted(layer, ctx)
        if predicted is None:
            return
        group = self.store.group_of(layer)
        ids = ctx.tables[group.index].ids
        generation = group.allocator.generation
        blocks = [(ids[p], generation[ids[p]], min(BLOCK_TOKENS, seq_end - p * BLOCK_TOKENS))
                  for p in predicted if p < len(ids) and ids[p] is not None]
        self.pool.prefetch(layer, blocks, self._copier(layer, group))

    def _passes(self, layer: int, group, ids: list[int], positions: list[int], seq_end: int):
        """Loads the blocks into the layer's slots, at most `num_slots` at a time, in logical order.

        Yields (index of the pass's first block, its slots, its logical block indices)."""
        pool = self.pool
        generation = group.allocator.generation
        copy_in = self._copier(layer, group)
        for first in range(0, len(ids), pool.num_slots):
            pass_ids = ids[first:first + pool.num_slots]
            pass_pos = positions[first:first + pool.num_slots]
            blocks = [(b, generation[b], min(BLOCK_TOKENS, seq_end - p * BLOCK_TOKENS)) for b, p in zip(pass_ids, pass_pos)]
            yield first, pool.load(layer, blocks, copy_in), pass_pos

    def _pool_states(self, layer, q, q_start, group, ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block states [n, Hq, D] and lse [n, Hq] of one query token, blocks streamed through the pool."""
        seq_end = q_start + 1
        n = len(ids)
        if self.backend == "native":
            states, lse = self._scratch(n)
        else:
            states = torch.empty(n, self.spec.num_heads, self.spec.head_dim, device=q.device)
            lse = torch.empty(n, self.spec.num_heads, device=q.device)
            qh, row_pos = self._rows(q, q_start)
        for first, slots, pass_pos in self._passes(layer, group, ids, positions, seq_end):
            end = first + len(slots)
            if self.backend == "triton":  # one split per block: the per-block states themselves
                out, l = self.triton_ops.paged_decode_attention(
                    q.contiguous(), self.pool.k[layer], self.pool.v[layer], self.pool.valid[layer],
                    self._int32([slots], q.device), self._int32([pass_pos], q.device), self._int32([seq_end], q.device),
                    scale=self.spec.attn_scale, window=group.window, num_splits=len(slots),
                )
                states[first:end], lse[first:end] = out[0], l[0]
                continue
            if self.backend == "native":
                native.decode_block_states(
                    self.native_lib, q[0].float().contiguous(), self.pool.k_addr[layer], self.pool.v_addr[layer],
                    torch.tensor(slots, dtype=torch.int32), torch.tensor(pass_pos, dtype=torch.int32),
                    self.spec.num_kv_heads, q_start, seq_end, group.window, self.spec.attn_scale,
                    states[first:end], lse[first:end], self.bf16,
                )
                continue
            k, v = self._slots(layer, slots)
            out, l = torch_attention.block_states(
                qh, row_pos, k, v, torch.tensor(pass_pos, dtype=torch.int64, device=q.device), seq_end, group.window,
                self.spec.attn_scale,
            )
            states[first:end] = out.reshape(len(slots), self.spec.num_heads, self.spec.head_dim)
            lse[first:end] = l.reshape(len(slots), self.spec.num_heads)
        return states, lse

    def _slots(self, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(slots, dtype=torch.int64, device=self.pool.k[layer].device)
        return self.pool.k[layer].index_select(0, index), self.pool.v[layer].index_select(0, index)

    def _attend_pool(self, layer, q, q_start, seq_end, group, ids, positions) -> torch.Tensor:
        """Query tokens [T, Hq, D] over blocks streamed through the pool: per-block states merged in order."""
        if self.backend == "triton":
            return self._triton_prefill(layer, q, q_start, seq_end, group, ids, positions)
        qh, row_pos = self._rows(q, q_start)
        fold = native.Fold(self.native_lib, self.spec.num_kv_heads, qh.shape[1], self.spec.head_dim) if self.native_lib else None
        outs, lses = [], []
        for _, slots, pass_pos in self._passes(layer, group, ids, positions, seq_end):
            k, v = self._slots(layer, slots)
            out, lse = torch_attention.block_states(
                qh, row_pos, k, v, torch.tensor(pass_pos, dtype=torch.int64, device=q.device), seq_end, group.window,
                self.spec.attn_scale,
            )
            if fold is not None:
                fold.add(out, lse)
            else:
                outs.append(out)
                lses.append(lse)
        merged = fold.result() if fold is not None else self._merge(outs, lses, qh)
        return torch_attention.rows_to_tokens(merged, q.shape[0])

    def _triton_prefill(self, layer, q, q_start, seq_end, group, ids, positions) -> torch.Tensor:
        """Triton: the chunk's queries over each pass of slots, the passes' states merged in order."""
        q_pos = torch.arange(q_start, seq_end, dtype=torch.int32, device=q.device)
        outs, lses = [], []
        for _, slots, pass_pos in self._passes(layer, group, ids, positions, seq_end):
            out, lse = self.triton_ops.paged_prefill_attention(
                q.contiguous(), q_pos, self.pool.k[layer], self.pool.v[layer], self.pool.valid[layer],
                self._int32(slots, q.device), self._int32(pass_pos, q.device),
                scale=self.spec.attn_scale, window=group.window,
            )
            outs.append(out)
            lses.append(lse)
        if not outs:
            return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if len(outs) == 1:
            return outs[0]
        return self.triton_ops.merge_attention_states(torch.stack(outs), torch.stack(lses), dim=0)[0]

    @staticmethod
    def _int32(values, device) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    def _scratch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused buffers for n blocks' decode states (allocating them each call costs page faults)."""
        if self._states is None or self._states.shape[0] < n:
            size = max(n, 2 * (self._states.shape[0] if self._states is not None else 0), 64)
            self._states = torch.empty(size, self.spec.num_heads, self.spec.head_dim)
            self._lse = torch.empty(size, self.spec.num_heads)
        return self._states[:n], self._lse[:n]

    @staticmethod
    def _merge(outs, lses, qh) -> torch.Tensor:
        """Merged states [Hkv, R, D]; zeros when no block was visible at all."""
        if not outs:
            return torch.zeros(qh.shape, dtype=torch.float32, device=qh.device)
        return torch_attention.merge_states(torch.cat(outs), torch.cat(lses))
