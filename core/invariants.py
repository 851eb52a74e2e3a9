"""Full consistency checks of the scheduler's memory state: O(blocks + requests), so they run
only in tests or with `Scheduler(debug=True)`; `schedule()` always asserts the cheap ones."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedserve.core.block_pool import SKIPPED_BLOCK
from pagedserve.core.request import RequestStatus

if TYPE_CHECKING:
    from pagedserve.core.scheduler import Scheduler


def check_invariants(sched: Scheduler) -> None:
    """Raise AssertionError unless:
    - each block's ref_cnt equals the number of running requests holding it (a block is held
      twice by one request never), and a block is free exactly when its ref_cnt is 0;
    - free + used == total;
    - every running request holds blocks for its computed tokens; waiting ones hold none;
    - a running request holds one block list per KV cache group, all of one length; a block
      belongs to one group only;
    - skipped blocks are exactly a group's first `num_skipped_blocks[g]`, all wholly behind the
      group's sliding window of the request's next token;
    - the hash map and the blocks' hashes agree, both ways;
    - `running`, the waiting queue and `swapped` partition the unfinished requests; a swapped
      request holds host blocks for its computed tokens and no device block; every host block is
      in one state, referenced exactly by the swapped requests that hold it;
    - with state slots, each running request holds one slot of its own, waiting ones none.
    """
    pool, kv = sched.kv.pool, sched.kv
    owners: Counter[int] = Counter()
    group_of: dict[int, int] = {}  # block id -> the KV cache group that owns it
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING, req
        assert len(req.blocks) == len(req.num_skipped_blocks) == kv.num_groups, req
        assert len({len(blocks) for blocks in req.blocks}) == 1, f"{req}: groups out of step"
        ids = []
        for g, blocks in enumerate(req.blocks):
            num_skipped = req.num_skipped_blocks[g]
            group_ids = [b.block_id for b in blocks[num_skipped:]]
            assert all(b is SKIPPED_BLOCK for b in blocks[:num_skipped]), req
            assert -1 not in group_ids, req
            if num_skipped:
                window = kv.windows[g]
                assert window is not None, req
                assert num_skipped * sched.block_size <= req.num_computed_tokens - window + 1, req
            for i in group_ids:
                assert group_of.setdefault(i, g) == g, f"block {i} is in two KV cache groups"
            ids += group_ids
        assert len(set(ids)) == len(ids), f"{req} holds a block twice"
        owners.update(ids)
        assert req.num_blocks * sched.block_size >= req.num_computed_tokens, req
        assert req.num_placeholders >= 0, req
        drafts = req.spec.num_planned if req.spec is not None else 0
        assert req.num_computed_tokens <= req.num_tokens + req.num_placeholders + drafts, req
        assert req.num_hashed_blocks <= req.num_blocks, req
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], f"{block}: {owners[block.block_id]} owners"
        assert (block in pool.free_queue) == (block.ref_cnt == 0), block
    assert pool.num_free == sum(1 for _ in pool.free_queue)
    assert pool.num_free + len(owners) == pool.num_blocks
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash, block
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)
    waiting = list(sched.policy)
    for req in waiting:
        assert not req.blocks and req.num_computed_tokens == 0 == req.num_placeholders, req
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), req
    assert len(sched.running) <= sched.config.max_num_seqs
    for req in sched.swapped:
        assert req.status == RequestStatus.SWAPPED and not req.blocks, req
        assert len(req.host_block_ids) == -(-req.num_computed_tokens // sched.block_size), req
        assert 0 < req.num_computed_tokens < req.num_tokens and not req.num_placeholders, req
    if sched.kv.tier is not None:
        sched.kv.tier.pool.check([i for r in sched.swapped for i in r.host_block_ids])
    unfinished = {id(r) for r in sched.running} | {id(r) for r in waiting}
    unfinished |= {id(r) for r in sched.swapped}
    num = len(sched.running) + len(waiting) + len(sched.swapped)
    assert len(unfinished) == num == len(sched.requests)
    assert unfinished == {id(r) for r in sched.requests.values()}
    if sched.states is not None:
        sched.states.check()
        slots = [r.state_slot for r in sched.running]
        assert None not in slots and len(set(slots)) == len(slots) == sched.states.num_held
        assert all(r.state_slot is None for r in waiting)
    else:
        assert all(r.state_slot is None for r in sched.running)
