"""One client must not stall, starve or hang the API server (issue 33, findings 1, 4, 5, 8, 9):
a stream nobody reads, multi-MB prompts, many long stop strings, strings the ipc cannot encode.

Real `pagedserve launch` processes on the embedded model (CPU). Stalls are measured as the worst
wait of a well-behaved client polling while the bad one runs, with thresholds far above noise
(the old code stalled it for seconds).
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import threading
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest
from test_reliability import metrics, wait_idle
from test_server import Launched, assert_error
from tokenizers import Tokenizer, models, normalizers, trainers

from pagedserve.frontend.detokenizer import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    StopStrings,
)
from pagedserve.frontend.hub import default_model_dir
from pagedserve.frontend.tokenizer import FastTokenizer, max_chars_per_token
from pagedserve.ipc.messages import EngineDead
from pagedserve.ipc.sockets import Receiver, Sender, ipc_address, ipc_dir

MAX_MODEL_LEN = 512
BASE = ["--host", "127.0.0.1", "--port", "0", "--device", "cpu",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32"]  # fmt: skip
STALL_S = 2.5  # the old code held a polling client 5 s or more in each of these tests
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """`plain`: the embedded model; `unbounded`: the same with a tokenizer whose prompt length
    in characters bounds nothing (a Strip normalizer may delete characters), so long prompts
    are tokenized, on a thread."""
    tmp = tmp_path_factory.mktemp("hardening")
    model = str(tmp / "unbounded-model")
    shutil.copytree(default_model_dir(), model)
    with open(f"{model}/tokenizer.json") as f:
        spec = json.load(f)
    spec["normalizer"] = {"type": "Strip", "strip_left": True, "strip_right": True}
    with open(f"{model}/tokenizer.json", "w") as f:
        json.dump(spec, f)
    both = {
        "plain": Launched(BASE, str(tmp / "plain.log")),
        "unbounded": Launched([*BASE, "--model", model], str(tmp / "unbounded.log")),
    }
    try:
        urls = {name: launched.wait_ready() for name, launched in both.items()}
        yield SimpleNamespace(urls=urls, launched=both)
    finally:
        for name, launched in both.items():
            assert launched.stop() == 0, f"{name}:\n{launched.output()}"


@pytest.fixture(scope="module")
def url(servers: SimpleNamespace) -> str:
    return servers.urls["plain"]


class Prober:
    """A well-behaved client on its own thread: GET /v1/models and a 2-token completion in
    turn, recording the longest each took (`worst`: the longest of all)."""

    def __init__(self, url: str) -> None:
        self.url, self.count = url, 0
        self.worst_by = {"models": 0.0, "completion": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def worst(self) -> float:
        return max(self.worst_by.values())

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                for kind, send in (
                    ("models", lambda: client.get("/v1/models")),
                    ("completion", lambda: client.post(
                        "/v1/completions", json={"prompt": "hi", "max_tokens": 2})),
                ):  # fmt: skip
                    start = time.monotonic()
                    assert send().status_code == 200
                    self.worst_by[kind] = max(self.worst_by[kind], time.monotonic() - start)
                    self.count += 1
                time.sleep(0.02)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)


# ---------------------------------------------------------------------- 1: a stream nobody reads
def open_stalled_stream(url: str, body: dict) -> socket.socket:
    """POST a streamed request on a socket with a tiny receive buffer, reading nothing yet."""
    parts = urlsplit(url)
    sock = socket.socket()
    # A small window and segment size: the server's kernel buffers (sized per segment) stay
    # small too, so it soon has to wait for this reader.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((parts.hostname, parts.port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    data = b""
    while not data.endswith(b"0\r\n\r\n"):  # the chunked body's end
        chunk = sock.recv(1 << 16)
        assert chunk, data[-300:]
        data += chunk
    sock.close()
    return data


def wait_engine_idle(url: str, timeout: float = 120) -> None:
    """Until the scheduler has had work and runs nothing more (the API server may still hold
    outputs for a reader)."""
    deadline, seen = time.monotonic() + timeout, False
    while time.monotonic() < deadline:
        m = metrics(url)
        busy = m["pagedserve:num_requests_running"] + m["pagedserve:num_requests_waiting"]
        seen = seen or busy > 0
        if seen and busy == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the engine did not finish the stalled request")


def test_a_stream_nobody_reads_holds_one_pending_output(url: str) -> None:
    """16 choices (two prompts, n=8, so merge_streams too) of 300 tokens streamed to a client that
    reads nothing until the engine is done: the server holds one pending output per request and
    the client then gets the rest merged, in far fewer chunks than the 4,800 tokens (the old code
    queued a full copy of the output per step, quadratic memory, and sent one chunk per token)."""
    n, num_tokens = 8, 300
    body = {"prompt": ["x", "y"], "n": n, "max_tokens": num_tokens, "ignore_eos": True,
            "stream": True, "logprobs": 0}  # fmt: skip
    sock = open_stalled_stream(url, body)
    wait_engine_idle(url)
    events = [
        json.loads(line[6:])
        for line in read_all(sock).decode().splitlines()
        if line.startswith("data: {")
    ]
    tokens: dict[int, int] = {}
    most = 0  # tokens in one chunk
    for event in events:
        for choice in event["choices"]:
            count = len(choice["logprobs"]["tokens"])
            tokens[choice["index"]] = tokens.get(choice["index"], 0) + count
            most = max(most, count)
    assert tokens == {i: num_tokens for i in range(2 * n)}
    assert len(events) < 2 * n * num_tokens / 4 and most > 50, (len(events), most)
    wait_idle(url)


# ---------------------------------------------------------------------- 4: multi-MB prompts
def post_in_background(url: str, path: str, body: dict, out: list) -> threading.Thread:
    def run() -> None:
        out.append(httpx.post(url + path, json=body, timeout=120))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("server", ["plain", "unbounded"])
def test_huge_prompts_do_not_hold_other_clients(servers: SimpleNamespace, server: str) -> None:
    """Two multi-MB prompts (completion and chat) while a client polls: they are 400s naming the
    context length, and the poller's worst wait stays far below the seconds their tokenizing
    takes. The plain server refuses them by their length in characters, without tokenizing; the
    unbounded one tokenizes them on a thread (the old code tokenized on the event loop)."""
    url = servers.urls[server]
    text = "hello world " * 300_000  # 3.6 MB (under the 4 MiB body limit): 2-5 s to tokenize
    answers: list[httpx.Response] = []
    with Prober(url) as prober:
        time.sleep(0.3)
        threads = [
            post_in_background(url, "/v1/completions", {"prompt": text}, answers),
            post_in_background(url, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": text}]}, answers),
        ]  # fmt: skip
        for thread in threads:
            thread.join(120)
        time.sleep(0.3)
    assert prober.count > 4 and prober.worst < STALL_S, (prober.worst_by, prober.count)
    assert len(answers) == 2
    for answer in answers:
        error = assert_error(answer, 400)
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
        assert ("characters" in error["message"]) == (server == "plain"), error


def test_max_chars_per_token_is_a_bound(tmp_path) -> None:
    """The bound holds on random text for byte-level BPE (the embedded model's) and for a
    byte-fallback BPE behind Llama-2's normalizers; none is claimed where characters can vanish."""
    embedded = FastTokenizer.load(default_model_dir())
    assert embedded is not None and max_chars_per_token(embedded) == 64
    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *bytes_])
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20], trainer)
    fallback = FastTokenizer(tk, {}, None)
    rng = random.Random(0)
    pieces = ["a", "b", " ", "  ", "é", "e\u0301", "日本", "😀", "the ", "\n", "ﬁ", "hello"]
    for tokenizer in (embedded, fallback):
        bound = max_chars_per_token(tokenizer)
        assert bound is not None
        for _ in range(200):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 300)))
            assert len(tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text)
    tk.normalizer = normalizers.Strip()  # "   ...   " is no token at all
    assert max_chars_per_token(FastTokenizer(tk, {}, None)) is None


# ---------------------------------------------------------------------- 5, 9: stop strings
def test_stop_strings_are_bounded(url: str) -> None:
    """Beyond the limits, or empty (as vLLM), stop strings are a 400 naming the limit; the old
    code took 4,000 strings of 1,000 characters and scanned each per token per choice."""
    over_count = [f"never-{i}" for i in range(MAX_STOP_STRINGS + 1)]
    too_long = ["y" * (MAX_STOP_STRING_CHARS + 1)]
    cases = [(over_count, str(MAX_STOP_STRINGS)), (too_long, str(MAX_STOP_STRING_CHARS)),
             ([""], "empty"), ("", "empty")]  # fmt: skip
    for stop, words in cases:
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", CHAT)):
            r = httpx.post(url + path, json={**body, "max_tokens": 2, "stop": stop}, timeout=30)
            error = assert_error(r, 400)
            assert error["param"] == "stop" and words in error["message"], error


def test_stop_strings_at_the_limits_do_not_hold_other_clients(url: str) -> None:
    """The most stop strings of the longest length, each ending in a space (so nearly every token
    scans them all) and never matching, on 16 choices of 200 tokens: a polling client's worst wait
    stays low, and every choice runs to its length."""
    body_len = MAX_STOP_STRING_CHARS - 4
    stops = [f"{i:03d}" + "\u2603" * body_len + " " for i in range(MAX_STOP_STRINGS)]
    body = {"prompt": "x", "n": 16, "max_tokens": 200, "ignore_eos": True, "stop": stops}
    answers: list[httpx.Response] = []
    with Prober(url) as prober:
        post_in_background(url, "/v1/completions", body, answers).join(120)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert [c["finish_reason"] for c in answer.json()["choices"]] == ["length"] * 16
    assert prober.count > 4 and prober.worst < STALL_S, (prober.worst_by, prober.count)


def test_stop_strings_match_incrementally() -> None:
    """StopStrings finds what scanning the whole text for every stop string finds: the earliest
    start (the first listed on a tie) among those that end in the new text."""
    rng = random.Random(1)
    for _ in range(2000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(4)]
        include = rng.random() < 0.5
        matcher, text, found = StopStrings(stops, include), "", None
        while found is None and len(text) < 40:
            new = "".join(rng.choice("abcd") for _ in range(rng.randint(1, 3)))
            before, text = text, text + new
            found = matcher.find(text, len(new))
            want = min(
                ((text.find(s), i, s) for i, s in enumerate(stops) if s in text), default=None
            )
            assert not any(s in before for s in stops)
            if want is None:
                assert found is None
            else:
                at, _, stop = want
                assert found == (stop, at + len(stop) if include else at), (stops, text, found)


# ---------------------------------------------------------------------- 8: unencodable strings
SURROGATE = "\ud800"
UNENCODABLE = [  # (id, path, body, param)
    ("stop", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [SURROGATE]}, "stop"),
    ("chat-stop", "/v1/chat/completions", {**CHAT, "stop": "a" + SURROGATE}, "stop"),
    ("prompt", "/v1/completions", {"prompt": "a" + SURROGATE + "b", "max_tokens": 2}, "prompt"),
    ("prompts", "/v1/completions", {"prompt": ["ok", SURROGATE], "max_tokens": 2}, "prompt"),
    ("message", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    ("regex", "/v1/completions", {"prompt": "hi", "max_tokens": 2,
     "structured_outputs": {"regex": "[0-9]" + SURROGATE}}, "structured_outputs"),
    ("choice", "/v1/completions", {"prompt": "hi", "max_tokens": 2,
     "structured_outputs": {"choice": ["yes", SURROGATE]}}, "structured_outputs"),
    ("schema", "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema",
     "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
         SURROGATE: {"type": "string"}}}}}}, "response_format"),
    ("tokenize", "/tokenize", {"prompt": SURROGATE}, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in UNENCODABLE],
                         ids=[c[0] for c in UNENCODABLE])  # fmt: skip
def test_unencodable_strings_are_400(url: str, path: str, body: dict, param: str) -> None:
    """A lone surrogate is valid JSON but not text: a 400 naming the field, in OpenAI's format
    (the old code never answered a stop string holding one, and its state leaked; prompts,
    regexes and choices were 500s), and the server goes on serving with nothing left behind."""
    raw = json.dumps(body).encode()  # ASCII: "\\ud800" stays an escape, as a client sends it
    assert b"\\ud800" in raw
    r = httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"},
                   timeout=20)  # fmt: skip
    error = assert_error(r, 400)
    assert error["param"] == param and "surrogate" in error["message"], error
    ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                   "stop": ["\U0001f600"]}, timeout=30)  # fmt: skip
    assert ok.status_code == 200, ok.text  # a surrogate pair is fine
    wait_idle(url)


def test_the_sender_refuses_what_it_cannot_encode() -> None:
    """Sender.send raises for a message msgpack cannot hold (the old one logged and dropped it
    on its IO thread, and the request behind it waited forever); the next message goes out."""
    directory = ipc_dir()
    try:
        address = ipc_address(directory, "s")
        receiver: Receiver[EngineDead] = Receiver(address, EngineDead, bind=True)
        sender: Sender[EngineDead] = Sender(address, bind=False)
        with pytest.raises(UnicodeEncodeError):
            sender.send(EngineDead(SURROGATE))
        sender.send(EngineDead("fine"))
        assert receiver.get(timeout=10) == EngineDead("fine")
        sender.close()
        receiver.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
