"""Which data parallel core a request goes to: prefix affinity under a load bound.

Every turn of a conversation resends its history, and a core's prefix cache holds what that core
computed, so a request should go to the core that served the longest start of its prompt. The
router remembers, per full KV block of each prompt it routed, the core it sent it to (block hashes
chained as the core's prefix cache chains them, in a bounded LRU table), and picks:
1. the core that holds the longest recorded prefix, unless that core is clearly busier than the
   others: its in-flight count > (1 + LOAD_EPS) x mean + LOAD_SLACK (bounded load, as the
   "consistent hashing with bounded loads" of deploy/nginx's replicas);
2. for a prompt no core holds, the core its first block hashes to (the same on every API server,
   so a conversation started through one server finds its core through another), unless that
   core has more than the mean + NEW_SLACK in flight: there is no cache to lose, so balance wins;
3. otherwise the least loaded core.
In-flight counts are this client's own (requests routed and not yet released). Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict

LOAD_EPS = 0.25
LOAD_SLACK = 4
NEW_SLACK = 1
MAX_ENTRIES = 1 << 17  # recorded blocks (a few MB): ~2M prompt tokens at 16 per block


def block_hashes(prompt_token_ids: list[int], block_size: int) -> list[int]:
    """One hash per full block, each chained with its parent's (deterministic across processes:
    Python hashes ints and tuples without a per-process seed)."""
    hashes, parent = [], 0
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        parent = hash((parent, *prompt_token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixRouter:
    def __init__(self, num_cores: int, block_size: int, max_entries: int = MAX_ENTRIES) -> None:
        self.num_cores = num_cores
        self.block_size = block_size
        self.max_entries = max_entries
        self.load = [0] * num_cores  # requests in flight per core
        self._owner: OrderedDict[int, int] = OrderedDict()  # block hash -> core, LRU first

    def route(self, prompt_token_ids: list[int]) -> int:
        """The core for a new request (counted in flight until `release`)."""
        if self.num_cores == 1:
            self.load[0] += 1
            return 0
        hashes = block_hashes(prompt_token_ids, self.block_size)
        owner = next((c for h in reversed(hashes) if (c := self._owner.get(h)) is not None), None)
        mean = (sum(self.load) + 1) / self.num_cores
        if owner is not None and self.load[owner] + 1 <= (1 + LOAD_EPS) * mean + LOAD_SLACK:
            core = owner
        else:
            first = hashes[0] if hashes else hash(tuple(prompt_token_ids))
            home = first % self.num_cores
            if owner is None and self.load[home] + 1 <= mean + NEW_SLACK:
                core = home
            else:
                core = min(range(self.num_cores), key=lambda c: (self.load[c], c != home))
        self._record(hashes, core)
        self.load[core] += 1
        return core

    def release(self, core: int) -> None:
        """A request routed to `core` finished (or failed, or was aborted)."""
        assert self.load[core] > 0, f"core {core} has no request in flight"
        self.load[core] -= 1

    def _record(self, hashes: list[int], core: int) -> None:
        owner = self._owner
        for h in hashes:
            owner[h] = core
            owner.move_to_end(h)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)
