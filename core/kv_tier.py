"""The KV cache's host-memory tier, as the core sees it: which copies each plan carries.

The core decides every copy; workers execute the lists a `StepPlan` names: before its forward,
first `kv_to_host` (spills of evicted prefix-cache blocks, preempted requests' blocks), then
`kv_from_host` (host prefix hits, swapped requests resuming); then, beside its forward,
`kv_to_host_ahead` (spills ahead: free cached blocks near the head of the free queue, the next
to be evicted, chosen once the plan's blocks are taken, so the plan neither writes them nor
waits for their copies; their later eviction finds them on the host and copies nothing). That
order, with these rules, makes every copy read what the core meant:
- a device block copied out in a plan was written by earlier plans only: it is either a victim's
  (preemption happens before any swap-in is planned in a step) or free and cached (a block filled
  by this plan's swap-in is held by its request until the plan is sent);
- a host block read by a swap-in is referenced until the plan is built (`end_plan`), so no copy
  of the same plan overwrites it; copies of later plans run after it (workers execute in order).

Not every evicted block is worth a spill: `SpillFilter` (core/spill_filter.py) always lets
through the blocks of a request preempted by recompute (it reads them again) and the rest only
while enough of them are read again (a multi-turn chat's histories, not a stream of unrelated
prompts' blocks).

Preemption by swap or recompute (`prefers_swap`). With the prefix cache on, recompute is a lazy
swap: the victim's full blocks stay cached on the device, spill to the host only if evicted, and
come back as device or host hits when it is admitted again, so only what was lost is copied or
computed (on an H100, W1 at a quarter of its KV need ran 21.3 req/s by recompute, 17.8 by eager
swap: docs/kv-offloading.md); auto mode then always recomputes. Without it, swapping costs the
blocks' bytes over the measured copy bandwidth, twice (out and back in), and recompute the prefill
of the computed tokens at the measured matmul throughput (both measured by the workers at
start-up); the cheaper wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.host_pool import HostPool
from pagedserve.core.spill_filter import SpillFilter, spill_threshold


@dataclass(frozen=True)
class TierSpec:
    """What the workers measured. `swap_s_per_block`: one block out or in (the slowest rank);
    `recompute_s_per_token`: one token's prefill over every stage; `block_bytes`: one block's
    bytes summed over the ranks (for the byte counters). `mode`: "swap" or "recompute" forces the
    choice, None lets the costs decide."""

    num_blocks: int
    swap_s_per_block: float = 0.0
    recompute_s_per_token: float = 0.0
    block_bytes: int = 0
    mode: str | None = None


def describe_costs(spec: TierSpec, block_size: int, caching: bool) -> str:
    """The preemption choice at start-up, from what the workers measured (the log line)."""
    swap = 2 * spec.swap_s_per_block * 1e6
    recompute = block_size * spec.recompute_s_per_token * 1e6
    if spec.mode is not None:
        choice = f"--preemption-mode {spec.mode}"
    elif caching:
        choice = "the prefix cache is on: recompute (a lazy swap)"
    else:
        choice = "swap" if swap < recompute else "recompute"
    text = (
        f"preemption cost per {block_size}-token block: swap out and in {swap:.1f} us, "
        f"recompute >= {recompute:.1f} us; chosen: {choice}"
    )
    if caching:
        share = spill_threshold(spec.swap_s_per_block, block_size, spec.recompute_s_per_token)
        text += (
            f". Evicted blocks spill to the host if a preempted request wants them, others while "
            f">= {share:.0%} of them are read again"
        )
    return text


class HostTier:
    def __init__(self, spec: TierSpec, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.pool = HostPool(spec.num_blocks)
        threshold = spill_threshold(spec.swap_s_per_block, block_size, spec.recompute_s_per_token)
        self.filter = SpillFilter(threshold, spec.num_blocks)  # core/spill_filter.py
        self._unwanted = bytearray(spec.num_blocks)  # host blocks spilled though not wanted
        self.swap_out: list[tuple[int, int]] = []  # (device block, host block), this plan
        self.swap_in: list[tuple[int, int]] = []  # (host block, device block), this plan
        self.ahead: list[tuple[int, int]] = []  # (device block, host block): spills ahead
        self._pinned: list[int] = []  # host blocks this plan reads, released at end_plan
        self._filled: set[int] = set()  # device blocks this plan's swap-ins write
        self.num_out_blocks = 0  # cumulative
        self.num_in_blocks = 0
        self.num_hit_tokens = 0  # host prefix-cache hits, in tokens

    def prefers_swap(self, num_blocks: int, num_tokens: int, caching: bool) -> bool:
        if self.spec.mode is not None:
            return self.spec.mode == "swap"
        if caching:  # recompute is a lazy swap (see above)
            return False
        swap = 2 * num_blocks * self.spec.swap_s_per_block
        return swap < num_tokens * self.spec.recompute_s_per_token

    def spill(self, block_id: int, key: bytes) -> None:
        """A cached device block is evicted: keep its content on the host (if it is not there
        already, the spill filter admits it and a host block can be had)."""
        assert block_id not in self._filled, "a block filled by this plan cannot be evicted"
        i = self.pool.lookup(key)
        wanted = key in self.filter.wanted
        if not self.filter.evicted(key, i is not None):
            return
        if i is not None:
            self.pool.touch(i)
            return
        self._spill(block_id, key, self.swap_out, wanted)

    def spill_ahead(self, block_id: int, key: bytes) -> None:
        """A cached device block that is free, and so evicted soon, is copied to the host now,
        by a copy that runs beside this plan's forward (the plan does not write the block:
        it was free once the plan's blocks were taken); its eviction then copies nothing.
        The caller checked that the host does not hold `key` (no touch: a scan is not a use)."""
        if self.filter.admits(key):
            self._spill(block_id, key, self.ahead, key in self.filter.wanted)

    def _spill(
        self, block_id: int, key: bytes, copies: list[tuple[int, int]], wanted: bool
    ) -> None:
        if not self.pool.num_free:
            return
        (i,) = self.pool.allocate(1)
        self.pool.set_hash(i, key)
        self.pool.unref([i])  # cached: evictable, findable
        self._unwanted[i] = not wanted
        copies.append((block_id, i))

    def hits(self, keys: list[bytes]) -> list[int]:
        """Host blocks of the longest run of `keys` the host holds (not yet taken); the keys
        after it that the spill filter let go count as its ghost hits."""
        out = []
        for key in keys:
            i = self.pool.lookup(key)
            if i is None:
                break
            out.append(i)
        self.filter.ghost_hits(keys[len(out) :])
        return out

    def save(self, block_ids: list[int], keys: list[bytes]) -> list[int] | None:
        """Copy a preempted request's blocks out; its host blocks (None: no room). `keys`: the
        prefix-cache keys of its leading full blocks, findable while it is swapped."""
        if len(block_ids) > self.pool.num_free:
            return None
        host_ids = self.pool.allocate(len(block_ids))
        for i, key in zip(host_ids, keys, strict=False):
            self.pool.set_hash(i, key)
        for i in host_ids:
            self._unwanted[i] = 0
        self.swap_out += zip(block_ids, host_ids, strict=True)
        return host_ids

    def pin(self, host_ids: list[int], take_ref: bool) -> None:
        """Keep host blocks this plan reads from reuse until `end_plan`, which drops a reference
        on each: `take_ref` for host hits (they stay cached after); a resuming request's own
        references are dropped so (its blocks become cached or free)."""
        if take_ref:
            self.pool.ref(host_ids)
            self.filter.reread(sum(self._unwanted[i] for i in host_ids))
        self._pinned += host_ids

    def load(self, host_ids: list[int], block_ids: list[int]) -> None:
        """Copy pinned host blocks into device blocks."""
        self._filled.update(block_ids)
        self.swap_in += zip(host_ids, block_ids, strict=True)

    def end_plan(self) -> tuple[list[tuple[int, int]], ...]:
        """This plan's copies (out, in, out ahead); releases the host blocks it read."""
        copies = self.swap_out, self.swap_in, self.ahead
        self.num_out_blocks += len(self.swap_out) + len(self.ahead)
        self.num_in_blocks += len(self.swap_in)
        self.pool.unref(self._pinned)
        self.swap_out, self.swap_in, self.ahead, self._pinned, self._filled = [], [], [], [], set()
        return copies
