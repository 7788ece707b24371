"""The store: where every block of every context lives (host RAM).

Layers that see the same blocks form a group: all full-attention layers, and all sliding-window
layers of one window size. A group has one allocator, so a block id names the same 64 tokens in
every layer of the group; each layer holds its K and V for that id. Storage comes in arenas,
tensors of `[A, Hkv, 64, D]` that never move once made, so a block's address is stable and a
run of consecutive ids in one arena is a plain view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import BlockAllocator
from .config import BLOCK_TOKENS

MIN_ARENA_BLOCKS = 16


@dataclass(frozen=True)
class Run:
    """Consecutive ids `first .. first+count-1` in one arena, starting at row `row`."""

    arena: int
    row: int
    count: int


class StoreGroup:
    def __init__(self, index: int, layers: list[int], window: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.index = index
        self.layers = layers
        self.window = window
        self.block_shape = (num_kv_heads, BLOCK_TOKENS, head_dim)
        self.dtype = dtype
        self.device = device
        self.allocator = BlockAllocator()
        self.k_arenas: list[list[torch.Tensor]] = [[] for _ in layers]  # [layer_pos][arena]: [A, Hkv, 64, D]
        self.v_arenas: list[list[torch.Tensor]] = [[] for _ in layers]
        self.arena_of: list[int] = []
        self.row_of: list[int] = []
        self.k_addr = [torch.empty(0, dtype=torch.int64) for _ in layers]  # per layer: [capacity] addresses
        self.v_addr = [torch.empty(0, dtype=torch.int64) for _ in layers]
        element = torch.empty(0, dtype=dtype).element_size()
        self.block_bytes_per_layer = 2 * num_kv_heads * BLOCK_TOKENS * head_dim * element

    @property
    def block_bytes(self) -> int:
        """K and V of one block in every layer of the group."""
        return self.block_bytes_per_layer * len(self.layers)

    def reserve(self, count: int) -> None:
        """Makes sure `count` ids can be allocated without another arena."""
        missing = count - self.allocator.num_free
        if missing <= 0:
            return
        size = max(missing, MIN_ARENA_BLOCKS, self.allocator.capacity // 2)
        arena = len(self.k_arenas[0])
        for pos in range(len(self.layers)):
            k = torch.zeros((size, *self.block_shape), dtype=self.dtype, device=self.device)
            v = torch.zeros((size, *self.block_shape), dtype=self.dtype, device=self.device)
            self.k_arenas[pos].append(k)
            self.v_arenas[pos].append(v)
            step = k[0].numel() * k.element_size()
            rows = torch.arange(size, dtype=torch.int64) * step
            self.k_addr[pos] = torch.cat([self.k_addr[pos], rows + k.data_ptr()])
            self.v_addr[pos] = torch.cat([self.v_addr[pos], rows + v.data_ptr()])
        self.arena_of.extend([arena] * size)
        self.row_of.extend(range(size))
        self.allocator.grow(size)

    def allocate(self, count: int) -> list[int]:
        self.reserve(count)
        return self.allocator.allocate(count)

    def k_block(self, pos: int, block_id: int) -> torch.Tensor:
        """K of block `block_id` in the group's layer number `pos`: [Hkv, 64, D]."""
        return self.k_arenas[pos][self.arena_of[block_id]][self.row_of[block_id]]

    def v_block(self, pos: int, block_id: int) -> torch.Tensor:
        return self.v_arenas[pos][self.arena_of[block_id]][self.row_of[block_id]]

    def copy_block(self, src: int, dst: int, tokens: int) -> None:
        """Copies the first `tokens` rows of block `src` into `dst`, in every layer (copy-on-write)."""
        for pos in range(len(self.layers)):
            self.k_block(pos, dst)[:, :tokens].copy_(self.k_block(pos, src)[:, :tokens])
            self.v_block(pos, dst)[:, :tokens].copy_(self.v_block(pos, src)[:, :tokens])

    def runs(self, ids: list[int]) -> list[Run]:
        """Splits ids (in logical order) into runs of consecutive ids within one arena."""
        runs: list[Run] = []
        for block_id in ids:
            arena, row = self.arena_of[block_id], self.row_of[block_id]
            last = runs[-1] if runs else None
            if last is not None and last.arena == arena and last.row + last.count == row:
                runs[-1] = Run(arena, last.row, last.count + 1)
            else:
                runs.append(Run(arena, row, 1))
        return runs

    def run_view(self, pos: int, run: Run) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of a run in layer `pos`: [count, Hkv, 64, D] views (no copy)."""
        sl = slice(run.row, run.row + run.count)
        return self.k_arenas[pos][run.arena][sl], self.v_arenas[pos][run.arena][sl]

    @property
    def bytes_used(self) -> int:
        return self.allocator.num_used * self.block_bytes

    @property
    def bytes_reserved(self) -> int:
        return self.allocator.capacity * self.block_bytes


class BlockStore:
    """All groups of a model; maps a layer to its group and its position in that group."""

    def __init__(self, layer_windows: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        by_window: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        self.groups = [
            StoreGroup(i, layers, window, num_kv_heads, head_dim, dtype, device)
            for i, (window, layers) in enumerate(sorted(by_window.items()))
        ]
        self.layer_group: list[int] = [0] * len(layer_windows)
        self.layer_pos: list[int] = [0] * len(layer_windows)
        for group in self.groups:
            for pos, layer in enumerate(group.layers):
                self.layer_group[layer] = group.index
                self.layer_pos[layer] = pos

    def group_of(self, layer: int) -> StoreGroup:
        return self.groups[self.layer_group[layer]]

    @property
    def bytes_used(self) -> int:
        return sum(g.bytes_used for g in self.groups)

    @property
    def bytes_reserved(self) -> int:
        return sum(g.bytes_reserved for g in self.groups)
