"""least_conn vs prefix affinity through deploy/nginx, on one multi-turn workload (issue 19).

    python tests/bench_affinity.py      # ~7 minutes on 2 cores: 3 modes x 384 requests

For each mode: start fresh CPU replicas of the embedded model (cold prefix caches), render nginx
in that mode with --replica-header, run `pagedserve bench serve --dataset-name multi-turn`
through it (the same conversations in every mode: same --seed), stop everything. Modes:
least_conn; affinity (consistent hash of the conversation's key, spill only on a replica's 503);
bounded (affinity with `render.py --max-conns 8`, the replicas' --max-num-seqs: a replica running
8 requests through nginx sends the next to the next replica on the ring with room; when none
has room, it waits at its own). Prints one line per mode, then a table.

The workload is shaped like real chats: 96 users arriving over 12 s, 4 turns, a 32-token system
prompt, 32-token messages, 96-token answers, 8 s (exponential) to read and type between turns.
Each replica's KV cache (--kv-cache-memory 24M: 24k tokens) holds its share of the conversations'
histories (~19k tokens at the end) with room to spare, not every conversation, as a production
replica's cache holds a fraction of all live conversations. Affinity needs only its share;
least_conn leaves a copy of a conversation's prefix on every replica it visits (up to three
times the working set). The run prints the working set next to the cache's size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_deploy import _free_port, _start_nginx, _start_replica, _stop, _wait_http  # noqa: E402

from pagedserve.entrypoints.cli import main  # noqa: E402

from proctools import descendants  # noqa: E402


def bench_argv(url: str, out: str, args: argparse.Namespace) -> list[str]:
    return ["bench", "serve", "--base-url", url, "--endpoint", "/v1/chat/completions",
            "--dataset-name", "multi-turn", "--num-users", str(args.num_users),
            "--num-turns", str(args.num_turns), "--turn-output-len", str(args.output_len),
            "--think-time", str(args.think_time), "--user-turn-len", str(args.user_turn_len),
            "--system-prompt-len", str(args.system_prompt_len),
            "--request-rate", str(args.user_rate),
            "--metric-percentiles", "50,99", "--save-result", "--result-filename", out,
            "--seed", str(args.seed), "--disable-tqdm"]  # fmt: skip


def run_mode(mode: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    extra = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "1024"]
    extra += args.replica_args.split()
    replicas = [_start_replica(_free_port(), f"{tmp}/{mode}-r{i}.log", *extra)
                for i in range(args.replicas)]  # fmt: skip
    nginx = None
    try:
        render_kw: dict[str, Any] = {"replica_header": True, "mode": "affinity"}
        if mode == "least_conn":
            render_kw["mode"] = "least_conn"
        elif mode == "bounded":
            render_kw["max_conns"] = args.max_conns
        url, nginx = _start_nginx(f"{tmp}/nginx-{mode}", replicas, **render_kw)
        for r in replicas:
            _wait_http(f"http://127.0.0.1:{r.port}/health", r.proc, f"replica :{r.port}", 300)
            r.children = descendants(r.proc.pid)
        out = f"{tmp}/{mode}.json"
        assert main(bench_argv(url, out, args)) == 0
        with open(out) as f:
            result = json.load(f)
        result["kv_tokens"] = kv_tokens(replicas[0].log())
        return result
    finally:
        if nginx is not None:
            _stop(nginx, [])
        for r in replicas:
            _stop(r.proc, r.children or descendants(r.proc.pid))


def kv_tokens(log: str) -> int:
    """A replica's KV cache in tokens, from its log line `KV cache: N blocks of B tokens`."""
    m = re.search(r"KV cache: (\d+) blocks of (\d+) tokens", log)
    return int(m[1]) * int(m[2]) if m else 0


def line(mode: str, r: dict[str, Any]) -> str:
    counts = list(r["per_replica_requests"].values())
    return (f"{mode:10}: {r['completed']}/{r['num_prompts']} ok, cached share "
            f"{r['cached_share']:.3f} (own history {r['conversation_cached_share']:.3f}), TTFT "
            f"p50 {r['median_ttft_ms']:.0f} ms / p99 {r['p99_ttft_ms']:.0f} ms, per replica "
            f"{counts} (busiest/quietest {max(counts) / max(1, min(counts)):.2f}), replica "
            f"changes {r['replica_switches']}, per turn cached "
            f"{[round(t['cached_share'], 2) for t in r['per_turn']]}, TTFT p50 "
            f"{[round(t['median_ttft_ms']) for t in r['per_turn']]} ms")  # fmt: skip


def working_set(r: dict[str, Any], output_len: int) -> int:
    """Tokens of every conversation's whole history (its last prompt plus the last answer)."""
    last = r["per_turn"][-1]
    return round(last["requests"] * (last["mean_prompt_tokens"] + output_len))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def summary(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    rows = ["| mode | cached share | own history | TTFT p50 / p99 | requests per replica "
            "| busiest/quietest | replica changes |", "|" + " --- |" * 7]  # fmt: skip
    for mode, r in results.items():
        counts = list(r["per_replica_requests"].values())
        busiest = max(counts) / max(1, min(counts))
        rows.append(f"| {mode} | {r['cached_share']:.3f} | {r['conversation_cached_share']:.3f} "
                    f"| {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} ms "
                    f"| {', '.join(map(str, counts))} | {busiest:.2f} "
                    f"| {r['replica_switches']} |")  # fmt: skip
    base = results.get("least_conn")
    for mode, r in results.items():
        if base and mode != "least_conn":
            own, base_own = r["conversation_cached_share"], base["conversation_cached_share"]
            rows.append(f"{mode} / least_conn: cached share "
                        f"{ratio(r['cached_share'], base['cached_share'])}, own history "
                        f"{ratio(own, base_own)}, TTFT p50 "
                        f"{ratio(r['median_ttft_ms'], base['median_ttft_ms'])}")  # fmt: skip
    first = next(iter(results.values()))
    total = working_set(first, args.output_len)
    rows.append(f"working set: {total} tokens of history in all ({total // args.replicas} per "
                f"replica when each keeps its share); KV cache {first['kv_tokens']} tokens per "
                f"replica; shared prefix {first['shared_prefix_tokens']} tokens")  # fmt: skip
    return rows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--num-users", type=int, default=96)
    p.add_argument("--num-turns", type=int, default=6)
    p.add_argument("--system-prompt-len", type=int, default=32)
    p.add_argument("--user-turn-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--user-rate", type=float, default=8.0, help="users arriving per second")
    p.add_argument("--think-time", type=float, default=8.0)
    p.add_argument("--kv-cache-memory", default="24M", help="per replica (1 KiB per token)")
    p.add_argument("--replica-args", default="--max-num-seqs 8 --max-waiting 8",
                   help="launch flags of every replica (its own bound: 503 beyond it)")  # fmt: skip
    p.add_argument("--max-conns", type=int, default=8,
                   help="bounded: render.py --max-conns (replicas' --max-num-seqs)")  # fmt: skip
    p.add_argument("--modes", default="least_conn,affinity,bounded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep logs and results here (default: a temporary dir)")
    return p.parse_args()


def main_() -> None:
    args = parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.workdir:
            os.makedirs(tmp := args.workdir, exist_ok=True)
        for mode in args.modes.split(","):
            results[mode] = run_mode(mode, args, tmp)
            print(line(mode, results[mode]), flush=True)
    print("\n".join(summary(results, args)))


if __name__ == "__main__":
    main_()
