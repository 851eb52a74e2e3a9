"""Requests wait here, outside the scheduler, until every worker holds their LoRA adapter in its
host pool; and here the core decides which adapters the pools hold (`--max-cpu-loras`).

Loading: the first request of an adapter the pools lack sends one `LoadLoRA`; every rank reads it
(safetensors -> CPU tensors in the LoRA dtype, scaling folded into B) on a thread of its own and
answers `LoRALoaded`. Until all have, the request is neither schedulable nor answered: then it is
admitted (it goes on to the scheduler) or, if a rank could not read it, refused with that rank's
reason. So a load never stalls a step of other requests, and no step finds its adapter missing
from a pool (a worker only copies it from the pool into a device slot, worker/lora/manager.py).

Holding: the pools hold exactly the adapters this gate lists (workers never evict by themselves).
At most `capacity`: a load order first drops the least recently used adapters that no unfinished
request uses (waiting, running or preempted: the scheduler counts them), and the drop rides on
that order, so workers apply it in plan order. An adapter in use (`in_use`: the core also
counts requests waiting for their grammar) is never dropped (past `capacity` adapters in use at
once, the pools hold more until they finish), so unloading one from the API never breaks its
running requests.

One `lora_int_id` names one adapter while requests use it: a request that names a held or
loading id with another adapter is refused while the first is in use (else the load replaces it).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from pagedserve.ipc.messages import AddRequest, LoadLoRA, LoRALoaded, LoRARequest

logger = logging.getLogger("pagedserve.core")


@dataclass
class _Loading:
    lora: LoRARequest
    ranks: set[int] = field(default_factory=set)
    waiting: list[AddRequest] = field(default_factory=list)
    error: str | None = None
    loaded_somewhere: bool = False  # some rank holds it (even if another failed)


class LoRAGate:
    def __init__(
        self,
        ranks: Iterable[int],
        capacity: int,
        in_use: Callable[[LoRARequest], bool] = lambda lora: False,
    ) -> None:
        """`ranks`: every worker (each holds the adapter's layers of its stage); only their
        answers count. `in_use(lora)`: whether an unfinished request has it (the scheduler's, or
        one waiting in another gate)."""
        assert capacity >= 1
        self.ranks = frozenset(ranks)
        self.capacity = capacity
        self._in_use = in_use
        self._held: OrderedDict[int, LoRARequest] = OrderedDict()  # every rank holds; LRU first
        self._loading: dict[int, _Loading] = {}
        self._id_of: dict[str, int] = {}  # req_id -> lora_int_id of the requests held here
        self._stale: set[int] = set()  # held by some ranks only (others failed): to drop

    @property
    def pending(self) -> bool:
        return bool(self._loading)

    @property
    def num_waiting(self) -> int:
        """Requests held here for their adapter (they count toward `max_waiting`)."""
        return len(self._id_of)

    def waiting(self) -> Iterator[AddRequest]:
        """The requests held here."""
        for loading in self._loading.values():
            yield from loading.waiting

    @property
    def held_ids(self) -> list[int]:
        """The adapters every pool holds, least recently used first."""
        return list(self._held)

    def admit(self, msg: AddRequest) -> tuple[bool, LoadLoRA | None]:
        """(whether the request may go on now, a load order to broadcast or None). ValueError
        if its `lora_int_id` names another adapter that is loading or in use."""
        lora = msg.lora
        if lora is None:
            return True, None
        lora_id = lora.lora_int_id
        held = self._held.get(lora_id)
        if held == lora:
            self._held.move_to_end(lora_id)
            return True, None
        loading = self._loading.get(lora_id)
        other = held if loading is None else loading.lora
        if other is not None and other != lora and (loading is not None or self._in_use(other)):
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r}: lora_int_id {lora_id} names adapter "
                f"{other.lora_name!r} ({other.lora_path}), which requests are using"
            )
        self._id_of[msg.req_id] = lora_id
        if loading is not None:
            loading.waiting.append(msg)
            return False, None
        if held is not None:  # the id names another adapter now, unused: the load replaces it
            del self._held[lora_id]
        self._loading[lora_id] = _Loading(lora, waiting=[msg])
        self._stale.discard(lora_id)
        return False, LoadLoRA(lora, drop_ids=self._make_room())

    def _make_room(self) -> list[int]:
        """The adapters the pools drop before loading one more: the stale ones, and the least
        recently used unused ones while more than `capacity` would be held."""
        dropped = sorted(self._stale)
        self._stale.clear()
        excess = len(self._held) + len(self._loading) - self.capacity
        for lora_id, lora in list(self._held.items()):
            if excess <= 0:
                break
            if not self._in_use(lora):
                del self._held[lora_id]
                dropped.append(lora_id)
                excess -= 1
        return dropped

    def loaded(self, msg: LoRALoaded) -> tuple[list[AddRequest], str | None]:
        """One rank's answer -> (the requests released, the error if the load failed)."""
        loading = self._loading.get(msg.lora_int_id)
        if loading is None:
            return [], None
        if msg.rank not in self.ranks:
            logger.error("dropped a LoRALoaded from rank %r, not a worker", msg.rank)
            return [], None
        loading.ranks.add(msg.rank)
        loading.error = loading.error or msg.error
        loading.loaded_somewhere |= msg.error is None
        if loading.ranks != self.ranks:
            return [], None
        del self._loading[msg.lora_int_id]
        for req in loading.waiting:
            self._id_of.pop(req.req_id, None)
        if loading.error is None:
            self._held[msg.lora_int_id] = loading.lora
        elif loading.loaded_somewhere:
            self._stale.add(msg.lora_int_id)
        return loading.waiting, loading.error

    def abort(self, req_ids: Iterable[str]) -> list[AddRequest]:
        """Drop waiting requests among `req_ids` (one pass per adapter); returns those dropped."""
        by_id: dict[int, set[str]] = defaultdict(set)
        for req_id in req_ids:
            lora_id = self._id_of.pop(req_id, None)
            if lora_id is not None:
                by_id[lora_id].add(req_id)
        dropped = []
        for lora_id, ids in by_id.items():
            loading = self._loading[lora_id]
            dropped += [r for r in loading.waiting if r.req_id in ids]
            loading.waiting = [r for r in loading.waiting if r.req_id not in ids]
        return dropped
