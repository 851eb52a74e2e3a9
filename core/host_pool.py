"""The host-memory tier's blocks: which host block holds what, and its own LRU.

Host blocks mirror GPU blocks (same layout, one per worker shard); the core only names them by
id. A host block is in exactly one state:
- free: no content worth keeping (`free_ids`);
- cached: holds a prefix-cache block (`hash_of[i]`, findable in `cached`), referenced by nobody,
  evictable in LRU order (`lru`, least recently used first);
- referenced (`ref_cnt > 0`): held by a swapped request, or pinned while the plan being built
  reads it (a host hit or a swap-in copies it back to the GPU): never reused while referenced.
A referenced block may have a hash too (a swapped request's full blocks are findable), so a host
hit can read it, and it becomes cached (not free) when its last reference goes.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class HostPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free ones, then cached ones (evicted)."""
        return len(self.free_ids) + len(self.lru)

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` blocks with one reference each: free ones first, then the least recently
        used cached ones (their hashes are forgotten)."""
        if num_blocks > self.num_free:
            raise ValueError(f"asked for {num_blocks} host blocks, only {self.num_free} free")
        out = []
        for _ in range(num_blocks):
            if self.free_ids:
                i = self.free_ids.popleft()
            else:
                i, _ = self.lru.popitem(last=False)
                del self.cached[self.hash_of[i]]
                self.hash_of[i] = None
            self.ref_cnt[i] = 1
            out.append(i)
        return out

    def set_hash(self, i: int, block_hash: bytes) -> None:
        """Make referenced block `i` findable under `block_hash` (a duplicate stays unfound)."""
        assert self.ref_cnt[i] > 0 and self.hash_of[i] is None
        if block_hash not in self.cached:
            self.cached[block_hash] = i
            self.hash_of[i] = block_hash

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, i: int) -> None:
        """Mark a cached block most recently used."""
        if self.ref_cnt[i] == 0:
            self.lru.move_to_end(i)

    def ref(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref_cnt[i] == 0:
                assert self.hash_of[i] is not None, f"host block {i} is free: nothing to read"
                del self.lru[i]
            self.ref_cnt[i] += 1

    def unref(self, ids: list[int]) -> None:
        for i in ids:
            assert self.ref_cnt[i] > 0, f"host block {i} released more often than taken"
            self.ref_cnt[i] -= 1
            if self.ref_cnt[i] == 0:
                if self.hash_of[i] is None:
                    self.free_ids.append(i)
                else:
                    self.lru[i] = None

    def reset(self) -> None:
        """Forget every cached (unreferenced) block's hash."""
        for i in self.lru:
            del self.cached[self.hash_of[i]]
            self.hash_of[i] = None
            self.free_ids.append(i)
        self.lru.clear()

    def check(self, held: list[int]) -> None:
        """Raise AssertionError unless each block is in one state and `held` (every swapped
        request's host blocks, with repeats) are exactly the references."""
        counts = [0] * self.num_blocks
        for i in held:
            counts[i] += 1
        assert counts == self.ref_cnt, "host references do not match the swapped requests"
        free, lru = set(self.free_ids), set(self.lru)
        assert len(free) == len(self.free_ids) and not free & lru, "a host block is queued twice"
        for i in range(self.num_blocks):
            state = (i in free) + (i in lru) + (self.ref_cnt[i] > 0)
            assert state == 1, f"host block {i} is in {state} states"
            assert i not in free or self.hash_of[i] is None
            assert i not in lru or self.hash_of[i] is not None
        for block_hash, i in self.cached.items():
            assert self.hash_of[i] == block_hash
        assert sum(h is not None for h in self.hash_of) == len(self.cached)
