"""Pooling models' routes (`--runner pooling`, docs/pooling.md), in vLLM's shapes:
/v1/embeddings (OpenAI's), /pooling, /classify, /score, and /rerank (Jina / Cohere: also
/v1/rerank and /v2/rerank).

Each input is one engine request that runs its prompt only; its vector comes back as float32
bytes (`encoding_format: base64` sends those bytes as they are). Usage counts prompt tokens. A
model of the other runner or task answers 400 naming it; fields vLLM has and we do not are
refused by name.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from pydantic import model_validator
from starlette.responses import Response

from pagedserve.frontend.openai.protocol import APIError, _Request, unsupported_field
from pagedserve.frontend.openai.serving import Serving, now_s
from pagedserve.frontend.openai.streams import ClientDisconnected, run_until_disconnect
from pagedserve.frontend.outputs import RequestOutput
from pagedserve.frontend.pooling import (
    POOLING_SAMPLING,
    cosine,
    decode_vector,
    pair_up,
    score_prompts,
    task_error,
    truncate,
)
from pagedserve.ipc.messages import PoolingParams

# vLLM's pooling request fields that pagedserve does not implement
POOLING_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "messages": (), "chat_template": (), "chat_template_kwargs": (), "mm_processor_kwargs": (),
    "activation": (True,), "use_activation": (True,), "softmax": (True,),
    "embed_dtype": ("float32",), "endianness": ("native", "little"), "cache_salt": (),
    "request_id": (),
}  # fmt: skip
Input = str | list[str] | list[int] | list[list[int]]


class _PoolingRequest(_Request):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0

    @model_validator(mode="before")
    @classmethod
    def _refuse_pooling_unsupported(cls, data: Any) -> Any:
        name = unsupported_field(data, POOLING_UNSUPPORTED, cls.model_fields)
        if name is not None:
            message = f"{name} is not supported by this server."
            raise APIError(400, message, param=name, code="unsupported_parameter")
        return data


class EmbeddingRequest(_PoolingRequest):
    input: Input
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool | None = None


class ClassificationRequest(_PoolingRequest):
    input: Input


class ScoreRequest(_PoolingRequest):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingRequest):
    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True


class PoolingServing(Serving):
    """The routes' shared steps: prompts to token ids, one engine request each, the vectors."""

    async def prompts(self, req: _PoolingRequest, raw: Input, param: str) -> list[list[int]]:
        """Token ids per input (texts tokenized, ids checked), cut to truncate_prompt_tokens."""
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]  # type: ignore[list-item]
        if not raw or any(not p for p in raw):
            raise APIError(400, f"{param} is empty.", param=param)
        texts = [p for p in raw if isinstance(p, str)]
        encoded = iter(await self.tokenize(texts, req.add_special_tokens, param))
        out = []
        for p in raw:
            ids = next(encoded) if isinstance(p, str) else list(p)
            out.append(self._truncated(req, ids))
        return out

    def _truncated(self, req: _PoolingRequest, ids: list[int]) -> list[int]:
        try:
            ids = truncate(ids, req.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens") from None
        self.check_prompt(ids, 0)  # the whole context is the prompt's: nothing is generated
        return ids

    def check_task(self, req: _PoolingRequest, task: str, what: str) -> None:
        if self.check_model(req.model) is not None:
            raise APIError(400, "LoRA adapters are not supported for pooling.", param="model")
        error = task_error(self.config.model.pooling, task, what)
        if error is not None:
            raise APIError(400, error, param="model")
        if not -(2**31) <= req.priority < 2**31:
            raise APIError(400, "priority must fit in 32 bits.", param="priority")
        self.check_alive()

    async def encode(
        self, prompts: list[list[int]], params: PoolingParams, req: _PoolingRequest, raw: Any
    ) -> list[RequestOutput]:
        """Run every prompt (counted in /metrics as generation requests are); a client that
        leaves (or a refusal) aborts the others."""

        async def one(ids: list[int]) -> RequestOutput:
            stream = self.generate(ids, POOLING_SAMPLING, None, req.priority, pooling=params)
            outputs = [out async for out in stream]
            assert outputs and outputs[-1].finished
            return outputs[-1]

        async def run_all() -> list[RequestOutput]:
            tasks = [asyncio.ensure_future(one(ids)) for ids in prompts]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        return await run_until_disconnect(run_all(), raw)

    def head(self, req: _PoolingRequest, kind: str) -> dict[str, Any]:
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": now_s(),
                "model": req.model or self.model_name}  # fmt: skip

    def prompt_usage(self, prompts: list[list[int]]) -> dict[str, Any]:
        return self.usage(sum(map(len, prompts)), 0)

    def labels(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in (self.config.model.hf.get("id2label") or {}).items()}


def _vector(out: RequestOutput, encoding_format: str) -> list[float] | str:
    assert out.pooled is not None
    if encoding_format == "base64":
        return base64.b64encode(out.pooled).decode()
    return decode_vector(out.pooled)


def add_pooling_routes(app: FastAPI, serving: PoolingServing, json: Any) -> None:
    """`json(body)`: the app's JSON response."""

    async def handle(coro: Any) -> Response:
        try:
            return json(await coro)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: HTTPRequest) -> Response:
        return await handle(_embed(serving, req, raw, "embedding"))

    @app.post("/pooling")
    async def pooling(req: EmbeddingRequest, raw: HTTPRequest) -> Response:
        return await handle(_embed(serving, req, raw, "pooling"))

    @app.post("/classify")
    async def classify(req: ClassificationRequest, raw: HTTPRequest) -> Response:
        return await handle(_classify(serving, req, raw))

    @app.post("/score")
    async def score(req: ScoreRequest, raw: HTTPRequest) -> Response:
        return await handle(_score(serving, req, raw))

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(_rerank_route(serving, handle))


def _rerank_route(serving: PoolingServing, handle: Any) -> Any:
    async def rerank(req: RerankRequest, raw: HTTPRequest) -> Response:
        return await handle(_rerank(serving, req, raw))

    return rerank


async def _embed(s: PoolingServing, req: EmbeddingRequest, raw: Any, kind: str) -> dict:
    """/v1/embeddings ("embedding" objects) and /pooling (the model's vector, "pooling")."""
    pooling = s.config.model.pooling
    task = "embed" if kind == "embedding" or pooling is None else pooling.task
    s.check_task(req, task, "/v1/embeddings" if kind == "embedding" else "/pooling")
    if req.encoding_format not in ("float", "base64"):
        message = "encoding_format must be float or base64."
        raise APIError(400, message, param="encoding_format")
    if task != "embed" and (req.dimensions is not None or req.normalize is not None):
        raise APIError(400, "dimensions and normalize apply to embed models.", param="dimensions")
    if req.dimensions is not None and req.dimensions < 1:
        raise APIError(400, "dimensions must be at least 1.", param="dimensions")
    prompts = await s.prompts(req, req.input, "input")
    params = PoolingParams(task=task, dimensions=req.dimensions, normalize=req.normalize)
    outs = await s.encode(prompts, params, req, raw)
    key = "embedding" if kind == "embedding" else "data"
    data = [{"index": i, "object": kind, key: _vector(o, req.encoding_format)}
            for i, o in enumerate(outs)]  # fmt: skip
    prefix = "embd" if kind == "embedding" else "pool"
    return {**s.head(req, prefix), "data": data, "usage": s.prompt_usage(prompts)}


async def _classify(s: PoolingServing, req: ClassificationRequest, raw: Any) -> dict:
    s.check_task(req, "classify", "/classify")
    prompts = await s.prompts(req, req.input, "input")
    outs = await s.encode(prompts, PoolingParams(task="classify"), req, raw)
    labels, data = s.labels(), []
    for i, out in enumerate(outs):
        probs = decode_vector(out.pooled)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels.get(str(best), f"LABEL_{best}"), "probs": probs,
                     "num_classes": len(probs)})  # fmt: skip
    return {**s.head(req, "classify"), "data": data, "usage": s.prompt_usage(prompts)}


async def _scores(
    s: PoolingServing, req: _PoolingRequest, queries: list[str], documents: list[str], raw: Any
) -> tuple[list[float], list[list[int]]]:
    """The relevance of each (query, document): a classify model's score of the pair as one
    prompt, or the cosine of an embed model's two embeddings."""
    pooling = s.config.model.pooling
    if pooling is None:
        s.check_task(req, "classify", "scoring")  # raises: the generate runner
    s.check_task(req, pooling.task, "scoring")
    if pooling.task == "embed":  # each distinct text embedded once
        texts = list(dict.fromkeys(queries + documents))
        prompts = await s.prompts(req, texts, "documents")
        outs = await s.encode(prompts, PoolingParams(task="embed"), req, raw)
        vecs = {t: decode_vector(o.pooled) for t, o in zip(texts, outs, strict=True)}
        return [cosine(vecs[q], vecs[d]) for q, d in zip(queries, documents, strict=True)], prompts
    for text in queries + documents:
        s.check_text(text, "documents")
    pairs = score_prompts(s.tokenizer, queries, documents)
    prompts = [s._truncated(req, ids) for ids in pairs]
    outs = await s.encode(prompts, PoolingParams(task="classify"), req, raw)
    return [decode_vector(o.pooled)[-1] for o in outs], prompts


async def _score(s: PoolingServing, req: ScoreRequest, raw: Any) -> dict:
    try:
        queries, documents = pair_up(req.text_1, req.text_2)
    except ValueError as e:
        raise APIError(400, str(e), param="text_2") from None
    scores, prompts = await _scores(s, req, queries, documents, raw)
    data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(scores)]
    return {**s.head(req, "score"), "data": data, "usage": s.prompt_usage(prompts)}


async def _rerank(s: PoolingServing, req: RerankRequest, raw: Any) -> dict:
    if not req.documents:
        raise APIError(400, "documents is empty.", param="documents")
    if req.top_n is not None and req.top_n < 0:
        raise APIError(400, "top_n must be >= 0.", param="top_n")
    scores, prompts = await _scores(s, req, *pair_up(req.query, req.documents), raw)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        results.append(result)
    head = s.head(req, "rerank")
    del head["object"], head["created"]
    return {**head, "results": results, "usage": {"total_tokens": sum(map(len, prompts))}}
