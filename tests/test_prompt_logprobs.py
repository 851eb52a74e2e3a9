"""Prompt log-probabilities (`prompt_logprobs`, and echo + logprobs on /v1/completions) against
transformers' log_softmax on a tiny float32 Llama: through chunked prefill (a token budget smaller
than the prompts), after a prefix-cache hit, and through a real `launch` with the openai client."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from test_server import Launched, launch_args

from pagedserve import LLM, SamplingParams

from tiny_models import tiny_model_dir

CPU = dict(device="cpu", dtype="float32")
BUDGET = 16  # max_num_batched_tokens: the longer prompts take several chunks
TOP = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir("llama", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def hf_logprobs(model_dir: str):
    """prompt token ids -> transformers' [len, V] log_softmax of the logits at each position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return run


@pytest.fixture(scope="module")
def llm(model_dir: str):
    with LLM(model_dir, max_num_batched_tokens=BUDGET, max_num_seqs=4, **CPU) as engine:
        yield engine


def check_prompt_logprobs(ids: list[int], got: list, ref: torch.Tensor, top: int) -> None:
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry, row = got[p], ref[p - 1]
        assert abs(entry[ids[p]].logprob - row[ids[p]].item()) < 1e-4, p
        assert entry[ids[p]].rank == int((row > row[ids[p]]).sum()) + 1
        ranked = sorted(entry.values(), key=lambda e: e.rank)
        top_lp, _ = row.topk(top)
        tops = [e for e in ranked if e.rank <= top]
        assert len(tops) >= top - 1  # the prompt token may be one of the top-N (a dict key)
        for e in tops:
            assert abs(e.logprob - top_lp[e.rank - 1].item()) < 1e-4


def test_prompt_logprobs_chunked_prefill(llm: LLM, hf_logprobs) -> None:
    """Prompts of mixed lengths, several longer than the token budget, in one batch."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (2, 7, 37, 23, 50)]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for ids, out in zip(prompts, outs, strict=True):
        check_prompt_logprobs(ids, out.prompt_logprobs, hf_logprobs(ids), TOP)
    plain = llm.generate({"prompt_token_ids": prompts[2]}, SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None
    several = SamplingParams(n=3, temperature=1, seed=1, max_tokens=2, prompt_logprobs=TOP)
    out = llm.generate({"prompt_token_ids": prompts[3]}, several)[0]  # scored once, by choice 0
    assert len(out.outputs) == 3
    check_prompt_logprobs(prompts[3], out.prompt_logprobs, hf_logprobs(prompts[3]), TOP)


def test_prompt_logprobs_after_prefix_cache_hit(llm: LLM, hf_logprobs) -> None:
    """A prompt whose blocks are cached is computed again from position 0 when its prompt
    logprobs are asked for (its cached blocks would skip them), and hits the cache otherwise."""
    ids = list(range(40, 90))  # 50 tokens: three full blocks to hit
    plain = SamplingParams(temperature=0, max_tokens=1)
    llm.generate({"prompt_token_ids": ids}, plain)
    assert llm.generate({"prompt_token_ids": ids}, plain)[0].num_cached_tokens == 48
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert out[0].num_cached_tokens == 0
    check_prompt_logprobs(ids, out[0].prompt_logprobs, hf_logprobs(ids), 0)


def test_prompt_logprobs_bounds(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs must be at most"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(prompt_logprobs=10_000))


# ---------------------------------------------------------------------- /v1/completions
@pytest.fixture(scope="module")
def client(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    args = launch_args(model_dir, "--served-model-name", "tiny", "--max-num-batched-tokens", "16")
    proc = Launched(args, str(tmp_path_factory.mktemp("launch") / "launch.log"))
    url = proc.wait_ready()
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    assert proc.stop() == 0, proc.output()


def test_echo_logprobs_max_tokens_0(client: openai.OpenAI, llm: LLM, hf_logprobs) -> None:
    """lm-eval's local-completions loglikelihood request: the prompt scored, nothing generated,
    in OpenAI's legacy logprobs shape (the first token has no logprob)."""
    text = "The quick brown fox jumps over the lazy dog, again and again and again."
    ids = llm.get_tokenizer().encode(text)
    assert len(ids) > 16
    resp = client.completions.create(
        model="tiny", prompt=text, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    choice = resp.choices[0]
    assert choice.text == text
    lp = choice.logprobs
    ref = hf_logprobs(ids)
    tok = llm.get_tokenizer()
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[p], ref[p - 1, ids[p]].item(), abs_tol=1e-4)
        assert len(lp.top_logprobs[p]) in (2, 3)  # the prompt token and the top-2
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 0
    chunks = list(
        client.completions.create(
            model="tiny", prompt=text, echo=True, logprobs=2, max_tokens=0, stream=True
        )
    )
    assert len(chunks) == 1 and chunks[0].choices[0].text == text
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_echo_logprobs_with_generation_and_extra_field(client: openai.OpenAI) -> None:
    """echo + logprobs with tokens generated: prompt entries, then the completion's; vLLM's
    `prompt_logprobs` extra field gives the prompt's entries on their own."""
    kw = dict(model="tiny", prompt="Hello, how are you today?", max_tokens=3, temperature=0)
    plain = client.completions.create(**kw, logprobs=1).choices[0]
    echoed = client.completions.create(**kw, logprobs=1, echo=True).choices[0]
    n = len(echoed.logprobs.tokens) - len(plain.logprobs.tokens)
    assert echoed.logprobs.token_logprobs[n:] == plain.logprobs.token_logprobs
    assert echoed.logprobs.token_logprobs[0] is None and echoed.text.endswith(plain.text)
    chunks = [
        c.choices[0].logprobs
        for c in client.completions.create(**kw, logprobs=1, echo=True, stream=True)
    ]
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert sum((getattr(c, field) for c in chunks), []) == getattr(echoed.logprobs, field)
    extra = client.completions.create(**kw, extra_body={"prompt_logprobs": 1}).model_dump()
    prompt_lps = extra["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == n
    assert all(len(entry) in (1, 2) for entry in prompt_lps[1:])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=0)


def test_chat_prompt_logprobs(client: openai.OpenAI) -> None:
    """vLLM's `prompt_logprobs` on chat completions: beside the choices, one entry per token of
    the rendered prompt; not with stream (as in vLLM)."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=1)
    resp = client.chat.completions.create(**kw, extra_body={"prompt_logprobs": 1}).model_dump()
    lps = resp["prompt_logprobs"]
    assert len(lps) == resp["usage"]["prompt_tokens"] and lps[0] is None
    assert all(1 <= len(e) <= 2 and all(v["rank"] >= 1 for v in e.values()) for e in lps[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(**kw, stream=True, extra_body={"prompt_logprobs": 1})
