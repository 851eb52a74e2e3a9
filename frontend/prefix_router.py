"""Which data parallel core a request goes to: prefix affinity under a load bound.

Every turn of a conversation resends its history, and a core's prefix cache holds what that core
computed, so a turn should go where the previous one went. The router remembers, in one bounded
LRU table, the core of each full KV block of every prompt it routed (block hashes chained as the
core's prefix cache chains them) and of each prompt's end (its last full block's hash with the
tokens after it), and picks:
1. when the prompt extends an earlier one (it starts with all of that prompt's tokens: a
   conversation's next turn, a repeated prompt), that prompt's core, unless it is clearly busier
   than the others: its in-flight count > (1 + LOAD_EPS) x mean + LOAD_SLACK (bounded load, as
   deploy/nginx's replicas);
2. otherwise (a new conversation; prompts that share a system prompt or document, which every
   core soon holds too) balance comes first: the core holding the longest start of the prompt,
   or else the core its first block hashes to (the same on every API server), unless that core
   has more than mean + NEW_SLACK in flight;
3. and when the core so chosen is too busy, the least loaded core.
In-flight counts are this client's own (requests routed and not yet released), so affinity is
exact within one API server and best effort across several. A LoRA request's keys start from its
adapter's id (`lora_int_id`), as the core's prefix cache keys do: the same prompt with another
adapter (or none) is another prefix. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict

LOAD_EPS = 0.25
LOAD_SLACK = 4
NEW_SLACK = 1
MAX_ENTRIES = 1 << 17  # recorded blocks (a few MB): ~2M prompt tokens at 16 per block


def block_hashes(prompt_token_ids: list[int], block_size: int, lora_id: int = 0) -> list[int]:
    """One hash per full block, each chained with its parent's, the first with the LoRA adapter's
    id (0: none). Deterministic across processes: Python hashes ints and tuples of ints without
    a per-process seed."""
    hashes, parent = [], lora_id
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
        # block hash or prompt end -> core, least recently used first
        self._owner: OrderedDict[int, int] = OrderedDict()

    def route(self, prompt_token_ids: list[int], lora_id: int = 0) -> int:
        """The core for a new request (counted in flight until `release`); `lora_id`: its LoRA
        adapter's `lora_int_id` (0: none)."""
        if self.num_cores == 1:
            self.load[0] += 1
            return 0
        ids, size = prompt_token_ids, self.block_size
        hashes = block_hashes(ids, size, lora_id)
        depth = next((d for d in range(len(hashes), 0, -1) if hashes[d - 1] in self._owner), 0)
        parent = hashes[depth - 1] if depth else lora_id
        start = depth * size  # an earlier prompt this one extends ends in its next block
        ends = (_end_key(parent, ids[start : start + r]) for r in range(size - 1, -1, -1))
        extended = next((self._owner[k] for k in ends if k in self._owner), None)
        mean = (sum(self.load) + 1) / self.num_cores
        if extended is not None:  # its core holds all of an earlier prompt this one extends
            home, bound = extended, (1 + LOAD_EPS) * mean + LOAD_SLACK
        else:
            first = hashes[0] if hashes else hash((lora_id, *ids))
            home = self._owner[parent] if depth else first % self.num_cores
            bound = mean + NEW_SLACK
        core = home
        if self.load[home] + 1 > bound:
            core = min(range(self.num_cores), key=lambda c: (self.load[c], c != home))
        self._record(ids, hashes, core, lora_id)
        self.load[core] += 1
        return core

    def release(self, core: int) -> None:
        """A request routed to `core` finished (or failed, or was aborted)."""
        assert self.load[core] > 0, f"core {core} has no request in flight"
        self.load[core] -= 1

    def _record(self, ids: list[int], hashes: list[int], core: int, lora_id: int) -> None:
        owner = self._owner
        end = _end_key(hashes[-1] if hashes else lora_id, ids[len(hashes) * self.block_size :])
        for key in (*hashes, end):
            owner[key] = core
            owner.move_to_end(key)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)


def _end_key(parent: int, tail: list[int]) -> int:
    """Where a prompt ends: its last full block's hash and the tokens after it (the -1 keeps
    these keys apart from block hashes; token ids are never negative)."""
    return hash((parent, -1, *tail))
