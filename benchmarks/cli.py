"""The `pagedserve bench` command: its subcommands' parsers and which function runs each
(throughput, latency, startup: offline.py; serve: serve.py; structured: structured.py). The hub
of benchmarks/: it imports them, they never import it.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.benchmarks.common import add_engine_flags, report
from pagedserve.benchmarks.embed import add_embed_parser, bench_embed
from pagedserve.benchmarks.lora import add_lora_flags
from pagedserve.benchmarks.offline import bench_latency, bench_startup, bench_throughput
from pagedserve.benchmarks.serve import add_serve_parser, bench_serve
from pagedserve.benchmarks.spec_decode import add_spec_parser, bench_spec
from pagedserve.benchmarks.structured import add_structured_parser, bench_structured


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, startup")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    tp = kinds.add_parser("throughput", help="offline throughput, in-process engine")
    add_engine_flags(tp)
    tp.add_argument("--input-len", type=int, default=1024)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--num-prompts", type=int, default=1000)
    tp.add_argument("--random-range-ratio", type=float, default=0.0)
    tp.add_argument("--random-prefix-len", type=int, default=0,
                    help="one shared random prefix before every prompt (vLLM's flag)")  # fmt: skip
    lat = kinds.add_parser("latency", help="batch-N fixed lengths, end-to-end latency")
    add_engine_flags(lat)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=256)
    lat.add_argument("--num-iters-warmup", type=int, default=2)
    lat.add_argument("--num-iters", type=int, default=5)
    for p in (tp, lat):
        add_lora_flags(p)
        p.add_argument("--speculative-config", default=None, help="JSON, as `launch` takes it")
    st = kinds.add_parser("startup", help="launch to first 200 on /health")
    st.add_argument("--port", type=int, default=8011)
    st.add_argument("--num-iters", type=int, default=2)
    st.add_argument("--timeout", type=float, default=600)
    st.add_argument("launch_args", nargs=argparse.REMAINDER, help="flags passed to launch")
    add_serve_parser(kinds)
    so = add_structured_parser(kinds)
    sd = add_spec_parser(kinds)
    em = add_embed_parser(kinds)
    for p in (tp, lat, st, so, sd, em):
        p.add_argument("--output-json", default=None)


def run_bench(args: argparse.Namespace) -> int:
    fn = {"throughput": bench_throughput, "latency": bench_latency, "startup": bench_startup,
          "serve": bench_serve, "structured": bench_structured, "spec": bench_spec,
          "embed": bench_embed}  # fmt: skip
    result = fn[args.bench_kind](args)
    report(args.bench_kind, result, getattr(args, "output_json", None))
    return 0
