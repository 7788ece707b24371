"""Block allocator: integer block ids with reference counts. Plain Python, no tensors."""

from __future__ import annotations


class BlockAllocator:
    """Hands out block ids; a block is free again when its last reference is dropped.

    Ids are dense (0 .. capacity-1) so that tensors indexed by id (address tables, per-block
    metadata) stay small. `generation[id]` changes every time an id is handed out again, so a
    cached copy of an old block is never mistaken for the new one.
    """

    def __init__(self) -> None:
        self.refcount: list[int] = []
        self.generation: list[int] = []
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.refcount)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def grow(self, count: int) -> range:
        """Adds `count` free ids and returns them."""
        start = self.capacity
        self.refcount.extend([0] * count)
        self.generation.extend([0] * count)
        # Kept sorted high->low so that pop() hands out the lowest free id: runs of consecutive ids
        # stay contiguous, and earlier arenas (host RAM before the disk tier) are used first.
        self._free.extend(range(start + count - 1, start - 1, -1))
        self._free.sort(reverse=True)
        return range(start, start + count)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        assert self.can_allocate(count), f"asked for {count} blocks, {len(self._free)} free"
        ids = [self._free.pop() for _ in range(count)]
        for block_id in ids:
            assert self.refcount[block_id] == 0
            self.refcount[block_id] = 1
            self.generation[block_id] += 1
        return ids

    def incref(self, ids) -> None:
        for block_id in ids:
            assert self.refcount[block_id] > 0, f"block {block_id} is free"
            self.refcount[block_id] += 1

    def decref(self, ids) -> list[int]:
        """Drops one reference to each id; returns the ids that became free."""
        freed = []
        for block_id in ids:
            assert self.refcount[block_id] > 0, f"block {block_id} is already free"
            self.refcount[block_id] -= 1
            if self.refcount[block_id] == 0:
                freed.append(block_id)
        # Keep the free list sorted high->low so allocation stays ascending after frees.
        if freed:
            self._free.extend(freed)
            self._free.sort(reverse=True)
        return freed
