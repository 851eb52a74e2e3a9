"""Maps requests to KV blocks: allocation, prefix-cache lookup and registration, freeing.

A full block is identified by a chained hash: blake2b(parent hash + its token ids). Chaining makes
a block's hash name its whole prefix, so equal hashes mean equal KV (not just equal local tokens).
blake2b, not Python's `hash()`: stable across processes and runs, and collisions are negligible.
A request's `cache_salt` (SamplingParams) is the parent of its first block (`root_hash`), so the
salt is in every hash of its chain: requests share blocks only with requests of the same salt, and
a client cannot learn from cache hits (`cached_tokens`, timing) what another salt's prompts hold.

Invariant: `req.blocks[:req.num_hashed_blocks]` are exactly the request's blocks that are full of
known tokens once every planned token is computed, and each is registered (or a duplicate of a
registered block, or skipped). A block whose last token is a placeholder (sampled by a plan still
in flight) is registered by a later allocation, once the core knows that token, or when the
request leaves.

KV cache groups (config.kv_cache_groups): a model whose layers all attend alike has one group; one
that mixes windowed and global layers (Gemma 2/3) has several, and a request holds one block list
per group in `req.blocks`. Every group's list has the same length (a block per `block_size`
positions) and grows in step with the others; blocks come from one shared pool, each owned by one
group (its prefix-cache key names the group), so the memory profile stays one number of blocks.

Sliding window: the next token to compute, at position `num_computed_tokens`, reads keys from
`num_computed_tokens - window + 1` on, and later tokens from further on. In a windowed group the
blocks wholly before that are freed at the request's next allocation and replaced by
`SKIPPED_BLOCK`, so a long sequence holds about `window / block_size` blocks there. A freed block
keeps its hash: it stays in the prefix cache (evictable) for requests that share the prefix. The
workers' block tables keep the freed block's id; attention masks those positions, so whatever a
new owner writes there is never weighed. The block is reused only by a later plan than the ones
that read it, and plans execute in order.

Prefix hits with groups: a hit of `k` blocks needs, in a global group, every block `0..k-1`
cached; in a windowed group only the blocks that the first token to compute (position
`k * block_size`) reads, the ones before stay skipped (never allocated). The hit is the largest `k`
that every group can serve.
"""

from __future__ import annotations

import hashlib
from array import array
from itertools import islice

from pagedserve.core.block_pool import SKIPPED_BLOCK, BlockPool, KVBlock
from pagedserve.core.kv_tier import HostTier
from pagedserve.core.request import Request

ROOT_HASH = b""  # parent of an unsalted sequence's first block


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def root_hash(cache_salt: str | None, lora_id: int = 0) -> bytes:
    """The parent of a sequence's first block: the hash of its salt and LoRA adapter id (its own
    domain, `person`, so it equals no block's hash), or ROOT_HASH with neither. The adapter is
    in every block's key: two adapters' KV differ for the same tokens, and never share a block."""
    if cache_salt is None and not lora_id:
        return ROOT_HASH
    key = (cache_salt or "").encode() if not lora_id else f"{lora_id}:{cache_salt or ''}".encode()
    person = b"cache_salt" if not lora_id else b"lora"
    return hashlib.blake2b(key, digest_size=16, person=person).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        group_windows: list[int | None] | None = None,
        tier: HostTier | None = None,
    ) -> None:
        """`tier`: the host-memory tier (core/kv_tier.py); one global group only."""
        self.windows = list(group_windows or [None])  # per KV cache group (None: global)
        assert all(w is None or w >= 1 for w in self.windows) and len(self.windows) < 256
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tier = tier
        assert tier is None or self.windows == [None]
        if tier is not None and enable_caching:  # evicted prefix-cache blocks spill to the host
            self.pool.on_evict = lambda block, key: tier.spill(block.block_id, key)
        self.prefix_cache_queries = 0  # cumulative, in tokens
        self.prefix_cache_hits = 0  # cumulative, in tokens

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def max_blocks_per_request(self, max_model_len: int, max_chunk: int) -> int:
        """The most blocks one request holds at once (`max_chunk`: the most tokens one step
        computes for it): all of its blocks in a global group; in a windowed one those its
        window and one chunk span, partial blocks at both ends included."""
        full, bs = cdiv(max_model_len, self.block_size), self.block_size
        chunk = min(max_chunk, max_model_len)
        return sum(
            full if w is None else min(full, cdiv(w + chunk + bs - 2, bs)) for w in self.windows
        )

    def block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the first `num_blocks` full blocks, extended lazily and kept on
        the request (they depend on its tokens and salt only, so they survive preemption)."""
        hashes, bs, tokens = req.block_hashes, self.block_size, req.all_token_ids
        assert num_blocks * bs <= len(tokens)
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_hash(req.sampling.cache_salt, req.lora_id)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    @staticmethod
    def _key(block_hash: bytes, group: int) -> bytes:
        """The prefix-cache key of a block of `group`: equal content in two groups is two
        blocks (each holds its own layers' KV)."""
        return block_hash if group == 0 else block_hash + bytes([group])

    def _num_behind(self, num_computed: int, window: int | None) -> int:
        """Blocks wholly behind the window of the token at position `num_computed`."""
        return 0 if window is None else max(num_computed - window + 1, 0) // self.block_size

    def get_computed_blocks(self, req: Request) -> tuple[list[list[KVBlock]], int]:
        """Per group, the blocks of the longest cached prefix of `req` (see above; leading
        blocks a windowed group does not need are `SKIPPED_BLOCK`), and its tokens.

        Capped at `(num_tokens - 1) // block_size` blocks so at least one token is left to
        compute: the step must run the last token to produce logits to sample from. Does not
        touch the blocks (allocate_slots does) nor count stats (record_lookup does, on success),
        so a lookup retried after a failed allocation is free and not double-counted.
        """
        if not self.enable_caching or req.num_computed_tokens > 0 or req.scores_prompt:
            return [], 0
        hashes = self.block_hashes(req, (req.num_tokens - 1) // self.block_size)
        num_hit = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:  # a prefix run, the bound for the windowed groups
                num_hit = self._prefix_run(hashes[:num_hit], g)
        valid = [True] * (num_hit + 1)  # valid[k]: every windowed group can serve a hit of k
        for g, window in enumerate(self.windows):
            if window is not None:
                for k, ok in enumerate(self._window_hits(hashes[:num_hit], g, window)):
                    valid[k] = valid[k] and ok
        num_hit = max(k for k, ok in enumerate(valid) if ok)
        if num_hit == 0:
            return [], 0
        hits = []
        for g, window in enumerate(self.windows):
            skip = self._num_behind(num_hit * self.block_size, window)
            found = [self.pool.lookup(self._key(h, g)) for h in hashes[skip:num_hit]]
            assert all(b is not None for b in found)
            hits.append([SKIPPED_BLOCK] * skip + found)
        return hits, num_hit * self.block_size

    def _prefix_run(self, hashes: list[bytes], group: int) -> int:
        """How many blocks from the start are cached in `group`."""
        for i, h in enumerate(hashes):
            if self.pool.lookup(self._key(h, group)) is None:
                return i
        return len(hashes)

    def _window_hits(self, hashes: list[bytes], group: int, window: int) -> list[bool]:
        """[k]: the blocks a token at position `k * block_size` reads in `group` are cached."""
        valid, run = [True], 0  # run: cached blocks in a row up to the current one
        for i, h in enumerate(hashes):
            run = run + 1 if self.pool.lookup(self._key(h, group)) is not None else 0
            k = i + 1
            valid.append(run >= k - self._num_behind(k * self.block_size, window))
        return valid

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    def host_hits(self, req: Request, num_device_hits: int) -> list[int]:
        """Host blocks that extend a device prefix hit of `num_device_hits` blocks (same cap:
        one token is left to compute)."""
        if self.tier is None or not self.enable_caching or req.num_computed_tokens > 0:
            return []
        if req.scores_prompt:
            return []
        hashes = self.block_hashes(req, (req.num_tokens - 1) // self.block_size)
        return self.tier.hits(hashes[num_device_hits:])

    def can_allocate(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVBlock]],
        num_host_hits: int = 0,
    ) -> bool:
        num_needed = self._num_blocks_needed(
            req, num_new_tokens, new_computed_blocks, num_host_hits
        )
        # A hit nobody owns sits in the free queue: touching it takes it out of the free pool.
        revived = (b for hits in new_computed_blocks for b in hits if b is not SKIPPED_BLOCK)
        num_revived = sum(1 for b in revived if b.ref_cnt == 0)
        return num_needed * self.num_groups + num_revived <= self.pool.num_free

    def _num_blocks_needed(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVBlock]],
        num_host_hits: int = 0,
    ) -> int:
        """New blocks each group needs (the same in all: their lists grow in step); host hits
        need new device blocks to be copied into."""
        num_hits = len(new_computed_blocks[0]) if new_computed_blocks else 0
        num_total = (
            req.num_computed_tokens + (num_hits + num_host_hits) * self.block_size + num_new_tokens
        )
        return max(0, cdiv(num_total, self.block_size) - req.num_blocks - num_hits)

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVBlock]] | None = None,
        host_hits: list[int] | None = None,
    ) -> bool:
        """Give `req` blocks, in every group, for `num_new_tokens` more tokens after its computed
        ones (and after `new_computed_blocks`, prefix hits found by `get_computed_blocks`, and
        `host_hits`, host blocks found by `host_hits`, copied into its first new blocks).
        False if they don't fit; then nothing changed but the blocks freed behind the window.

        On success, every block that becomes full once these tokens are computed is registered
        in the prefix cache now, at plan time: a sibling request planned later in the same step
        can hit it. That is sound because every layer writes the whole batch's new K/V into the
        cache before attending, and plans execute in order.
        """
        hits = new_computed_blocks or []
        self.free_outside_window(req)  # whatever follows: those blocks are needed no more
        host_hits = host_hits or []
        if not self.can_allocate(req, num_new_tokens, hits, len(host_hits)):
            return False
        assert not (hits or host_hits) or not req.blocks, "hits only on a first allocation"
        num_needed = self._num_blocks_needed(req, num_new_tokens, hits, len(host_hits))
        num_hits = len(hits[0]) if hits else 0
        num_tokens = (
            req.num_computed_tokens + (num_hits + len(host_hits)) * self.block_size + num_new_tokens
        )
        if host_hits:  # before any eviction: a spill must not take these host blocks
            self.tier.pin(host_hits, take_ref=True)
        if not req.blocks:
            req.blocks = [[] for _ in self.windows]
            req.num_skipped_blocks = [0] * self.num_groups
            if self.tier is not None and req.num_preemptions:  # back: its blocks are in use
                self.tier.filter.forget(req.block_hashes)
        # Every group's hits leave the free queue before any group pops new blocks: popping
        # first could evict (and hand to another group) a block that a later group hits.
        for g, group_hits in enumerate(hits):
            held = [b for b in group_hits if b is not SKIPPED_BLOCK]
            self.pool.touch(held)
            req.blocks[g].extend(group_hits)
            req.num_skipped_blocks[g] += len(group_hits) - len(held)  # they lead the list
        for blocks in req.blocks:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        if host_hits:
            targets = req.blocks[0][num_hits : num_hits + len(host_hits)]
            self.tier.load(host_hits, [b.block_id for b in targets])
        req.num_hashed_blocks += num_hits  # the host hits' blocks are registered below
        self._cache_full_blocks(req, min(num_tokens, req.num_tokens) // self.block_size)
        return True

    def _cache_full_blocks(self, req: Request, num_full: int) -> None:
        if not self.enable_caching or num_full <= req.num_hashed_blocks:
            return
        hashes = self.block_hashes(req, num_full)
        for g, blocks in enumerate(req.blocks):
            for i in range(req.num_hashed_blocks, num_full):
                if blocks[i] is not SKIPPED_BLOCK:  # freed before its last token was known
                    self.pool.cache_block(blocks[i], self._key(hashes[i], g))
        req.num_hashed_blocks = num_full

    def free_outside_window(self, req: Request) -> None:
        """Free, in each windowed group, the blocks wholly behind the window of the next token
        to compute (see above)."""
        for g, window in enumerate(self.windows):
            if window is None or not req.blocks:
                continue
            num_behind = min(self._num_behind(req.num_computed_tokens, window), req.num_blocks)
            skipped = req.num_skipped_blocks[g]
            if num_behind <= skipped:
                continue
            behind = req.blocks[g][skipped:num_behind]
            req.blocks[g][skipped:num_behind] = [SKIPPED_BLOCK] * len(behind)
            req.num_skipped_blocks[g] = num_behind
            self.pool.free_blocks(reversed(behind))  # latest first: the prefix is evicted last

    def free_tail(self, req: Request, num_keep: int) -> bool:
        """Free `req`'s blocks past its first `num_keep`, which hold no token it keeps (the
        rejected drafts' of speculative decoding), tail first; True if any were freed. None of
        them is in the prefix cache: only blocks full of known tokens are."""
        if req.num_blocks <= num_keep:
            return False
        assert req.num_hashed_blocks <= num_keep, req
        for blocks in req.blocks:
            tail = blocks[num_keep:]
            del blocks[num_keep:]
            self.pool.free_blocks(reversed(tail))
        return True

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its prefix.

        First every block full of known, computed tokens is registered: under async scheduling
        the last ones held a placeholder when they were allocated, and a request that leaves
        (finished, aborted, preempted) gets no later allocation to register them."""
        if req.blocks:
            self._cache_full_blocks(
                req, min(req.num_computed_tokens, req.num_tokens) // self.block_size
            )
        for blocks in req.blocks:
            self.pool.free_blocks(b for b in reversed(blocks) if b is not SKIPPED_BLOCK)
        req.blocks = []
        req.num_hashed_blocks = 0
        req.num_skipped_blocks = []

    def swap_out(self, req: Request, num_keep_tokens: int) -> list[int] | None:
        """Copy the blocks of the first `num_keep_tokens` of a request being preempted to the
        host tier, if the cost model prefers that and there is room; its host blocks, or None
        (then it is recomputed: a lazy swap, whose full blocks the spill filter marks wanted).
        Its device blocks are freed by the caller."""
        num_blocks = cdiv(num_keep_tokens, self.block_size)
        tier = self.tier
        if tier is None or not num_blocks:
            return None
        full = num_keep_tokens // self.block_size
        keys = self.block_hashes(req, full) if self.enable_caching else []
        host_ids = None
        if tier.prefers_swap(num_blocks, num_keep_tokens, self.enable_caching):
            host_ids = tier.save([b.block_id for b in req.blocks[0][:num_blocks]], keys)
        if host_ids is None:
            tier.filter.want(keys)
        return host_ids

    def swap_in(self, req: Request, num_new_tokens: int) -> bool:
        """Give a swapped request device blocks for its kept tokens and `num_new_tokens` more
        (False: they don't fit, nothing changed). Its leading blocks still cached on the device
        (it left them there when it was preempted) are taken as prefix hits; only its host
        blocks after them are copied in."""
        host_ids = req.host_block_ids
        num_tokens = req.num_computed_tokens + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size)
        assert not req.blocks and num_needed >= len(host_ids)
        hits = self._swapped_hits(req, len(host_ids))
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed - len(hits) + num_revived > self.pool.num_free:
            return False
        self.tier.pin(host_ids, take_ref=False)  # the request's references go with this plan
        self.pool.touch(hits)  # before any eviction: popping could take a hit
        blocks = hits + self.pool.get_new_blocks(num_needed - len(hits))
        self.tier.load(
            host_ids[len(hits) :], [b.block_id for b in blocks[len(hits) : len(host_ids)]]
        )
        req.blocks, req.num_skipped_blocks, req.num_hashed_blocks = [blocks], [0], len(hits)
        req.host_block_ids = []
        self._cache_full_blocks(req, min(num_tokens, req.num_tokens) // self.block_size)
        return True

    def _swapped_hits(self, req: Request, num_host_blocks: int) -> list[KVBlock]:
        """The device blocks that still hold a swapped request's leading full blocks."""
        if not self.enable_caching:
            return []
        num_full = min(req.num_computed_tokens // self.block_size, num_host_blocks)
        hits = []
        for h in self.block_hashes(req, num_full):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def spill_ahead(self, num_blocks: int) -> None:
        """Copy to the host, ahead of their eviction, the cached blocks among the first
        `num_blocks` of the free queue (the next evicted) that the host does not hold yet."""
        if self.tier is None or not self.enable_caching:
            return
        on_host = self.tier.pool.cached  # a dict lookup per block: this runs every step
        for block in islice(self.pool.free_queue, num_blocks):
            if block.block_hash is not None and block.block_hash not in on_host:
                self.tier.spill_ahead(block.block_id, block.block_hash)

    def reset_prefix_cache(self) -> bool:
        if self.tier is not None and self.pool.num_free == self.pool.num_blocks:
            self.tier.pool.reset()
            self.tier.filter.reset()
        return self.pool.reset_prefix_cache()
