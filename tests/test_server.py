"""The OpenAI-compatible HTTP API end to end: `pagedserve launch` as a real process (two API
servers sharing one port, an API key, a tiny Llama on CPU), driven by the official `openai`
client (sync and async) and raw httpx, checked against `LLM.generate` on the same model."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.frontend.engine_client import start_engine_core
from pagedserve.frontend.llm import build_engine_config
from pagedserve.frontend.openai.protocol import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from pagedserve.ipc.sockets import ipc_dir

from tiny_models import tiny_model_dir

MODEL = "tiny"
API_KEY = "sk-test-123"
MAX_MODEL_LEN = 512
CPU_ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16M"]
PROMPTS = ["Hello, how are", "The quick brown fox", "Once upon a time there was a little town"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
NUM_TOKENS = 16
# Prompts used only by the abort tests (so no other test warms the prefix cache for them).
ABORT_PROMPTS = ["Numbers like one, two, three", "Please write a short poem about the moon"]
LONG = MAX_MODEL_LEN - 16


# ---------------------------------------------------------------------- launching
class Launched:
    """A `pagedserve launch` subprocess whose output goes to a file."""

    def __init__(
        self,
        args: list[str],
        log_path: str,
        command: str = "launch",
        env: dict | None = None,
        preexec_fn: Callable[[], None] | None = None,  # e.g. to lower a resource limit
    ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (outlives this call)
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", command, *args]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec_fn
        )

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 240.0) -> str:
        """The base URL, once every API server accepts connections."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(r"listening on (https?://\S+)", self.output())
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"launch exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        raise AssertionError(f"launch not ready in {timeout} s:\n{self.output()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 40.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                message = f"launch ignored {sig} for {timeout} s:\n{self.output()}"
                raise AssertionError(message) from None
        self._log.close()
        return self.proc.returncode


def launch_args(model_dir: str, *extra: str) -> list[str]:
    return ["--model", model_dir, "--host", "127.0.0.1", "--port", "0", *CPU_ARGS, *extra]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir("llama", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def launched(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    args = launch_args(
        model_dir, "--served-model-name", MODEL, "--api-servers", "2", "--api-key", API_KEY,
        "--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details",
    )  # fmt: skip
    proc = Launched(args, str(tmp_path_factory.mktemp("launch") / "launch.log"))
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def reference(launched: Launched, model_dir: str) -> SimpleNamespace:
    """Greedy outputs of `LLM` on the same model (built while the server starts)."""
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=3)
    with LLM(model_dir, device="cpu", dtype="float32", kv_cache_memory=16 << 20) as llm:
        completions = llm.generate(PROMPTS, greedy)
        chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS))[0]
        long_params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
        long = llm.generate(ABORT_PROMPTS, long_params)
    return SimpleNamespace(completions=completions, chat=chat, long=long)


@pytest.fixture(scope="module")
def url(launched: Launched) -> str:
    return launched.wait_ready()


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(url: str):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        yield c


def metrics(http: httpx.Client) -> dict[str, float]:
    """`name{labels}` -> value, from /metrics (labels other than model_name and the one engine
    core's engine="0" kept)."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        key = key.replace(f'model_name="{MODEL}"', "").replace('engine="0"', "")
        key = re.sub(r",+", ",", key).replace("{,", "{").replace(",}", "}")
        out[key.replace("{}", "")] = float(value)
    return out


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


# ---------------------------------------------------------------------- basic endpoints
def test_models_health_version(client: openai.OpenAI, url: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(url + "/health").status_code == 200  # open without a key
    version = httpx.get(url + "/version", headers={"Authorization": f"Bearer {API_KEY}"})
    assert version.json()["version"]


def test_completions_match_llm(client: openai.OpenAI, reference: SimpleNamespace) -> None:
    for prompt, ref in zip(PROMPTS, reference.completions, strict=True):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0
        )
        assert r.object == "text_completion" and r.model == MODEL
        assert r.choices[0].text == ref.outputs[0].text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == NUM_TOKENS
        assert r.usage.total_tokens == len(ref.prompt_token_ids) + NUM_TOKENS
    batch = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=NUM_TOKENS, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [r.outputs[0].text for r in reference.completions]
    assert batch.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in reference.completions)


def test_token_id_prompts(client: openai.OpenAI, reference: SimpleNamespace) -> None:
    ids = [r.prompt_token_ids for r in reference.completions]
    one = client.completions.create(
        model=MODEL, prompt=ids[0], max_tokens=NUM_TOKENS, temperature=0
    )
    assert one.choices[0].text == reference.completions[0].outputs[0].text
    many = client.completions.create(model=MODEL, prompt=ids, max_tokens=NUM_TOKENS, temperature=0)
    assert [c.text for c in many.choices] == [r.outputs[0].text for r in reference.completions]


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=NUM_TOKENS, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_llm_and_stream(client: openai.OpenAI, reference: SimpleNamespace) -> None:
    kw = dict(model=MODEL, messages=CHAT, max_tokens=NUM_TOKENS, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == reference.chat.outputs[0].text
    assert full.usage.prompt_tokens == len(reference.chat.prompt_token_ids)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    parts = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in CHAT]
    as_parts = client.chat.completions.create(**{**kw, "messages": parts})
    assert as_parts.choices[0].message.content == full.choices[0].message.content


def test_async_client_concurrent(url: str, reference: SimpleNamespace) -> None:
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0) as c:
            calls = [
                c.completions.create(model=MODEL, prompt=p, max_tokens=NUM_TOKENS, temperature=0)
                for p in PROMPTS * 3
            ]
            return [r.choices[0].text for r in await asyncio.gather(*calls)]

    expected = [r.outputs[0].text for r in reference.completions] * 3
    assert asyncio.run(run()) == expected


def test_api_servers_share_the_port(url: str, reference: SimpleNamespace) -> None:
    """Both API servers answer on the one port (new connections spread over them)."""
    seen: set[str] = set()
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    expected = reference.completions[0].outputs[0].text
    results: list[httpx.Response] = []

    def one() -> None:
        results.append(httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60))

    for _ in range(10):
        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seen |= {r.headers["x-pagedserve-api-server"] for r in results}
        if seen == {"0", "1"}:
            break
    assert seen == {"0", "1"}
    for r in results:
        assert r.status_code == 200
        assert expected.startswith(r.json()["choices"][0]["text"])


# ---------------------------------------------------------------------- sampling features
def test_n_choices(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], n=3, max_tokens=8, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    assert len({c.text for c in r.choices}) > 1  # seeds differ per choice
    two = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=4, seed=1)
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=3, max_tokens=4, seed=3, stream=True
    )
    finished = {c.choices[0].index for c in chat if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2}


def test_completion_logprobs(client: openai.OpenAI, reference: SimpleNamespace) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=NUM_TOKENS, temperature=0, logprobs=3)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    n = NUM_TOKENS
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n and lp.text_offset[0] == 0
    ref = reference.completions[1].outputs[0]
    for i, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        expected = ref.logprobs[i][ref.token_ids[i]].logprob
        assert math.isclose(value, expected, abs_tol=1e-4)
        assert 1 <= len(top) <= 4 and value <= 0
        assert math.isclose(max(top.values()), value, abs_tol=1e-6)  # greedy takes the top
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-6)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_stop_strings_cut_exactly(client: openai.OpenAI, reference: SimpleNamespace) -> None:
    base = reference.completions[2].outputs[0].text
    start = next(i for i in range(len(base) // 2, len(base) - 3) if "\ufffd" not in base[i : i + 3])
    stop = base[start : start + 3]
    cut = base.find(stop)
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=NUM_TOKENS, temperature=0)
    r = client.completions.create(**kw, stop=["NEVER-THERE", stop])
    assert r.choices[0].text == base[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True)
    )
    assert streamed == base[:cut]
    kept = client.completions.create(
        **kw, stop=stop, extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == base[: cut + len(stop)]


def test_stop_token_ids_and_max_tokens_default(http: httpx.Client, reference) -> None:
    ref = reference.completions[0].outputs[0]
    body = {"model": MODEL, "prompt": PROMPTS[0], "temperature": 0, "max_tokens": NUM_TOKENS}
    r = http.post("/v1/completions", json={**body, "stop_token_ids": [ref.token_ids[4]]}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == ref.token_ids[4]
    assert r["usage"]["completion_tokens"] == ref.token_ids.index(ref.token_ids[4]) + 1
    ids = list(range(3, MAX_MODEL_LEN - 3))  # no max_tokens: up to max_model_len
    body = {"model": MODEL, "prompt": ids, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body).json()
    assert r["usage"]["completion_tokens"] == 6
    assert r["usage"]["total_tokens"] == MAX_MODEL_LEN
    assert r["choices"][0]["finish_reason"] == "length"


def test_usage_cached_tokens_and_tokenize(http: httpx.Client) -> None:
    prompt = " ".join(["The weather today is cloudy with a chance of rain."] * 6)
    count = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert count > 32
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = http.post("/v1/completions", json=body).json()["usage"]
    second = http.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens"] == second["prompt_tokens"] == count
    assert second["completion_tokens"] == 3 and second["total_tokens"] == count + 3
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and count - 16 <= cached < count


def test_tokenize_detokenize(http: httpx.Client, model_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok("Hello world")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and len(r["token_strs"]) == r["count"]
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    assert_error(http.post("/detokenize", json={"tokens": [10**6]}), 400)


def test_echo(client: openai.OpenAI, reference: SimpleNamespace) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=NUM_TOKENS, temperature=0, echo=True)
    expected = PROMPTS[0] + reference.completions[0].outputs[0].text
    assert client.completions.create(**kw).choices[0].text == expected
    chunks = client.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_stream_continuous_usage(http: httpx.Client) -> None:
    body = {
        "model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" in c for c in chunks)
    generated = [c["usage"]["completion_tokens"] for c in chunks]
    assert generated == sorted(generated) and generated[-1] == 5


# ---------------------------------------------------------------------- errors
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
BAD_REQUESTS = [
    ("suffix", COMPLETION | {"suffix": "x"}),
    ("logprobs>20", COMPLETION | {"logprobs": 21}),
    ("negative-logprobs", COMPLETION | {"logprobs": -1}),
    ("empty-prompt", COMPLETION | {"prompt": ""}),
    ("empty-list", COMPLETION | {"prompt": []}),
    ("empty-in-list", COMPLETION | {"prompt": ["a", ""]}),
    ("empty-ids", COMPLETION | {"prompt": [[]]}),
    ("oov-token", COMPLETION | {"prompt": [5, 512]}),
    ("negative-token", COMPLETION | {"prompt": [5, -1]}),
    ("prompt-too-long", COMPLETION | {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": None}),
    ("prompt+max_tokens", COMPLETION | {"prompt": [5] * 500, "max_tokens": 13}),
    ("best_of", COMPLETION | {"best_of": 2}),
    ("stream_options", COMPLETION | {"stream_options": {"include_usage": True}}),
    ("temperature", COMPLETION | {"temperature": -1}),
    ("top_p", COMPLETION | {"top_p": 0}),
    ("top_k", COMPLETION | {"top_k": -5}),
    ("min_p", COMPLETION | {"min_p": 2}),
    ("presence_penalty", COMPLETION | {"presence_penalty": 3}),
    ("repetition_penalty", COMPLETION | {"repetition_penalty": 0}),
    ("max_tokens=0", COMPLETION | {"max_tokens": 0}),
    ("min_tokens", COMPLETION | {"min_tokens": 9}),
    ("n=0", COMPLETION | {"n": 0}),
    ("logit_bias-key", COMPLETION | {"logit_bias": {"abc": 1}}),
    ("logit_bias-oov", COMPLETION | {"logit_bias": {"99999": 1}}),
    ("logit_bias-value", COMPLETION | {"logit_bias": {"5": 101}}),
    ("priority-fcfs", COMPLETION | {"priority": 1}),
    ("prompt_logprobs>20", COMPLETION | {"prompt_logprobs": 21}),
    ("echo-max_tokens=-1", COMPLETION | {"echo": True, "max_tokens": -1}),
    ("wrong-type", COMPLETION | {"max_tokens": "many"}),
    ("no-prompt", {"model": MODEL}),
    ("chat-top_logprobs>20", CHAT_BODY | {"logprobs": True, "top_logprobs": 21}),
    ("chat-top_logprobs-alone", CHAT_BODY | {"top_logprobs": 2}),
    ("chat-no-messages", CHAT_BODY | {"messages": []}),
    (
        "chat-image",
        CHAT_BODY | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    ),
    ("chat-max_completion_tokens", CHAT_BODY | {"max_completion_tokens": 0}),
    ("chat-too-long", CHAT_BODY | {"max_tokens": MAX_MODEL_LEN}),
    ("chat-stream_options", CHAT_BODY | {"stream_options": {"include_usage": True}}),
]


@pytest.mark.parametrize("body", [b for _, b in BAD_REQUESTS], ids=[i for i, _ in BAD_REQUESTS])
def test_bad_requests_are_400(http: httpx.Client, body: dict) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    for stream in (False, True) if "stream_options" not in body else (False,):
        error = assert_error(http.post(path, json=body | ({"stream": True} if stream else {})), 400)
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("field", list(UNSUPPORTED_FIELDS))
def test_unsupported_fields_are_refused_by_name(http: httpx.Client, field: str) -> None:
    """A feature vLLM has and we lack is a 400 naming it, never silently dropped."""
    for path, body, model in (
        ("/v1/chat/completions", CHAT_BODY, ChatCompletionRequest),
        ("/v1/completions", COMPLETION, CompletionRequest),
    ):
        if field in model.model_fields:
            continue  # this endpoint implements it (echo, response_format, tools on chat)
        error = assert_error(http.post(path, json=body | {field: 12345}), 400)
        assert error["param"] == field and field in error["message"], error


def test_unsupported_fields_no_op_values_pass(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=1, extra_body={"use_beam_search": True}
        )
    assert "use_beam_search" in info.value.message
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=1, response_format={"type": "text"},
        tool_choice="none", extra_body={"guided_json": None, "use_beam_search": False},
    )  # fmt: skip
    assert reply.usage.completion_tokens == 1


def test_request_chat_template_needs_trust_flag(http: httpx.Client) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for path, body in (
        ("/v1/chat/completions", CHAT_BODY | {"chat_template": template}),
        ("/v1/chat/completions", CHAT_BODY | {"chat_template_kwargs": {"chat_template": template}}),
        ("/tokenize", {"model": MODEL, "messages": CHAT, "chat_template": template}),
    ):
        error = assert_error(http.post(path, json=body), 400)
        assert "--trust-request-chat-template" in error["message"], error
        assert error["param"] == "chat_template"


def test_error_shapes(http: httpx.Client, client: openai.OpenAI) -> None:
    error = assert_error(http.post("/v1/completions", json=COMPLETION | {"model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    assert_error(http.post("/v1/chat/completions", json=CHAT_BODY | {"model": "gpt-9"}), 404)
    assert_error(http.get("/v1/nothing-here"), 404)
    invalid = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(invalid, 400)
    assert (
        "max_tokens"
        in assert_error(http.post("/v1/completions", json=COMPLETION | {"max_tokens": "x"}), 400)[
            "param"
        ]
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", logprobs=21)
    assert "logprobs" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


def test_api_key(url: str) -> None:
    body = COMPLETION
    assert_error(httpx.post(url + "/v1/completions", json=body), 401)
    wrong = {"Authorization": "Bearer sk-wrong"}
    assert_error(httpx.post(url + "/v1/completions", json=body, headers=wrong), 401)
    assert_error(httpx.get(url + "/v1/models", headers={"Authorization": API_KEY}), 401)
    assert_error(httpx.post(url + "/tokenize", json={"prompt": "a"}), 401)
    assert httpx.get(url + "/health").status_code == 200
    assert_error(httpx.get(url + "/metrics"), 401)  # open only with --metrics-public
    ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200
    bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---------------------------------------------------------------------- metrics and aborts
def test_metrics_count_requests(http: httpx.Client, reference: SimpleNamespace) -> None:
    before = metrics(http)
    num_prompt = sum(len(r.prompt_token_ids) for r in reference.completions)
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).status_code == 200
    after = metrics(http)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('pagedserve:request_success_total{finished_reason="length"}') == 3
    assert delta("pagedserve:generation_tokens_total") == 15
    assert delta("pagedserve:prompt_tokens_total") == num_prompt
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"pagedserve:{hist}_seconds_count") == 3
    assert delta("pagedserve:inter_token_latency_seconds_count") == 12
    assert after["pagedserve:prefix_cache_queries_total"] >= num_prompt
    assert "pagedserve:num_preemptions_total" in after
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"pagedserve:{gauge}" in after


def wait_idle(http: httpx.Client, timeout: float) -> float:
    """Seconds until the engine reports no running request and an empty KV cache."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        m = metrics(http)
        if m["pagedserve:num_requests_running"] == 0 and m["pagedserve:kv_cache_usage_perc"] == 0:
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"engine still busy after {timeout} s: {metrics(http)}")


def cached_prefix(http: httpx.Client, ids: list[int]) -> int:
    """How many leading tokens of `ids` the server's prefix cache holds."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1}
    return http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def assert_aborted(http: httpx.Client, ref, stopped_before: int) -> None:
    """The engine stopped the request: running and KV usage return to 0, and the prefix cache
    (which keeps full blocks of generated tokens too) holds its greedy continuation only up to
    about where the client left, far from the end it would have reached."""
    wait_idle(http, 10)
    ids = ref.prompt_token_ids + ref.outputs[0].token_ids
    assert (
        cached_prefix(http, ids[: MAX_MODEL_LEN - 8]) < len(ref.prompt_token_ids) + stopped_before
    )


def test_abort_on_disconnect_streamed(http: httpx.Client, reference: SimpleNamespace) -> None:
    ref = reference.long[0]
    body = {"model": MODEL, "prompt": ABORT_PROMPTS[0], "max_tokens": LONG, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    wait_idle(http, 10)
    with http.stream("POST", "/v1/completions", json=body) as r:
        texts = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
            if len(texts) == 8:
                break
        assert ref.outputs[0].text.startswith("".join(texts))
    assert_aborted(http, ref, stopped_before=200)


def test_abort_on_disconnect_non_streamed(http: httpx.Client, reference) -> None:
    ref = reference.long[1]
    body = {"model": MODEL, "prompt": ABORT_PROMPTS[1], "max_tokens": LONG, "temperature": 0}
    wait_idle(http, 10)
    # The client leaves after 0.1 s: at ~1 ms a token (the C++ CPU attention) that is ~100 of
    # the LONG tokens the request would have run to (0.25 s was ~270: too close to 250).
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body | {"ignore_eos": True}, timeout=0.1)
    assert_aborted(http, ref, stopped_before=250)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_death_gives_503(model_dir: str, tmp_path) -> None:
    """An API server run on its own against an EngineCore that then dies: /health and requests
    answer 503 in OpenAI's error shape."""
    config = build_engine_config(
        model_dir, device="cpu", dtype="float32", kv_cache_memory=16 << 20, served_model_name=MODEL
    )
    directory = ipc_dir()
    core = start_engine_core(config, directory)
    port = free_port()
    cmd = [
        sys.executable, "-m", "pagedserve.entrypoints.api_server", "--config", config.to_json(),
        "--ipc-dir", directory, "--core-pid", str(core.pid), "--port", str(port),
        "--log-level", "warning",
    ]  # fmt: skip
    log = open(tmp_path / "api.log", "wb")  # noqa: SIM115
    api = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert api.poll() is None, (tmp_path / "api.log").read_text()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "API server did not become healthy"
            time.sleep(0.2)
        core.proc.send_signal(signal.SIGKILL)
        core.proc.wait()
        deadline = time.monotonic() + 10
        while (health := httpx.get(url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 after the engine died"
            time.sleep(0.1)
        assert assert_error(health, 503)["type"] == "service_unavailable"
        assert_error(httpx.post(url + "/v1/completions", json=COMPLETION), 503)
        assert_error(
            httpx.post(url + "/v1/chat/completions", json=CHAT_BODY | {"stream": True}), 503
        )
    finally:
        api.send_signal(signal.SIGTERM)
        api.wait(timeout=20)
        log.close()
        core.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_engine_errors_map_to_openai_errors():
    """The engine clients raise pagedserve/errors.py's errors; only the HTTP layer turns them into
    statuses and OpenAI error bodies (the overload 503 is also checked end to end in
    test_reliability.py)."""
    from pagedserve.errors import EngineOverloadedError, RequestRefusedError, StepTimeoutError
    from pagedserve.frontend.openai.protocol import engine_api_error

    over = engine_api_error(EngineOverloadedError(8))
    assert (over.status, over.code) == (503, "server_overloaded")
    assert over.headers == {"Retry-After": "1"}
    assert over.message == "The server is overloaded (8 requests are waiting). Retry later."
    refused = engine_api_error(RequestRefusedError("token id 99 is out of range"))
    assert (refused.status, refused.type) == (400, "invalid_request_error")
    assert refused.message == "The engine refused the request: token id 99 is out of range"
    dead = engine_api_error(StepTimeoutError("step 3 got no result"))
    assert (dead.status, dead.type, dead.code) == (503, "service_unavailable", "engine_dead")
    assert dead.message == "The engine is not running: step 3 got no result"
