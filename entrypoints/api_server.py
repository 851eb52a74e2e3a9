"""One API server process: FastAPI on uvicorn (uvloop), an AsyncEngine client of the EngineCore.

Started by `pagedserve launch` as `python -m pagedserve.entrypoints.api_server --fd N ...`: the
launcher binds the listening socket once and every API server accepts on the same fd, so N servers
share one port. Each server is its own engine client (`--client-index`); the core routes each
request's outputs back to the server that sent it. Readiness is reported to the launcher as lines
on `--ready-fd` ("engine I" once the engine answered, "server I" once accepting connections).
The app itself (routes, errors, drain) is frontend/openai/api_server.py's `build_app`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

import uvicorn

from pagedserve import settings
from pagedserve.config import EngineConfig
from pagedserve.entrypoints.args import add_guard_args, int_list
from pagedserve.frontend.async_engine import AsyncEngine
from pagedserve.frontend.openai.api_server import TenancyOptions, build_app
from pagedserve.frontend.openai.connections import ConnectionGuard, connection_limit
from pagedserve.frontend.openai.metrics import Metrics
from pagedserve.frontend.openai.middleware import DEFAULT_MAX_REQUEST_BYTES, Drain, DrainingServer
from pagedserve.frontend.openai.response_store import ResponseStore
from pagedserve.frontend.openai.serving_chat import ChatOptions
from pagedserve.ipc.process import die_with_parent

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# How long an idle client connection stays open. Longer than any proxy in front keeps its idle
# connections to us (deploy/nginx: keepalive_timeout 60s), so the proxy always closes first:
# with uvicorn's 5 s, nginx reused connections we had just closed, and a POST sent on one fails
# with 502 (never resent: it may have run) and marks this replica down for fail_timeout.
KEEP_ALIVE_S = 75


def _listening_socket(args: argparse.Namespace) -> socket.socket:
    if args.fd is not None:
        return socket.socket(fileno=args.fd)
    return socket.create_server((args.host, args.port), backlog=2048)


def _notifier(ready_fd: int | None, line: str) -> Any:
    def notify() -> None:
        if ready_fd is not None:
            os.write(ready_fd, f"{line}\n".encode())

    return notify


def _exit_quietly(_signum: int, _frame: Any) -> None:
    raise SystemExit(0)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pagedserve-api-server")
    ap.add_argument("--config", required=True, help="EngineConfig.to_json()")
    ap.add_argument("--ipc-dir", required=True)
    ap.add_argument("--core-pid", type=int_list, help="each engine core's pid (data parallel)")
    ap.add_argument("--client-index", type=int, default=0)
    ap.add_argument("--parent-pid", type=int)
    ap.add_argument("--fd", type=int, help="an inherited listening socket")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--ready-fd", type=int)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S)
    ap.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    ap.add_argument("--log-requests", action="store_true", help="a line per request")
    ap.add_argument("--log-prompts", action="store_true", help="with its prompt text")
    ap.add_argument("--uvicorn-log-level", default="info")
    ap.add_argument("--chat-template", help="the template itself (the launcher read the file)")
    ap.add_argument("--trust-request-chat-template", action="store_true")
    ap.add_argument("--allowed-origins", type=json.loads, help="a JSON list")
    ap.add_argument("--ssl-keyfile")
    ap.add_argument("--ssl-certfile")
    ap.add_argument("--root-path", default="")
    ap.add_argument("--enable-auto-tool-choice", action="store_true")
    ap.add_argument("--tool-call-parser")
    ap.add_argument("--reasoning-parser")
    add_guard_args(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    die_with_parent(args.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # until uvicorn takes them over: exit quietly
        signal.signal(sig, _exit_quietly)
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s[%(process)d]: %(message)s")
    index = args.client_index
    config = EngineConfig.from_json(args.config)
    settings.activate(config.settings)
    sock = _listening_socket(args)
    try:
        engine = AsyncEngine(config, index, args.ipc_dir, args.core_pid)
    except Exception as e:
        print(f"pagedserve: API server {index}: {e}", file=sys.stderr, flush=True)
        return 1
    _notifier(args.ready_fd, f"engine {index}")()
    drain = Drain()
    metrics = Metrics(config.model.name)
    cache_dtype = "fp8_e4m3" if config.cache.kv_fp8 else config.model.resolved_dtype
    for core, ready in enumerate(engine.cores.readies):
        metrics.set_cache(ready.num_blocks, ready.block_size, cache_dtype, core)
    if config.lora is not None:
        metrics.set_lora(config.lora.max_loras)
    app = build_app(
        engine,
        metrics,
        settings.api_key_from_env(vllm_too=False),
        index,
        on_ready=_notifier(args.ready_fd, f"server {index}"),
        drain=drain,
        max_request_bytes=args.max_request_bytes,
        log_requests=args.log_requests,
        log_prompts=args.log_prompts,
        allowed_origins=args.allowed_origins,
        chat_options=ChatOptions(
            args.enable_auto_tool_choice,
            args.tool_call_parser,
            args.reasoning_parser,
            args.chat_template,
            args.trust_request_chat_template,
        ),
        tenancy=TenancyOptions(
            args.enable_prompt_tokens_details, args.cache_salt_by, args.metrics_public
        ),
        response_store=ResponseStore(args.responses_store_size, args.responses_store_max_age),
    )
    server = DrainingServer(_uvicorn_config(app, args), drain, args.drain_timeout)
    app.state.server = server
    server.run(sockets=[sock])
    return 0


def _uvicorn_config(app: Any, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn on uvloop, with httptools' C parser (h11 was a third of this process's time when
    streaming) under the connection deadlines and limit of frontend/openai/connections.py."""
    guard = ConnectionGuard(
        args.timeout_header, args.timeout_body, connection_limit(args.max_connections)
    )
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=guard.protocol,
        log_level=args.uvicorn_log_level.lower(),
        access_log=args.uvicorn_log_level.lower() in ("debug", "trace"),
        timeout_graceful_shutdown=2,
        timeout_keep_alive=KEEP_ALIVE_S,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path,
    )


if __name__ == "__main__":
    sys.exit(main())
