"""BlockPool and FreeBlockQueue: O(1) queue ops, ref counting, LRU eviction, hash map."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.core.block_pool import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


# ---------------------------------------------------------------- FreeBlockQueue
def test_free_queue_order_and_remove_from_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and blocks[2] not in q
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q) == [1, 3] and q.num_free == 2
    q.append(blocks[0])
    q.appendleft(blocks[4])
    assert ids(q) == [4, 1, 3, 0]
    assert q.popleft() is blocks[4]
    assert ids(q) == [1, 3, 0] and q.num_free == 3


def test_free_queue_rejects_double_insert_and_empty_pop():
    b = KVBlock(0)
    q = FreeBlockQueue([b])
    with pytest.raises(AssertionError):
        q.append(b)
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(AssertionError):
        q.remove(b)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pop", "append", "left", "remove"]), st.integers(0, 7))))
def test_free_queue_matches_a_list_model(ops):
    blocks = [KVBlock(i) for i in range(8)]
    q = FreeBlockQueue(blocks)
    model = list(range(8))
    for op, i in ops:
        if op == "pop" and model:
            assert q.popleft().block_id == model.pop(0)
        elif op in ("append", "left") and i not in model:
            (q.append if op == "append" else q.appendleft)(blocks[i])
            model.append(i) if op == "append" else model.insert(0, i)
        elif op == "remove" and i in model:
            q.remove(blocks[i])
            model.remove(i)
        assert ids(q) == model and q.num_free == len(model)


# ---------------------------------------------------------------- BlockPool
def test_ref_counting_and_usage():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert ids(a) == [0, 1] and all(b.ref_cnt == 1 for b in a)
    assert pool.num_free == 2 and pool.usage == 0.5
    pool.touch(a)  # a second owner
    pool.free_blocks(a)
    assert pool.num_free == 2 and all(b.ref_cnt == 1 for b in a)
    pool.free_blocks(a)
    assert pool.num_free == 4 and pool.usage == 0.0
    with pytest.raises(AssertionError):
        pool.free_blocks(a[:1])
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


def test_eviction_is_lru_with_cached_blocks_after_never_used():
    pool = BlockPool(6)
    req_a = pool.get_new_blocks(3)  # 0 1 2
    for i, b in enumerate(req_a):
        pool.cache_block(b, h(i))
    pool.free_blocks(reversed(req_a))  # tail first
    # never-used 3 4 5 first, then a's tail before its prefix
    assert ids(pool.free_queue) == [3, 4, 5, 2, 1, 0]
    got = pool.get_new_blocks(4)
    assert ids(got) == [3, 4, 5, 2]
    assert pool.lookup(h(2)) is None, "evicted block leaves the hash map"
    assert pool.lookup(h(0)) is req_a[0] and pool.lookup(h(1)) is req_a[1]


def test_uncached_freed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_block(blocks[0], h(0))
    pool.free_blocks(reversed(blocks))  # 2 and 1 hold nothing findable
    assert ids(pool.free_queue) == [1, 2, 0]
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.lookup(h(0)) is blocks[0]


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h(7))
    pool.free_blocks([b])
    assert b in pool.free_queue and pool.num_free == 3
    hit = pool.lookup(h(7))
    assert hit is b
    pool.touch([hit])
    assert b not in pool.free_queue and b.ref_cnt == 1 and pool.num_free == 2
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.lookup(h(7)) is b, "an owned block is never evicted"


def test_cache_block_keeps_the_first_block_for_a_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(1))  # same content computed twice
    assert pool.lookup(h(1)) is a and b.block_hash is None
    pool.free_blocks([a, b])
    # evicting b must not drop a's map entry; evicting a drops it
    pool.get_new_blocks(3)  # b (hashless, at the head), then 2, 3
    assert pool.lookup(h(1)) is a
    pool.get_new_blocks(1)
    assert pool.lookup(h(1)) is None and a.block_hash is None


def test_stale_map_entry_only_dropped_for_its_own_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.free_blocks([a])
    (a2,) = pool.get_new_blocks(1)  # a evicted
    assert a2 is a and pool.lookup(h(1)) is None
    pool.cache_block(b, h(1))
    pool.free_blocks([a2, b])
    pool.get_new_blocks(1)  # a again (hashless head): b's entry must survive
    assert pool.lookup(h(1)) is b


def test_caching_disabled_never_maps():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1))
    assert pool.lookup(h(1)) is None and a.block_hash is None


def test_reset_prefix_cache_only_when_all_free():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i))
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(h(0)) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(h(0)) is None and not pool.cached
    assert all(b.block_hash is None for b in pool.blocks) and pool.num_free == 3
