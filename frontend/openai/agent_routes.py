"""The routes of the APIs coding agents speak: OpenAI's Responses (Codex CLI, the Agents SDK) and
Anthropic's Messages (Claude Code, the Anthropic SDK). Both are served by the chat code, behind
the same middleware (API key, drain, body limit, request log, metrics) as /v1/chat/completions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from pagedserve.frontend.openai.messages_protocol import CountTokensRequest, MessagesRequest
from pagedserve.frontend.openai.response_store import ResponseStore
from pagedserve.frontend.openai.responses_protocol import ResponsesRequest
from pagedserve.frontend.openai.serving_chat import ChatServing
from pagedserve.frontend.openai.serving_messages import MessagesServing
from pagedserve.frontend.openai.serving_responses import ResponsesServing


def add_agent_routes(
    app: FastAPI, chat: ChatServing, store: ResponseStore, salt: Callable[[Any, Request], None]
) -> None:
    """`salt(req, raw)`: the request's prefix-cache salt by tenant (api_server.salt_by_tenant)."""
    responses = ResponsesServing(chat, store)
    messages = MessagesServing(chat)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        salt(req, raw)
        return await responses.create(req, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return await responses.cancel(response_id)

    @app.post("/v1/messages")
    async def create_message(req: MessagesRequest, raw: Request) -> Response:
        salt(req, raw)
        return await messages.create(req, raw)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest) -> Response:
        return await messages.count_tokens(req)
