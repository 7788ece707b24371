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
        ids, positions = self.blocks_for(layer, ctx, q_start)
        if self.selector is not None:
            ids, positions = self.selector(layer, q, ctx, ids, positions)
        if self.kv_path == "store":
            return self._attend_store(layer, q, q_start, seq_end, group, ids, positions)
        return self._attend_pool(layer, q, q_start, seq_end, group, ids, positions)

    def _attend_store(self, layer, q, q_start, seq_end, group, ids, positions) -> torch.Tensor:
        pos = self.store.layer_pos[layer]
        if self.backend == "native" and q.shape[0] == 1:
            ids_t = torch.tensor(ids, dtype=torch.int32)
            pos_t = torch.tensor(positions, dtype=torch.int32)
            return self._native_decode(q, group.k_addr[pos], group.v_addr[pos], ids_t, pos_t, q_start, seq_end, group.window)
        outs, lses = [], []
        block_pos = torch.tensor(positions, dtype=torch.int64)
        done = 0
        q_pos = torch.arange(q_start, seq_end)
        for run in group.runs(ids):
            k, v = group.run_view(pos, run)
            out, lse = torch_attention.block_states(
                q, q_pos, k, v, block_pos[done:done + run.count], seq_end, group.window, self.spec.attn_scale
            )
            outs.append(out)
            lses.append(lse)
            done += run.count
        return self._merge(outs, lses, q)

    def _attend_pool(self, layer, q, q_start, seq_end, group, ids, positions) -> torch.Tensor:
        pos = self.store.layer_pos[layer]
        pool = self.pool
        generation = group.allocator.generation

        def copy_in(block_id: int, k_slot: torch.Tensor, v_slot: torch.Tensor, tokens: int) -> None:
            started = time.perf_counter()
            k_slot[:, :tokens].copy_(group.k_block(pos, block_id)[:, :tokens], non_blocking=True)
            v_slot[:, :tokens].copy_(group.v_block(pos, block_id)[:, :tokens], non_blocking=True)
            self.copy_seconds += time.perf_counter() - started

        native_decode = self.backend == "native" and q.shape[0] == 1
        n = len(ids)
        if native_decode:
            states = torch.empty(n, self.spec.num_heads, self.spec.head_dim)
            lse = torch.empty(n, self.spec.num_heads)
        outs, lses = [], []
        q_pos = torch.arange(q_start, seq_end, device=q.device)
        for first in range(0, n, pool.num_slots):
            pass_ids = ids[first:first + pool.num_slots]
            pass_pos = positions[first:first + pool.num_slots]
            blocks = [(b, generation[b], min(BLOCK_TOKENS, seq_end - p * BLOCK_TOKENS)) for b, p in zip(pass_ids, pass_pos)]
            slots = pool.load(layer, blocks, copy_in)
            slots_t = torch.tensor(slots, dtype=torch.int32)
            pos_t = torch.tensor(pass_pos, dtype=torch.int32)
            if native_decode:
                end = first + len(slots)
                native.decode_block_states(
                    self.native_lib, q[0].float().contiguous(), pool.k_addr[layer], pool.v_addr[layer], slots_t, pos_t,
                    self.spec.num_kv_heads, q_start, seq_end, group.window, self.spec.attn_scale,
                    states[first:end], lse[first:end], self.bf16,
                )
                continue
            index = slots_t.to(device=pool.k[layer].device, dtype=torch.int64)
            k = pool.k[layer].index_select(0, index)
            v = pool.v[layer].index_select(0, index)
            out, l = torch_attention.block_states(
                q, q_pos, k, v, pos_t.to(device=q.device, dtype=torch.int64), seq_end, group.window, self.spec.attn_scale
            )
            outs.append(out)
            lses.append(l)
        if native_decode:
            out = torch.empty(self.spec.num_heads, self.spec.head_dim)
            native.merge_states(self.native_lib, states, lse, out)
            return out[None]
        return self._merge(outs, lses, q)

    def _native_decode(self, q, k_addr, v_addr, ids_t, pos_t, q_start, seq_end, window) -> torch.Tensor:
        n = ids_t.numel()
        states = torch.empty(n, self.spec.num_heads, self.spec.head_dim)
        lse = torch.empty(n, self.spec.num_heads)
        native.decode_block_states(
            self.native_lib, q[0].float().contiguous(), k_addr, v_addr, ids_t, pos_t, self.spec.num_kv_heads,
            q_start, seq_end, window, self.spec.attn_scale, states, lse, self.bf16,
        )
        out = torch.empty(self.spec.num_heads, self.spec.head_dim)
        native.merge_states(self.native_lib, states, lse, out)
        return out[None]

    @staticmethod
    def _merge(outs, lses, q) -> torch.Tensor:
        if not outs:
            return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        return torch_attention.merge_states(torch.cat(outs), torch.cat(lses))
