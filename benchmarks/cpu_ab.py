"""Interleaved A/B of CPU serving settings (issue 43): on a machine shared with other work, one
arm's runs must sit between the other's, or the load of the moment decides the comparison.

    python -m pagedserve.benchmarks.cpu_ab --arm A: --arm B:OMP_NUM_THREADS=2 [--rows 8 32]
        [--pairs 3] [--prompts 64] [--model DIR] [--load-format dummy] [--lengths 128 128]

Each `--arm NAME:VAR=VALUE,VAR=VALUE` is an environment for `pagedserve launch` (nothing after
the colon: the defaults). For each pair, in order, each arm launches the model (waiting for its
compiled CPU forward, as `cpu_profile` does), runs `pagedserve bench serve` (`--lengths`, 128 in
/ 128 out by default; `--prompts`) at each `--rows` in flight, and stops. Printed: one line per
run, then per arm and rows the median req/s and TPOT p50, and how many pairs the first arm's
req/s beat each other's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile

from pagedserve.benchmarks.cpu_profile import CLI, DEFAULT_MODEL, _cpu_line, _wait_ready


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:VAR=VALUE,VAR=VALUE` -> (NAME, {VAR: VALUE}); an argparse type."""
    name, sep, rest = text.partition(":")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: an arm is NAME:VAR=VALUE,... (or NAME:)")
    env = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not var or not eq:
            raise argparse.ArgumentTypeError(f"{item!r} in arm {name!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def run_arm(env: dict[str, str], a: argparse.Namespace) -> dict:
    """Launch with `env`, one bench run per `a.rows`; {rows: bench serve's result dict}."""
    model, rows_list, prompts = a.model, a.rows, a.prompts
    port = 8000 + (os.getpid() + 500) % 1000
    tmp = tempfile.mkdtemp(prefix="cpu_ab_")
    log = os.path.join(tmp, "launch.log")
    cmd = [*CLI, "launch", "--model", model, "--dtype", "float32", "--port", str(port),
           "--max-model-len", "1024", "--load-format", a.load_format]  # fmt: skip
    with open(log, "w") as out:
        launch = subprocess.Popen(cmd, stdout=out, stderr=out, env={**os.environ, **env})
    results = {}
    try:
        _wait_ready(port, log)
        for rows in rows_list:
            path = os.path.join(tmp, f"{rows}.json")
            bench = [*CLI, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                     "--dataset-name", "random", "--random-input-len", str(a.lengths[0]),
                     "--random-output-len", str(a.lengths[1]), "--ignore-eos", "--num-prompts",
                     str(max(prompts, 2 * rows)), "--max-concurrency", str(rows),
                     "--disable-tqdm", "--tokenizer", model, "--output-json", path]  # fmt: skip
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
            with open(path) as f:
                results[rows] = json.load(f)
    finally:
        launch.send_signal(signal.SIGTERM)
        launch.wait(timeout=60)
    return results


def summary(runs: dict[str, list[dict]], rows_list: list[int]) -> list[str]:
    """Median req/s and TPOT p50 per arm and rows; wins: pairs where the first arm's req/s was
    higher than this arm's (pairs are the runs at the same index)."""
    first = next(iter(runs))
    lines = ["| arm | rows | median req/s | median TPOT p50 ms | pairs the first arm won |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, arm_runs in runs.items():
        for rows in rows_list:
            rps = [r[rows]["request_throughput"] for r in arm_runs]
            tpot = [r[rows]["median_tpot_ms"] for r in arm_runs]
            base = [r[rows]["request_throughput"] for r in runs[first]]
            wins = sum(a > b for a, b in zip(base, rps, strict=True))
            won = "" if name == first else f"{wins}/{len(rps)}"
            lines.append(f"| {name} | {rows} | {statistics.median(rps):.2f} | "
                         f"{statistics.median(tpot):.2f} | {won} |")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arm", type=parse_arm, action="append", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--load-format", default="auto", help="dummy: a config-only model dir")
    ap.add_argument("--lengths", type=int, nargs=2, default=[128, 128], metavar=("IN", "OUT"))
    a = ap.parse_args()
    if len(a.arm) < 2 or len({name for name, _ in a.arm}) != len(a.arm):
        ap.error("give at least two --arm, each with its own name")
    print(f"CPU: {_cpu_line()}")
    runs: dict[str, list[dict]] = {name: [] for name, _ in a.arm}
    for pair in range(a.pairs):
        for name, env in a.arm:
            result = run_arm(env, a)
            runs[name].append(result)
            for rows, r in result.items():
                print(f"pair {pair + 1} {name} {rows} in flight: "
                      f"{r['request_throughput']:.2f} req/s, TPOT p50 {r['median_tpot_ms']:.2f} ms",
                      flush=True)  # fmt: skip
    print("\n".join(summary(runs, a.rows)))


if __name__ == "__main__":
    main()
