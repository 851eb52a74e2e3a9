"""State slots: a fixed pool of per-request recurrent-state rows beside the KV blocks.

Linear-attention layers (Qwen3-Next, Qwen3.5's Gated DeltaNet) keep, per request, a conv state and
a state matrix of constant size instead of KV that grows with the context. The workers hold those
states in tensors of `num_slots` rows (worker/layers/gated_deltanet.py); the core hands each
running request one row, as it hands out blocks, so admission counts slots and a request that
leaves (finished, aborted, preempted) gives its slot back. A preempted request recomputes its
state from scratch when it comes back, like its KV, so it may get another slot.

Invariants: every slot is either free or held by exactly one running request; `num_free +
len(held) == num_slots`. A slot freed by the core is reused only by a later plan than the ones that
wrote it, and plans execute in order, so no step sees another request's state. A pure stack, so a
slot freed last is reused first (its rows are warm in cache).
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._held:
            raise AssertionError(f"state slot {slot} is not held")
        self._held.remove(slot)
        self._free.append(slot)

    def check(self) -> None:
        """The invariants (debug builds and tests)."""
        assert len(self._free) + len(self._held) == self.num_slots
        assert not self._held.intersection(self._free)
        assert all(0 <= s < self.num_slots for s in self._free)
