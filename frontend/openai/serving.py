"""What the completion and chat endpoints share: checks, sampling params, streams, disconnects.

Every check a client can fail raises `APIError(400, ...)` before anything reaches the engine, so a
bad request never occupies the core. A request ends early (client gone, task cancelled) by closing
its `AsyncEngine.generate` generator, which aborts it in the core and frees its KV blocks: streams
are closed explicitly (`SSEResponse`, `merge_streams`) rather than left to the garbage collector.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.frontend.async_engine import AsyncEngine
from pagedserve.frontend.openai.metrics import Metrics
from pagedserve.frontend.openai.protocol import ENGINE_ERRORS, APIError, engine_api_error
from pagedserve.frontend.openai.structured import GrammarValidator, spec_from_request
from pagedserve.frontend.outputs import CompletionOutput, RequestOutput
from pagedserve.ipc.messages import MAX_LOGPROBS, MAX_N, SamplingParams, StructuredOutputs

T = TypeVar("T")
_DONE = object()
logger = logging.getLogger("pagedserve.api")
MAX_CHOICES = 2048  # prompts x n of one request: each is an engine request


class Serving:
    def __init__(
        self, engine: AsyncEngine, metrics: Metrics | None = None, log_requests: bool = False
    ) -> None:
        self.engine = engine
        self.log_requests = log_requests  # prompts reach the log only when asked (--log-requests)
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

    # ------------------------------------------------------------------ checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )

    def check_alive(self) -> None:
        message = self.engine.dead_message
        if message is None:
            try:
                self.engine.client.check_alive()
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

    def check_request(self, req: Any) -> None:
        """Checks that do not depend on the prompt."""
        self.check_model(req.model)
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
        if req.max_tokens is not None and req.max_tokens < 1:
            raise APIError(400, "max_tokens must be at least 1.", param="max_tokens")
        self.check_alive()

    async def structured_outputs(self, req: Any) -> StructuredOutputs | None:
        """The request's grammar (response_format or structured_outputs), checked: a 400 names
        what does not compile."""
        spec = spec_from_request(req)
        if spec is not None:
            await self.grammars.check(spec, "response_format" if req.response_format else
                                      "structured_outputs")  # fmt: skip
        return spec

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

    # ------------------------------------------------------------------ generation
    def generate(
        self, ids: list[int], params: SamplingParams, prompt: str | None, priority: int
    ) -> AsyncIterator[RequestOutput]:
        request_id = self.engine.new_request_id()
        if self.log_requests:
            logger.info(
                "request %s: prompt %r, %d tokens, %s", request_id, prompt, len(ids), params
            )
        stream = self.engine.generate(ids, params, request_id, prompt=prompt, priority=priority)
        if self.metrics is not None:
            stream = self.metrics.track(stream, len(ids))
        return stream

    async def admit(
        self, streams: list[AsyncIterator[RequestOutput]]
    ) -> list[AsyncIterator[RequestOutput]]:
        """Start the requests and wait for the core's answer to each (admitted, or refused with a
        503 + Retry-After when its queue is full) before any status line is sent: a refusal is
        then a 503, not an error inside a 200 stream. Refused: every other one is aborted."""
        firsts = await asyncio.gather(*(_first(s) for s in streams), return_exceptions=True)
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)  # type: ignore[attr-defined]
            raise errors[0]
        return [_prepend(f, s) for f, s in zip(firsts, streams, strict=True)]  # type: ignore[arg-type]


async def _first(stream: AsyncIterator[T]) -> T:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("a request ended without any output") from None


async def _prepend(first: T, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        yield first
        async for item in stream:
            yield item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


class Cursor:
    """How much of one choice a stream has sent: text, tokens and (legacy logprobs) text offset."""

    def __init__(self, text_offset: int = 0) -> None:
        self.text_len = 0
        self.num_tokens = 0
        self.text_offset = text_offset
        self.started = False
        self.done = False

    def advance(self, choice: CompletionOutput) -> tuple[str, int] | None:
        """(new text, index of the first new token), or None when nothing changed."""
        if self.done:
            return None
        text = choice.text[self.text_len :]
        start = self.num_tokens
        self.done = choice.finish_reason is not None
        if not text and len(choice.token_ids) == start and not self.done:
            return None
        self.text_len = max(self.text_len, len(choice.text))
        self.num_tokens = len(choice.token_ids)
        return text, start


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


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as (stream index, item). Leaving early cancels (and so closes)
    every stream still running."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, _DONE, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    pass


async def run_until_disconnect(coro: Any, request: Request) -> Any:
    """Await `coro` unless the client goes away first; then cancel it (which aborts its requests
    in the engine) and raise ClientDisconnected."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends (on a client
    disconnect starlette cancels the send task; the generator may be parked at a `yield`)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def stream_error(e: Exception) -> dict[str, Any]:
    """The error event that ends a stream that failed after its 200 went out."""
    if isinstance(e, APIError):
        return e.body()
    if isinstance(e, ENGINE_ERRORS):
        return engine_api_error(e).body()
    logger.exception("a stream failed")
    return APIError(500, f"Internal error: {type(e).__name__}: {e}").body()


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def now_s() -> int:
    return int(time.time())
