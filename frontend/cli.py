"""The `pagedserve` command: `pagedserve launch ...` and `pagedserve bench ...` (frontend/bench/).

Every mistake a user can make on the command line ends in one line on stderr and exit code 2:
argparse's own errors (without the usage dump) and the config's ValueErrors alike.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import pagedserve

DEFAULT_MODEL_NAME = "pagedserve-default"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def default_model_dir() -> str:
    import pagedserve.frontend

    return os.path.join(os.path.dirname(pagedserve.frontend.__file__), "default_model")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `512M`, `2G`, `1.5GiB` (binary multiples)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (like 512M or 2G)")
    number, unit = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    return int(float(number) * 1024**power)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def add_launch_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", help="HF model directory (default: the embedded tiny model)")
    a("--served-model-name", help="the model name clients use (default: --model)")
    a("--host", default="0.0.0.0")
    a("--port", type=int, default=8000, help="0 picks a free port")
    a("--api-servers", type=_positive_int, default=1, help="API server processes on one port")
    a("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    a("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1)
    a("--pp-layer-partition", type=_int_list, help="layers per pipeline stage, e.g. 20,12")
    a("--nnodes", type=_positive_int, default=1, help="machines in one TP x PP group")
    a("--node-rank", type=_non_negative_int, default=0, help="0 runs the engine and API servers")
    a("--master-addr", default="127.0.0.1", help="address of node 0 (multi-node)")
    a("--master-port", type=_positive_int, help="node 0's rendezvous port (multi-node; it also "
      "uses the next two ports for the step plans and results)")  # fmt: skip
    a("--max-model-len", type=int)
    a("--max-num-seqs", type=int)
    a("--max-num-batched-tokens", type=int)
    a("--block-size", type=int, default=16)
    a("--gpu-memory-utilization", type=float, default=0.9)
    a("--kv-cache-memory", type=parse_size, help="KV cache size in bytes (512M, 2G)")
    a("--dtype", default="auto")
    a("--load-format", default="auto")
    a("--seed", type=int, default=0)
    a("--device", default="auto")
    a("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"), help="or PAGEDSERVE_API_KEY")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    a("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    a("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
      help="plan step N+1 while step N runs (one pipeline stage only)")  # fmt: skip
    a("--enforce-eager", action="store_true", help="no CUDA graphs")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    a("--log-requests", action="store_true", help="log each request's prompt (off: no prompt text)")
    a(
        "--max-waiting",
        type=_non_negative_int,
        help="refuse requests (503 + Retry-After) while this many wait (default: no bound)",
    )
    a(
        "--drain-timeout",
        type=_non_negative_float,
        default=30.0,
        help="on SIGTERM, seconds running requests may take to finish before they are aborted",
    )
    a(
        "--step-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds one engine step may take before the engine is declared dead (stuck worker)",
    )
    a(
        "--max-request-bytes",
        type=parse_size,
        default=4 << 20,
        help="largest request body (4M); bigger bodies get 413",
    )


def launch(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> int:
    from pagedserve.frontend.launcher import Launcher, LaunchOptions
    from pagedserve.frontend.llm import build_engine_config

    model, served_name = args.model, args.served_model_name
    if model is None:
        model = default_model_dir()
        if not os.path.isfile(os.path.join(model, "config.json")):
            fail(f"no --model given and the embedded default model is missing at {model}")
        served_name = served_name or DEFAULT_MODEL_NAME
    try:
        config = build_engine_config(
            model,
            served_model_name=served_name,
            tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp,
            pp_layer_partition=args.pp_layer_partition,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory=args.kv_cache_memory,
            dtype=args.dtype,
            load_format=args.load_format,
            seed=args.seed,
            device=args.device,
            enable_prefix_caching=args.enable_prefix_caching,
            scheduling_policy=args.scheduling_policy,
            max_waiting=args.max_waiting,
            step_timeout=args.step_timeout,
            async_scheduling=args.async_scheduling,
            enforce_eager=args.enforce_eager,
        )
    except (ValueError, TypeError, OSError) as e:
        fail(str(e))
    opts = LaunchOptions(
        args.host, args.port, args.api_servers, args.api_key, args.log_level,
        drain_timeout=args.drain_timeout, max_request_bytes=args.max_request_bytes,
        log_requests=args.log_requests,
    )  # fmt: skip
    if config.parallel.node_rank > 0:
        from pagedserve.frontend.launcher import run_worker_node

        return run_worker_node(config)
    return Launcher(config, opts).run()


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = _Parser(prog="pagedserve", description="An LLM serving engine.")
    parser.add_argument("--version", action="version", version=pagedserve.__version__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    launch_p = sub.add_parser("launch", help="serve a model over an OpenAI-compatible HTTP API")
    add_launch_args(launch_p)
    launch_p.set_defaults(handler=launch)
    return parser, {"launch": launch_p, "bench": _add_bench(sub), "gen-key": _add_gen_key(sub)}


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
    """`pagedserve bench ...` lives in frontend/bench/."""
    from pagedserve.frontend.bench.offline import add_bench_parser, run_bench

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
