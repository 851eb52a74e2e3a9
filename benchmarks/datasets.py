"""The prompts `pagedserve bench serve` sends, in vLLM's dataset formats (`--dataset-name`):

- `random`: prompts of exact token lengths drawn from the served model's own vocabulary (special
  tokens left out), sent as token ids to /v1/completions and as their text to chat; with
  `--random-prefix-len N` every prompt starts with the same N random tokens (vLLM's flag: the
  prompt is N + `--random-input-len` tokens, a shared system prompt for prefix caching);
- `sharegpt`: a JSON list of `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
  "value": ...}, ...]}`; the first turn is the prompt and the second's length the output length
  (or `--sharegpt-output-len`); entries with fewer than two turns are skipped;
- `custom`: JSONL, one `{"prompt": ...}` a line, rendered with the chat template for
  /v1/completions unless `--custom-skip-chat-template`; output length `--custom-output-len`.

Lengths are counted with the model's tokenizer. Like vLLM: file datasets are shuffled with the
seed, samples too short (< 4 tokens) or too long are dropped, and a dataset with fewer samples than
`--num-prompts` is oversampled.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedserve.benchmarks.common import random_lengths

MIN_LEN = 4  # vLLM's is_valid_sequence: shorter prompts or replies are dropped
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


@dataclass
class SampleRequest:
    """One request to send: `prompt` is text, or token ids (random prompts on /v1/completions)."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def get_samples(
    args: argparse.Namespace, tokenizer: Any, vocab_size: int | None, max_model_len: int | None
) -> list[SampleRequest]:
    rng = np.random.default_rng(args.seed)
    name, chat = args.dataset_name, args.endpoint.endswith("/chat/completions")
    if name == "random":
        if args.dataset_path is not None:
            raise ValueError("--dataset-name random takes no --dataset-path")
        return random_samples(args, tokenizer, vocab_size, rng, as_text=chat)
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if tokenizer is None:
        raise ValueError(f"--dataset-name {name} needs the model's tokenizer (--tokenizer)")
    if name == "sharegpt":
        samples = sharegpt_samples(args.dataset_path, tokenizer, args.sharegpt_output_len, rng)
    else:
        template = not chat and not args.custom_skip_chat_template
        samples = custom_samples(
            args.dataset_path, tokenizer, args.custom_output_len, template, rng
        )
    if max_model_len is not None:
        samples = [s for s in samples if s.prompt_len + s.expected_output_len <= max_model_len]
    if not samples:
        raise ValueError(f"{args.dataset_path}: no usable samples (too short or too long)")
    return oversample(samples, args.num_prompts, rng)


def random_samples(
    args: argparse.Namespace,
    tokenizer: Any,
    vocab_size: int | None,
    rng: np.random.Generator,
    as_text: bool,
) -> list[SampleRequest]:
    if as_text and tokenizer is None:
        raise ValueError("random prompts for chat need the model's tokenizer (--tokenizer)")
    n = args.num_prompts
    in_lens = random_lengths(args.random_input_len, args.random_range_ratio, n, rng)
    out_lens = random_lengths(args.random_output_len, args.random_range_ratio, n, rng)
    allowed = token_pool(tokenizer, vocab_size)
    prefix_len = args.random_prefix_len
    prefix = rng.choice(allowed, size=prefix_len).tolist() if prefix_len else []
    samples = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        ids = prefix + rng.choice(allowed, size=in_len).tolist()
        prompt = tokenizer.decode(ids) if as_text else ids
        samples.append(SampleRequest(prompt, prefix_len + in_len, out_len))
    return samples


def token_pool(tokenizer: Any, vocab_size: int | None) -> np.ndarray:
    """The ids random prompts are drawn from: the tokenizer's vocabulary less its special tokens
    (`--vocab-size` overrides the size, e.g. for a server whose tokenizer is not at hand)."""
    if vocab_size is None and tokenizer is None:
        raise ValueError("random prompts need the model's tokenizer (--tokenizer) or --vocab-size")
    size = vocab_size if vocab_size is not None else len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    pool = np.array([i for i in range(size) if i not in special])
    if pool.size == 0:
        raise ValueError(f"no ordinary token ids below {size}")
    return pool


def sharegpt_samples(
    path: str, tokenizer: Any, output_len: int | None, rng: np.random.Generator
) -> list[SampleRequest]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    entries = [e for e in data if len(e.get("conversations") or []) >= 2]
    samples = []
    for i in rng.permutation(len(entries)):
        turns = entries[i]["conversations"]
        prompt, reply = turns[0]["value"], turns[1]["value"]
        prompt_len = len(tokenizer(prompt)["input_ids"])
        out_len = len(tokenizer(reply)["input_ids"]) if output_len is None else output_len
        if valid_lengths(prompt_len, out_len, fixed_output=output_len is not None):
            samples.append(SampleRequest(prompt, prompt_len, out_len))
    return samples


def custom_samples(
    path: str, tokenizer: Any, output_len: int, template: bool, rng: np.random.Generator
) -> list[SampleRequest]:
    from pagedserve.frontend.tokenizer import render_chat

    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if any("prompt" not in row for row in rows):
        raise ValueError(f"{path}: every JSONL line needs a 'prompt'")
    samples = []
    for i in rng.permutation(len(rows)):
        prompt = rows[i]["prompt"]
        if template:
            prompt = render_chat(tokenizer, [{"role": "user", "content": prompt}])
        prompt_len = len(tokenizer(prompt)["input_ids"])  # as the server encodes a text prompt
        samples.append(SampleRequest(prompt, prompt_len, output_len))
    return samples


def valid_lengths(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    too_short = prompt_len < MIN_LEN or (not fixed_output and output_len < MIN_LEN)
    too_long = prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN
    return not too_short and not too_long


def oversample(
    samples: list[SampleRequest], n: int, rng: np.random.Generator
) -> list[SampleRequest]:
    """Exactly `n` samples: the first `n`, or all of them plus random repeats."""
    if len(samples) >= n:
        return samples[:n]
    extra = rng.choice(len(samples), size=n - len(samples)).tolist()
    return samples + [samples[i] for i in extra]


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset-name", default="random", choices=["random", "sharegpt", "custom", "multi-turn"]
    )
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON or custom JSONL file")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (default: --model, or the server's model path)",
    )
    p.add_argument("--vocab-size", type=int, default=None,
                   help="random ids below this (default: the tokenizer's vocabulary)")  # fmt: skip
    p.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=int,
                   default=512)  # fmt: skip
    p.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=int,
                   default=256)  # fmt: skip
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="one shared random prefix of N tokens before every prompt")  # fmt: skip
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--custom-output-len", type=int, default=256)
    p.add_argument("--custom-skip-chat-template", action="store_true")
