"""The streaming regime's pass schedule (kv/schedule.py): a resident prefix and a ring, against the
least-recently-used pool that copies every block every step on a cyclic scan."""

from __future__ import annotations

from kvpage_cli.engine.kv.schedule import LeastRecentlyUsed, StreamSchedule, simulate, step_items


def test_a_small_case_pinned():
    """10 blocks through 6 slots, a ring of 2: the first step copies all 10, each later one only
    the 6 past the prefix of 4; the old pool, passes of 6, copies 8 of 10 every step."""
    schedule = StreamSchedule(6, ring=2)
    first = schedule.passes(list(range(10)))
    assert [p.blocks for p in first] == [[0, 1, 2, 3], [4], [5], [6], [7], [8], [9]]
    assert [p.slots for p in first] == [[0, 1, 2, 3], [4], [5], [4], [5], [4], [5]]
    second = schedule.passes(list(range(10)))
    assert [b for p in second for b in p.copied] == [4, 5, 6, 7, 8, 9]
    lru = LeastRecentlyUsed(6)
    assert [sum(len(p.copied) for p in lru.passes(list(range(10)))) for _ in range(3)] == [10, 8, 8]


def test_no_block_is_copied_again_while_it_holds_its_slot():
    schedule = StreamSchedule(16, ring=4)
    held: dict[int, int] = {}  # slot -> block it holds
    for step in range(200):
        for plan in schedule.passes(step_items(40, 3, step, block_tokens=16)):
            for block, slot in zip(plan.blocks, plan.slots):
                copied = block in plan.copied
                assert copied == (held.get(slot) != block), (step, block, slot)
                held[slot] = block
            assert len(set(plan.slots)) == len(plan.slots)  # a pass's blocks are all in the pool at once


def test_a_context_that_fits_is_copied_once():
    copies = simulate(StreamSchedule(64), context_blocks=16, batch=16, steps=130)
    assert copies[0] == 16 + 16  # the document and each fork's tail
    assert sum(copies[1:]) == 2 * 16  # a new tail block per fork every 64 steps (steps 64 and 128)


def test_the_schedule_copies_less_than_the_old_pool_once_streaming():
    for context, slots in ((128, 45), (2048, 45), (130, 5)):
        ours = simulate(StreamSchedule(slots), context, batch=16, steps=8)
        theirs = simulate(LeastRecentlyUsed(slots), context, batch=16, steps=8)
        assert all(a == context + 16 - (slots - StreamSchedule(slots).ring) for a in ours[1:])  # all but the prefix
        assert all(a < b for a, b in zip(ours[1:], theirs[1:]))


def test_the_old_pools_simulation_is_the_pools_own_count():
    """LeastRecentlyUsed counts what kv/pool.py's SlotPool copies, pass for pass (the figures
    bench/pool_schedule.py sets beside the schedule's)."""
    import torch

    from kvpage_cli.engine.kv.pool import SlotPool

    slots, context, batch = 7, 20, 3
    pool = SlotPool(1, slots, 1, 8, torch.float32, torch.device("cpu"))
    copies = []

    def copy_in(block_id, k_slot, v_slot, tokens):
        copies[-1] += 1

    for step in range(70):
        copies.append(0)
        items = step_items(context, batch, step)
        for first in range(0, len(items), slots):
            pool.load(0, [(b, 0, 64) for b in items[first:first + slots]], copy_in)
    assert copies == simulate(LeastRecentlyUsed(slots), context, batch, 70)


def test_without_a_copy_stream_the_ring_is_read_whole_with_the_same_copies():
    """Copies made in line before each pass (the engine on a CPU): ring passes of the whole ring,
    half as many passes, the same blocks copied as the double-buffered plan's."""
    whole, halves = StreamSchedule(6, ring=2, double_buffered=False), StreamSchedule(6, ring=2)
    for _ in range(3):
        ours, theirs = whole.passes(list(range(10))), halves.passes(list(range(10)))
        assert [p.blocks for p in ours] == [[0, 1, 2, 3], [4, 5], [6, 7], [8, 9]]
        assert [p.slots for p in ours[1:]] == [[4, 5]] * 3
        assert sorted(b for p in ours for b in p.copied) == sorted(b for p in theirs for b in p.copied)
