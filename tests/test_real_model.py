"""A real instruct model (SmolLM2-135M-Instruct, tests/real_models.py) where real text matters:
the GGUF loader against transformers' own GGUF load, and chat end to end through `launch` with
the openai client (EOS, stop strings inside words, seeded n > 1, logprobs, a multi-turn prefix)."""

from __future__ import annotations

import anthropic
import gguf
import numpy as np
import openai
import pytest
import torch
from test_server import Launched, launch_args
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig
from pagedserve.frontend.tokenizer import FastTokenizer, load_tokenizer

from real_models import IM_END, smollm2_gguf, smollm2_hf_dir

MODEL = "smollm2"
REAL_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "64M"]  # 46 KB of KV per token
REAL_ARGS += ["--enable-prompt-tokens-details"]  # test_prefix_cache_across_turns reads them
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."


@pytest.fixture(scope="module")
def hf_dir() -> str:
    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def client(hf_dir: str, tmp_path_factory: pytest.TempPathFactory):
    args = launch_args(hf_dir, "--served-model-name", MODEL, *REAL_ARGS)
    proc = Launched(args, str(tmp_path_factory.mktemp("real") / "launch.log"))
    try:
        url = proc.wait_ready()
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        assert proc.stop() == 0, proc.output()


def test_gguf_greedy_equals_transformers(hf_dir: str) -> None:
    """`--model file.gguf` (here by its packaged name) loads config, tokenizer (a plain
    tokenizer.json: no torch in API servers) and dequantized weights from the file itself, and
    decodes greedily token for token as transformers' own GGUF load does (fp32, CPU)."""
    config = ModelConfig(MODEL)
    assert config.gguf_file == smollm2_gguf()
    assert isinstance(load_tokenizer(config.tokenizer_path), FastTokenizer)
    chats = [FRANCE, [{"role": "user", "content": "Write a haiku about the sea."}]]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    cpu = dict(device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20)
    with LLM(MODEL, **cpu) as llm:
        outs = llm.chat(chats, greedy)
        prompts = [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
                   for c in chats]  # fmt: skip
    assert outs[0].outputs[0].text == PARIS
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert list(out.outputs[0].token_ids) == ids[0, len(prompt) :].tolist()


def test_unsupported_gguf_architecture(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        ModelConfig(str(tmp_path))  # the directory holding it


def test_chat_stops_on_im_end(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=FRANCE, max_tokens=64, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert (choice.message.content, choice.finish_reason) == (PARIS, "stop")
    assert r.usage.completion_tokens < 64 and IM_END not in choice.message.content
    chunks = client.chat.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == PARIS


def test_stop_string_inside_a_word(client: openai.OpenAI) -> None:
    """'ari' is inside the token ' Paris': the text stops mid-token, the stop string left out."""
    for stream in (False, True):
        r = client.chat.completions.create(
            model=MODEL, messages=FRANCE, max_tokens=64, temperature=0, stop=["ari"], stream=stream
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        else:
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        assert text == "The capital of France is P"


def test_n_with_seeds(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], n=2,
              max_tokens=8, temperature=1.0, seed=11)  # fmt: skip
    first = [c.message.content for c in client.chat.completions.create(**kw).choices]
    again = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert first == again and len(set(first)) > 1  # seeded per choice, and the choices differ


def test_logprobs_on_real_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=64, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = r.choices[0].logprobs.content  # the reply's tokens, then the EOS that ended it
    assert "".join(e.token for e in entries) == PARIS + IM_END
    assert any(e.token == " Paris" for e in entries)  # real multi-byte BPE tokens, space and all
    for e in entries:
        assert e.bytes == list(e.token.encode()) and e.logprob <= 0
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
        assert e.top_logprobs[0].token == e.token  # greedy takes the top token
    assert entries[-1].token == IM_END and entries[-1].logprob > -1  # sure it is done


def test_prefix_cache_across_turns(client: openai.OpenAI) -> None:
    """Each turn's prompt is the previous turn's prompt and reply plus a new question: all but
    the last partial block of what the previous turn computed comes from the prefix cache."""
    messages = [{"role": "system", "content": "You are a geography tutor. Answer briefly."}]
    cached: list[int] = []
    prompt_tokens: list[int] = []
    for question in ("What is the capital of France?", "And of Italy?", "And of Spain?"):
        messages.append({"role": "user", "content": question})
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0
        )
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        details = r.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        prompt_tokens.append(r.usage.prompt_tokens)
    assert cached[0] < cached[1] < cached[2], (cached, prompt_tokens)
    for turn in (1, 2):  # at least the previous prompt's full blocks
        assert cached[turn] % 16 == 0 and cached[turn] >= prompt_tokens[turn - 1] // 16 * 16


def test_responses_and_messages_apis(client: openai.OpenAI) -> None:
    """The coding agents' APIs (tests/test_agent_apis.py) on real text: OpenAI's Responses with
    a conversation continued by previous_response_id, Anthropic's Messages streamed, each ending
    on the model's own <|im_end|> (completed, end_turn)."""
    first = client.responses.create(
        model=MODEL, input=FRANCE[0]["content"], temperature=0, max_output_tokens=24
    )
    assert first.status == "completed" and first.output_text == PARIS
    more = client.responses.create(
        model=MODEL, input="And of Italy?", previous_response_id=first.id, temperature=0,
        max_output_tokens=24,
    )  # fmt: skip
    assert more.status == "completed" and "Rome" in more.output_text
    assert more.usage.input_tokens_details.cached_tokens >= 16  # the first turn, from the cache
    base_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    claude = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    with claude.messages.stream(
        model=MODEL, max_tokens=24, messages=FRANCE, extra_body={"temperature": 0}
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "end_turn" and message.content[0].text == PARIS
