"""No client can stall the server's connections or read another tenant's prompts (issue 33,
findings 7 and 11), through real `pagedserve launch` processes (the embedded model on CPU):

- `tight`: an API server with 256 file descriptors (`ulimit -n`, so --max-connections drops to
  128 by itself), 2 s header and body deadlines, `--cache-salt-by api-key`, no API key, no
  `--enable-prompt-tokens-details`;
- `tenants`: an API key, `--enable-prompt-tokens-details`, `--cache-salt-by user`,
  `--max-connections 8`.

Both start together (module scope), so their start-ups overlap.
"""

from __future__ import annotations

import json
import resource
import select
import selectors
import socket
import threading
import time
from types import SimpleNamespace
from urllib.parse import urlparse

import httpx
import pytest
from test_server import Launched, assert_error

DEADLINE_S = 2.0
NOFILE = 256
API_KEY = "sk-tenants-3"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BASE = ["--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--max-model-len", "512"]
BASE += ["--kv-cache-memory", "16M"]
# Four full 16-token blocks and more on the embedded model's tokenizer: a "secret" to guess.
SECRET = "def transfer(account_id, amount):\n    token = 'zq-7731-marmalade-quasar'\n" * 3


def _few_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("hardening")
    deadlines = ["--timeout-header", str(DEADLINE_S), "--timeout-body", str(DEADLINE_S)]
    both = {
        "tight": Launched(
            [*BASE, *deadlines, "--cache-salt-by", "api-key"], str(logs / "tight.log"),
            preexec_fn=_few_descriptors,
        ),
        "tenants": Launched(
            [*BASE, "--api-key", API_KEY, "--enable-prompt-tokens-details",
             "--cache-salt-by", "user", "--max-connections", "8"],
            str(logs / "tenants.log"),
        ),
    }  # fmt: skip
    try:
        yield SimpleNamespace(**{name: launched.wait_ready() for name, launched in both.items()})
    finally:
        for name, launched in both.items():
            assert launched.stop() == 0, f"{name}:\n{launched.output()}"


def _connect(url: str) -> socket.socket:
    parts = urlparse(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def _until_closed(
    socks: list[socket.socket], t0: float, timeout: float
) -> list[tuple[float, bytes]]:
    """For each socket: seconds from `t0` until the server closed it, and what it sent before."""
    out: dict[int, tuple[float, bytes]] = {}
    data = {i: b"" for i in range(len(socks))}
    with selectors.DefaultSelector() as sel:
        for i, s in enumerate(socks):
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, i)
        while len(out) < len(socks):
            left = t0 + timeout - time.monotonic()
            assert left > 0, f"still open after {timeout} s: {sorted(set(data) - set(out))}"
            for key, _ in sel.select(left):
                i = key.data
                try:
                    chunk = socks[i].recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    data[i] += chunk
                else:
                    out[i] = (time.monotonic() - t0, data[i])
                    sel.unregister(socks[i])
    return [out[i] for i in range(len(socks))]


def _health_ms(url: str) -> float:
    t0 = time.monotonic()
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    return (time.monotonic() - t0) * 1e3


# ---------------------------------------------------------------------- finding 7: connections
POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_stalled_connections_are_closed_at_their_deadline(servers: SimpleNamespace) -> None:
    """A connection that sends nothing, half a head, a head dripped a byte at a time, or half a
    body is closed by the server at its deadline (total, not idle: the drip keeps sending); the
    ones whose request began get a 408 naming the flag. /health answers all the while."""
    url = servers.tight
    t0 = time.monotonic()
    idle, half_head, drip, half_body = (_connect(url) for _ in range(4))
    half_head.sendall(POST_HEAD[:30])
    half_body.sendall(POST_HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "a')
    stop = threading.Event()

    def dripping() -> None:
        for byte in POST_HEAD:
            if stop.wait(0.2) or select.select([drip], [], [], 0)[0]:
                return  # (once the server answered: more bytes would reset the connection)
            try:
                drip.send(bytes([byte]))
            except OSError:
                return

    thread = threading.Thread(target=dripping)
    thread.start()
    waits = [_health_ms(url)]
    try:
        results = _until_closed([idle, half_head, drip, half_body], t0, DEADLINE_S + 8)
    finally:
        stop.set()
        thread.join()
    waits.append(_health_ms(url))
    print(f"\nclosed after {[round(t, 2) for t, _ in results]} s; /health {waits} ms")
    for elapsed, _ in results:
        assert DEADLINE_S * 0.8 <= elapsed <= DEADLINE_S + 4, results
    assert results[0][1] == b"", "no request began: closed without an answer"
    for (_, sent), flag in zip(results[1:], ["header", "header", "body"], strict=True):
        head, _, body = sent.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), sent
        error = json.loads(body)["error"]
        assert f"--timeout-{flag}" in error["message"] and error["code"] == "timeout", error


def test_a_connection_flood_leaves_health_answering(servers: SimpleNamespace) -> None:
    """600 idle connections kept open (reopened as the server closes them) against an API server
    of 256 descriptors: without a limit they take every descriptor and /health cannot even be
    accepted. The server closes the oldest idle connections instead, and /health stays fast."""
    url = servers.tight
    stop = threading.Event()
    opened: list[int | BaseException] = [0]

    def closed(s: socket.socket) -> bool:
        try:
            return s.recv(1) == b""
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True

    def flood() -> None:
        socks = [_connect(url) for _ in range(600)]
        opened[0] = len(socks)
        while not stop.is_set():
            for i, s in enumerate(socks):
                s.setblocking(False)
                if closed(s):  # by the server: open another
                    s.close()
                    socks[i] = _connect(url)
                    opened[0] += 1
            stop.wait(0.05)
        for s in socks:
            s.close()

    def flood_or_fail() -> None:
        try:
            flood()
        except Exception as e:
            opened[0] = e

    thread = threading.Thread(target=flood_or_fail)
    thread.start()
    try:
        while isinstance(opened[0], int) and opened[0] < 600:
            time.sleep(0.05)
        waits = []
        end = time.monotonic() + 2 * DEADLINE_S
        while time.monotonic() < end:
            waits.append(_health_ms(url))
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join()
    assert isinstance(opened[0], int), f"the flood failed: {opened[0]!r}"
    print(f"\nflood: {opened[0]} connections opened; /health worst {max(waits):.0f} ms")
    assert max(waits) < 2000, waits


def test_over_the_limit_only_health_answers(servers: SimpleNamespace) -> None:
    """--max-connections 8, all 8 busy sending a body (nothing idle to close): a 9th connection
    gets /health and a 503 for everything else; once they end, requests pass again."""
    url = servers.tenants
    head = POST_HEAD + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n".encode()
    busy = [_connect(url) for _ in range(8)]
    try:
        for s in busy:
            s.sendall(head + b'{"prompt": ')
        time.sleep(0.3)  # the server has read their heads
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        r = httpx.get(url + "/v1/models", headers=AUTH, timeout=5)
        assert assert_error(r, 503)["code"] == "too_many_connections"
        assert r.headers["connection"] == "close" and r.headers["retry-after"] == "1"
    finally:
        for s in busy:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(url + "/v1/models", headers=AUTH, timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "still refused after the busy connections closed"
        time.sleep(0.1)


# ---------------------------------------------------------------------- finding 11: tenants
def _cached(url: str, path: str, **fields: object) -> int:
    """The cached tokens the server reports for SECRET (as a completion or a chat message)."""
    body: dict = {"max_tokens": 1, **fields}
    if path == "/v1/completions":
        body["prompt"] = SECRET
    else:
        body["messages"] = [{"role": "user", "content": SECRET}]
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_guess_with_another_salt_gets_no_cached_tokens(servers, path: str) -> None:
    url = servers.tenants
    salt = f"victim-{path}"
    _cached(url, path, cache_salt=salt)  # the victim's prompt, now cached under its salt
    assert _cached(url, path, cache_salt="attacker") == 0
    assert _cached(url, path) == 0  # no salt at all
    assert _cached(url, path, cache_salt=salt) >= 64  # the victim's next turn still hits


def test_salting_by_user(servers: SimpleNamespace) -> None:
    """--cache-salt-by user: each `user` shares cached blocks with itself only; a request's own
    cache_salt partitions further inside its user."""
    url, path = servers.tenants, "/v1/completions"
    _cached(url, path, user="alice")
    assert _cached(url, path, user="bob") == 0
    assert _cached(url, path, user="alice", cache_salt="project-x") == 0
    assert _cached(url, path, user="alice") >= 64


@pytest.mark.parametrize("salt", ["", 12345, "\ud800", "x" * 1025])
def test_bad_cache_salts_are_400(servers: SimpleNamespace, salt: object) -> None:
    body = json.dumps({"prompt": "a", "max_tokens": 1, "cache_salt": salt})  # "\ud800" escaped
    headers = AUTH | {"Content-Type": "application/json"}
    r = httpx.post(servers.tenants + "/v1/completions", content=body, headers=headers, timeout=30)
    assert assert_error(r, 400)["param"] == "cache_salt"


def _prefix_hits(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pagedserve:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no prefix_cache_hits_total")


def test_salting_by_api_key_and_no_cached_tokens_without_the_flag(servers) -> None:
    """`tight` reports no cached tokens (no --enable-prompt-tokens-details), so the prefix-cache
    hits are read from its (open: no API key there) /metrics. --cache-salt-by api-key: another
    bearer token finds nothing of the first one's prompt."""
    url = servers.tight

    def send(token: str, stream: bool = False) -> dict:
        body = {"prompt": SECRET, "max_tokens": 1, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"Authorization": f"Bearer {token}"}
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            events = [e for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
            return json.loads(events[-1].removeprefix("data: "))["usage"]
        return r.json()["usage"]

    def hits_of(token: str) -> float:
        before = _prefix_hits(url)
        usage = send(token)
        assert "prompt_tokens_details" not in usage, usage
        time.sleep(0.2)  # the stats of the step that served it reach /metrics
        return _prefix_hits(url) - before

    send("tenant-a")
    assert hits_of("tenant-b") == 0
    assert hits_of("tenant-a") >= 64
    assert "prompt_tokens_details" not in send("tenant-a", stream=True)


def test_metrics_need_the_key(servers: SimpleNamespace) -> None:
    """/metrics counts prefix-cache hits, so it is behind the API key (without
    --metrics-public); /health stays open."""
    url = servers.tenants
    assert assert_error(httpx.get(url + "/metrics"), 401)["code"] == "invalid_api_key"
    assert httpx.get(url + "/metrics", headers=AUTH).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
