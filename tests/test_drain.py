"""Graceful drain: SIGTERM to `pagedserve launch` while streams are open lets them finish.

During the drain each API server still accepts connections but answers 503 (OpenAI's error shape)
to /health and to every new request; once its running requests are done it exits and the listener
closes, so a client then sees "connection refused". launch exits 0 and leaves no process behind.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from test_server import Launched, assert_error

from proctools import descendants, wait_gone

DEFAULT_MODEL_ARGS = ["--host", "127.0.0.1", "--port", "0", "--device", "cpu"]
NUM_STREAMS = 3
MAX_TOKENS = 150


def read_events(url: str, body: dict, started: threading.Event, out: list) -> None:
    """Collect a stream's SSE payloads into `out` (JSON objects, then "[DONE]")."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                payload = line[6:]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
                started.set()


def start_streams(url: str, n: int, max_tokens: int) -> tuple[list, list[threading.Thread]]:
    """`n` streamed completions, each running (first chunk received) when this returns."""
    results: list[list] = [[] for _ in range(n)]
    threads = []
    for i in range(n):
        body = {"prompt": f"Stream number {i} says", "max_tokens": max_tokens, "stream": True,
                "logprobs": 0}  # fmt: skip
        started = threading.Event()
        t = threading.Thread(target=read_events, args=(url, body | {"ignore_eos": True}, started,
                             results[i]), daemon=True)  # fmt: skip
        t.start()
        threads.append(t)
        assert started.wait(60), f"stream {i} did not start"
    return results, threads


def test_sigterm_drains_open_streams(tmp_path) -> None:
    # --log-requests: the prompts then appear in the log (their absence by default is checked in
    # test_reliability.py), which saves starting another server for that check.
    args = [*DEFAULT_MODEL_ARGS, "--max-model-len", "512", "--log-requests"]
    launched = Launched(args, str(tmp_path / "launch.log"))
    try:
        url = launched.wait_ready()
        pids = descendants(launched.proc.pid)
        assert len(pids) >= 3  # API server, EngineCore, worker
        results, threads = start_streams(url, NUM_STREAMS, MAX_TOKENS)
        launched.proc.send_signal(signal.SIGTERM)
        seen = poll_while_draining(url, threads)
        for t in threads:
            t.join(120)
        rc = launched.proc.wait(60)
    finally:
        launched.stop()
    output = launched.output()
    assert rc == 0, output
    assert "SIGTERM received" in output and "draining" in output
    assert 503 in seen, seen  # /health said 503 at least once while the streams ran
    draining = seen[seen.index(503) :]  # (the launcher may take a moment to pass SIGTERM on)
    assert set(draining) <= {503, "refused"}, seen
    for events in results:
        assert events[0] == 200 and events[-1] == "[DONE]", events[-3:]
        chunks = events[1:-1]
        assert all("error" not in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # every token came (a chunk holds one, or several when the reader fell behind)
        assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == MAX_TOKENS
    assert wait_gone(pids, 10) == []
    assert "Stream number 0 says" in output  # --log-requests


def poll_while_draining(url: str, threads: list[threading.Thread]) -> list:
    """/health, and a new request once /health says 503, polled until the streams end: 503
    each (or refused once the listener closed). Returns what /health answered."""
    seen: list = []
    while any(t.is_alive() for t in threads):
        try:
            health = httpx.get(url + "/health", timeout=5)
            seen.append(health.status_code)
            if health.status_code == 503:
                assert assert_error(health, 503)["code"] == "server_draining"
                body = {"prompt": "late", "max_tokens": 2}
                late = httpx.post(url + "/v1/completions", json=body, timeout=5)
                assert assert_error(late, 503)["code"] == "server_draining"
        except httpx.TransportError:  # refused or reset: the drained server closed its listener
            seen.append("refused")
        time.sleep(0.2)
    return seen
