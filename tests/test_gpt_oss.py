"""gpt-oss against transformers on a tiny random checkpoint in the released MXFP4 format
(tests/gpt_oss_model.py): the dequantization, logits through the paged KV cache (chunked
prefill, decodes, both KV cache groups), the engine at tp=2 (prefix-cache hits, preemption,
seeded sampling) and the refusals."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from gpt_oss_model import load_oracle, make_gpt_oss, teach_replies
from test_models import PagedRunner, check, random_seqs
from test_server import Launched, launch_args, metrics

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig
from pagedserve.worker.models import build_model

NUM_NEW = 8
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
SAY_HELLO = [{"role": "user", "content": "Hello!"}]
CALL_REPLY = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
    'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
FINAL_REPLY = (
    "<|channel|>analysis<|message|>Say hello.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Hello there!<|return|>"
)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    """The tiny MXFP4 checkpoint, its LM head solved so that greedy decoding answers the two
    chat prompts below in harmony (a tool call; reasoning and a final answer)."""
    path = make_gpt_oss(str(tmp_path_factory.getbasetemp() / "gpt-oss"))
    teach_replies(path, [(ASK_WEATHER, [WEATHER], CALL_REPLY), (SAY_HELLO, None, FINAL_REPLY)])
    return path


@pytest.fixture(scope="module")
def models(gpt_oss_dir):
    ours = build_model(ModelConfig(model=gpt_oss_dir), torch.float32, torch.device("cpu"))
    return ours, load_oracle(gpt_oss_dir)


def test_chunked_prefill_and_decode_logits(models):
    """Rows past the 8-token window, chunked, decoding beside prefills."""
    ours, theirs = models
    seqs = random_seqs([30, 21, 9], seed=5)
    steps = [{0: 11, 2: 9}, {0: 13, 1: 7, 2: 0}, {0: 6, 1: 14}]
    check(PagedRunner(ours, seqs), theirs, steps)


@pytest.mark.parametrize(("num_splits", "window"), [(1, 9), (3, None)])
def test_triton_sinks_match_reference(num_splits, window):
    """Sinks in the unsplit epilogue and in the split-K merge (Triton's interpreter on CPU)."""
    pytest.importorskip("triton")
    from triton_env import RUNNABLE

    if not RUNNABLE:
        pytest.skip("triton was imported without the interpreter")
    from pagedserve.benchmarks.kernels.bench_kernels import random_batch
    from pagedserve.kernels.attention.reference import paged_attention_ref
    from pagedserve.kernels.attention.triton import triton_paged_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    computed, new = [0, 37, 70], [9, 1, 1]  # a prompt and two decodes, past the window
    q, kv, meta = random_batch(computed, new, 4, 2, 16, 16, torch.float32, device, seed=3)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], device=device)
    ref = paged_attention_ref(q, kv, meta, 0.25, window, sinks=sinks)
    plain = paged_attention_ref(q, kv, meta, 0.25, window)
    assert not torch.allclose(ref, plain, atol=1e-2), "the sinks must matter here"
    out = triton_paged_attention(q, kv, meta, 0.25, window, num_splits=num_splits, sinks=sinks)
    tol = dict(atol=2e-2, rtol=2e-2) if device == "cuda" else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)


def test_mxfp4_dequantization_equals_transformers():
    """Our MXFP4 decoding of random codes (every nibble, exponents 2^-127..2^128) is
    transformers' `convert_moe_packed_tensors`, before its transpose."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagedserve.kernels.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen).byte()
    scales = torch.randint(0, 256, (3, 8, 2), generator=gen).byte()
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales, torch.float32), theirs)
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales).transpose(1, 2))


def _hf_greedy(path: str, prompts: list[list[int]], num_new: int = NUM_NEW) -> list[list[int]]:
    """transformers' greedy tokens (exactly `num_new` unless 0 < `num_new` is open-ended)."""
    model = load_oracle(path)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        new = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
            min_new_tokens=NUM_NEW if num_new == NUM_NEW else 0, do_sample=False, pad_token_id=2,
        )  # fmt: skip
        out.append(new[0, len(prompt) :].tolist())
    return out


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 500, (16,), generator=gen).tolist()
    return [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 7, 5, 9)]


@pytest.fixture(scope="module")
def tp2(gpt_oss_dir, prompts):
    """Greedy and seeded samples of the engine at tp=2 (4-token blocks, a 16-token step budget,
    the windowed group freeing blocks behind its 8-token window, prefix-cache hits)."""
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(
        gpt_oss_dir, device="cpu", dtype="float32", tensor_parallel_size=2, block_size=4,
        max_num_batched_tokens=16, num_gpu_blocks_override=24, max_model_len=64,
    ) as llm:  # fmt: skip
        first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy)
        sampled = llm.generate([{"prompt_token_ids": p} for p in prompts], seeded)
    assert all(o.num_cached_tokens == 16 for o in rest)
    return [o.outputs[0].token_ids for o in first + rest], [o.outputs[0].token_ids for o in sampled]


def test_engine_tp2_prefix_cache_equals_transformers(gpt_oss_dir, prompts, tp2):
    assert tp2[0] == _hf_greedy(gpt_oss_dir, prompts)


@pytest.fixture(scope="module")
def server(gpt_oss_dir, tmp_path_factory):
    """tp=1; 40 blocks of 16 tokens (4 KB each: the two groups' one layer share a KV tensor),
    what one request of max_model_len 320 may need over the two groups."""
    args = launch_args(
        gpt_oss_dir, "--served-model-name", "tiny", "--max-model-len", "320",
        "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
        "--enable-auto-tool-choice", "--kv-cache-memory", str(40 * 4096),
    )  # fmt: skip
    proc = Launched(args, str(tmp_path_factory.mktemp("gpt-oss") / "launch.log"))
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


def test_launch_serves_harmony_chat(server, gpt_oss_dir):
    """The checkpoint's template renders the tools as transformers does; the reply's analysis
    channel comes back as reasoning_content and its commentary call as tool_calls, whole and
    streamed."""
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    tok = AutoTokenizer.from_pretrained(gpt_oss_dir)
    text = tok.apply_chat_template(
        ASK_WEATHER, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    want = tok.encode(text, add_special_tokens=False)
    reply = client.chat.completions.create(
        model="tiny", messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=40
    )
    assert reply.usage.prompt_tokens == len(want)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.reasoning_content == "Need the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    hello = client.chat.completions.create(
        model="tiny", messages=SAY_HELLO, temperature=0, max_tokens=40
    ).choices[0]
    assert hello.message.reasoning_content == "Say hello."
    assert hello.message.content == "Hello there!"
    stream = client.chat.completions.create(
        model="tiny", messages=SAY_HELLO, temperature=0, max_tokens=40, stream=True
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Say hello."
    assert "".join(d.content or "" for d in deltas) == "Hello there!"


def test_launch_preempts_and_seeded_tp1_equals_tp2(server, gpt_oss_dir, prompts, tp2):
    """Ten 40-token prompts at once need 4 blocks each for their 64 tokens and up to 2 in the
    windowed group, the cache holds 40: the scheduler preempts, and greedy outputs still equal
    transformers'. The seeded samples of the tp=2 engine come out of this tp=1 one alike."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gpt_oss_dir)
    gen = torch.Generator().manual_seed(9)
    long = [torch.randint(3, 500, (40,), generator=gen).tolist() for _ in range(10)]
    http = httpx.Client(base_url=server, timeout=120)

    def complete(prompt: list[int], **params) -> str:
        body = {"model": "tiny", "prompt": prompt, **params}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(long)) as pool:
        texts = list(pool.map(lambda p: complete(p, temperature=0, max_tokens=24), long))
    want = _hf_greedy(gpt_oss_dir, long, 24)
    assert texts == [tok.decode(ids, skip_special_tokens=True) for ids in want]
    assert metrics(http)["pagedserve:num_preemptions_total"] > 0
    seeded = dict(temperature=1.0, seed=11, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    sampled = [complete(p, **seeded) for p in prompts]
    assert sampled == [tok.decode(ids, skip_special_tokens=True) for ids in tp2[1]]


def test_refusals(gpt_oss_dir, tmp_path):
    """What we do not run is refused by name: FP8 on gpt-oss, MXFP4 on another family, a
    backend without sinks, MXFP4 experts split off their 32-unit scale blocks."""
    import shutil

    from pagedserve.kernels.attention.selection import backend_refusal
    from pagedserve.worker.layers.gpt_oss_moe import GptOssExperts

    with pytest.raises(ValueError, match="quantization fp8 does not apply to an MXFP4"):
        ModelConfig(model=gpt_oss_dir, quantization="fp8")
    other = tmp_path / "llama"
    shutil.copytree(gpt_oss_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"], config["architectures"] = "llama", ["LlamaForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MXFP4 weights are supported for gpt-oss's experts only"):
        ModelConfig(model=str(other))
    assert backend_refusal("flash", False, torch.bfloat16, sinks=True) == (
        "has no attention sinks (gpt-oss)"
    )
    assert backend_refusal("triton", False, torch.bfloat16, sinks=True) is None
    hf = {**config, "hidden_size": 64, "intermediate_size": 80, "num_local_experts": 2}
    with pytest.raises(ValueError, match="80 intermediate units per rank is not a multiple of 32"):
        GptOssExperts(hf, mxfp4=True)


def test_harmony_parsers_on_text():
    """The parsers alone: a raw reply (no reasoning parser: analysis dropped), a preamble before
    a call, a reply that ignores harmony, and every prefix of a streamed reply giving prefixes
    of the final reasoning and content."""
    import re

    from pagedserve.frontend.openai.harmony import GptOssReasoningParser, OpenAIToolParser
    from pagedserve.frontend.openai.protocol import APIError

    reasoning, tools = GptOssReasoningParser(None), OpenAIToolParser()
    assert tools.extract(CALL_REPLY.removesuffix("<|call|>")) == (
        None, [("get_weather", '{"city": "Paris"}')],
    )  # fmt: skip
    preamble = (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f"
        "<|channel|>commentary json<|message|>{}<|call|>"
    )
    assert tools.extract(reasoning.split(preamble, True)[1]) == ("Checking.", [("f", "{}")])
    assert reasoning.split("plain words", True) == ("", "plain words")
    assert tools.extract("plain words") == ("plain words", [])
    final = reasoning.split(FINAL_REPLY, True)
    assert final == ("Say hello.", "Hello there!")
    pieces = re.split(
        r"(<\|[a-z]+\|>|\s)",
        FINAL_REPLY + CALL_REPLY.replace("<|channel|>", "<|start|>assistant<|channel|>", 1),
    )
    text, seen = "", []
    for piece in pieces:
        text += piece
        seen.append(reasoning.split(text, False))
    for (r, c), (r2, c2) in zip(seen, seen[1:], strict=False):
        assert r2.startswith(r) and c2.startswith(c)
    assert tools.stream_cut(seen[-1][1]) == len("Hello there!")
    with pytest.raises(APIError, match="not supported with --reasoning-parser openai_gptoss"):
        reasoning.grammar_starts_after([])  # a grammar would bind the harmony header: a 400
