"""Where a CPU serving step's time goes (issue 43), in two parts, re-runnable on any machine:

    python -m pagedserve.benchmarks.cpu_profile [--model DIR] [--rows 8 32] [--ctx 128]
        [--serve-prompts 64] [--py-spy] [--skip-serve]

1. Ops: the worker's forward alone (`ModelRunner.execute` of decode steps at each `--rows`, no
   processes), under torch's profiler: ms per step and the ops by self CPU time. It runs the
   eager forward (`PAGEDSERVE_CPU_COMPILE=off`) since the compiled one is a single opaque call;
   its own ms per step is printed beside for comparison.
2. Processes: `pagedserve launch` of the same model and `pagedserve bench serve` against it at
   `--rows` in flight (128 in / 128 out); each process's CPU seconds over the run (API server,
   engine core, workers, the client), as shares of the machine's cores, and with `--py-spy` the
   functions each process spends most samples in.

The machine's other load skews absolute numbers: read the shares, run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import torch

from pagedserve import settings
from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import CachedDelta, NewRequest, SamplingParams, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.device import set_cpu_threads, weight_bytes
from pagedserve.worker.model_runner import ModelRunner

DEFAULT_MODEL = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "frontend", "default_model"
)
CLI = [sys.executable, "-m", "pagedserve.entrypoints.cli"]


def _runner(model: str, rows: int, ctx: int) -> ModelRunner:
    blocks = rows * (-(-(ctx + 64) // 16)) + 8
    config = build_engine_config(model, device="cpu", dtype="float32",
                                 num_gpu_blocks_override=blocks)  # fmt: skip
    runner = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    runner.init_cache(blocks)
    set_cpu_threads(1, weight_bytes(runner.model))  # the threads a served worker takes
    return runner


def _decode_steps(runner: ModelRunner, rows: int, ctx: int, first: int, n: int) -> float:
    """ms per decode step over `n` steps of `rows` requests already prefilled."""
    t0 = time.perf_counter()
    for i in range(n):
        cached = [CachedDelta(f"r{r}", [], [], ctx + first + i) for r in range(rows)]
        runner.execute(StepPlan(first + i + 1, [c.req_id for c in cached], [1] * rows,
                                cached=cached))  # fmt: skip
    return 1000 * (time.perf_counter() - t0) / n


def _prefill(runner: ModelRunner, rows: int, ctx: int) -> None:
    per = -(-(ctx + 64) // runner.block_size)
    news = [
        NewRequest(f"r{r}", list(range(10, 10 + ctx)), list(range(r * per, (r + 1) * per)),
                   SamplingParams(temperature=0, max_tokens=64), 0)
        for r in range(rows)
    ]  # fmt: skip
    runner.execute(StepPlan(0, [n.req_id for n in news], [ctx] * rows, new_requests=news))


def profile_ops(model: str, rows: int, ctx: int, top: int) -> None:
    runner = _runner(model, rows, ctx)
    _prefill(runner, rows, ctx)
    _decode_steps(runner, rows, ctx, 0, 5)  # warm-up
    ms = _decode_steps(runner, rows, ctx, 5, 20)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled_ms = _decode_steps(runner, rows, ctx, 25, 10)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    in_ops = sum(e.self_cpu_time_total for e in events) / 10  # us per step, all threads
    outside = max(0.0, 1000 * profiled_ms - in_ops)
    print(f"\n## worker ops, {rows} rows, context {ctx}: eager decode step {ms:.2f} ms, "
          f"{torch.get_num_threads()} intra-op threads")  # fmt: skip
    print("| op | calls/step | self us/step | share |\n|---|---|---|---|")
    whole = in_ops + outside
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        us = e.self_cpu_time_total / 10
        print(f"| {e.key[:60]} | {e.count / 10:.0f} | {us:.0f} | {100 * us / whole:.1f}% |")
    print(f"| outside torch ops (Python, the C++ attention kernel) | | {outside:.0f} | "
          f"{100 * outside / whole:.1f}% |")  # fmt: skip


def _role(proc: psutil.Process) -> str:
    """A process's part: the module after `-m` (api_server, engine_process, worker_process...)."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "gone"
    module = cmd[cmd.index("-m") + 1] if "-m" in cmd[:-1] else os.path.basename(cmd[0])
    if module.endswith("entrypoints.cli"):
        return "launch" if "launch" in cmd else "bench client"
    return module.rsplit(".", 1)[-1]


def _cpu_seconds(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def _py_spy(pid: int, path: str) -> subprocess.Popen | None:
    """py-spy sampling `pid` until it exits or is interrupted, into `path` (raw stacks)."""
    cmd = ["py-spy", "record", "-p", str(pid), "-r", "50", "-f", "raw", "-o", path,
           "--nonblocking"]  # fmt: skip
    try:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None


def _top_frames(path: str, top: int) -> str:
    """The functions a py-spy raw profile's samples were in (innermost frame), largest first."""
    counts: collections.Counter[str] = collections.Counter()
    try:
        with open(path) as f:
            for line in f:
                stack, _, n = line.rpartition(" ")
                counts[stack.rsplit(";", 1)[-1].split(" (")[0]] += int(n)
    except (OSError, ValueError):
        return "no samples"
    whole = sum(counts.values()) or 1
    return ", ".join(f"{name} {100 * n / whole:.0f}%" for name, n in counts.most_common(top))


def _serve_run(launch: psutil.Process, port: int, model: str, rows: int, prompts: int,
               spy: bool) -> None:  # fmt: skip
    """One `bench serve` run at `rows` in flight: CPU seconds per process, as shares."""
    bench = [*CLI, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--dataset-name",
             "random", "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos",
             "--num-prompts", str(prompts), "--max-concurrency", str(rows), "--disable-tqdm",
             "--tokenizer", model]  # fmt: skip
    procs = [launch, *launch.children(recursive=True)]
    before, t0 = _cpu_seconds(procs), time.perf_counter()
    client = psutil.Popen(bench, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(client)
    roles = {p.pid: _role(p) for p in procs}  # now: the client's command line goes at its exit
    tmp = tempfile.mkdtemp(prefix="cpu_profile_")
    spies = {p.pid: _py_spy(p.pid, f"{tmp}/{p.pid}.txt") for p in procs} if spy else {}
    used = {}
    while client.poll() is None:  # sampled while it runs: the client's times vanish at its exit
        used.update({pid: t - before.get(pid, 0.0) for pid, t in _cpu_seconds(procs).items()})
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    out = client.stdout.read() if client.stdout else ""
    lines = [ln for ln in out.splitlines() if "throughput" in ln.lower() or "Median TPOT" in ln]
    print(
        f"\n## processes, {rows} in flight, {prompts} x 128/128: {wall:.1f} s wall, "
        f"{os.cpu_count()} cores; " + "; ".join(" ".join(ln.split()) for ln in lines[:3])
    )
    print("| process | pid | CPU s | share of the machine | top functions (py-spy) |")
    print("|---|---|---|---|---|")
    cores = os.cpu_count() or 1
    for p in procs:
        spied = spies.get(p.pid)
        if spied is not None:
            spied.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
            spied.wait(timeout=60)
        top = _top_frames(f"{tmp}/{p.pid}.txt", 4) if spied is not None else ""
        secs = used.get(p.pid, 0.0)
        share = 100 * secs / (wall * cores)
        print(f"| {roles[p.pid]} | {p.pid} | {secs:.1f} | {share:.0f}% | {top} |")


def profile_serving(model: str, rows_list: list[int], prompts: int, spy: bool) -> None:
    port = 8000 + os.getpid() % 1000
    log = os.path.join(tempfile.mkdtemp(prefix="cpu_profile_"), "launch.log")
    cmd = [*CLI, "launch", "--model", model, "--dtype", "float32", "--port", str(port),
           "--max-model-len", "1024"]  # fmt: skip
    with open(log, "w") as out:
        launch = psutil.Popen(cmd, stdout=out, stderr=out)
    try:
        _wait_ready(port, log)
        for rows in rows_list:
            _serve_run(launch, port, model, rows, max(prompts, 2 * rows), spy)
    finally:
        launch.send_signal(signal.SIGTERM)
        launch.wait(timeout=60)


def _wait_ready(port: int, log: str, timeout: float = 900) -> None:
    """Until the server answers and, if it compiles its CPU forward, that forward is in use (the
    worker switches at a step: small requests make steps while it waits)."""
    import httpx

    url, deadline = f"http://127.0.0.1:{port}/v1", time.time() + timeout
    while time.time() < deadline:
        try:
            model = httpx.get(f"{url}/models").json()["data"][0]["id"]
            break
        except (httpx.HTTPError, KeyError, ValueError):
            time.sleep(0.5)
    else:
        raise TimeoutError(f"the server on port {port} did not come up: see {log}")
    while time.time() < deadline:
        with open(log) as f:
            text = f.read()
        if "compiling the CPU forward" not in text or "compiled CPU forward in use" in text:
            return
        body = {"model": model, "prompt": "def", "max_tokens": 2}
        httpx.post(f"{url}/completions", json=body, timeout=60)
        time.sleep(1)
    raise TimeoutError(f"the compiled CPU forward was not in use in {timeout} s: see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--serve-prompts", type=int, default=64)
    ap.add_argument("--py-spy", action="store_true", help="sample each process with py-spy")
    ap.add_argument("--skip-serve", action="store_true")
    a = ap.parse_args()
    print(f"CPU: {_cpu_line()}, torch {torch.__version__}")
    os.environ["PAGEDSERVE_CPU_COMPILE"] = "off"  # ops by name: the eager forward
    settings.forget()
    for rows in a.rows:
        profile_ops(a.model, rows, a.ctx, a.top)
    del os.environ["PAGEDSERVE_CPU_COMPILE"]
    settings.forget()
    if not a.skip_serve:
        profile_serving(a.model, a.rows, a.serve_prompts, a.py_spy)


def _cpu_line() -> str:
    with open("/proc/cpuinfo") as f:
        info = f.read()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "?")  # fmt: skip
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "").split()
    vector = sorted(f for f in set(flags) if f in ("avx2", "fma") or f.startswith("avx512"))
    return f"{name}, {os.cpu_count()} cores, {' '.join(vector)}"


if __name__ == "__main__":
    main()
