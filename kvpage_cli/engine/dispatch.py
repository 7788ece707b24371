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
        self.selector = None  # set by selective mode: (layer, q, ctx, ids, positions) -> (ids, positions)

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
        if self.backend == "native" and self.kv_path == "store" and q.shape[0] == 1 and self.selector is None:
            # Decode fast path: the table's cached id tensors; a sliding table holds only its window.
            ids_t, pos_t = ctx.tables[group.index].live_tensors()
            pos = self.store.layer_pos[layer]
            return self._native_decode(q, group.k_addr[pos], group.v_addr[pos], ids_t, pos_t, q_start, seq_end, group.window)
        ids, positions = self.blocks_for(layer, ctx, q_start)
        if self.selector is not None:
            ids, positions = self.selector(layer, q, ctx, ids, positions)
        if self.kv_path == "store":
            return self._attend_store(layer, q, q_start, seq_end, group, ids, positions)
        return self._attend_pool(layer, q, q_start, seq_end, group, ids, positions)

    def _attend_store(self, layer, q, q_start, seq_end, group, ids, positions) -> torch.Tensor:
        pos = self.store.layer_pos[layer]
        num_tokens = q.shape[0]
        if self.backend == "native" and num_tokens == 1:
            ids_t = torch.tensor(ids, dtype=torch.int32)
            pos_t = torch.tensor(positions, dtype=torch.int32)
            return self._native_decode(q, group.k_addr[pos], group.v_addr[pos], ids_t, pos_t, q_start, seq_end, group.window)
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

    def _attend_pool(self, layer, q, q_start, seq_end, group, ids, positions) -> torch.Tensor:
        pos = self.store.layer_pos[layer]
        pool = self.pool
        generation = group.allocator.generation

        def copy_in(block_id: int, k_slot: torch.Tensor, v_slot: torch.Tensor, tokens: int) -> None:
            started = time.perf_counter()
            k_slot[:, :tokens].copy_(group.k_block(pos, block_id)[:, :tokens], non_blocking=True)
            v_slot[:, :tokens].copy_(group.v_block(pos, block_id)[:, :tokens], non_blocking=True)
            self.copy_seconds += time.perf_counter() - started

        num_tokens = q.shape[0]
        native_decode = self.backend == "native" and num_tokens == 1
        n = len(ids)
        fold = None
        if native_decode:
            states, lse = self._scratch(n)
        else:
            qh, row_pos = self._rows(q, q_start)
            if self.backend == "native":
                fold = native.Fold(self.native_lib, self.spec.num_kv_heads, qh.shape[1], self.spec.head_dim)
        outs, lses = [], []
        for first in range(0, n, pool.num_slots):
            pass_ids = ids[first:first + pool.num_slots]
            pass_pos = positions[first:first + pool.num_slots]
            blocks = [(b, generation[b], min(BLOCK_TOKENS, seq_end - p * BLOCK_TOKENS)) for b, p in zip(pass_ids, pass_pos)]
            slots = pool.load(layer, blocks, copy_in)
            if native_decode:
                end = first + len(slots)
                native.decode_block_states(
                    self.native_lib, q[0].float().contiguous(), pool.k_addr[layer], pool.v_addr[layer],
                    torch.tensor(slots, dtype=torch.int32), torch.tensor(pass_pos, dtype=torch.int32),
                    self.spec.num_kv_heads, q_start, seq_end, group.window, self.spec.attn_scale,
                    states[first:end], lse[first:end], self.bf16,
                )
                continue
            index = torch.tensor(slots, dtype=torch.int64, device=pool.k[layer].device)
            k = pool.k[layer].index_select(0, index)
            v = pool.v[layer].index_select(0, index)
            out, l = torch_attention.block_states(
                qh, row_pos, k, v, torch.tensor(pass_pos, dtype=torch.int64, device=q.device), seq_end, group.window,
                self.spec.attn_scale,
            )
            if fold is not None:
                fold.add(out, l)
                continue
            outs.append(out)
            lses.append(l)
        if native_decode:
            out = torch.empty(self.spec.num_heads, self.spec.head_dim)
            native.merge_states(self.native_lib, states, lse, out)
            return out[None]
        merged = fold.result() if fold is not None else self._merge(outs, lses, qh)
        return torch_attention.rows_to_tokens(merged, num_tokens)

    def _scratch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused buffers for n blocks' decode states (allocating them each call costs page faults)."""
        if self._states is None or self._states.shape[0] < n:
            size = max(n, 2 * (self._states.shape[0] if self._states is not None else 0), 64)
            self._states = torch.empty(size, self.spec.num_heads, self.spec.head_dim)
            self._lse = torch.empty(size, self.spec.num_heads)
        return self._states[:n], self._lse[:n]

    def _native_decode(self, q, k_addr, v_addr, ids_t, pos_t, q_start, seq_end, window) -> torch.Tensor:
        states, lse = self._scratch(ids_t.numel())
        native.decode_block_states(
            self.native_lib, q[0].float().contiguous(), k_addr, v_addr, ids_t, pos_t, self.spec.num_kv_heads,
            q_start, seq_end, window, self.spec.attn_scale, states, lse, self.bf16,
        )
        out = torch.empty(self.spec.num_heads, self.spec.head_dim)
        native.merge_states(self.native_lib, states, lse, out)
        return out[None]

    @staticmethod
    def _merge(outs, lses, qh) -> torch.Tensor:
        """Merged states [Hkv, R, D]; zeros when no block was visible at all."""
        if not outs:
            return torch.zeros(qh.shape, dtype=torch.float32, device=qh.device)
        return torch_attention.merge_states(torch.cat(outs), torch.cat(lses))
