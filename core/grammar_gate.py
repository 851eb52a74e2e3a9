"""Requests wait here, outside the scheduler, until every sampling rank has compiled their
grammar; and here the core decides which grammars the workers hold.

Compiling: the first request of a grammar sends one `CompileGrammar`; the sampling ranks compile
it on threads of their own, each within `--max-grammar-compile-seconds`, and answer
`GrammarCompiled`. Until all have, the request is neither schedulable nor answered: then it is
admitted (and joins the scheduler) or, if a rank could not compile it, refused with that rank's
reason (an API server returns it as a 400 before any status line). Neither the core loop nor the
workers' step loop ever waits for a compile.

Holding: the workers hold exactly the grammars this gate lists (they never evict by themselves),
so a plan never brings a worker a grammar it would have to compile on the step path. At most
`capacity` are held: a new compile order first drops the least recently used grammars that no
unfinished request uses (waiting, running or preempted: the scheduler counts them), and the drop
rides on that order, so workers apply it in plan order. A grammar in use is never dropped (past
`capacity` grammars in use at once, the workers hold more until they finish); a request whose
grammar was dropped waits here again for a recompile.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from pagedserve.ipc.messages import AddRequest, CompileGrammar, GrammarCompiled

MAX_HELD = 512  # compiled grammars per sampling rank (the workers' memory for them)
SCAN_SLACK = 32  # grammars in use looked past per compile order, at most, to find one to drop
logger = logging.getLogger("pagedserve.core")


@dataclass
class _Compiling:
    ranks: set[int] = field(default_factory=set)
    waiting: list[AddRequest] = field(default_factory=list)
    error: str | None = None
    compiled_somewhere: bool = False  # some rank holds it (even if another failed)


class GrammarGate:
    def __init__(
        self,
        sampling_ranks: Iterable[int],
        capacity: int = MAX_HELD,
        in_use: Callable[[str], bool] = lambda key: False,
    ) -> None:
        """`sampling_ranks`: the last pipeline stage's ranks; only their answers count, so a
        stray or hostile `GrammarCompiled` cannot release a request early. `in_use(key)`:
        whether an unfinished request of the scheduler has that grammar."""
        assert capacity >= 1
        self.sampling_ranks = frozenset(sampling_ranks)
        self.capacity = capacity
        self._in_use = in_use
        self._held: OrderedDict[str, None] = OrderedDict()  # every sampling rank holds; LRU first
        self._compiling: dict[str, _Compiling] = {}
        self._key_of: dict[str, str] = {}  # req_id -> key of the requests held here
        self._stale: set[str] = set()  # held by some ranks only (others failed): to drop

    @property
    def pending(self) -> bool:
        return bool(self._compiling)

    @property
    def num_waiting(self) -> int:
        """Requests held here for their grammar (they count toward `max_waiting`)."""
        return len(self._key_of)

    def waiting(self) -> Iterator[AddRequest]:
        """The requests held here."""
        for compiling in self._compiling.values():
            yield from compiling.waiting

    @property
    def held_keys(self) -> list[str]:
        """The grammars every sampling rank holds, least recently used first."""
        return list(self._held)

    def admit(self, msg: AddRequest) -> tuple[bool, CompileGrammar | None]:
        """(whether the request may be scheduled now, a compile order to broadcast or None)."""
        spec = msg.sampling.structured_outputs
        if spec is None:
            return True, None
        key = spec.key
        if key in self._held:
            self._held.move_to_end(key)
            return True, None
        self._key_of[msg.req_id] = key
        compiling = self._compiling.get(key)
        if compiling is not None:
            compiling.waiting.append(msg)
            return False, None
        self._compiling[key] = _Compiling(waiting=[msg])
        self._stale.discard(key)
        return False, CompileGrammar(key, spec, drop_keys=self._make_room())

    def _make_room(self) -> list[str]:
        """The grammars the workers drop before compiling one more: the stale ones, and the least
        recently used unused ones while more than `capacity` would be held. A grammar in use met
        on the way counts as just used (it moves to the back)."""
        dropped = sorted(self._stale)
        self._stale.clear()
        excess = len(self._held) + len(self._compiling) - self.capacity
        for _ in range(min(excess + SCAN_SLACK, len(self._held)) if excess > 0 else 0):
            key = next(iter(self._held))
            if self._in_use(key):
                self._held.move_to_end(key)
                continue
            del self._held[key]
            dropped.append(key)
            excess -= 1
            if not excess:
                break
        return dropped

    def compiled(self, msg: GrammarCompiled) -> tuple[list[AddRequest], str | None]:
        """One rank's answer -> (the requests released, the error if the compile failed)."""
        compiling = self._compiling.get(msg.key)
        if compiling is None:
            return [], None
        if msg.rank not in self.sampling_ranks:
            logger.error("dropped a GrammarCompiled from rank %r, not a sampling rank", msg.rank)
            return [], None
        compiling.ranks.add(msg.rank)
        compiling.error = compiling.error or msg.error
        compiling.compiled_somewhere |= msg.error is None
        if compiling.ranks != self.sampling_ranks:
            return [], None
        del self._compiling[msg.key]
        for req in compiling.waiting:
            self._key_of.pop(req.req_id, None)
        if compiling.error is None:
            self._held[msg.key] = None
        elif compiling.compiled_somewhere:
            self._stale.add(msg.key)
        return compiling.waiting, compiling.error

    def abort(self, req_ids: Iterable[str]) -> list[AddRequest]:
        """Drop waiting requests among `req_ids` (one pass per grammar); returns those dropped."""
        by_key: dict[str, set[str]] = defaultdict(set)
        for req_id in req_ids:
            key = self._key_of.pop(req_id, None)
            if key is not None:
                by_key[key].add(req_id)
        dropped = []
        for key, ids in by_key.items():
            compiling = self._compiling[key]
            dropped += [r for r in compiling.waiting if r.req_id in ids]
            compiling.waiting = [r for r in compiling.waiting if r.req_id not in ids]
        return dropped
