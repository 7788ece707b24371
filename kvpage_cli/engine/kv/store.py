"""The store: where every block of every context lives (host RAM, then a disk tier).

Layers that see the same blocks form a group: all full-attention layers, and all sliding-window
layers of one window size. A group has one allocator, so a block id names the same 64 tokens in
every layer of the group; each layer holds its K and V for that id. Storage comes in arenas,
tensors of `[A, Hkv, 64, D]` that never move once made, so a block's address is stable and a
run of consecutive ids in one arena is a plain view.

Arenas are made in host RAM while the host budget allows; beyond it they are memory-mapped
files (the disk tier), read back on demand through the page cache. Either way an arena is a
tensor at a fixed address, so the kernels read both alike and the values are the same bits.

int8 blocks carry their scales: each KV head's 64 rows of int8 are followed by `scale_rows`
rows that hold the 64 rows' scales (float32, one per row: symmetric, largest magnitude / 127).
A block stays self-contained, so every copy (pool slots, copy-on-write, the disk tier, saved KV)
moves its scales with it; a row's value is its int8 numbers times its scale, in float32, the
same product in every reader (`decode_rows` here, the native kernel).
"""

from __future__ import annotations

import os
import secrets
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import BLOCK_TOKENS
from .blocks import BlockAllocator

# An arena's blocks are zeroed (resident) when it is made: a short prompt's first arena is this
# small (256 tokens: 8 MiB of a 1B llama's bfloat16 KV, 32 MiB of an 8B's), a longer one is reserved
# whole, and a growing context's next arena is half its capacity, so arenas stay few.
MIN_ARENA_BLOCKS = 4
SCALE_BYTES = 4  # one float32 scale per int8 row


def scale_rows(dtype: torch.dtype, head_dim: int) -> int:
    """Rows after a block's 64 that hold its row scales: 0 for float blocks."""
    if dtype != torch.int8:
        return 0
    if head_dim % SCALE_BYTES:
        raise ValueError(f"int8 KV needs a head size divisible by {SCALE_BYTES}, got {head_dim}")
    return -(-BLOCK_TOKENS * SCALE_BYTES // head_dim)


def stored_block_shape(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """A block's shape as kept (store, pool, saved KV): [Hkv, 64 (+ scale rows), D]."""
    return num_kv_heads, BLOCK_TOKENS + scale_rows(dtype, head_dim), head_dim


def block_bytes_per_layer(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one block in one layer, as kept."""
    heads, rows, dim = stored_block_shape(num_kv_heads, head_dim, dtype)
    return 2 * heads * rows * dim * torch.empty(0, dtype=dtype).element_size()


def row_scales(blocks: torch.Tensor) -> torch.Tensor:
    """The scales of int8 blocks [..., 64 + scale rows, D] -> [..., 64] float32 (a view where
    the blocks' rows are contiguous, so writing into it writes the blocks)."""
    tail = blocks[..., BLOCK_TOKENS:, :].view(torch.float32)  # [..., R, D/4]
    return tail.flatten(-2)[..., :BLOCK_TOKENS]


def encode_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., D] of floats -> (int8 [..., D], scales [...] float32): symmetric, per row."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / safe[..., None]).clamp_(-127, 127).to(torch.int8), scale


def decode_rows(blocks: torch.Tensor) -> torch.Tensor:
    """Stored blocks [..., rows, D] -> their 64 rows' values [..., 64, D] (float32 for int8 blocks,
    else the blocks' first 64 rows as they are)."""
    if blocks.dtype != torch.int8:
        return blocks[..., :BLOCK_TOKENS, :]
    return blocks[..., :BLOCK_TOKENS, :].float() * row_scales(blocks)[..., None]


@dataclass(frozen=True)
class Run:
    """Consecutive ids `first .. first+count-1` in one arena, starting at row `row`."""

    arena: int
    row: int
    count: int


class ArenaSource:
    """Makes arenas: in RAM up to `host_bytes` (None: no bound), then memory-mapped files.

    The files live in a private folder `spill_dir/store-<pid>-<random>` (0700, files 0600) and
    are unlinked as soon as they are mapped, so nothing is left on disk when the process ends,
    however it ends; the folder itself is removed when the store is collected.
    """

    def __init__(self, device: torch.device, host_bytes: int | None = None, spill_dir: Path | None = None,
                 pin: bool = False) -> None:
        """pin: arenas in RAM are page-locked (a GPU then copies blocks from them without a
        staging copy, asynchronously)."""
        self.device = device
        self.host_bytes = host_bytes
        self.spill_dir = spill_dir
        self.pin = pin
        self.ram_bytes = 0
        self.disk_bytes = 0
        self._folder: Path | None = None

    def split(self, blocks: int, block_bytes: int) -> tuple[int, int]:
        """How many of `blocks` new blocks (of `block_bytes` each) go in RAM and how many on disk."""
        if self.host_bytes is None or self.device.type != "cpu":
            return blocks, 0
        room = max(0, self.host_bytes - self.ram_bytes) // block_bytes
        return min(blocks, room), blocks - min(blocks, room)

    def ram(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=self.pin)
        self.ram_bytes += tensor.numel() * tensor.element_size()
        return tensor

    def disk(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor of `shape` backed by a memory-mapped file."""
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        path = self.folder() / f"arena-{secrets.token_hex(6)}.kv"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # sparse: reads as zeros, takes disk only where written
        finally:
            os.close(fd)
        try:
            mapped = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            path.unlink()  # the mapping keeps the file alive until the tensor is freed
        self.disk_bytes += nbytes
        return mapped.view(dtype).view(shape)

    def folder(self) -> Path:
        if self._folder is None:
            if self.spill_dir is None:
                import tempfile

                self.spill_dir = Path(tempfile.gettempdir())
            self.spill_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            _remove_stale_folders(self.spill_dir)
            folder = self.spill_dir / f"store-{os.getpid()}-{secrets.token_hex(4)}"
            folder.mkdir(mode=0o700)
            os.chmod(folder, 0o700)
            weakref.finalize(self, shutil.rmtree, folder, True)
            self._folder = folder
        return self._folder


def copy_rows(dst: torch.Tensor, src: torch.Tensor, tokens: int, non_blocking: bool = False) -> None:
    """The first `tokens` rows of a stored block [Hkv, rows, D] (and an int8 block's scale rows)."""
    dst[:, :tokens].copy_(src[:, :tokens], non_blocking=non_blocking)
    if dst.shape[1] > BLOCK_TOKENS:
        dst[:, BLOCK_TOKENS:].copy_(src[:, BLOCK_TOKENS:], non_blocking=non_blocking)


def head_addresses(blocks: torch.Tensor, block_dim: int) -> torch.Tensor:
    """[n, Hkv] int64 addresses of every block's rows of every KV head ([64, D] each), for a
    tensor of blocks [Hkv, n, 64, D] (block_dim 1: a store arena) or [n, Hkv, 64, D] (block_dim 0:
    the pool's slots). The native kernels read blocks through such tables."""
    head_dim = 1 - block_dim
    element = blocks.element_size()
    rows = torch.arange(blocks.shape[block_dim], dtype=torch.int64)[:, None] * (blocks.stride(block_dim) * element)
    heads = torch.arange(blocks.shape[head_dim], dtype=torch.int64)[None, :] * (blocks.stride(head_dim) * element)
    return rows + heads + blocks.data_ptr()


def _remove_stale_folders(spill_dir: Path) -> None:
    """Removes the spill folders of processes that are gone (their files were unlinked already)."""
    for folder in spill_dir.glob("store-*-*"):
        try:
            pid = int(folder.name.split("-")[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (ValueError, PermissionError, OSError):
            continue


class StoreGroup:
    def __init__(self, index: int, layers: list[int], window: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, source: ArenaSource | None = None) -> None:
        self.index = index
        self.layers = layers
        self.window = window
        self.block_shape = (num_kv_heads, BLOCK_TOKENS, head_dim)  # a block's values
        self.stored_shape = stored_block_shape(num_kv_heads, head_dim, dtype)  # as kept (int8: with scales)
        self.dtype = dtype
        self.quantized = dtype == torch.int8
        self.device = device
        self.allocator = BlockAllocator()
        self.source = source if source is not None else ArenaSource(device)
        self.k_arenas: list[list[torch.Tensor]] = [[] for _ in layers]  # [layer_pos][arena]: [Hkv, A, 64, D]
        self.v_arenas: list[list[torch.Tensor]] = [[] for _ in layers]
        self.arena_of: list[int] = []
        self.row_of: list[int] = []
        self.arena_on_disk: list[bool] = []
        # per layer: [capacity, Hkv] addresses of each block's rows of each KV head ([64, D] each)
        self.k_addr = [torch.empty(0, num_kv_heads, dtype=torch.int64) for _ in layers]
        self.v_addr = [torch.empty(0, num_kv_heads, dtype=torch.int64) for _ in layers]
        self.block_bytes_per_layer = block_bytes_per_layer(num_kv_heads, head_dim, dtype)

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
        in_ram, on_disk = self.source.split(size, self.block_bytes)
        if in_ram:
            self._add_arena(in_ram, on_disk=False)
        if on_disk:
            self._add_arena(on_disk, on_disk=True)

    def _add_arena(self, size: int, on_disk: bool) -> None:
        arena = len(self.k_arenas[0])
        num_kv_heads, rows, head_dim = self.stored_shape
        arena_shape = (num_kv_heads, size, rows, head_dim)
        # On disk, one file per arena holds K and V of every layer: [layers, 2, Hkv, A, 64, D].
        both = self.source.disk((len(self.layers), 2, *arena_shape), self.dtype) if on_disk else None
        for pos in range(len(self.layers)):
            if both is not None:
                k, v = both[pos, 0], both[pos, 1]
            else:
                k = self.source.ram(arena_shape, self.dtype)
                v = self.source.ram(arena_shape, self.dtype)
            self.k_arenas[pos].append(k)
            self.v_arenas[pos].append(v)
            self.k_addr[pos] = torch.cat([self.k_addr[pos], head_addresses(k, 1)])
            self.v_addr[pos] = torch.cat([self.v_addr[pos], head_addresses(v, 1)])
        self.arena_of.extend([arena] * size)
        self.row_of.extend(range(size))
        self.arena_on_disk.append(on_disk)
        self.allocator.grow(size)

    def allocate(self, count: int) -> list[int]:
        self.reserve(count)
        return self.allocator.allocate(count)

    def k_block(self, pos: int, block_id: int) -> torch.Tensor:
        """K of block `block_id` in the group's layer number `pos` as kept: [Hkv, 64 (+ scale rows), D]
        (a view; `decode_rows` gives its values)."""
        return self.k_arenas[pos][self.arena_of[block_id]][:, self.row_of[block_id]]

    def v_block(self, pos: int, block_id: int) -> torch.Tensor:
        return self.v_arenas[pos][self.arena_of[block_id]][:, self.row_of[block_id]]

    def put(self, pos: int, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes K, V [n, Hkv, 64, D] of blocks `ids` in layer `pos`, one copy per arena (float
        blocks; int8 blocks are encoded one by one: block_manager.put_block)."""
        assert not self.quantized
        by_arena: dict[int, list[int]] = {}
        for i, block_id in enumerate(ids):
            by_arena.setdefault(self.arena_of[block_id], []).append(i)
        for arena, items in by_arena.items():
            rows = torch.tensor([self.row_of[ids[i]] for i in items], dtype=torch.int64)
            which = torch.tensor(items, dtype=torch.int64)
            self.k_arenas[pos][arena].index_copy_(1, rows, k.index_select(0, which).transpose(0, 1).to(self.dtype))
            self.v_arenas[pos][arena].index_copy_(1, rows, v.index_select(0, which).transpose(0, 1).to(self.dtype))

    def k_values(self, pos: int, block_id: int) -> torch.Tensor:
        """K's values of a block: [Hkv, 64, D] (a view of float blocks, decoded from int8 ones)."""
        return decode_rows(self.k_block(pos, block_id))

    def gather(self, pos: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V values of blocks `ids` in layer `pos`: [n, Hkv, 64, D] copies."""
        if not ids:
            empty = torch.empty(0, *self.block_shape, dtype=torch.float32 if self.quantized else self.dtype,
                                device=self.device)
            return empty, empty
        k = torch.stack([self.k_block(pos, b) for b in ids])
        v = torch.stack([self.v_block(pos, b) for b in ids])
        return (decode_rows(k), decode_rows(v)) if self.quantized else (k, v)

    def stacked(self, pos: int, ids: list[int], pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of blocks `ids` in layer `pos` as kept (int8 blocks with their scale rows), in one
        piece each [n, Hkv, rows, D]: what one copy moves to the pool's slots. pin: the piece is
        page-locked (a GPU copies it without waiting; torch's pinned allocator keeps it until then)."""
        shape = (len(ids), *self.stored_shape)
        k = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
        v = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
        torch.stack([self.k_block(pos, b) for b in ids], out=k)
        torch.stack([self.v_block(pos, b) for b in ids], out=v)
        return k, v

    def copy_block(self, src: int, dst: int, tokens: int) -> None:
        """Copies the first `tokens` rows of block `src` into `dst`, in every layer (copy-on-write);
        int8 blocks' scale rows too."""
        for pos in range(len(self.layers)):
            copy_rows(self.k_block(pos, dst), self.k_block(pos, src), tokens)
            copy_rows(self.v_block(pos, dst), self.v_block(pos, src), tokens)

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
        """K, V values of a run in layer `pos`: [Hkv, count * 64, D] views (no copy; int8 blocks
        are decoded into a copy)."""
        sl = slice(run.row, run.row + run.count)
        num_kv_heads, _, head_dim = self.block_shape
        shape = (num_kv_heads, run.count * BLOCK_TOKENS, head_dim)
        k, v = self.k_arenas[pos][run.arena][:, sl], self.v_arenas[pos][run.arena][:, sl]
        if self.quantized:
            k, v = decode_rows(k), decode_rows(v)
        return k.reshape(shape), v.reshape(shape)

    def arena_rows(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """(arena, row) of each block id."""
        return [self.arena_of[b] for b in ids], [self.row_of[b] for b in ids]

    @property
    def bytes_used(self) -> int:
        return self.allocator.num_used * self.block_bytes

    @property
    def bytes_reserved(self) -> int:
        return self.allocator.capacity * self.block_bytes

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the blocks in use that live in the disk tier."""
        on_disk, arena_of, refcount = self.arena_on_disk, self.arena_of, self.allocator.refcount
        return sum(1 for i, count in enumerate(refcount) if count and on_disk[arena_of[i]]) * self.block_bytes


class BlockStore:
    """All groups of a model; maps a layer to its group and its position in that group."""

    def __init__(self, layer_windows: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, host_bytes: int | None = None, spill_dir: Path | None = None,
                 pin: bool = False) -> None:
        """host_bytes bounds the RAM of all arenas together (None: no bound); arenas beyond it are
        memory-mapped files in a private folder under `spill_dir` (default: the system temp folder).
        pin: RAM arenas page-locked (the compute device is a GPU)."""
        self.source = ArenaSource(device, host_bytes, spill_dir, pin)
        by_window: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        self.groups = [
            StoreGroup(i, layers, window, num_kv_heads, head_dim, dtype, device, self.source)
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

    @property
    def bytes_on_disk(self) -> int:
        """Of `bytes_used`, the bytes in the disk tier (the rest are in RAM)."""
        return sum(g.bytes_on_disk for g in self.groups)
