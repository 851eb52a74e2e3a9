"""Reliability and security of `pagedserve launch` (the embedded default model on CPU): bad input
(hand-written and schemathesis fuzzing of the server's own OpenAPI spec), overload, a soak test
for leaks, a stuck worker, the API key on every route, prompts kept out of logs, private ipc.

Three servers are shared by the module (started together, so their start-ups overlap):
- `open`: no API key, room for many requests (bad input, fuzzing, soak);
- `guarded`: an API key, `--max-num-seqs 4 --max-waiting 8` (overload), `--log-level debug`;
- `stuck`: `--step-timeout 3`, for the stuck worker's test (which ends it).
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import random
import re
import signal
import stat
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from ipc_fuzz import anything, client_message, frames, worker_message
from test_cli import child_pids, stream_in_background, wait_exit
from test_server import Launched, assert_error

from pagedserve.frontend.openai.middleware import ServerMiddleware

from proctools import descendants, wait_gone

API_KEY = "sk-reliability-7"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 128
BASE = ["--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--max-model-len", "128"]
SECRET_PROMPT = "zebra quasar marmalade 7731"  # must never reach a log by default
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("reliability")
    both = {
        # A small KV cache: warm-up touches all of it, so its pages don't count as growth.
        "open": Launched(
            [*BASE, "--max-num-seqs", "32", "--kv-cache-memory", "8M"], str(logs / "open.log")
        ),
        "guarded": Launched(
            [*BASE, "--api-key", API_KEY, "--max-num-seqs", "4", "--max-waiting", "8",
             "--log-level", "debug"],
            str(logs / "guarded.log"),
        ),
        # test_stuck_worker_trips_the_step_timeout's, which ends it (exit code 1)
        "stuck": Launched([*BASE, "--step-timeout", "3"], str(logs / "stuck.log")),
    }  # fmt: skip
    try:
        urls = {name: launched.wait_ready() for name, launched in both.items()}
        yield SimpleNamespace(urls=urls, launched=both)
    finally:
        for name, launched in both.items():
            rc = launched.stop()
            assert rc == 0 or name == "stuck", f"{name}:\n{launched.output()}"


@pytest.fixture(scope="module")
def url(servers: SimpleNamespace) -> str:
    return servers.urls["open"]


@pytest.fixture(scope="module")
def guarded(servers: SimpleNamespace) -> str:
    return servers.urls["guarded"]


def metrics(url: str) -> dict[str, float]:
    """`name` -> value from /metrics (labels dropped; one model, so names are unique enough)."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[re.sub(r"\{[^}]*\}", "", key)] = float(value)
    return out


# ---------------------------------------------------------------------- bad input
COMPLETION = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
RAW_BAD = [  # (id, path, raw body)
    ("malformed", "/v1/completions", b'{"prompt": "Hello", '),
    ("nan-temperature", "/v1/completions", b'{"prompt": "Hi", "temperature": NaN}'),
    ("inf-top_p", "/v1/completions", b'{"prompt": "Hi", "top_p": Infinity}'),
    ("nan-penalty", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "Hi"}], "presence_penalty": NaN}'),
    ("nan-logit_bias", "/v1/completions", b'{"prompt": "Hi", "logit_bias": {"5": NaN}}'),
    ("invalid-utf8", "/v1/completions", b'{"prompt": "\xff\xfe\xc3\x28"}'),
    ("nested-lists", "/v1/completions", b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}"),
    ("nested-dicts", "/v1/completions", b'{"a":' * 10000 + b"1" + b"}" * 10000),
    ("not-an-object", "/v1/completions", b'"just a string"'),
    ("empty-body", "/v1/completions", b""),
]  # fmt: skip
JSON_BAD = [  # (id, path, body): each a 400
    ("wrong-type", "/v1/completions", COMPLETION | {"max_tokens": "many"}),
    ("wrong-type-stream", "/v1/completions", COMPLETION | {"stream": {"yes": 1}}),
    ("huge-n", "/v1/completions", COMPLETION | {"n": 129}),
    ("enormous-n", "/v1/completions", COMPLETION | {"n": 10**30}),
    ("huge-max_tokens", "/v1/completions", COMPLETION | {"max_tokens": MAX_MODEL_LEN}),
    ("enormous-max_tokens", "/v1/completions", COMPLETION | {"max_tokens": 10**30}),
    ("negative-temperature", "/v1/completions", COMPLETION | {"temperature": -0.5}),
    ("negative-top_p", "/v1/completions", COMPLETION | {"top_p": -1}),
    ("negative-max_tokens", "/v1/completions", COMPLETION | {"max_tokens": -3}),
    ("huge-float", "/v1/completions", COMPLETION | {"frequency_penalty": 1e308}),
    ("enormous-seed", "/v1/completions", COMPLETION | {"seed": 2**70}),
    ("seed-plus-n", "/v1/completions", COMPLETION | {"seed": 2**63 - 1, "n": 2}),
    ("enormous-top_k", "/v1/completions", COMPLETION | {"top_k": 2**40}),
    ("enormous-priority", "/v1/completions", COMPLETION | {"priority": 2**70}),
    ("enormous-stop-id", "/v1/completions", COMPLETION | {"stop_token_ids": [2**70]}),
    ("oov-token", "/v1/completions", COMPLETION | {"prompt": [5, 4096]}),
    ("negative-token", "/v1/completions", COMPLETION | {"prompt": [-7]}),
    ("enormous-token", "/v1/completions", COMPLETION | {"prompt": [[1, 2**70]]}),
    ("too-many-choices", "/v1/completions", COMPLETION | {"prompt": [[5]] * 100, "n": 100}),
    ("unknown-role", "/v1/chat/completions", CHAT | {"messages": [{"role": "wizard",
                                                                    "content": "Hi"}]}),
    ("role-type", "/v1/chat/completions", CHAT | {"messages": [{"role": 5, "content": "Hi"}]}),
    ("template-kwargs", "/v1/chat/completions", CHAT | {"chat_template_kwargs": {"tokenize": 1}}),
    ("tokenize-role", "/tokenize", {"messages": [{"role": "wizard", "content": "Hi"}]}),
    ("detokenize-oov", "/detokenize", {"tokens": [2**70]}),
]  # fmt: skip


@pytest.mark.parametrize("path,body", [c[1:] for c in RAW_BAD], ids=[c[0] for c in RAW_BAD])
def test_raw_bad_bodies_are_400(url: str, path: str, body: bytes) -> None:
    headers = {"content-type": "application/json"}
    assert_error(httpx.post(url + path, content=body, headers=headers, timeout=30), 400)


@pytest.mark.parametrize("path,body", [c[1:] for c in JSON_BAD], ids=[c[0] for c in JSON_BAD])
def test_bad_values_are_400(url: str, path: str, body: dict) -> None:
    for stream in (False, True) if path.startswith("/v1") and "stream" not in body else (False,):
        r = httpx.post(url + path, json=body | ({"stream": True} if stream else {}), timeout=30)
        assert assert_error(r, 400)["type"] == "invalid_request_error"


def test_huge_bodies_are_413(url: str) -> None:
    big = json.dumps({"prompt": "a" * (10 << 20), "max_tokens": 1}).encode()
    headers = {"content-type": "application/json"}
    r = httpx.post(url + "/v1/completions", content=big, headers=headers, timeout=60)
    assert assert_error(r, 413)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit holds while reading
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    r = httpx.post(url + "/v1/completions", content=chunked(), headers=headers, timeout=60)
    assert_error(r, 413)
    assert httpx.get(url + "/health").status_code == 200


def test_unknown_fields_are_ignored(url: str) -> None:
    body = COMPLETION | {"no_such_field": {"x": [1, 2]}, "another": None}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    body = CHAT | {"messages": [{"role": "user", "content": "Hi", "extra": 1}], "zzz": True}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


def check_response(response) -> None:
    """No 5xx; every 4xx in OpenAI's error shape (Anthropic's under /v1/messages)."""
    status = response.status_code
    assert status < 500, (status, response.text[:500])
    if status >= 400:
        body = response.json()
        error = body["error"]
        if is_anthropic(response.request.url):
            assert body["type"] == "error" and set(error) == {"message", "type"}, body
        else:
            assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]


def is_anthropic(url) -> bool:
    """/v1/messages answers errors in Anthropic's shape: {"type": "error", "error": {type,
    message}}."""
    return str(httpx.URL(str(url)).path).startswith("/v1/messages")


def bound_cost(case) -> None:
    """Keep each generated request cheap (the fuzzer may ask for 128 choices of 128 tokens):
    valid-looking sizes are clamped, anything of another type is left for the server to refuse."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        del body["model"]  # a random name is only ever a 404: let the request go deeper
    for key, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
        value = body.get(key)
        if value is None or (
            isinstance(value, int) and not isinstance(value, bool) and value > cap
        ):
            body[key] = cap
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 4:
        body["prompt"] = prompt[:4]


def test_fuzz_openapi(url: str) -> None:
    """schemathesis: valid and invalid requests generated from /openapi.json."""
    import schemathesis  # the test extra: missing fails, never skips
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 7  # models, completions, chat, health, version, metrics, tokenize...
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    for operation in operations:
        for mode in modes if len(operation.body) else modes[:1]:  # nothing to break in a GET

            @settings(
                max_examples=15, deadline=None, database=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
            )  # fmt: skip
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case) -> None:
                bound_cost(case)
                check_response(case.call(base_url=url, timeout=60))

            fuzz()
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=60).status_code == 200


# ---------------------------------------------------------------------- overload
def test_burst_refuses_beyond_the_queue(guarded: str) -> None:
    """10x capacity at once (4 running + 8 waiting, 120 requests): the rest get 503 with
    Retry-After at once, every admitted request completes, /health answers fast throughout."""
    latencies: list[float] = []
    done = threading.Event()

    def poll_health() -> None:
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(guarded + "/health", timeout=5).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(headers=AUTH, timeout=120, limits=limits) as client:
            body = {"prompt": "Tell me", "max_tokens": 12, "ignore_eos": True}
            calls = [client.post(guarded + "/v1/completions", json=body) for _ in range(120)]
            return await asyncio.gather(*calls)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        responses = asyncio.run(burst())
    finally:
        done.set()
        poller.join()
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    # At least a full queue is admitted (how many more depends on how arrivals meet steps).
    assert len(ok) >= 8 and refused, (len(ok), len(refused))
    for r in refused:
        assert assert_error(r, 503)["code"] == "server_overloaded"
        assert r.headers["retry-after"] == "1"
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 12
    assert latencies and max(latencies) < 1.0, max(latencies)


# ---------------------------------------------------------------------- leaks
# The worker's RSS climbs for the first ~2000 requests of varied batch shapes (torch's per-shape
# CPU caches, oneDNN's primitive cache among them, which are bounded) and then flattens: the
# growth is measured over the 2000 requests after that warm-up.
SOAK_REQUESTS = 4000
SOAK_WARMUP = 2000
WORDS = ["the", "a", "cat", "dog", "runs", "over", "bright", "quiet", "river", "stone", "light"]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def process_rss(launched: Launched) -> dict[str, int]:
    names = child_pids(launched) | {"launch": launched.proc.pid}
    return {name: rss_kb(pid) for name, pid in names.items()}


async def soak_one(client: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    """One random request; returns what happened to it."""
    words = rng.choices(WORDS, k=rng.randint(1, 40))
    body = {"prompt": " ".join(words), "max_tokens": rng.randint(1, 2), "temperature": 1.0}
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS), " a"]
    if rng.random() < 0.1:
        body["n"] = 2
    kind = rng.choice(["plain", "stream", "stream-disconnect", "disconnect"])
    if kind == "disconnect":  # the client gives up before the answer: the server aborts
        body["max_tokens"] = 48
        try:
            await client.post(url + "/v1/completions", json=body, timeout=rng.uniform(0.01, 0.2))
        except httpx.TimeoutException:
            return "aborted"
        return "finished"
    if kind.startswith("stream"):
        body["stream"] = True
        leave_after = None
        if kind == "stream-disconnect":  # leaves mid-stream: the server aborts
            body["max_tokens"], leave_after = 8, rng.randint(1, 3)
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if leave_after is not None and n >= leave_after:
                    return "aborted"
        return "finished"
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return "finished"


async def soak(url: str, num: int, seed: int, concurrency: int = 16) -> dict[str, int]:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    queue = list(range(num))
    async with httpx.AsyncClient(timeout=60) as client:

        async def worker() -> None:
            while queue:
                queue.pop()
                outcome = await soak_one(client, url, rng)
                counts[outcome] = counts.get(outcome, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


def wait_idle(url: str, timeout: float = 15) -> dict[str, float]:
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
             "num_requests_unfinished", "api_server_requests_tracked")  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = {n: m[f"pagedserve:{n}"] for n in names if m[f"pagedserve:{n}"] != 0}
        if not busy:
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {busy}"
        time.sleep(0.2)


def test_soak_leaves_nothing_behind(servers: SimpleNamespace, url: str) -> None:
    """Thousands of short requests with random disconnects, aborts, stop strings and n=2: the
    scheduler and API server end with nothing tracked and no KV block in use, and no process
    grows by more than 150 MB between a warm-up point and the end."""
    launched = servers.launched["open"]
    asyncio.run(soak(url, SOAK_WARMUP, seed=1))
    wait_idle(url)
    before = process_rss(launched)
    counts = asyncio.run(soak(url, SOAK_REQUESTS - SOAK_WARMUP, seed=2))
    assert counts.get("aborted", 0) > 100 and counts["finished"] > 500, counts
    wait_idle(url)
    after = process_rss(launched)
    grown = {name: (after[name] - before[name]) // 1024 for name in before}
    assert all(mb < 150 for mb in grown.values()), (grown, before, after)
    assert set(before) >= {"launch", "API server 0", "EngineCore", "worker 0"}


# ---------------------------------------------------------------------- stuck worker
def test_stuck_worker_trips_the_step_timeout(servers: SimpleNamespace) -> None:
    launched, url = servers.launched["stuck"], servers.urls["stuck"]
    try:
        pids = descendants(launched.proc.pid)
        worker = child_pids(launched)["worker 0"]
        events, thread = stream_in_background(url, 120)
        os.kill(worker, signal.SIGSTOP)
        seconds = wait_exit(launched, 20)
        thread.join(10)
    finally:
        rc = launched.stop()
    output = launched.output()
    assert rc == 1 and seconds < 12, (seconds, output)
    assert re.search(
        rf"error: EngineCore \(pid \d+\) exited with code 1 \(step \d+ .* got no result from "
        rf"the workers in [\d.]+ s \(--step-timeout 3\); worker 0 \(pid {worker}\) is stopped\)",
        output,
    ), output
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-2:]
    assert wait_gone(pids, 10) == []


# ---------------------------------------------------------------------- auth and exposure
def test_every_route_needs_the_key(guarded: str) -> None:
    """With --api-key, only /health answers without it (nothing else does: /metrics, /version,
    /docs, /openapi.json and unknown paths included). The key is compared in constant time."""
    spec = httpx.get(guarded + "/openapi.json", headers=AUTH).json()
    routes = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/nowhere")]
    assert {("POST", "/tokenize"), ("GET", "/version"), ("GET", "/metrics")} <= set(routes)
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}):
            r = httpx.request(method, guarded + path, headers=headers, json={})
            if path == "/health":
                assert r.status_code == 200, (method, path)
            elif is_anthropic(guarded + path):
                assert r.status_code == 401, (method, path)
                assert r.json()["error"]["type"] == "authentication_error", (method, path)
            else:
                assert assert_error(r, 401)["code"] == "invalid_api_key", (method, path)
    assert httpx.get(guarded + "/version", headers=AUTH).status_code == 200
    import inspect

    assert "hmac.compare_digest(" in inspect.getsource(ServerMiddleware)


def test_prompts_stay_out_of_logs(servers: SimpleNamespace, guarded: str) -> None:
    """At --log-level debug the guarded server logs requests but never their text (the opt-in
    --log-requests is checked in test_drain.py)."""
    body = {"prompt": SECRET_PROMPT, "max_tokens": 2}
    assert httpx.post(guarded + "/v1/completions", json=body, headers=AUTH).status_code == 200
    chat = {"messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 2}
    assert httpx.post(guarded + "/v1/chat/completions", json=chat, headers=AUTH).status_code == 200
    bad = {"prompt": SECRET_PROMPT, "max_tokens": 10**6}
    assert_error(httpx.post(guarded + "/v1/completions", json=bad, headers=AUTH), 400)
    output = servers.launched["guarded"].output()
    assert "POST /v1/completions" in output  # debug logging is on
    assert SECRET_PROMPT not in output and "zebra" not in output


def listening_tcp_ports(pid: int) -> set[tuple[str, int]]:
    """(hex address, port) of the TCP sockets `pid` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    host, port = address.split(":")
                    found.add((host, int(port, 16)))
    return found


def test_ipc_is_private_and_typed(servers: SimpleNamespace, guarded: str, tmp_path) -> None:
    """ipc sockets live in a 0700 directory; no process but the HTTP listener has a TCP port;
    a pickle sent to the EngineCore's input socket is dropped, not unpickled, and the engine
    keeps serving."""
    launched = servers.launched["guarded"]
    names = child_pids(launched)
    with open(f"/proc/{names['API server 0']}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    directory = argv[argv.index("--ipc-dir") + 1]
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(os.path.join(directory, "input")).st_mode)
    http_port = int(guarded.rsplit(":", 1)[1])
    for name, pid in [*names.items(), ("launch", launched.proc.pid)]:
        ports = {port for _, port in listening_tcp_ports(pid)}
        assert ports <= {http_port}, (name, ports)

    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"ipc://{directory}/input")
    sock.send(pickle.dumps(Exploit()))
    sock.send(b"\x93\xff\x00garbage")
    sock.close()
    ctx.term()
    r = httpx.post(guarded + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=60)
    assert r.status_code == 200 and not marker.exists()
    assert "dropped a frame that is not a valid message" in launched.output()


def test_no_pickle_on_the_wire() -> None:
    """No module that talks to another process imports pickle or multiprocessing, or uses
    pyzmq's pickling helpers (send_pyobj / recv_pyobj)."""
    banned = re.compile(
        r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|multiprocessing)\b"
        r"|\b(send_pyobj|recv_pyobj)\b",
        re.MULTILINE,
    )
    checked = 0
    for sub in ("ipc", "frontend", "core", "worker", "parallel"):
        for root, _, files in os.walk(os.path.join(PACKAGE, sub)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(root, name)) as f:
                        hit = banned.search(f.read())
                    assert hit is None, f"{sub}/{name}: {hit.group(0)!r}"
                    checked += 1
    assert checked > 20


# ---------------------------------------------------------------------- the core's own sockets
def test_fuzz_core_sockets(servers: SimpleNamespace, url: str) -> None:
    """Hostile frames (tests/ipc_fuzz.py) on each of the EngineCore's sockets: client input,
    worker results, and the plan broadcast (a subscriber sending junk and never reading), while
    a normal client keeps being served and /health stays 200."""
    launched = servers.launched["open"]
    with open(f"/proc/{child_pids(launched)['API server 0']}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    directory = argv[argv.index("--ipc-dir") + 1]
    statuses: list[int] = []
    stop = threading.Event()

    def serve_normally() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                statuses.append(client.get("/health").status_code)
                statuses.append(client.post("/v1/completions", json=COMPLETION).status_code)

    ctx = zmq.Context()
    sockets = {name: ctx.socket(zmq.PUSH) for name in ("input", "results")}
    sockets["plans"] = ctx.socket(zmq.XSUB)  # sends (un)subscriptions and junk, reads nothing
    for name, sock in sockets.items():
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"ipc://{directory}/{name}")
    normal = threading.Thread(target=serve_normally)
    normal.start()
    quick = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))  # fmt: skip
    try:
        for name, messages in [("input", client_message(directory)), ("results", worker_message(1)),
                               ("plans", anything.map(lambda x: [x]))]:  # fmt: skip

            @quick
            @given(frame=frames(messages))
            def fuzz(frame: bytes) -> None:
                sockets[name].send(frame)  # noqa: B023 (called right here)

            fuzz()
        time.sleep(1.0)  # the last frames reach the core
    finally:
        stop.set()
        normal.join(timeout=60)
        for sock in sockets.values():
            sock.close()
        ctx.term()
    assert statuses and set(statuses) == {200}, statuses
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    output = launched.output()
    for dropped in ("not a valid message", "refused request", "fits no plan"):
        assert dropped in output, dropped
