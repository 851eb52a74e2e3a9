"""The logs an operator reads (issue 34): one line per HTTP request (method, path, status, token
counts, latency; the prompt's text only with --log-prompts) and the EngineCore's stats line every
--log-stats-interval seconds (none with --disable-log-stats). A real `pagedserve launch` of the
embedded model, driven by the openai client."""

from __future__ import annotations

import re
import time

import openai
import pytest
from test_drain import DEFAULT_MODEL_ARGS
from test_server import Launched

SECRET = "Marmalade zeppelins whisper"
REQUEST_LINE = re.compile(
    r'"POST /v1/(chat/completions|completions) HTTP/1\.1" (\d+) '
    r"prompt_tokens=(\d+) completion_tokens=(\d+) latency=[\d.]+s"
)
STATS_LINE = re.compile(
    r"pagedserve\.engine: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: "
    r"([\d.]+) tokens/s, Requests in: [\d.]+/s, out: [\d.]+/s, Running: \d+ reqs, Swapped: 0 reqs, "
    r"Pending: \d+ reqs, Preempted: \d+ reqs, KV cache usage: [\d.]+%, "
    r"Prefix cache hit rate: [\d.]+%"
)


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory):
    """The module's two servers, started together (their start-ups overlap: CI time); each test
    stops its own."""
    logs = tmp_path_factory.mktemp("logs")
    args = [*DEFAULT_MODEL_ARGS, "--max-model-len", "512", "--log-stats-interval", "1"]
    both = {
        "stats": Launched(args, str(logs / "stats.log")),
        "quiet": Launched([*args, "--disable-log-stats", "--log-prompts"], str(logs / "quiet.log")),
    }
    try:
        yield both
    finally:
        for launched in both.values():
            launched.stop()


def ready(launched: Launched) -> tuple[Launched, openai.OpenAI]:
    url = launched.wait_ready()
    return launched, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def send_requests(client: openai.OpenAI) -> list[tuple[str, int, int]]:
    """A completion, a chat completion and a stream; (path, prompt, completion tokens) each."""
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt=SECRET, max_tokens=4)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": SECRET}], max_tokens=3
    )
    stream = client.completions.create(
        model=model, prompt=SECRET + " again", max_tokens=5, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len([chunk for chunk in stream]) >= 1
    num_prompt = done.usage.prompt_tokens
    return [
        ("completions", num_prompt, done.usage.completion_tokens),
        ("chat/completions", chat.usage.prompt_tokens, chat.usage.completion_tokens),
        ("completions", None, 5),  # its prompt is longer than the first one's
    ]


def wait_for(launched: Launched, pattern: re.Pattern, timeout: float) -> list[re.Match]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(pattern.finditer(launched.output()))
        if found:
            return found
        time.sleep(0.2)
    return []


def test_request_lines_and_stats_lines(launches: dict[str, Launched]) -> None:
    launched, client = ready(launches["stats"])
    try:
        expected = send_requests(client)
        stats = wait_for(launched, STATS_LINE, 15)
        assert stats, launched.output()
        # a line covers the requests' work: prompt and generation tokens per second
        assert any(float(m[1]) > 0 and float(m[2]) > 0 for m in stats), stats
        lines = list(REQUEST_LINE.finditer(launched.output()))
        seen = [(m[1], int(m[3]), int(m[4])) for m in lines]
        assert [m[2] for m in lines] == ["200"] * 3, launched.output()
        assert [(p, n) for p, _, n in seen] == [(p, n) for p, _, n in expected]
        assert seen[0][1] == expected[0][1] and seen[1][1] == expected[1][1]
        assert seen[2][1] > seen[0][1]
    finally:
        assert launched.stop() == 0, launched.output()
    assert SECRET not in launched.output()  # no prompt text without --log-prompts


def test_log_prompts_and_disable_log_stats(launches: dict[str, Launched]) -> None:
    launched, client = ready(launches["quiet"])
    try:
        send_requests(client)
        time.sleep(2.5)  # over two --log-stats-interval periods
    finally:
        assert launched.stop() == 0, launched.output()
    output = launched.output()
    assert len(REQUEST_LINE.findall(output)) == 3, output
    assert f"prompt='{SECRET}'" in output  # the completion's line carries its prompt
    assert "Avg prompt throughput" not in output
