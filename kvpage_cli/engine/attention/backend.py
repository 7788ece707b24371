"""Attention backends: per-block attention states for one or many queries, and their merge.

One interface, chosen once when the engine loads:

| backend | decode states (one token per sequence) | merge | prefill (a chunk of one sequence) |
|---|---|---|---|
| torch  | the reference: `attention.block_states` | `attention.merge_states` | `store_prefill` (one causal flash pass, or per-block states over store views), `pool_prefill` (per-block states pass after pass) |
| native | C kernels over an address table (store or pool) | C, in logical order | over bfloat16 KV in the store, a chunk in one call of prefill.c (bfloat16 dot products; causal, windows); else as torch, the pool path's states folded in C |
| triton | `shared_decode_states` over pool slots (each block read once for its queries) | `merge_ragged_states`, in logical order | `paged_prefill_attention` over pool slots |

Dispatch only decides which blocks a step reads and from where; every attention computation is
behind this interface. What is bit-identical (docs/exactness.md): every backend
computes each (block, query) state on its own and merges a query's states in logical block order,
so results do not depend on which slots or passes held the blocks. With the native and Triton
backends a decode query's state also does not depend on the other queries of its step: batched
decoding gives each sequence the bits it gets alone. The store path's prefill (one
flash-attention call over the blocks every row sees whole) is exact to rounding, within 1e-5 of
the per-block path, not bit-identical to it (tested); over bfloat16 KV the native backend's
(prefill.c: Q written as three bfloat16 terms and the probabilities as two, fp32 sums) agrees with
torch's fp32 flash attention to about 1e-5 of the outputs' scale (tested), and each query row's
bits there do not depend on the other rows of the call either. Where prefill.c does not apply (a
CPU without AVX512-BF16, float32 or int8 KV) the native backend attends a short prompt segment's
rows (config.SMALL_ROWS) as decode queries instead (dispatch), so that there too a token gets the
same bits whatever the length of the segment it comes in (a review's clause prompts, batched or
alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import native
from ..config import BLOCK_TOKENS
from . import reference


@dataclass(frozen=True)
class DecodePlan:
    """The decode queries of one step over one store group and the blocks they read.

    Items are the distinct blocks (id, logical index), in logical order; each is read once for
    all the queries that own it (forks sharing a document). Pairs are (item, query), numbered
    item by item; `q_pairs[q_off[j]:q_off[j+1]]` are query j's pairs in logical block order."""

    item_ids: torch.Tensor  # [I] int32: block ids (store path) or slots (pool path, per pass)
    item_pos: torch.Tensor  # [I] int32 logical block index
    item_off: torch.Tensor  # [I+1] int32 CSR offsets into the pairs
    pair_query: torch.Tensor  # [P] int32
    q_pos: torch.Tensor  # [Nq] int64 position of each query
    q_end: torch.Tensor  # [Nq] int64 keys at positions >= q_end are not seen
    q_off: torch.Tensor  # [Nq+1] int32
    q_pairs: torch.Tensor  # [P] int32

    @property
    def num_pairs(self) -> int:
        return self.pair_query.numel()

    @property
    def num_queries(self) -> int:
        return self.q_pos.numel()

    @classmethod
    def build(cls, blocks: list[tuple[torch.Tensor, torch.Tensor]], q_pos: list[int]) -> "DecodePlan":
        """blocks[j]: (ids [n_j], logical indices [n_j]) int32 of query j's blocks, in logical order."""
        counts = torch.tensor([ids.numel() for ids, _ in blocks], dtype=torch.int64)
        ids = torch.cat([b[0] for b in blocks]).to(torch.int64) if blocks else torch.empty(0, dtype=torch.int64)
        pos = torch.cat([b[1] for b in blocks]).to(torch.int64) if blocks else torch.empty(0, dtype=torch.int64)
        owner = torch.repeat_interleave(torch.arange(len(blocks)), counts)
        span = int(ids.max()) + 1 if ids.numel() else 1
        keys, entry_item = torch.unique(pos * span + ids, return_inverse=True)  # items sorted by (position, id)
        order = torch.argsort(entry_item * max(1, len(blocks)) + owner, stable=True)  # entries in pair order
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        item_off = torch.zeros(keys.numel() + 1, dtype=torch.int64)
        item_off[1:] = torch.cumsum(torch.bincount(entry_item, minlength=keys.numel()), 0)
        q_off = torch.zeros(len(blocks) + 1, dtype=torch.int64)
        q_off[1:] = torch.cumsum(counts, 0)
        positions = torch.tensor(q_pos, dtype=torch.int64)
        return cls(
            item_ids=(keys % span).to(torch.int32), item_pos=(keys // span).to(torch.int32),
            item_off=item_off.to(torch.int32), pair_query=owner[order].to(torch.int32),
            q_pos=positions, q_end=positions + 1, q_off=q_off.to(torch.int32), q_pairs=rank.to(torch.int32),
        )

    def items(self, first: int, last: int, item_ids: torch.Tensor | None = None) -> "DecodePlan":
        """The plan restricted to items first .. last-1 (a pass through the pool), their pairs
        keeping their numbers; `item_ids` replaces the block ids (by the slots that hold them)."""
        return DecodePlan(
            item_ids=self.item_ids[first:last] if item_ids is None else item_ids, item_pos=self.item_pos[first:last],
            item_off=self.item_off[first:last + 1], pair_query=self.pair_query, q_pos=self.q_pos, q_end=self.q_end,
            q_off=self.q_off, q_pairs=self.q_pairs,
        )


@dataclass(frozen=True)
class LayerBlocks:
    """Where one layer's blocks are read: an address table [capacity, Hkv] (by block id in the
    store, by slot in the pool) and a way to gather them as tensors."""

    k_addr: torch.Tensor
    v_addr: torch.Tensor
    gather: object  # (ids: list[int]) -> (k, v) [n, Hkv, 64, D]
    k_slots: torch.Tensor | None = None  # the pool's slots [S, Hkv, 64, D] (Triton reads these)
    v_slots: torch.Tensor | None = None
    valid: torch.Tensor | None = None


class TorchBackend:
    """The reference: plain torch (CPU flash attention per block where available)."""

    name = "torch"
    attend_all: "reference.AttendAll | None" = None  # a whole prompt chunk in one call (the native backend's)
    short_as_queries = False  # dispatch attends a short prompt segment's rows as decode queries (NativeBackend)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale

    def states(self, num_pairs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(num_pairs, self.num_heads, self.head_dim, device=device),
                torch.empty(num_pairs, self.num_heads, device=device))

    def decode_states(self, q: torch.Tensor, plan: DecodePlan, blocks: LayerBlocks, window: int,
                      states: torch.Tensor, lse: torch.Tensor, tiles: int = 0) -> None:
        """Fills states [P, Hq, D] and lse [P, Hq] for the plan's items. q: [Nq, Hq, D] fp32. tiles:
        the native kernels may take AMX tiles for blocks many queries share (a batch's generated
        tokens; other bits than alone), up to `tiles` consecutive blocks in one pass whose state
        stands for all of them (1: each block's own state); the other backends ignore it."""
        for i in range(plan.item_ids.numel()):
            first, last = int(plan.item_off[i]), int(plan.item_off[i + 1])
            queries = plan.pair_query[first:last].to(torch.int64)
            k, v = blocks.gather([int(plan.item_ids[i])])
            qh, row_pos = reference.rows(q[queries], plan.q_pos[queries].to(q.device), self.num_kv_heads)
            out, l = reference.block_states(qh, row_pos, k, v, plan.item_pos[i:i + 1].to(q.device, torch.int64),
                                            int(plan.q_end[queries].max()), window, self.scale)
            # [1, Hkv, n*G, D] -> [n, Hq, D]
            states[first:last] = reference.rows_to_tokens(out[0], last - first)
            lse[first:last] = reference.rows_to_tokens(l[0][..., None], last - first)[..., 0]

    def merge(self, states: torch.Tensor, lse: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """Each query's pairs merged in logical order -> [Nq, Hq, D] fp32."""
        out = torch.empty(plan.num_queries, self.num_heads, self.head_dim, device=states.device)
        for j in range(plan.num_queries):
            pairs = plan.q_pairs[int(plan.q_off[j]):int(plan.q_off[j + 1])].to(torch.int64)
            out[j] = reference.merge_states(states[pairs], lse[pairs]) if pairs.numel() else 0.0
        return out

    def block_states(self, qh, row_pos, k, v, block_pos, seq_end: int, window: int):
        """Prefill rows over gathered blocks: per-block (out [n, Hkv, R, D], lse [n, Hkv, R])."""
        return reference.block_states(qh, row_pos, k, v, block_pos, seq_end, window, self.scale)

    def accumulator(self, qh: torch.Tensor) -> "Accumulator":
        """Folds per-block states, pass after pass, in logical order."""
        return Accumulator(qh)

    def store_prefill(self, q: torch.Tensor, q_start: int, runs, window: int) -> torch.Tensor:
        """Store path: a chunk's queries [T, Hq, D] at positions q_start.. over runs of consecutive
        blocks read in place (runs: (k, v [Hkv, n*64, D] views, first block's position)) -> [T, Hq, D].
        When the keys are every position from 0 (a full-attention layer), one causal flash-attention
        pass, exact to rounding; else per-block states merged in logical order. A backend with
        `attend_all` (the native one over bfloat16 KV) takes the whole chunk in one call, window
        layers too."""
        if self.attend_all is not None and runs and q.device.type == "cpu":
            base = runs[0][2] * BLOCK_TOKENS  # runs hold consecutive blocks from there (range_attention's contract)
            views = reference.token_views(runs, base, q_start + q.shape[0])
            num_kv_heads = views[0][0].shape[0]
            done = self.attend_all(reference.query_rows(q, num_kv_heads), views, q_start - base, q.shape[1] // num_kv_heads,
                                   window)
            if done is not None:
                return reference.rows_to_tokens(done[0], q.shape[0])
        if not window and runs and runs[0][2] == 0:
            out = reference.causal_attention(q, runs, q_start, self.scale)
            if out is not None:
                return out
        seq_end = q_start + q.shape[0]
        qh, row_pos = reference.rows(q, torch.arange(q_start, seq_end, device=q.device), self.num_kv_heads)
        merged = reference.range_attention(qh, row_pos, runs, seq_end, window, self.scale)[0]
        return reference.rows_to_tokens(merged, q.shape[0])

    def pool_prefill(self, q: torch.Tensor, q_start: int, blocks: LayerBlocks, passes, window: int) -> torch.Tensor:
        """Pool path: a chunk's queries [T, Hq, D] at positions q_start.. over the blocks loaded into
        the pool pass after pass (passes: (slots, their blocks' positions), in logical order; each
        pass is loaded when it is reached) -> [T, Hq, D]. Any pool size gives the same bits."""
        seq_end = q_start + q.shape[0]
        qh, row_pos = reference.rows(q, torch.arange(q_start, seq_end, device=q.device), self.num_kv_heads)
        accumulator = self.accumulator(qh)
        for slots, positions in passes:
            k, v = blocks.gather(slots)
            out, lse = self.block_states(qh, row_pos, k, v, torch.as_tensor(positions, dtype=torch.int64, device=q.device),
                                         seq_end, window)
            accumulator.add(out, lse)
        return reference.rows_to_tokens(accumulator.result(), q.shape[0])


class Accumulator:
    """Per-block states kept and merged at the end (torch)."""

    def __init__(self, qh: torch.Tensor) -> None:
        self.qh = qh
        self.outs: list[torch.Tensor] = []
        self.lses: list[torch.Tensor] = []

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.outs.append(out)
        self.lses.append(lse)

    def result(self) -> torch.Tensor:
        if not self.outs:
            return torch.zeros(self.qh.shape, dtype=torch.float32, device=self.qh.device)
        return reference.merge_states(torch.cat(self.outs), torch.cat(self.lses))


class NativeBackend(TorchBackend):
    """The C kernels of native/: decode states over an address table and merges, in fp32."""

    name = "native"

    def __init__(self, lib, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, kv_dtype: str) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.lib = lib
        self.kv_dtype = kv_dtype
        # where prefill.c does not take a chunk, torch's flash attention would, whose bits for a row
        # depend on the chunk's length: a short segment's rows go through the decode kernel instead
        self.short_as_queries = kv_dtype != "bfloat16" or head_dim % 64 != 0 or not native.has_bf16_prefill(lib)
        self._states: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None

    def states(self, num_pairs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused buffers (allocating them each step costs page faults)."""
        if self._states is None or self._states.shape[0] < num_pairs:
            size = max(num_pairs, 2 * (self._states.shape[0] if self._states is not None else 0), 64)
            self._states = torch.empty(size, self.num_heads, self.head_dim)
            self._lse = torch.empty(size, self.num_heads)
        return self._states[:num_pairs], self._lse[:num_pairs]

    def attend_all(self, qh: torch.Tensor, views, causal: int | None, group: int, window: int = 0):
        """Rows over keys in the store's bfloat16 (reference.AttendAll): prefill.c's bfloat16 dot
        products (torch's fp32 flash attention where they do not apply)."""
        if self.kv_dtype != "bfloat16":
            return None
        return native.attend_all_bf16(self.lib, qh, views, self.scale, causal, group, window)

    def decode_states(self, q, plan, blocks, window, states, lse, tiles: int = 0) -> None:
        native.decode_states(self.lib, q.contiguous(), blocks.k_addr, blocks.v_addr, plan, window, self.scale,
                             states, lse, self.kv_dtype, tiles)

    def merge(self, states, lse, plan) -> torch.Tensor:
        out = torch.empty(plan.num_queries, self.num_heads, self.head_dim)
        native.merge_pairs(self.lib, states, lse, plan, out)
        return out

    def accumulator(self, qh: torch.Tensor) -> native.Fold:
        return native.Fold(self.lib, self.num_kv_heads, qh.shape[1], self.head_dim)


class TritonBackend(TorchBackend):
    """The Triton kernels of kvpage_kernels, over the pool's slots."""

    name = "triton"

    def __init__(self, ops, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.ops = ops

    def decode_states(self, q, plan, blocks, window, states, lse, tiles: int = 0) -> None:
        # one launch: each item's block is read once from its slot for all the queries that share it
        device = q.device
        self.ops.shared_decode_states(
            q.contiguous(), blocks.k_slots, blocks.v_slots, blocks.valid, plan.item_ids.to(device),
            plan.item_pos.to(device), plan.item_off.to(device), plan.pair_query.to(device), plan.q_pos.to(device),
            plan.q_end.to(device), scale=self.scale, window=window, out=states, lse=lse)

    def merge(self, states, lse, plan) -> torch.Tensor:
        device = states.device
        return self.ops.merge_ragged_states(states, lse, plan.q_off.to(device), plan.q_pairs.to(device))[0]

    def pool_prefill(self, q, q_start, blocks, passes, window) -> torch.Tensor:
        q_pos = torch.arange(q_start, q_start + q.shape[0], dtype=torch.int32, device=q.device)
        outs, lses = [], []
        for slots, positions in passes:
            out, lse = self.ops.paged_prefill_attention(
                q.contiguous(), q_pos, blocks.k_slots, blocks.v_slots, blocks.valid,
                torch.as_tensor(slots, dtype=torch.int32, device=q.device),  # lists, or the device step's tensors
                torch.as_tensor(positions, dtype=torch.int32, device=q.device), scale=self.scale, window=window)
            outs.append(out)
            lses.append(lse)
        if not outs:
            return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if len(outs) == 1:
            return outs[0]
        return self.ops.merge_attention_states(torch.stack(outs), torch.stack(lses), dim=0)[0]
