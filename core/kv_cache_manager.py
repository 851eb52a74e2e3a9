"""Maps requests to KV blocks: allocation, prefix-cache lookup and registration, freeing.

A full block is identified by a chained hash: blake2b(parent hash + its token ids). Chaining makes
a block's hash name its whole prefix, so equal hashes mean equal KV (not just equal local tokens).
blake2b, not Python's `hash()`: stable across processes and runs, and collisions are negligible.

Invariant: `req.blocks[:req.num_hashed_blocks]` are exactly the request's blocks that are full of
known tokens once every planned token is computed, and each is registered (or a duplicate of a
registered block, or skipped). A block whose last token is a placeholder (sampled by a plan still
in flight) is registered by a later allocation, once the core knows that token, or when the
request leaves.

Sliding window (every layer attends only to the last `sliding_window` positions): the next token
to compute, at position `num_computed_tokens`, reads keys from `num_computed_tokens - window + 1`
on, and later tokens from further on. Blocks wholly before that are freed at the request's next
allocation and replaced by `SKIPPED_BLOCK`, so a long sequence holds about `window / block_size`
blocks. A freed block keeps its hash: it stays in the prefix cache (evictable) for requests that
share the prefix. The workers' block tables keep the freed block's id; attention masks those
positions, so whatever a new owner writes there is never weighed. The block is reused only by a
later plan than the ones that read it, and plans execute in order.
"""

from __future__ import annotations

import hashlib
from array import array

from pagedserve.core.block_pool import SKIPPED_BLOCK, BlockPool, KVBlock
from pagedserve.core.request import Request

ROOT_HASH = b""  # parent of a sequence's first block


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        assert sliding_window is None or sliding_window >= 1
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.prefix_cache_queries = 0  # cumulative, in tokens
        self.prefix_cache_hits = 0  # cumulative, in tokens

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the first `num_blocks` full blocks, extended lazily and kept on
        the request (they depend on its tokens only, so they survive preemption)."""
        hashes, bs, tokens = req.block_hashes, self.block_size, req.all_token_ids
        assert num_blocks * bs <= len(tokens)
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks from the start of `req`, and its tokens.

        Capped at `(num_tokens - 1) // block_size` blocks so at least one token is left to
        compute: the step must run the last token to produce logits to sample from. Does not
        touch the blocks (allocate_slots does) nor count stats (record_lookup does, on success),
        so a lookup retried after a failed allocation is free and not double-counted.
        """
        if not self.enable_caching or req.num_computed_tokens > 0:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in self.block_hashes(req, max_blocks):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    def can_allocate(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock]
    ) -> bool:
        num_needed = self._num_blocks_needed(req, num_new_tokens, new_computed_blocks)
        # A hit nobody owns sits in the free queue: touching it takes it out of the free pool.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return num_needed + num_revived <= self.pool.num_free

    def _num_blocks_needed(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock]
    ) -> int:
        num_total = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total += num_new_tokens
        return max(0, cdiv(num_total, self.block_size) - len(req.blocks) - len(new_computed_blocks))

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Give `req` blocks for `num_new_tokens` more tokens after its computed ones (and after
        `new_computed_blocks`, prefix hits found by `get_computed_blocks`). None if they don't fit;
        then nothing changed.

        On success, every block that becomes full once these tokens are computed is registered
        in the prefix cache now, at plan time: a sibling request planned later in the same step
        can hit it. That is sound because every layer writes the whole batch's new K/V into the
        cache before attending, and plans execute in order.
        """
        hits = new_computed_blocks or []
        self.free_outside_window(req)  # whatever follows: those blocks are needed no more
        if not self.can_allocate(req, num_new_tokens, hits):
            return None
        assert not hits or not req.blocks, "prefix hits only on a request's first allocation"
        num_needed = self._num_blocks_needed(req, num_new_tokens, hits)
        num_tokens = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        self.pool.touch(hits)
        req.blocks.extend(hits)
        req.num_hashed_blocks += len(hits)
        new_blocks = self.pool.get_new_blocks(num_needed)
        req.blocks.extend(new_blocks)
        self._cache_full_blocks(req, min(num_tokens, req.num_tokens) // self.block_size)
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, req: Request, num_full: int) -> None:
        if not self.enable_caching or num_full <= req.num_hashed_blocks:
            return
        hashes = self.block_hashes(req, num_full)
        for i in range(req.num_hashed_blocks, num_full):
            if req.blocks[i] is not SKIPPED_BLOCK:  # freed before its last token was known
                self.pool.cache_block(req.blocks[i], hashes[i])
        req.num_hashed_blocks = num_full

    def free_outside_window(self, req: Request) -> None:
        """Free the blocks wholly behind the window of the next token to compute (see above)."""
        if self.sliding_window is None:
            return
        first_needed = req.num_computed_tokens - self.sliding_window + 1  # a key position
        num_behind = min(max(first_needed, 0) // self.block_size, len(req.blocks))
        if num_behind <= req.num_skipped_blocks:
            return
        behind = req.blocks[req.num_skipped_blocks : num_behind]
        req.blocks[req.num_skipped_blocks : num_behind] = [SKIPPED_BLOCK] * len(behind)
        req.num_skipped_blocks = num_behind
        self.pool.free_blocks(reversed(behind))  # latest first: the prefix is evicted last

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its prefix.

        First every block full of known, computed tokens is registered: under async scheduling
        the last ones held a placeholder when they were allocated, and a request that leaves
        (finished, aborted, preempted) gets no later allocation to register them."""
        self._cache_full_blocks(
            req, min(req.num_computed_tokens, req.num_tokens) // self.block_size
        )
        self.pool.free_blocks(b for b in reversed(req.blocks) if b is not SKIPPED_BLOCK)
        req.blocks = []
        req.num_hashed_blocks = 0
        req.num_skipped_blocks = 0

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
