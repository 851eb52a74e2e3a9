"""POST /v1/completions: prompts as text or token ids (one or many), echo, legacy logprobs, SSE.

Each prompt of a request is one engine request (with `n` choices); choice `j` of prompt `i` is
numbered `i * n + j`, as OpenAI and vLLM do.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from starlette.responses import Response

from pagedserve.frontend.openai.protocol import APIError, CompletionRequest
from pagedserve.frontend.openai.serving import (
    MAX_CHOICES,
    Serving,
    check_prompt_logprobs,
    clamp_logprob,
    now_s,
    vllm_prompt_logprobs,
)
from pagedserve.frontend.openai.streams import (
    SSE_DONE,
    ClientDisconnected,
    Cursor,
    SSEResponse,
    merge_streams,
    run_until_disconnect,
    sse,
    stream_error,
)
from pagedserve.frontend.outputs import CompletionOutput, RequestOutput
from pagedserve.ipc.messages import SamplingParams

_encode = msgspec.json.encode


class CompletionServing(Serving):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        lora = self.check_request(req)
        prompt_logprobs = _check_prompt_logprobs(req)
        # echo with max_tokens 0 scores the prompt alone: one token is generated and dropped
        max_tokens = 1 if _scores_only(req) else req.max_tokens
        prompts = await self._prompts(req)
        if len(prompts) * req.n > MAX_CHOICES:
            message = f"prompts x n must be at most {MAX_CHOICES} (got {len(prompts) * req.n})."
            raise APIError(400, message, param="prompt")
        spec = await self.structured_outputs(req)
        params = [
            msgspec.structs.replace(
                self.sampling_params(req, self.check_prompt(ids, max_tokens), req.logprobs, spec),
                prompt_logprobs=prompt_logprobs,
            )
            for _, ids in prompts
        ]
        generating = [
            self.generate(ids, p, text, req.priority, lora)
            for (text, ids), p in zip(prompts, params, strict=True)
        ]
        try:
            streams = await self.admit(generating, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": now_s(),
            "model": req.model or self.model_name,
        }
        if req.stream:
            return SSEResponse(self._stream(req, head, prompts, params, streams))
        try:
            finals = await run_until_disconnect(_collect(streams), raw)
        except ClientDisconnected:
            return Response(status_code=499)
        return Response(_encode(self._response(req, head, prompts, finals)), 200)

    async def _prompts(self, req: CompletionRequest) -> list[tuple[str, list[int]]]:
        """(text, token ids) per prompt; text is decoded from ids for token-id prompts."""
        raw = req.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]  # type: ignore[list-item]
        if not raw or any(not p for p in raw):
            raise APIError(400, "The prompt is empty.", param="prompt")
        texts = [p for p in raw if isinstance(p, str)]
        encoded = iter(await self.tokenize(texts, req.add_special_tokens, "prompt"))
        prompts = []
        for p in raw:
            if isinstance(p, str):
                prompts.append((p, next(encoded)))
            else:
                ids = list(p)
                self.check_prompt(ids, req.max_tokens)  # out-of-vocab ids must not reach decode
                prompts.append((self.tokenizer.decode(ids), ids))
        return prompts

    def _response(
        self,
        req: CompletionRequest,
        head: dict[str, Any],
        prompts: list[tuple[str, list[int]]],
        finals: list[RequestOutput],
    ) -> dict[str, Any]:
        choices = []
        scores_only = _scores_only(req)
        for i, ((text, ids), out) in enumerate(zip(prompts, finals, strict=True)):
            for c in out.outputs:
                prefix = text if req.echo else ""
                lp, offset = None, len(prefix)
                if req.echo and req.logprobs is not None:
                    lp, offset = self._prompt_part(ids, out, req.logprobs)
                if c.logprobs is not None and not scores_only:
                    body = completion_logprobs(c, 0, len(c.token_ids), offset)[0]
                    lp = body if lp is None else {k: lp[k] + body[k] for k in body}
                choice = _choice(
                    i * req.n + c.index, prefix + ("" if scores_only else c.text), lp, c
                )
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(out)
                choices.append(choice)
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_generated = sum(len(c.token_ids) for out in finals for c in out.outputs)
        num_generated = 0 if scores_only else num_generated
        num_cached = sum(out.num_cached_tokens for out in finals)
        total = self.usage(num_prompt, num_generated, num_cached)
        return {**head, "choices": choices, "usage": total}

    async def _stream(
        self,
        req: CompletionRequest,
        head: dict[str, Any],
        prompts: list[tuple[str, list[int]]],
        params: list[SamplingParams],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[bytes]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        cursors = {(i, j): Cursor() for i in range(len(prompts)) for j in range(req.n)}
        num_generated = [0] * len(prompts)
        num_cached = [0] * len(prompts)
        merged = merge_streams(streams)
        try:
            async for i, out in merged:
                num_cached[i] = out.num_cached_tokens
                if _scores_only(req):  # the prompt, scored, once it is (nothing generated)
                    for c in out.outputs if out.finished else ():
                        lp = None
                        if req.logprobs is not None:
                            lp = self._prompt_part(prompts[i][1], out, req.logprobs)[0]
                        choice = _choice(i * req.n + c.index, prompts[i][0], lp, c)
                        yield sse(_encode({**head, "choices": [choice]}))
                    continue
                num_generated[i] = sum(len(c.token_ids) for c in out.outputs)
                for c in out.outputs:
                    cursor = cursors[(i, c.index)]
                    step = cursor.advance(c)
                    if step is None:
                        continue
                    text, start = step
                    lp = None
                    if req.echo and not cursor.started:
                        text = prompts[i][0] + text
                        if req.logprobs is not None:
                            lp, cursor.text_offset = self._prompt_part(
                                prompts[i][1], out, req.logprobs
                            )
                    cursor.started = True
                    if c.logprobs is not None:
                        body, cursor.text_offset = completion_logprobs(
                            c, start, len(c.token_ids), cursor.text_offset
                        )
                        lp = body if lp is None else {k: lp[k] + body[k] for k in body}
                    chunk = {**head, "choices": [_choice(i * req.n + c.index, text, lp, c)]}
                    if continuous:
                        chunk["usage"] = self.usage(len(prompts[i][1]), num_generated[i])
                    yield sse(_encode(chunk))
            if include_usage:
                num_prompt = sum(len(ids) for _, ids in prompts)
                total = self.usage(num_prompt, sum(num_generated), sum(num_cached))
                yield sse(_encode({**head, "choices": [], "usage": total}))
        except Exception as e:
            yield sse(_encode(stream_error(e)))
        finally:
            await merged.aclose()
        yield SSE_DONE

    def _prompt_part(
        self, ids: list[int], out: RequestOutput, top: int
    ) -> tuple[dict[str, Any], int]:
        """Legacy logprobs of the echoed prompt (its first token has none), the next offset."""
        assert out.prompt_logprobs is not None, "echo with logprobs asks for prompt logprobs"
        tokens, token_logprobs, tops, offsets, offset = [], [], [], [], 0
        for token_id, entries in zip(ids, out.prompt_logprobs, strict=True):
            if entries is None:
                token, lp, ranked = self.tokenizer.decode([token_id]), None, None
            else:
                token = entries[token_id].decoded_token or ""
                lp = clamp_logprob(entries[token_id].logprob)
                ranked = _ranked(
                    e for e in entries.values() if e is entries[token_id] or (e.rank or 0) <= top
                )
            tokens.append(token)
            token_logprobs.append(lp)
            tops.append(ranked)
            offsets.append(offset)
            offset += len(token)
        body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops}
        return {**body, "text_offset": offsets}, offset


def _check_prompt_logprobs(req: CompletionRequest) -> int | None:
    """The prompt logprobs the engine computes: vLLM's `prompt_logprobs` field, else (echo with
    logprobs) `logprobs`'s."""
    prompt_logprobs = check_prompt_logprobs(req)
    if req.echo and req.logprobs is not None:
        return max(req.logprobs, prompt_logprobs or 0)
    return prompt_logprobs


def _scores_only(req: CompletionRequest) -> bool:
    return req.echo and req.max_tokens == 0


def _ranked(entries: Any) -> dict[str, float]:
    ranked: dict[str, float] = {}
    for e in sorted(entries, key=lambda e: e.rank or 0):
        # Tokens can share a text (partial UTF-8 is "\ufffd"): keep the likeliest.
        ranked.setdefault(e.decoded_token or "", clamp_logprob(e.logprob))
    return ranked


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        finals[i] = out
    assert all(f is not None and f.finished for f in finals)
    return finals  # type: ignore[return-value]


def _choice(index: int, text: str, logprobs: Any, c: CompletionOutput) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def completion_logprobs(
    c: CompletionOutput, start: int, end: int, text_offset: int
) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs for tokens [start, end) of a choice, and the next text offset."""
    assert c.logprobs is not None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entries in zip(c.token_ids[start:end], c.logprobs[start:end], strict=True):
        sampled = entries[token_id]
        token = sampled.decoded_token or ""
        tokens.append(token)
        token_logprobs.append(clamp_logprob(sampled.logprob))
        top.append(_ranked(entries.values()))
        offsets.append(text_offset)
        text_offset += len(token)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top}
    return {**body, "text_offset": offsets}, text_offset
