"""The `pagedserve` command: `pagedserve serve MODEL ...` (vLLM's habit) or its older spelling
`pagedserve launch --model MODEL ...` (flags in entrypoints/args.py), and `pagedserve bench ...`
(benchmarks/).

Every mistake a user can make on the command line ends in one line on stderr and exit code 2:
argparse's own errors (without the usage dump) and the config's ValueErrors alike.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import pagedserve
from pagedserve.entrypoints.args import add_launch_args, engine_kwargs, guard_argv, parse_size
from pagedserve.frontend.hub import DEFAULT_MODEL_NAME, default_model_dir

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.entrypoints.launcher import LaunchOptions

__all__ = ["main", "parse_size"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def engine_config(args: argparse.Namespace, serving: bool = False) -> EngineConfig:
    """The EngineConfig the flags describe (ValueError / TypeError / OSError: a user mistake);
    `serving`: for `launch` (frontend/engine_args.py's serving defaults)."""
    from pagedserve.frontend.engine_args import build_engine_config
    from pagedserve.frontend.generation_config import sampling_defaults

    kwargs = engine_kwargs(args)
    model = args.model
    if model is None:
        model = default_model_dir()
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"no model given and the embedded default model is missing at {model}")
        kwargs["served_model_name"] = kwargs["served_model_name"] or [DEFAULT_MODEL_NAME]
    config = build_engine_config(model, serving=serving, **kwargs)
    sampling_defaults(config.model)  # a bad generation_config.json is an error now, not later
    return config


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    from pagedserve.entrypoints.launcher import LaunchOptions
    from pagedserve.frontend.chat_template import load_chat_template

    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    return LaunchOptions(
        args.host, args.port, args.api_servers, args.api_key, args.log_level,
        drain_timeout=args.drain_timeout, max_request_bytes=args.max_request_bytes,
        log_requests=args.log_requests, log_prompts=args.log_prompts,
        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
        chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
        uvicorn_log_level=args.uvicorn_log_level or args.log_level,
        allowed_origins=args.allowed_origins, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, root_path=args.root_path,
        api_server_args=(*_chat_args(args), *guard_argv(args)),
    )  # fmt: skip


def _chat_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The API server flags for tool calls and reasoning (passed through as given)."""
    out: list[str] = ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    for name in ("tool_call_parser", "reasoning_parser"):
        if getattr(args, name):
            out += ["--" + name.replace("_", "-"), getattr(args, name)]
    return tuple(out)


def launch(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> int:
    from pagedserve.entrypoints.launcher import Launcher

    try:
        config = engine_config(args, serving=True)
        opts = launch_options(args)
        from pagedserve.frontend.engine_cores import check_devices

        check_devices(config.parallel)  # this node's dp x tp x pp GPUs
        if config.parallel.nnodes > 1:  # every node needs the key: say so before starting any
            from pagedserve.ipc.curve import load_key

            load_key()
    except (ValueError, TypeError, OSError) as e:
        fail(str(e))
    if config.parallel.node_rank > 0:
        from pagedserve.entrypoints.launcher import run_worker_node

        return run_worker_node(config)
    if args.enable_auto_tool_choice:
        _warn_if_tools_unseen(config, opts.chat_template)
    if args.api_servers > 1 and args.responses_store_size > 0:
        print("pagedserve: warning: the Responses API store is per API server: with "
              f"--api-servers {args.api_servers} previous_response_id, GET and cancel of "
              "/v1/responses/{id} find a response only on the server that made it (send "
              "store false and the whole conversation, as Codex CLI does, or use one API "
              "server)", file=sys.stderr, flush=True)  # fmt: skip
    return Launcher(config, opts).run()


def _warn_if_tools_unseen(config: EngineConfig, chat_template: str | None) -> None:
    """One line on stderr when the chat template never shows the model its tools."""
    from pagedserve.frontend.chat_template import model_chat_template, tools_unseen_warning

    template = chat_template or model_chat_template(config.model.tokenizer_path)
    warning = tools_unseen_warning(template)
    if warning is not None:
        print(f"pagedserve: {warning}", file=sys.stderr, flush=True)


def serve(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> int:
    """`serve MODEL`: vLLM's `vllm serve MODEL` (the model positional; --model works too)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            fail(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return launch(args, fail)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = _Parser(prog="pagedserve", description="An LLM serving engine.")
    parser.add_argument("--version", action="version", version=pagedserve.__version__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    launch_p = sub.add_parser("launch", help="serve a model over an OpenAI-compatible HTTP API")
    launch_p.add_argument("--model", help="HF model directory or hub id ORG/NAME (default: the "
                          "embedded tiny model)")  # fmt: skip
    add_launch_args(launch_p)
    launch_p.set_defaults(handler=launch)
    serve_p = sub.add_parser("serve", help="serve MODEL (a directory or hub id), as `vllm serve`")
    serve_p.add_argument("model_tag", nargs="?", metavar="MODEL", help="directory or hub id")
    serve_p.add_argument("--model", help=argparse.SUPPRESS)
    add_launch_args(serve_p)
    serve_p.set_defaults(handler=serve)
    return parser, {
        "launch": launch_p,
        "serve": serve_p,
        "bench": _add_bench(sub),
        "gen-key": _add_gen_key(sub),
    }


def _add_gen_key(sub: Any) -> argparse.ArgumentParser:
    """`pagedserve gen-key [--output FILE]`: the CURVE key pair every node of a multi-node
    group gets (ipc/curve.py); printed, or written to a new 0600 file."""
    p = sub.add_parser("gen-key", help="make the key pair that protects multi-node traffic")
    p.add_argument("--output", help="write it to this new file (mode 0600) instead of stdout")

    def gen_key(args: argparse.Namespace, fail: Any) -> int:
        from pagedserve.ipc.curve import CurveKey

        text = CurveKey.generate().text() + "\n"
        if args.output is None:
            sys.stdout.write(text)
            return 0
        try:
            fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            fail(f"cannot create {args.output}: {e.strerror}")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return 0

    p.set_defaults(handler=gen_key)
    return p


def _add_bench(sub: Any) -> argparse.ArgumentParser:
    """`pagedserve bench ...` lives in benchmarks/."""
    from pagedserve.benchmarks.cli import add_bench_parser, run_bench

    add_bench_parser(sub)
    bench: argparse.ArgumentParser = sub.choices["bench"]
    bench.set_defaults(handler=lambda args, fail: run_bench(args))
    return bench


def main(argv: list[str] | None = None) -> int:
    parser, subparsers = build_parser()
    args, unknown = parser.parse_known_args(argv)
    sub: Any = subparsers[args.command]
    if unknown:
        sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.handler(args, sub.error)


if __name__ == "__main__":
    sys.exit(main())
