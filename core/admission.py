"""The EngineCore is the gate: what it checks before a client's request or a worker's result may
touch the scheduler.

Any process that reaches the core's sockets (an API server, `LLM`, or a careless or hostile one)
sends messages that msgspec has only type-checked. A value the model cannot take (a token id
outside the vocabulary, more logprobs than it has tokens, a seed the workers cannot add to) would
raise deep in a worker or in `schedule()` and kill the engine for every user. So the core checks
each AddRequest against the model here and refuses a bad one to its sender with the reason, and
checks each StepResult against the plan it answers; a result that does not fit is dropped (a
worker that never sends a good one trips the step timeout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.core.request import Request
from pagedserve.ipc.messages import (
    MAX_LOGPROBS,
    AddRequest,
    StepResult,
    TokenLogprobs,
)

MAX_REQ_ID_LEN = 256  # request ids are echoed in every delta and log line
MAX_STOP_TOKEN_IDS = 1024
_I32 = 2**31


@dataclass(frozen=True)
class ModelLimits:
    """What the model can take: from the EngineConfig, known before any request arrives."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = MAX_LOGPROBS
    lora: bool = False  # the engine serves LoRA adapters (--enable-lora)
    # a pooling engine (--runner pooling): its task, the floats of its result, Matryoshka
    pooling_task: str | None = None
    pooling_dim: int = 0
    matryoshka: bool = False
    # an encoder's prompt runs whole in one step: at most this many tokens (None: chunked)
    whole_prompt_limit: int | None = None


def check_request(msg: AddRequest, limits: ModelLimits) -> None:
    """Raise ValueError naming the first value of `msg` this model cannot run."""
    vocab = limits.vocab_size
    _require(0 < len(msg.req_id) <= MAX_REQ_ID_LEN, f"request ids are 1 to {MAX_REQ_ID_LEN} chars")
    ids = msg.prompt_token_ids
    _require(len(ids) > 0, "the prompt is empty")
    _require(
        len(ids) <= limits.max_model_len,
        f"the prompt has {len(ids)} tokens; max_model_len is {limits.max_model_len}",
    )
    _require(min(ids) >= 0 and max(ids) < vocab, f"prompt token ids must be in [0, {vocab})")
    _require(
        all(0 <= t < vocab for t in msg.eos_token_ids), f"eos_token_ids must be in [0, {vocab})"
    )
    _require(math.isfinite(msg.arrival_time), "arrival_time must be finite")
    _require(-_I32 <= msg.priority < _I32, "priority must fit in 32 bits")
    _require(
        msg.lora is None or limits.lora,
        "a LoRA adapter was requested but the engine runs without --enable-lora",
    )
    _check_sampling(msg, limits)
    _check_pooling(msg, limits)


def _check_pooling(msg: AddRequest, limits: ModelLimits) -> None:
    """A pooling engine runs pooling requests of its task only, a generating one none."""
    pooling, task = msg.pooling, limits.pooling_task
    if task is None:
        _require(pooling is None, "this model runs the generate runner: pooling requests "
                 "(embeddings, classification, scores) need --runner pooling")  # fmt: skip
        return
    _require(pooling is not None, "this model runs the pooling runner: it does not generate text")
    _require(pooling.task == task, f"this model's pooling task is {task}, not {pooling.task}")
    _require(msg.sampling.max_tokens == 1, "a pooling request runs its prompt only (max_tokens 1)")
    limit = limits.whole_prompt_limit
    _require(
        limit is None or len(msg.prompt_token_ids) <= limit,
        f"the prompt has {len(msg.prompt_token_ids)} tokens; this encoder runs a prompt whole in "
        f"one step of at most --max-num-batched-tokens {limit} tokens",
    )
    if pooling.dimensions is not None:
        _require(limits.matryoshka, "this model does not support matryoshka representation "
                 "(dimensions): its config.json sets no is_matryoshka")  # fmt: skip
        _require(pooling.dimensions <= limits.pooling_dim,
                 f"dimensions must be at most {limits.pooling_dim}")  # fmt: skip


def _check_sampling(msg: AddRequest, limits: ModelLimits) -> None:
    p, vocab = msg.sampling, limits.vocab_size
    cap = min(limits.max_logprobs, vocab)
    _require(p.logprobs is None or p.logprobs <= cap, f"logprobs must be at most {cap}")
    _require(
        p.prompt_logprobs is None or p.prompt_logprobs <= cap,
        f"prompt_logprobs must be at most {cap}",
    )
    _require(
        p.seed is None or p.seed + p.n - 1 < 2**63,
        "seed + n - 1 must fit in 64 bits (choice i samples with seed + i)",
    )
    stops = p.stop_token_ids or []
    _require(len(stops) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
    _require(all(0 <= t < vocab for t in stops), f"stop_token_ids must be in [0, {vocab})")
    bias = p.logit_bias or {}
    _require(
        all(0 <= t < vocab for t in bias), f"logit_bias keys must be token ids in [0, {vocab})"
    )


def check_result(
    record: list[tuple[Request, bool]],
    result: StepResult,
    vocab_size: int,
    sampler_drafts: dict[str, int] | None = None,
) -> str | None:
    """Why `result` cannot answer the plan that scheduled `record` (each request, and whether
    the result still applies to it); None: it can. `sampler_drafts`: the plan's
    `num_sampler_drafts`.

    One list of at most one sampled id per scheduled request (1 + its drafts where it verified
    drafts), ids in the vocabulary, a sample only where the plan sampled (a current request has
    a token in flight), logprobs aligned."""
    sampled = result.sampled_token_ids
    if len(sampled) != len(record):
        return f"{len(sampled)} sample lists for {len(record)} scheduled requests"
    drafted = _sampler_drafts(record, result, sampler_drafts)
    if isinstance(drafted, str):
        return drafted
    for (req, current), token_ids in zip(record, sampled, strict=True):
        if not token_ids:  # (plain loop, no generators: this runs on every step's result)
            continue
        most = 1 + len(req.spec.drafts) if current and req.spec is not None else 1
        if drafted is not None and req.req_id in sampler_drafts:
            most = 1 + drafted[req.req_id]
        if len(token_ids) > most or not all(0 <= t < vocab_size for t in token_ids):
            return (
                f"request {req.req_id!r}: sampled {token_ids[:4]} (at most {most} ids in the "
                "vocabulary)"
            )
        if current and req.num_placeholders == 0:
            return f"request {req.req_id!r}: a sample where the plan sampled nothing"
    if result.logprobs is not None:
        if len(result.logprobs) != len(record):
            return f"{len(result.logprobs)} logprob entries for {len(record)} requests"
        for lps, token_ids in zip(result.logprobs, sampled, strict=True):
            if lps is not None and (len(lps) != len(token_ids) or not all(map(_aligned, lps))):
                return "logprob entries not one per sampled id, or of unequal lengths"
    if result.pooled is not None:
        if len(result.pooled) != len(record):
            return f"{len(result.pooled)} pooled entries for {len(record)} requests"
        for (req, current), pooled in zip(record, result.pooled, strict=True):
            if pooled is not None and current and (req.pooling is None or len(pooled) % 4):
                return f"request {req.req_id!r}: a pooled vector it did not ask for"
    if result.prompt_logprobs is not None:
        if len(result.prompt_logprobs) != len(record):
            return f"{len(result.prompt_logprobs)} prompt logprob lists for {len(record)} requests"
        for (req, _), entries in zip(record, result.prompt_logprobs, strict=True):
            if len(entries) > req.num_prompt_tokens - 1 or not all(map(_aligned, entries)):
                return f"request {req.req_id!r}: prompt logprob entries that do not fit its prompt"
    return None


def _aligned(entry: TokenLogprobs) -> bool:
    return 0 < len(entry.token_ids) == len(entry.logprobs) == len(entry.ranks)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _sampler_drafts(
    record: list[tuple[Request, bool]], result: StepResult, planned: dict[str, int] | None
) -> dict[str, int] | str | None:
    """The drafts the sampling ranks verified per request left to them, each within what the
    plan allowed (a string: why not)."""
    if not planned:
        return None
    if len(result.num_drafts) != len(record):
        return f"{len(result.num_drafts)} draft counts for {len(record)} scheduled requests"
    drafted = {}
    for (req, _), n in zip(record, result.num_drafts, strict=True):
        if not 0 <= n <= planned.get(req.req_id, 0):
            return f"request {req.req_id!r}: {n} drafts where the plan allowed fewer"
        drafted[req.req_id] = n
    return drafted
