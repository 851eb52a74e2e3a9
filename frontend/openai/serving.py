"""What the completion and chat endpoints share: checks, sampling params, admission.

Every check a client can fail raises `APIError(400, ...)` before anything reaches the engine, so a
bad request never occupies the core. A request ends early (client gone, task cancelled) by closing
its `AsyncEngine.generate` generator, which aborts it in the core and frees its KV blocks (streams
and their helpers: streams.py). Prompts are tokenized on a thread (the tokenizer releases the GIL),
after a check of their length in characters that refuses, untokenized, a text too long for any
`max_model_len` tokens.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request

from pagedserve.frontend.async_engine import AsyncEngine
from pagedserve.frontend.detokenizer import check_stop_strings, check_unicode
from pagedserve.frontend.openai.metrics import Metrics
from pagedserve.frontend.openai.protocol import APIError
from pagedserve.frontend.openai.request_log import request_tally, tally_outputs
from pagedserve.frontend.openai.streams import (
    ClientDisconnected,
    first_item,
    run_until_disconnect,
)
from pagedserve.frontend.openai.structured import GrammarValidator, spec_from_request
from pagedserve.frontend.outputs import RequestOutput
from pagedserve.frontend.pooling import runner_error
from pagedserve.frontend.tokenizer import encode_prompts
from pagedserve.ipc.messages import (
    MAX_LOGPROBS,
    MAX_N,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    StructuredOutputs,
)

MAX_CHOICES = 2048  # prompts x n of one request: each is an engine request
# The core answers every request at once; this only ends a wait for an answer that got lost.
ADMIT_TIMEOUT_S = 120.0


class Serving:
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: Metrics | None = None,
        prompt_tokens_details: bool = False,
    ) -> None:
        self.engine = engine
        # usage.prompt_tokens_details.cached_tokens only when asked (--enable-prompt-tokens-
        # details, as vLLM): a client's cache hits tell what other clients' prompts hold
        self.prompt_tokens_details = prompt_tokens_details
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_name = engine.config.model.name
        self.model_names = engine.config.model.names
        # generation_config.json's values, for requests that leave them unset (vLLM's rule)
        self.default_sampling = engine.default_sampling
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.config.model.vocab_size
        self.metrics = metrics
        self.grammars = GrammarValidator()
        per_token = engine.max_chars_per_token
        self.max_prompt_chars = None if per_token is None else self.max_model_len * per_token

    # ------------------------------------------------------------------ checks
    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter `name` selects (None: the base model); an unknown name is a 404."""
        if name is None or name in self.model_names:
            return None
        lora = self.engine.loras.get(name) if self.engine.loras is not None else None
        if lora is None:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return lora

    def check_alive(self) -> None:
        message = self.engine.dead_message
        if message is None:
            try:
                self.engine.check_alive()
            except Exception as e:
                message = str(e)
        if message is not None:
            raise APIError(503, f"The engine is not running: {message}", code="engine_dead")

    def check_prompt(self, ids: list[int], max_tokens: int | None) -> int:
        """Check a prompt's token ids; return max_tokens (default: up to max_model_len, or
        generation_config's max_new_tokens if smaller)."""
        if not ids:
            raise APIError(400, "The prompt is empty.", param="prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise APIError(
                400, f"Token id {bad} is out of vocabulary (size {self.vocab_size}).", "prompt"
            )
        limit = self.max_model_len
        if max_tokens is None:
            if len(ids) >= limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt has {len(ids)} tokens, which leaves no room for a completion. "
                    "Please reduce the length of the prompt.",
                    param="prompt",
                )
            return min(limit - len(ids), self.default_sampling.get("max_tokens") or limit)
        if len(ids) + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or completion.",
                param="max_tokens",
            )
        return max_tokens

    def check_text(self, text: str, param: str) -> None:
        """A prompt text that cannot fit max_model_len whatever its tokens (refused before it is
        tokenized), or that is not valid Unicode, is a 400."""
        limit, bound = self.max_model_len, self.max_prompt_chars
        if bound is not None and len(text) > bound:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(text)} characters, more than {limit} tokens of this model's tokenizer can "
                f"hold ({bound} characters at most). Please reduce the length of the prompt.",
                param=param,
            )
        try:
            check_unicode(text, param)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    async def tokenize(
        self, texts: list[str], add_special_tokens: bool, param: str
    ) -> list[list[int]]:
        """Token ids of prompt texts, checked first (`check_text`), tokenized on a thread."""
        if not texts:
            return []
        for text in texts:
            self.check_text(text, param)
        encode = functools.partial(encode_prompts, self.tokenizer, texts, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(None, encode)

    def check_request(self, req: Any) -> LoRARequest | None:
        """Checks that do not depend on the prompt; the LoRA adapter `model` names, if any."""
        lora = self.check_model(req.model)
        error = runner_error(self.config.model.pooling, False, "Text generation")
        if error is not None:
            raise APIError(400, error, param="model")
        if not 1 <= req.n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}.", param="n")
        if not -(2**31) <= req.priority < 2**31:
            raise APIError(400, "priority must fit in 32 bits.", param="priority")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must be equal to n (or unset).", param="best_of")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true.", "stream")
        if req.priority != 0 and self.config.scheduler.policy != "priority":
            raise APIError(
                400, "priority needs the server to run with --scheduling-policy priority.",
                param="priority",
            )  # fmt: skip
        if req.max_tokens is not None and req.max_tokens < (0 if getattr(req, "echo", 0) else 1):
            message = "max_tokens must be at least 1 (0 only with echo: the prompt scored alone)."
            raise APIError(400, message, param="max_tokens")
        self.check_alive()
        return lora

    async def structured_outputs(self, req: Any) -> StructuredOutputs | None:
        """The request's grammar (response_format or structured_outputs), checked: a 400 names
        what does not compile."""
        spec = spec_from_request(req)
        if spec is not None:
            await self.check_grammar(
                spec, "response_format" if req.response_format else "structured_outputs"
            )
        return spec

    async def check_grammar(self, spec: StructuredOutputs, param: str) -> None:
        """A grammar that compiles and can cross the ipc (no lone surrogate in a regex, choice or
        schema), else a 400 naming `param`."""
        try:
            msgspec.msgpack.encode(spec)
        except UnicodeEncodeError as e:
            surrogate = ascii(e.object[e.start])
            message = f"{param} is not valid Unicode text: it holds a lone surrogate ({surrogate})."
            raise APIError(400, message, param=param) from None
        await self.grammars.check(spec, param)

    # ------------------------------------------------------------------ sampling
    def sampling_params(
        self,
        req: Any,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutputs | None = None,
    ) -> SamplingParams:
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}.", "logprobs")
        names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")  # fmt: skip
        fields = {name: getattr(req, name) for name in names}
        fields = {**self.default_sampling, **{k: v for k, v in fields.items() if v is not None}}
        fields.pop("max_tokens", None)  # decided by check_prompt
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        try:
            check_stop_strings(stop or [])
        except ValueError as e:
            raise APIError(400, str(e), param="stop") from None
        try:
            return SamplingParams(
                n=req.n,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                logit_bias=self._logit_bias(req.logit_bias),
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured,
                cache_salt=req.cache_salt,
                **fields,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        out = {}
        for key, value in bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise APIError(
                    400, f"logit_bias key {key!r} is not a token id.", "logit_bias"
                ) from None
            if not 0 <= token_id < self.vocab_size:
                raise APIError(
                    400, f"logit_bias token id {token_id} is out of vocabulary.", "logit_bias"
                )
            if not -100 <= value <= 100:
                raise APIError(400, "logit_bias values must be in [-100, 100].", "logit_bias")
            out[token_id] = float(value)
        return out

    def usage(self, num_prompt: int, num_generated: int, num_cached: int | None = None) -> dict:
        """The usage object; cached tokens only with --enable-prompt-tokens-details."""
        return usage(num_prompt, num_generated, num_cached if self.prompt_tokens_details else None)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        priority: int,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        request_id = self.engine.new_request_id()
        stream = self.engine.generate(
            ids, params, request_id, prompt=prompt, priority=priority, lora_request=lora,
            pooling=pooling,
        )  # fmt: skip
        if self.metrics is not None:
            core_of = self.engine.cores.core_of
            stream = self.metrics.track(stream, len(ids), lambda: core_of(request_id))
        return stream

    async def admit(
        self, streams: list[AsyncIterator[RequestOutput]], raw: Request
    ) -> list[AsyncIterator[RequestOutput]]:
        """Start the requests and wait for the core's answer to each (admitted, or refused with a
        503 + Retry-After when its queue is full) before any status line is sent: a refusal is
        then a 503, not an error inside a 200 stream. Refused: every other one is aborted. A
        client that leaves while waiting aborts them too (ClientDisconnected); an answer that
        never comes is a 503 after ADMIT_TIMEOUT_S."""
        wait = asyncio.gather(*(first_item(s) for s in streams), return_exceptions=True)
        wait.add_done_callback(_retrieve)  # left behind on a disconnect: nothing to log
        try:
            firsts = await run_until_disconnect(asyncio.wait_for(wait, ADMIT_TIMEOUT_S), raw)
        except (ClientDisconnected, asyncio.TimeoutError) as e:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)  # type: ignore[attr-defined]
            if isinstance(e, ClientDisconnected):
                raise
            message = f"The engine did not answer within {ADMIT_TIMEOUT_S:.0f} s."
            raise APIError(503, message, code="engine_timeout") from None
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)  # type: ignore[attr-defined]
            raise errors[0]
        tally = request_tally(raw.scope)  # counted for the request's log line
        return [tally_outputs(f, s, tally) for f, s in zip(firsts, streams, strict=True)]  # type: ignore[arg-type]


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as seen (asyncio logs an exception nobody retrieved)."""
    if not future.cancelled():
        future.exception()


def check_prompt_logprobs(req: Any) -> int | None:
    """vLLM's `prompt_logprobs` request field (completions and chat), checked."""
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            message = f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}."
            raise APIError(400, message, param="prompt_logprobs")
        if req.stream:
            message = "prompt_logprobs is not available when stream is enabled (as in vLLM)."
            raise APIError(400, message, param="prompt_logprobs")
    return req.prompt_logprobs


def vllm_prompt_logprobs(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` in a response: per prompt token, token id -> its logprob."""
    assert out.prompt_logprobs is not None
    return [
        None
        if entries is None
        else {
            str(tid): {
                "logprob": clamp_logprob(e.logprob),
                "rank": e.rank,
                "decoded_token": e.decoded_token,
            }  # fmt: skip
            for tid, e in entries.items()
        }
        for entries in out.prompt_logprobs
    ]


def clamp_logprob(value: float) -> float:
    return max(value, -9999.0)  # JSON has no -inf


def usage(num_prompt: int, num_generated: int, num_cached: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_generated,
        "total_tokens": num_prompt + num_generated,
    }
    if num_cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return out


def now_s() -> int:
    return int(time.time())
