"""least_conn vs prefix affinity through deploy/nginx, on one multi-turn workload (issue 19).

    python tests/bench_affinity.py [--replicas 3 --num-users 12 --num-turns 4 ...]

For each mode: start fresh CPU replicas of the embedded model (cold prefix caches; each bounded by
--replica-args, which is what makes affinity spill), render nginx in that mode with
--replica-header, run `pagedserve bench serve --dataset-name multi-turn` through it (the same
conversations in every mode: same --seed), stop everything. Prints one line per mode:
cached share of prompt tokens, TTFT p50/p99, requests per replica, replica changes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_deploy import _free_port, _render_nginx, _start_replica, _stop, _tool, _wait_http  # noqa: E402

from pagedserve.frontend.cli import main  # noqa: E402

from proctools import descendants  # noqa: E402


def run_mode(mode: str, args: argparse.Namespace, tmp: str) -> dict:
    extra = ["--kv-cache-memory", args.kv_cache_memory, *args.replica_args.split()]
    replicas = [_start_replica(_free_port(), f"{tmp}/{mode}-r{i}.log", *extra)
                for i in range(args.replicas)]  # fmt: skip
    nginx = None
    try:
        port, render = _free_port(), _render_nginx()
        conf = render.render(  # type: ignore[attr-defined]
            f"127.0.0.1:{port}", [f"127.0.0.1:{r.port}" for r in replicas], mode=mode,
            replica_header=True,
        )  # fmt: skip
        prefix = f"{tmp}/nginx-{mode}"
        path = render.standalone(prefix, conf)  # type: ignore[attr-defined]
        cmd = [_tool("nginx"), "-p", prefix, "-e", f"{prefix}/logs/error.log", "-c", path]
        nginx = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/nginx-health", nginx, "nginx", timeout=20)
        for r in replicas:
            _wait_http(f"http://127.0.0.1:{r.port}/health", r.proc, f"replica :{r.port}", 300)
            r.children = descendants(r.proc.pid)
        out = f"{prefix}/result.json"
        argv = ["bench", "serve", "--base-url", url, "--endpoint", "/v1/chat/completions",
                "--dataset-name", "multi-turn", "--num-users", str(args.num_users),
                "--num-turns", str(args.num_turns), "--turn-output-len", str(args.output_len),
                "--think-time", str(args.think_time), "--user-turn-len", str(args.user_turn_len),
                "--metric-percentiles", "50,99", "--save-result", "--result-filename", out,
                "--seed", str(args.seed), "--disable-tqdm"]  # fmt: skip
        assert main(argv) == 0
        with open(out) as f:
            return json.load(f)
    finally:
        if nginx is not None:
            _stop(nginx, [])
        for r in replicas:
            _stop(r.proc, r.children or descendants(r.proc.pid))


def main_() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--num-users", type=int, default=12)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--user-turn-len", type=int, default=48)
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--kv-cache-memory", default="64M")
    p.add_argument(
        "--replica-args",
        default="--max-num-seqs 4 --max-waiting 4",
        help="launch flags of every replica (the bound that makes affinity spill)",
    )
    p.add_argument("--modes", default="least_conn,affinity")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            r = run_mode(mode, args, tmp)
            rows.append(f"{mode:10}: {r['completed']}/{r['num_prompts']} ok, "
                        f"cached share {r['cached_share']:.3f}, TTFT p50 "
                        f"{r['median_ttft_ms']:.0f} ms / p99 {r['p99_ttft_ms']:.0f} ms, "
                        f"per replica {list(r['per_replica_requests'].values())} (imbalance "
                        f"{r.get('replica_imbalance', 0):.2f}), replica changes "
                        f"{r['replica_switches']}, per turn cached "
                        f"{[round(t['cached_share'], 2) for t in r['per_turn']]}, TTFT p50 "
                        f"{[round(t['median_ttft_ms']) for t in r['per_turn']]} ms")  # fmt: skip
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main_()
