"""The recurrent-state slot pool (core/state_pool.py) against a model of it: a set of held slots.
The scheduler's use of it (admission, preemption, finishing) is in tests/test_scheduler.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.core.state_pool import StatePool


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=60))
def test_pool_hands_out_each_slot_once(num_slots, ops):
    """Random allocations and frees: a slot is never handed out twice while held, allocation
    fails exactly when every slot is held, and freeing a slot not held is refused."""
    pool, held = StatePool(num_slots), set()
    for alloc, pick in ops:
        if alloc:
            slot = pool.allocate()
            if len(held) == num_slots:
                assert slot is None
            else:
                assert slot is not None and slot not in held and 0 <= slot < num_slots
                held.add(slot)
        elif held:
            slot = sorted(held)[pick % len(held)]
            pool.free(slot)
            held.remove(slot)
        else:
            with pytest.raises(AssertionError, match="not held"):
                pool.free(pick % num_slots)
        pool.check()
        assert pool.num_free == num_slots - len(held) and pool.num_held == len(held)


def test_pool_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        StatePool(0)
