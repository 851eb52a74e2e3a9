"""KV cache blocks, their free queue and the prefix-cache hash map.

Invariants:
- a block with `ref_cnt == 0` is in the free queue; a block with `ref_cnt > 0` is not;
- `cached[h] is b` implies `b.block_hash == h`; a block's hash is dropped when the block is
  reused for new content (evicted), never while some request may still hit it;
- the free queue is in eviction order: blocks holding nothing worth keeping (never used, or freed
  without a hash) first, then cached blocks from least to most recently freed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class KVBlock:
    """One block of `block_size` KV slots. `prev`/`next` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


# Holds the place, in a request's block list, of a block freed because it lies wholly behind the
# sliding window: positions keep their indices, and the pool never sees this object.
SKIPPED_BLOCK = KVBlock(-1)


class FreeBlockQueue:
    """Free blocks as a doubly linked list with sentinels.

    A doubly linked list (not a deque) so that a cached block hit by a new request leaves the
    middle of the queue in O(1); `popleft`, `append` and `appendleft` are O(1) too.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        assert block.prev is None and block.next is None, f"{block} is already queued"
        block.prev, block.next = prev, nxt
        prev.next = block
        nxt.prev = block
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        assert self._tail.prev is not None
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        assert self._head.next is not None
        self._link(block, self._head, self._head.next)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev is not None

    def __iter__(self):
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """Owns every KV block: ref counts, the free queue and the hash -> block map.

    Requests share a cached block by reference counting; a freed cached block stays findable in
    the map until it is popped for new content, so a later request with the same prefix can
    revive it (`touch`) instead of recomputing it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        # Called with a cached block and its key as it is evicted (the host tier spills it).
        self.on_evict: Callable[[KVBlock, bytes], None] | None = None

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request (cached free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self.num_free:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if h is not None:
            if self.cached.get(h) is block:
                del self.cached[h]
                if self.on_evict is not None:
                    self.on_evict(block, h)
            block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits; a hit with no owner leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block, in the order given (callers pass a request's blocks
        tail first, so its tail is evicted first). A block whose last reference goes is queued:
        at the tail if it is cached (most recently used), at the head if it holds nothing
        findable, so it is reused before any cached block."""
        for block in blocks:
            assert block.ref_cnt > 0, f"{block} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full block. If the hash is already mapped (the same content computed twice
        by requests scheduled together), the first block stays the cached one."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no request holds a block (else False)."""
        if self.num_free != self.num_blocks:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
