"""A real `launch` of a tiny random Qwen3.5 (hybrid) model serving a Qwen3.5-style chat template
(tests/data/qwen3_5_chat_template.jinja: ChatML, <think> blocks, XML tool calls) with
`--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser qwen3_coder`, driven by
the openai client.

- Thinking on (the default): the template opens `<think>` in the prompt, so the whole greedy
  reply, token for token what transformers generates from the same rendered prompt, is
  `reasoning_content`. `chat_template_kwargs: {"enable_thinking": false}` closes an empty block
  instead: the prompt grows by it and the reply is all content.
- A tool call, forced deterministically (random weights call nothing): `logit_bias` makes
  `</think>` the first token and a `structured_outputs` regex (which applies after `</think>`,
  or at once when the prompt already closed thinking) writes the XML call; the qwen3_coder parser
  reads it, typing each parameter by the tool's schema, whole and streamed.
"""

from __future__ import annotations

import json
import os

import openai
import pytest
import torch
from test_server import Launched, launch_args

from tiny_models import TEXT, VOCAB_SIZE, make_tiny_model

TEMPLATE = os.path.join(os.path.dirname(__file__), "data", "qwen3_5_chat_template.jinja")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MODEL = "qwen3.5-chat"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
NUM_NEW = 6


def make_qwen35_chat_model(path: str) -> str:
    """The tiny Qwen3.5 with a Qwen-style tokenizer: ChatML specials, `<|im_end|>` ending a
    turn, the think and tool tags as added (not special) tokens, the template above."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    make_tiny_model("qwen3.5", path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TAGS), special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(TEXT.splitlines() * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    assert tok.get_vocab_size() == VOCAB_SIZE
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    with open(TEMPLATE) as f:
        fast.chat_template = f.read()
    fast.save_pretrained(path)
    for name, ids in (("config.json", 2), ("generation_config.json", [2, 0])):
        with open(os.path.join(path, name)) as f:
            config = json.load(f)
        config.update(bos_token_id=None, eos_token_id=ids, pad_token_id=0)
        with open(os.path.join(path, name), "w") as f:
            json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_qwen35_chat_model(str(tmp_path_factory.getbasetemp() / MODEL))


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    args = launch_args(
        model_dir, "--served-model-name", MODEL, "--max-model-len", "512",
        "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
        "--tool-call-parser", "qwen3_coder",
    )  # fmt: skip
    proc = Launched(args, str(tmp_path_factory.mktemp("hybrid-chat") / "launch.log"))
    url = proc.wait_ready()
    yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert proc.stop() == 0, proc.output()


def _transformers_reply(model_dir: str, **kwargs) -> tuple[int, str]:
    """(prompt tokens, greedy reply text) of transformers on the template's rendering."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False
    )
    return ids.shape[1], tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_on_and_off(client, model_dir, thinking):
    switch = {} if thinking else {"enable_thinking": False}
    num_prompt, want = _transformers_reply(model_dir, **switch)
    want = want.removesuffix("\ufffd")  # a stream holds back a last incomplete UTF-8 character
    assert want and "</think>" not in want and "<tool_call>" not in want
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=NUM_NEW,
        temperature=0,
        extra_body={"chat_template_kwargs": switch},
    )
    message = r.choices[0].message
    assert r.usage.prompt_tokens == num_prompt
    got = (message.reasoning_content, message.content)
    assert got == ((want, None) if thinking else (None, want)), got


def _reply(chunks) -> tuple[str, str, list, str | None]:
    """(reasoning, content, [(name, arguments)], finish_reason) of a streamed reply."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (
                    name + (t.function.name or ""),
                    args + (t.function.arguments or ""),
                )
            finish = c.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(("thinking", "stream"), [(True, False), (False, True)])
def test_forced_tool_call(client, model_dir, thinking, stream):
    """Thinking on: `</think>` first (logit_bias), then the grammar; off: the grammar at once."""
    from tokenizers import Tokenizer

    end_id = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).token_to_id("</think>")
    body = {
        "structured_outputs": {"regex": CALL.replace("\n", "\\n")},
        "chat_template_kwargs": {"enable_thinking": thinking},
    }
    bias = {str(end_id): 100} if thinking else None
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=120, temperature=0,
        logit_bias=bias, stream=stream, extra_body=body,
    )  # fmt: skip
    if stream:
        reasoning, content, calls, finish = _reply(r)
    else:
        choice = r.choices[0]
        message, finish = choice.message, choice.finish_reason
        reasoning, content = message.reasoning_content, message.content
        calls = [(t.function.name, t.function.arguments) for t in message.tool_calls or []]
    assert finish == "tool_calls" and not reasoning and not content, (reasoning, content)
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "days": 3})]
