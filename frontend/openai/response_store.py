"""The Responses API's stored responses: a bounded in-memory LRU with an age limit.

`store: true` (OpenAI's default) keeps a response's body, for `GET /v1/responses/{id}`, and its
conversation as chat messages (instructions left out, as OpenAI does), which a request naming it
as `previous_response_id` continues: the same messages render to the same prompt prefix, so the
prefix cache hits. The store holds at most `max_entries` responses (`--responses-store-size`),
each for at most `max_age_s` seconds since it was last used (`--responses-store-max-age`); the
least recently used leaves first. It is one API server's memory: with `--api-servers N` a
response lives on the server that made it.

A running response (stored or not) has a `cancel` event that `POST /v1/responses/{id}/cancel`
sets; the request stops (and frees its KV blocks) and ends with status `cancelled`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_AGE_S = 3600.0


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the Response object as GET returns it
    messages: list[dict[str, Any]]  # the conversation so far, as chat messages
    used: float = field(default_factory=time.monotonic)


class ResponseStore:
    def __init__(
        self, max_entries: int = DEFAULT_MAX_ENTRIES, max_age_s: float = DEFAULT_MAX_AGE_S
    ) -> None:
        assert max_entries >= 0 and max_age_s > 0
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.running: dict[str, asyncio.Event] = {}  # response id -> its cancel event

    def put(self, resp_id: str, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._entries[resp_id] = StoredResponse(body, messages)
        self._entries.move_to_end(resp_id)
        self._expire()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, resp_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(resp_id)
        if entry is not None:
            entry.used = time.monotonic()
            self._entries.move_to_end(resp_id)
        return entry

    def delete(self, resp_id: str) -> bool:
        return self._entries.pop(resp_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        """Drop entries unused for max_age_s (the oldest-used come first)."""
        limit = time.monotonic() - self.max_age_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.used >= limit:
                break
            self._entries.popitem(last=False)
