"""What a vLLM user sees by name (issue 34): the text of the stop token that ended a reply is
dropped as vLLM drops it, `/metrics` serves every series with a vLLM twin under its `vllm:` name,
and vLLM's removed `guided_*` fields get a 400 that names `structured_outputs`.

One real `pagedserve launch` of the embedded model on CPU, checked against `LLM` on the same model.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import CPU_ARGS, Launched, assert_error

from pagedserve import LLM, SamplingParams
from pagedserve.frontend.hub import DEFAULT_MODEL_NAME, default_model_dir

PROMPT = "def add(a, b):\n    return"
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):
    log = str(tmp_path_factory.mktemp("vllm_names") / "launch.log")
    launched = Launched(["--host", "127.0.0.1", "--port", "0", *CPU_ARGS], log)
    try:
        yield launched.wait_ready()
    finally:
        assert launched.stop() == 0, launched.output()


@pytest.fixture(scope="module")
def stop(url: str) -> SimpleNamespace:
    """A visible token the model emits greedily (its first occurrence, at k), and the greedy
    texts of k and of k + 1 tokens, from `LLM` (built while the server starts)."""
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with LLM(default_model_dir(), device="cpu", dtype="float32", kv_cache_memory=16 << 20) as llm:
        ids = llm.generate(PROMPT, greedy)[0].outputs[0].token_ids

        def text(n: int) -> str:
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            return llm.generate(PROMPT, params)[0].outputs[0].text

        for k in range(1, len(ids)):
            before, after = text(k), text(k + 1)
            if ids[k] not in ids[:k] and after != before:
                break
        else:
            raise AssertionError(f"no visible first-time token in {ids}")
        without = dict(temperature=0, max_tokens=NUM_TOKENS, stop_token_ids=[ids[k]])
        outs = [
            llm.generate(PROMPT, SamplingParams(**without, include_stop_str_in_output=include))
            for include in (False, True)
        ]
    return SimpleNamespace(id=ids[k], k=k, before=before, after=after, llm=outs)


def test_stop_token_text_is_dropped_unless_included(url: str, stop: SimpleNamespace) -> None:
    """vLLM keeps the id of the stop token (or EOS) that ended a reply but not its text, unless
    include_stop_str_in_output; through `LLM`, HTTP and a stream alike."""
    for include, expected in ((False, stop.before), (True, stop.after)):
        out = stop.llm[include][0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (expected, "stop", stop.id)
        assert len(out.token_ids) == stop.k + 1 and out.token_ids[-1] == stop.id
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    for include, expected in ((False, stop.before), (True, stop.after)):
        kw = dict(model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0)
        extra = {"stop_token_ids": [stop.id], "include_stop_str_in_output": include}
        choice = client.completions.create(**kw, extra_body=extra).choices[0]
        assert (choice.text, choice.finish_reason) == (expected, "stop"), include
        chunks = client.completions.create(**kw, extra_body=extra, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected, include


# vLLM V1's names (vllm/v1/metrics/loggers.py), and the two older ones its dashboards used.
VLLM_SERIES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "gpu_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
    "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "request_success_total", "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count", "time_per_output_token_seconds_count",
    "e2e_request_latency_seconds_count", "request_queue_time_seconds_count", "cache_config_info",
]  # fmt: skip


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_have_vllm_twins(url: str, stop: SimpleNamespace) -> None:
    """After a request, every vllm: series exists with model_name and equals its pagedserve:
    twin (gpu_cache_usage_perc and time_per_output_token_seconds: vLLM's older names)."""
    body = {"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    got = samples(url)
    renamed = {"gpu_cache_usage_perc": "kv_cache_usage_perc"}
    renamed["time_per_output_token_seconds_count"] = "inter_token_latency_seconds_count"
    for name in VLLM_SERIES:
        ours = "pagedserve:" + renamed.get(name, name)
        found = [(labels, v) for (n, labels), v in got.items() if n == "vllm:" + name]
        assert found, f"vllm:{name} missing"
        for labels, value in found:
            assert ("model_name", DEFAULT_MODEL_NAME) in labels, (name, labels)
            assert got[(ours, labels)] == value, name
    reasons = {
        dict(labels)["finished_reason"] for (n, labels) in got if n.endswith("success_total")
    }
    assert "length" in reasons
    labels = frozenset({("model_name", DEFAULT_MODEL_NAME), ("engine", "0")})
    assert got[("vllm:generation_tokens_total", labels)]


@pytest.mark.parametrize(
    "field, value, replacement",
    [
        ("guided_json", {"type": "object"}, "structured_outputs={'json'"),
        ("guided_regex", "[a-z]+", "structured_outputs={'regex'"),
        ("guided_choice", ["yes", "no"], "structured_outputs={'choice'"),
        ("guided_grammar", 'root ::= "a"', "structured_outputs={'grammar'"),
        ("guided_whitespace_pattern", " ", "structured_outputs={'any_whitespace'"),
        ("guided_decoding_backend", "xgrammar", "structured_outputs"),
    ],
)
def test_removed_guided_fields_name_their_replacement(
    url: str, field: str, value: object, replacement: str
) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", chat),
    ):
        error = assert_error(httpx.post(url + path, json=body | {field: value}, timeout=30), 400)
        assert error["param"] == field and field in error["message"], error
        assert "removed in vLLM" in error["message"] and replacement in error["message"], error


def test_structured_outputs_refuses_keys_it_does_not_implement():
    from pydantic import ValidationError

    from pagedserve.frontend.openai.protocol import StructuredOutputsRequest

    assert StructuredOutputsRequest.model_validate({"json": {"type": "object"}}).json_schema
    for key in ("whitespace_pattern", "disable_fallback", "disable_any_whitespace"):
        with pytest.raises(ValidationError, match=key):
            StructuredOutputsRequest.model_validate({"regex": "[0-9]", key: True})
