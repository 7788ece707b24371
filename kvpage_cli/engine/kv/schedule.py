"""The streaming regime's pass schedule: which blocks stay in the pool and which stream through it.

When the blocks a decode step reads outnumber a layer's slots, they pass through the pool in
logical order. A least-recently-used pool does the worst thing on such a cyclic scan: each pass
evicts exactly the blocks the next step reads first, so every block crosses the link every step.
The schedule keeps a resident prefix instead: the first `resident` blocks in logical order (a
document's opening blocks, shared by every fork) keep their slots from step to step, and the rest
stream through a ring of the other slots, a pass at a time (the ring is split in two halves, so
that on a GPU one half can be filled while attention reads the other). A step then copies only the
blocks past the prefix, and a block is never copied again while it holds its slot.

`StreamSchedule.passes(items)` is the plan for one step of one layer group; `simulate` counts the
copies of whole steps for a context, a pool and a batch without touching a tensor
(bench/pool_schedule.py reports them beside the least-recently-used pool's).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Pass:
    """Items (block ids, logical order) read together, the slots holding them, and which of them
    are copied in before the pass runs (the rest were in their slots already)."""

    blocks: list[int]
    slots: list[int]
    copied: list[int]


class StreamSchedule:
    """One layer group's slots: a resident prefix and a ring (see the module docstring)."""

    def __init__(self, num_slots: int, ring: int | None = None, double_buffered: bool = True) -> None:
        """ring: slots given to streaming (default: a quarter of the pool, at least 2, at most all
        but one); the prefix holds the others. double_buffered: ring passes of half the ring (one
        half filled while attention reads the other: copies on their own stream); else passes of
        the whole ring (copies made before the pass, in line: fewer passes, the same copies)."""
        if num_slots < 1:
            raise ValueError("a pool needs at least one slot")
        ring = ring if ring is not None else max(2, num_slots // 4)
        self.ring = min(max(1, ring), num_slots)
        self.num_slots = num_slots
        self.double_buffered = double_buffered
        self.prefix_slots = num_slots - self.ring
        self.prefix: dict[int, int] = {}  # block id -> its slot, for the resident prefix
        self.ring_holds: list[int | None] = [None] * self.ring  # what each ring slot holds
        self.next_ring = 0

    def passes(self, items: list[int]) -> list[Pass]:
        """The plan for one step over `items` (distinct block ids in logical order). Blocks that
        fit are all resident; past that, the first `prefix_slots` stay and the rest stream."""
        if len(items) <= self.num_slots:
            return [self._resident_pass(items)]
        head, tail = items[:self.prefix_slots], items[self.prefix_slots:]
        plans = [self._resident_pass(head, limit=self.prefix_slots)] if head else []
        size = max(1, self.ring // 2) if self.double_buffered else self.ring
        for first in range(0, len(tail), size):
            plans.append(self._ring_pass(tail[first:first + size]))
        return plans

    def _resident_pass(self, blocks: list[int], limit: int | None = None) -> Pass:
        """Blocks that keep their slots: those already held keep them, new ones take free slots
        (a block no longer read gives its slot up)."""
        limit = self.num_slots if limit is None else limit
        wanted = set(blocks)
        self.prefix = {b: s for b, s in self.prefix.items() if b in wanted and s < limit}
        if limit == self.num_slots:  # everything resident: the ring's slots join the prefix's
            self.ring_holds = [None] * self.ring
        used = set(self.prefix.values())
        free = iter(s for s in range(limit) if s not in used)
        slots, copied = [], []
        for block in blocks:
            if block not in self.prefix:
                self.prefix[block] = next(free)
                copied.append(block)
            slots.append(self.prefix[block])
        return Pass(blocks, slots, copied)

    def _ring_pass(self, blocks: list[int]) -> Pass:
        """Blocks through the ring's next slots, in turn; a block still in its ring slot from
        the step before is not copied again."""
        slots, copied = [], []
        for block in blocks:
            index = self.next_ring
            self.next_ring = (self.next_ring + 1) % self.ring
            if self.ring_holds[index] != block:
                self.ring_holds[index] = block
                copied.append(block)
            slots.append(self.prefix_slots + index)
        return Pass(blocks, slots, copied)


class LeastRecentlyUsed:
    """The pool's policy before the schedule (kv/pool.py's victims), for comparison: passes of
    `num_slots` blocks, each copied unless held, evicting the least recently used."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[int, None] = OrderedDict()  # held blocks, least recent first

    def passes(self, items: list[int]) -> list[Pass]:
        plans = []
        for first in range(0, len(items), self.num_slots):
            blocks = items[first:first + self.num_slots]
            copied = [b for b in blocks if b not in self.slots]
            for block in blocks:
                if block in self.slots:
                    self.slots.move_to_end(block)
            for block in copied:
                if len(self.slots) >= self.num_slots:
                    victim = next(b for b in self.slots if b not in blocks)
                    del self.slots[victim]
                self.slots[block] = None
            plans.append(Pass(blocks, [], copied))
        return plans


def step_items(context_blocks: int, batch: int, step: int, block_tokens: int = 64) -> list[int]:
    """The distinct blocks a decode step reads: a document of `context_blocks` blocks shared by
    `batch` forks, each with its own tail block (a new one every `block_tokens` steps). Ids:
    the document's 0.., then per fork and tail generation a fresh id."""
    generation = step // block_tokens
    tails = [context_blocks + (generation * batch + fork) for fork in range(batch)]
    return list(range(context_blocks)) + tails


def simulate(policy, context_blocks: int, batch: int, steps: int) -> list[int]:
    """Blocks copied at each of `steps` decode steps (one layer group's layer) under `policy`."""
    return [sum(len(p.copied) for p in policy.passes(step_items(context_blocks, batch, step))) for step in range(steps)]
