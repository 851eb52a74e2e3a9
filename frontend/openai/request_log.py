"""One log line per HTTP request, written by ServerMiddleware once the response has ended.

`127.0.0.1:5000 "POST /v1/completions HTTP/1.1" 200 prompt_tokens=5 completion_tokens=16
latency=0.412s`, at INFO through the `pagedserve.api` logger (`/health` and `/metrics`, polled
by probes and scrapers, at DEBUG). Token counts appear for requests that generated: the
middleware puts a `RequestTally` in the request's scope (`scope["state"]`, what
`Request.state` reads) and the serving code counts each engine request's outputs into it as they
pass (`tally_outputs`), so streams with or without `include_usage` are counted alike. A prompt's
text is in the line only with `--log-prompts`: prompts are the clients' data.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.types import Scope

from pagedserve.frontend.outputs import RequestOutput

logger = logging.getLogger("pagedserve.api")
QUIET_PATHS = ("/health", "/metrics")  # logged at DEBUG
TALLY_KEY = "pagedserve_tally"


@dataclass
class RequestTally:
    """What one HTTP request generated, over all its engine requests (prompts x n)."""

    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    prompts: list[str] = field(default_factory=list)
    generated: bool = False


def new_tally(scope: Scope) -> RequestTally:
    tally = RequestTally()
    scope.setdefault("state", {})[TALLY_KEY] = tally
    return tally


def request_tally(scope: Scope) -> RequestTally | None:
    return scope.get("state", {}).get(TALLY_KEY)


async def tally_outputs(
    first: RequestOutput, stream: AsyncIterator[RequestOutput], tally: RequestTally | None
) -> AsyncIterator[RequestOutput]:
    """`first`, then the rest of `stream` (closed at the end), counted into `tally`."""
    lengths: dict[int, int] = {}  # choice index -> tokens so far (outputs carry all of them)
    if tally is not None:
        tally.generated = True
        tally.num_prompt_tokens += len(first.prompt_token_ids)
        if first.prompt is not None:
            tally.prompts.append(first.prompt)

    def count(out: RequestOutput) -> RequestOutput:
        if tally is not None:
            for c in out.outputs:
                tally.num_completion_tokens += len(c.token_ids) - lengths.get(c.index, 0)
                lengths[c.index] = len(c.token_ids)
        return out

    try:
        yield count(first)
        async for out in stream:
            yield count(out)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def log_request(
    scope: Scope, path: str, status: int, seconds: float, tally: RequestTally, prompts: bool
) -> None:
    """The request's line; `path` is the route's path (without --root-path's prefix)."""
    level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
    if not logger.isEnabledFor(level):
        return
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    target = scope["path"]
    query = scope.get("query_string", b"").decode("latin-1")
    if query:
        target += "?" + query
    version = scope.get("http_version", "1.1")
    line = f'{who} "{scope["method"]} {target} HTTP/{version}" {status or "-"}'
    if tally.generated:
        line += (
            f" prompt_tokens={tally.num_prompt_tokens}"
            f" completion_tokens={tally.num_completion_tokens}"
        )
    line += f" latency={seconds:.3f}s"
    if prompts and tally.prompts:
        line += " prompt=" + " | ".join(repr(p) for p in tally.prompts)
    logger.log(level, "%s", line)
