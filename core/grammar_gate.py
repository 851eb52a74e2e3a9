"""Requests wait here, outside the scheduler, until every sampling rank has compiled their grammar.

The first request of a grammar sends one `CompileGrammar` to the workers; the sampling ranks
compile it on a thread of their own and each answers `GrammarCompiled`. Until all have, the
request is not schedulable, so neither the core loop nor the workers' step loop ever waits for a
compile: other requests keep running. Keys known to be compiled pass at once (the last
MAX_READY of them; a forgotten key only costs a cache hit on the workers).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.ipc.messages import AddRequest, CompileGrammar, GrammarCompiled

MAX_READY = 4096
logger = logging.getLogger("pagedserve.core")


@dataclass
class _Compiling:
    ranks: set[int] = field(default_factory=set)
    waiting: list[AddRequest] = field(default_factory=list)
    error: str | None = None


class GrammarGate:
    def __init__(self, sampling_ranks: Iterable[int]) -> None:
        """`sampling_ranks`: the last pipeline stage's ranks; only their answers count, so a
        stray or hostile `GrammarCompiled` cannot release a request early."""
        self.sampling_ranks = frozenset(sampling_ranks)
        self._ready: OrderedDict[str, None] = OrderedDict()
        self._compiling: dict[str, _Compiling] = {}
        self._key_of: dict[str, str] = {}  # req_id -> key of the requests held here

    @property
    def pending(self) -> bool:
        return bool(self._compiling)

    def admit(self, msg: AddRequest) -> tuple[bool, CompileGrammar | None]:
        """(whether the request may be scheduled now, a compile order to broadcast or None)."""
        spec = msg.sampling.structured_outputs
        if spec is None:
            return True, None
        key = spec.key
        if key in self._ready:
            self._ready.move_to_end(key)
            return True, None
        self._key_of[msg.req_id] = key
        compiling = self._compiling.get(key)
        if compiling is not None:
            compiling.waiting.append(msg)
            return False, None
        self._compiling[key] = _Compiling(waiting=[msg])
        return False, CompileGrammar(key, spec)

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
        if compiling.ranks != self.sampling_ranks:
            return [], None
        del self._compiling[msg.key]
        for req in compiling.waiting:
            self._key_of.pop(req.req_id, None)
        if compiling.error is None:
            self._ready[msg.key] = None
            while len(self._ready) > MAX_READY:
                self._ready.popitem(last=False)
        return compiling.waiting, compiling.error

    def abort(self, req_ids: list[str]) -> list[AddRequest]:
        """Drop held requests among `req_ids`; returns those dropped."""
        dropped = []
        for req_id in req_ids:
            key = self._key_of.pop(req_id, None)
            if key is None:
                continue
            waiting = self._compiling[key].waiting
            req = next(r for r in waiting if r.req_id == req_id)
            waiting.remove(req)
            dropped.append(req)
        return dropped
