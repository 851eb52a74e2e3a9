"""Scheduling policies: the order of the waiting queue and of the running list.

A policy keeps `running` sorted so that its LAST element is always the request to preempt first
(FCFS: the latest admitted; priority: the highest (priority, arrival_time, seq)). The scheduler
walks `running` from the head and takes victims from the tail, so a victim is never a request
already planned in the same step: its blocks never carry work a sent plan will not do.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque

from pagedserve.core.request import Request


class FcfsPolicy:
    """First come, first served. Preempted requests go back to the front of the queue."""

    def __init__(self) -> None:
        self._waiting: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self):
        return iter(self._waiting)

    def push(self, req: Request) -> None:
        self._waiting.append(req)

    def push_preempted(self, req: Request) -> None:
        self._waiting.appendleft(req)

    def peek(self) -> Request:
        return self._waiting[0]

    def pop(self) -> Request:
        return self._waiting.popleft()

    def remove(self, req: Request) -> None:
        self._waiting.remove(req)

    def add_running(self, running: list[Request], req: Request) -> None:
        running.append(req)


def priority_key(req: Request) -> tuple[int, float, int]:
    """Lower runs first (vLLM's convention); ties by arrival, then admission order."""
    return (req.priority, req.arrival_time, req.seq)


class PriorityPolicy:
    """A heap on (priority, arrival_time, seq). A preempted request keeps its key, so it resumes
    ahead of everything that ranks below it."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (req for _, req in sorted(self._heap, key=lambda e: e[0]))

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (priority_key(req), req))

    push_preempted = push

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[1] is not req]
        heapq.heapify(self._heap)

    def add_running(self, running: list[Request], req: Request) -> None:
        bisect.insort(running, req, key=priority_key)


def make_policy(name: str) -> FcfsPolicy | PriorityPolicy:
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityPolicy()
    raise ValueError(f"unknown scheduling policy {name!r}: choose fcfs or priority")
