"""Which blocks evicted from the GPU prefix cache are worth a copy to the host tier.

A spill costs a block's copy out (on the step path when the eviction comes first, beside the
forward when it is spilled ahead) and pays only if someone reads the block again. Two kinds:
- **wanted**: the full blocks of a request preempted by recompute while the tier is on (a lazy
  swap): it comes back and reads them, so they are always spilled; the mark goes when the block
  is evicted or the request is admitted again;
- **the rest** (blocks of finished requests): worth it in a multi-turn chat, whose next turn
  re-reads the history, and never in a stream of unrelated prompts (W1: ~93% of what the tier
  copied there was read by nobody). The filter learns which it is: of these blocks evicted, the
  share read again (`rereads / candidates`, both decaying over `window` evictions), counting a
  host hit on a block spilled so and a **ghost** hit (a lookup that would have found on the host
  a block evicted without a spill, remembered by key, as many as the host holds); spills while
  that share is at least `threshold` (what a spill costs over what a hit saves, from the costs
  measured at start-up). It starts open, with a prior worth `PRIOR` evictions at twice the
  threshold: a workload that reads nothing again stops spilling after about that many.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

PRIOR = 256  # evictions the starting estimate is worth
MAX_GHOSTS = 1 << 16


def spill_threshold(
    swap_s_per_block: float, block_size: int, recompute_s_per_token: float
) -> float:
    """The share of spilled blocks that must be read again for spills to pay: a copy out per
    spill against, per read, a block's recompute less its copy back in (clamped to 2-50%)."""
    saved = block_size * recompute_s_per_token - swap_s_per_block
    if saved <= 0:
        return 0.5
    return min(0.5, max(0.02, swap_s_per_block / saved))


class SpillFilter:
    def __init__(self, threshold: float, window: int) -> None:
        self.threshold = threshold
        self.window = max(PRIOR, min(window, MAX_GHOSTS))
        self.decay = 1.0 - 1.0 / self.window
        self.candidates = float(PRIOR)
        self.rereads = 2.0 * threshold * PRIOR
        self.wanted: set[bytes] = set()
        self.ghosts: OrderedDict[bytes, None] = OrderedDict()
        self.num_skipped = 0  # cumulative: evicted blocks not spilled

    @property
    def open(self) -> bool:
        """Blocks that are not wanted are spilled now."""
        return self.rereads >= self.threshold * self.candidates

    def want(self, keys: Iterable[bytes]) -> None:
        self.wanted.update(keys)

    def forget(self, keys: Iterable[bytes]) -> None:
        self.wanted.difference_update(keys)

    def reset(self) -> None:
        """The prefix cache was reset: no key names a block any more."""
        self.wanted.clear()
        self.ghosts.clear()

    def admits(self, key: bytes) -> bool:
        """Spill ahead (no eviction yet, nothing counted)."""
        return self.open or key in self.wanted

    def evicted(self, key: bytes, on_host: bool) -> bool:
        """A cached device block is evicted: copy it (or keep its host copy)? A block not
        wanted counts as a candidate; one not copied is remembered as a ghost."""
        if key in self.wanted:
            self.wanted.discard(key)
            return True
        self.candidates = self.candidates * self.decay + 1.0
        self.rereads *= self.decay
        if on_host or self.open:
            return True
        self.num_skipped += 1
        self.ghosts[key] = None
        if len(self.ghosts) > self.window:
            self.ghosts.popitem(last=False)
        return False

    def reread(self, num_blocks: int) -> None:
        """Host hits on blocks spilled though not wanted."""
        self.rereads += num_blocks

    def ghost_hits(self, keys: Iterable[bytes]) -> int:
        """Count (once) the leading `keys` that were evicted without a spill: the host would
        have served them."""
        n = 0
        for key in keys:
            if key not in self.ghosts:
                break
            del self.ghosts[key]
            n += 1
        self.rereads += n
        return n
