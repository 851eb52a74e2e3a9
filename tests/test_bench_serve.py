"""`pagedserve bench serve` against a real `pagedserve launch` of the embedded default model:
random prompts from the served model's own vocabulary, the ShareGPT sample on the chat endpoint,
a custom JSONL, vLLM's result keys in --save-result, and --max-concurrency's clock (a request's
latency starts when it is sent, not while it waits for a slot)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_server import CPU_ARGS, Launched

from pagedserve.benchmarks.datasets import custom_samples, sharegpt_samples
from pagedserve.benchmarks.multi_turn import conversation_share
from pagedserve.benchmarks.results import RequestResult
from pagedserve.entrypoints.cli import main
from pagedserve.frontend.hub import DEFAULT_MODEL_NAME, default_model_dir
from pagedserve.frontend.tokenizer import load_tokenizer

SHAREGPT = os.path.join(os.path.dirname(__file__), "data", "sharegpt_sample.json")
VLLM_KEYS = [
    "date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The embedded default model (vocabulary 4096: the old 32000 default drew invalid ids)."""
    log = str(tmp_path_factory.mktemp("bench") / "launch.log")
    args = ["--host", "127.0.0.1", "--port", "0", *CPU_ARGS, "--enable-prompt-tokens-details"]
    launched = Launched(args, log)
    try:
        yield launched.wait_ready()
    finally:
        assert launched.stop() == 0, launched.output()


def bench(url: str, out: str, *flags: str) -> dict:
    """Run `pagedserve bench serve` in this process; its saved result file."""
    argv = ["bench", "serve", "--base-url", url, "--save-result", "--result-filename", out]
    assert main([*argv, "--disable-tqdm", "--seed", "1", *flags]) == 0
    with open(out) as f:
        return json.load(f)


def test_random_prompts_use_the_served_vocabulary(server, tmp_path):
    """No --model, no --vocab-size: the model and its tokenizer come from the server."""
    flags = ["--num-prompts", "3", "--random-input-len", "24", "--random-output-len", "3"]
    result = bench(server, str(tmp_path / "r.json"), *flags, "--save-detailed")
    assert [k for k in VLLM_KEYS if k not in result] == []
    assert result["errors"] == ["", "", ""] and (result["completed"], result["failed"]) == (3, 0)
    assert result["model_id"] == DEFAULT_MODEL_NAME and result["backend"] == "openai"
    assert os.path.samefile(result["tokenizer_id"], default_model_dir())
    assert result["input_lens"] == [24] * 3 and result["total_output_tokens"] == 9
    assert result["request_rate"] == "inf" and result["max_concurrency"] is None


def test_sharegpt_sample_on_chat(server, tmp_path):
    tokenizer = load_tokenizer(default_model_dir())
    samples = sharegpt_samples(SHAREGPT, tokenizer, None, np.random.default_rng(0))
    assert len(samples) == 32  # of 34: one single-turn entry and one 1-word prompt are skipped
    flags = ["--dataset-name", "sharegpt", "--dataset-path", SHAREGPT, "--num-prompts", "3"]
    flags += ["--endpoint", "/v1/chat/completions", "--sharegpt-output-len", "3"]
    result = bench(server, str(tmp_path / "s.json"), *flags, "--save-detailed")
    assert (result["completed"], result["backend"]) == (3, "openai-chat")
    assert all(result["generated_texts"]) and result["total_output_tokens"] == 9
    assert "generated_texts" not in bench(server, str(tmp_path / "s2.json"), *flags)


def test_custom_jsonl_through_the_chat_template(server, tmp_path):
    """Client-side prompt lengths (chat template rendered here) equal what the server counted."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os"}\n')
    flags = ["--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "2"]
    result = bench(server, str(tmp_path / "c.json"), *flags, "--custom-output-len", "2")
    assert (result["completed"], result["total_output_tokens"]) == (2, 4)
    tokenizer = load_tokenizer(default_model_dir())
    samples = custom_samples(str(path), tokenizer, 2, True, np.random.default_rng(0))
    assert result["total_input_tokens"] == sum(s.prompt_len for s in samples)
    assert all(str(s.prompt).endswith("<|assistant|>\n") for s in samples)


def test_max_concurrency_clock_starts_when_sent(server, tmp_path):
    """One slot, four requests: they run one after another, each latency is one request's own
    (not the wait for the slot, which shows as queue time instead)."""
    flags = ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "6"]
    result = bench(server, str(tmp_path / "m.json"), *flags, "--max-concurrency", "1")
    assert result["completed"] == 4 and result["max_concurrent_requests"] == 1
    latencies, queued = result["latencies"], sorted(result["queue_times"])
    assert max(latencies) < 0.7 * result["duration"]
    assert queued[-1] > sum(sorted(latencies)[:2])  # the last one waited for three others


def test_multi_turn_resends_the_history(server, tmp_path):
    """Each turn resends the conversation so far: the server finds its earlier turns cached."""
    flags = ["--dataset-name", "multi-turn", "--endpoint", "/v1/chat/completions"]
    flags += ["--num-users", "2", "--num-turns", "2", "--turn-output-len", "2"]
    flags += ["--think-time", "0", "--system-prompt-len", "40", "--user-turn-len", "8"]
    result = bench(server, str(tmp_path / "t.json"), *flags)
    assert (result["completed"], result["num_prompts"]) == (4, 4)
    first, second = result["per_turn"]
    assert second["mean_prompt_tokens"] > first["mean_prompt_tokens"] + 8
    assert first["cached_share"] < second["cached_share"]  # turn 2 finds turn 1's prompt
    assert result["per_replica_requests"] == {} and result["replica_switches"] == 0


def test_random_prefix_is_shared():
    """W6's `--random-prefix-len`: one prefix, then each prompt's own tokens (no server)."""
    import argparse

    from pagedserve.benchmarks.datasets import add_dataset_args, random_samples

    p = argparse.ArgumentParser()
    add_dataset_args(p)
    p.add_argument("--num-prompts", type=int)
    flags = "--num-prompts 3 --random-prefix-len 20 --random-input-len 5 --random-output-len 2"
    args = p.parse_args(flags.split())
    samples = random_samples(args, None, 1000, np.random.default_rng(0), as_text=False)
    assert [s.prompt_len for s in samples] == [25] * 3
    assert all(len(s.prompt) == 25 for s in samples)
    assert samples[0].prompt[:20] == samples[1].prompt[:20] == samples[2].prompt[:20]
    assert samples[0].prompt[20:] != samples[1].prompt[20:]


def test_conversation_share_leaves_the_shared_system_prompt_out():
    """Two users: turn 1 finds only the shared prompt (32 tokens, the most any first turn found);
    turn 2 finds its whole turn 1 (100) on one replica and only the shared prompt on another."""

    def turn(prompt: int, cached: int) -> RequestResult:
        return RequestResult(success=True, prompt_len=prompt, cached_tokens=cached)

    kept = [turn(64, 32), turn(160, 100)]
    moved = [turn(64, 0), turn(160, 32)]
    share = conversation_share([kept, moved])
    assert share["shared_prefix_tokens"] == 32
    # own tokens: 32 + 128 + 32 + 128 = 320; found beyond the shared prefix: 100 - 32 = 68
    assert share["conversation_cached_share"] == 68 / 320


def test_sustained_throughput_tells_keeping_up_from_falling_behind():
    """`sustained_request_throughput` (no server): 600 Poisson arrivals at 8 req/s, each taking
    5-17 s on a server that keeps up, read as the send rate; on one that completes 6 a second
    (FIFO), as about 6; `request_throughput` reads both well below 8, the drain at the end in
    its duration."""
    from pagedserve.benchmarks.results import summarize

    rng = np.random.default_rng(0)
    sent = np.cumsum(rng.exponential(1 / 8, 600))
    service = rng.uniform(5, 17, 600)

    def run(done: np.ndarray) -> dict:
        reqs = [RequestResult(success=True, output_tokens=2, start_time=s, latency=d - s, ttft=0.1)
                for s, d in zip(sent, done, strict=True)]  # fmt: skip
        return summarize(reqs, float(done.max() - sent[0]), [], [])

    kept = run(sent + service)
    assert abs(kept["sustained_request_throughput"] / kept["steady_send_rate"] - 1) < 0.02, kept
    assert 7.2 < kept["steady_send_rate"] < 8.8 and kept["request_throughput"] < 7.3
    behind = run(np.maximum(sent + service, 5 + np.arange(600) / 6))
    assert 5.8 < behind["sustained_request_throughput"] < 6.5, behind  # the transition: above 6
