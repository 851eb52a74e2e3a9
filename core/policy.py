"""Scheduling policies: the order of the waiting queue and of the running list.

A policy keeps `running` sorted so that its LAST element is always the request to preempt first
(FCFS: the latest admitted; priority: the highest (priority, arrival_time, seq)). The scheduler
walks `running` from the head and takes victims from the tail, so a victim is never a request
already planned in the same step: its blocks never carry work a sent plan will not do.

Removal from the waiting queue is lazy: `remove` only marks the requests, `peek`/`pop` skip the
marked ones at the head, and the queue is rebuilt once when half of it is marked. Aborting k of
n waiting requests so costs O(k) plus at most one O(n) pass, in one call or in k calls (a
cancellation storm of 15,000 waiting requests used to rebuild the heap once per id: minutes).
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from pagedserve.core.request import Request


class _WaitingQueue:
    """The lazy removal both queues share; a subclass keeps `_items` and says how a request is
    found in an item and how the head is dropped."""

    _items: deque | list

    def __init__(self) -> None:
        self._removed: set[int] = set()  # id() of marked requests still in `_items`

    def __len__(self) -> int:
        return len(self._items) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        return (r for r in map(self._request, self._ordered()) if id(r) not in self._removed)

    def peek(self) -> Request:
        self._prune()
        return self._request(self._items[0])

    def pop(self) -> Request:
        self._prune()
        return self._request(self._drop_head())

    def remove(self, reqs: Iterable[Request]) -> None:
        """Take `reqs` (all waiting) out of the queue."""
        removed = self._removed
        removed.update(map(id, reqs))
        if 2 * len(removed) > len(self._items):
            self._items = self._rebuild(
                [e for e in self._items if id(self._request(e)) not in removed]
            )
            removed.clear()

    def _prune(self) -> None:
        while self._removed and id(self._request(self._items[0])) in self._removed:
            self._removed.remove(id(self._request(self._drop_head())))

    def _check_new(self, req: Request) -> None:
        assert id(req) not in self._removed, f"{req} was removed and comes back"

    # what a subclass defines
    def _request(self, item) -> Request:
        raise NotImplementedError

    def _drop_head(self):
        raise NotImplementedError

    def _ordered(self) -> Iterable:
        raise NotImplementedError

    def _rebuild(self, items: list) -> deque | list:
        raise NotImplementedError


class FcfsPolicy(_WaitingQueue):
    """First come, first served. Preempted requests go back to the front of the queue."""

    def __init__(self) -> None:
        super().__init__()
        self._items: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._check_new(req)
        self._items.append(req)

    def push_preempted(self, req: Request) -> None:
        self._check_new(req)
        self._items.appendleft(req)

    def add_running(self, running: list[Request], req: Request) -> None:
        running.append(req)

    def _request(self, item: Request) -> Request:
        return item

    def _drop_head(self) -> Request:
        return self._items.popleft()

    def _ordered(self) -> Iterable[Request]:
        return self._items

    def _rebuild(self, items: list[Request]) -> deque[Request]:
        return deque(items)


def priority_key(req: Request) -> tuple[int, float, int]:
    """Lower runs first (vLLM's convention); ties by arrival, then admission order."""
    return (req.priority, req.arrival_time, req.seq)


class PriorityPolicy(_WaitingQueue):
    """A heap on (priority, arrival_time, seq). A preempted request keeps its key, so it resumes
    ahead of everything that ranks below it."""

    def __init__(self) -> None:
        super().__init__()
        self._items: list[tuple[tuple[int, float, int], Request]] = []

    def push(self, req: Request) -> None:
        self._check_new(req)
        heapq.heappush(self._items, (priority_key(req), req))

    push_preempted = push

    def add_running(self, running: list[Request], req: Request) -> None:
        bisect.insort(running, req, key=priority_key)

    def _request(self, item: tuple[tuple[int, float, int], Request]) -> Request:
        return item[1]

    def _drop_head(self) -> tuple[tuple[int, float, int], Request]:
        return heapq.heappop(self._items)

    def _ordered(self) -> Iterable[tuple[tuple[int, float, int], Request]]:
        return sorted(self._items, key=lambda e: e[0])

    def _rebuild(
        self, items: list[tuple[tuple[int, float, int], Request]]
    ) -> list[tuple[tuple[int, float, int], Request]]:
        heapq.heapify(items)
        return items


def make_policy(name: str) -> FcfsPolicy | PriorityPolicy:
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityPolicy()
    raise ValueError(f"unknown scheduling policy {name!r}: choose fcfs or priority")
