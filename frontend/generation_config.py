"""What a checkpoint's generation_config.json means to the clients (LLM, API servers): every EOS id
ends a reply, and its sampling values are the defaults of requests that leave them unset.

vLLM's rules: the tokenizer's EOS and every id in generation_config's `eos_token_id` stop a request
(`ignore_eos` overrides them all); temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens become defaults unless `--generation-config vllm` (see `ModelConfig`).
"""

from __future__ import annotations

from typing import Any

from pagedserve.config import ModelConfig
from pagedserve.ipc.messages import SamplingParams


def stop_eos_ids(model: ModelConfig, tokenizer: Any) -> list[int]:
    """generation_config's EOS ids, then the tokenizer's (if another), without repeats."""
    ids = list(model.eos_token_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(int(tokenizer_eos))
    return ids


def sampling_defaults(model: ModelConfig) -> dict[str, Any]:
    """The model's sampling defaults, checked once at start-up (a bad value would otherwise fail
    every request that leaves it unset)."""
    defaults = model.default_sampling
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"generation_config.json of {model.model}: {e}") from None
    return defaults


def describe_defaults(model: ModelConfig) -> str | None:
    """One line saying which defaults were taken (None: none were)."""
    defaults = sampling_defaults(model)
    if not defaults:
        return None
    values = ", ".join(f"{k}={v}" for k, v in defaults.items())
    return (
        f"sampling defaults from generation_config.json: {values} (for requests that leave them "
        "unset; --generation-config vllm ignores them)"
    )


def default_params(model: ModelConfig) -> SamplingParams:
    """`LLM.generate` / `LLM.chat` without sampling params (as vLLM's LLM does)."""
    return SamplingParams(**sampling_defaults(model))
