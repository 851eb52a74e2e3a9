"""`pagedserve launch` as a process: flag errors, the embedded default model, a port already in
use, shutdown on SIGTERM, when a child dies and when the launcher is killed (no orphans left)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import CPU_ARGS, Launched, launch_args

from pagedserve.entrypoints.args import parse_size
from pagedserve.frontend.hub import DEFAULT_MODEL_NAME, default_model_dir

from proctools import descendants, wait_gone
from tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir("llama", tmp_path_factory.getbasetemp())


def run_cli(
    *args: str, timeout: float = 60, env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def child_pids(launched: Launched) -> dict[str, int]:
    """Name -> pid of the launcher's direct children, from their command lines."""
    out = {}
    for pid in descendants(launched.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if "pagedserve.entrypoints.engine_process" in argv:
            out["EngineCore"] = pid
        elif "pagedserve.entrypoints.api_server" in argv:
            out[f"API server {argv[argv.index('--client-index') + 1]}"] = pid
        elif "pagedserve.worker.worker_process" in argv:
            out[f"worker {argv[argv.index('--rank') + 1]}"] = pid
    return out


def stream_in_background(
    url: str, max_tokens: int, chat: bool = False
) -> tuple[list, threading.Thread]:
    """A streamed completion (or chat completion) on its own thread, running when this returns;
    its SSE payloads (or the transport error that ended it) collect in the returned list. A chat
    stream's first event (the assistant role) needs no token: it comes even while no worker runs."""
    body: dict = {"max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        body["prompt"] = "Hello"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    events: list = []
    streaming = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream("POST", url + path, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        streaming.set()
        except httpx.HTTPError as e:
            events.append(e)
        streaming.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert streaming.wait(30)
    return events, thread


BAD_FLAGS = [
    ("--block-size", "3"),
    ("--port", "abc"),
    ("--kv-cache-memory", "12Q"),
    ("--kv-offloading-size", "-1"),
    ("--max-model-len", "0"),
    ("--tp", "3"),
    ("--scheduling-policy", "lifo"),
    ("--api-servers", "0"),
    ("--dtype", "int3"),
    ("--gpu-memory-utilization", "1.5"),
    ("--no-such-flag", "1"),
]


@pytest.mark.parametrize("flag,value", BAD_FLAGS, ids=[f for f, _ in BAD_FLAGS])
def test_bad_flag_exits_2_with_one_line(model_dir: str, flag: str, value: str) -> None:
    r = run_cli("launch", "--model", model_dir, *CPU_ARGS, flag, value)
    assert r.returncode == 2, r
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("pagedserve launch: error:")
    assert flag.lstrip("-").split("-")[0] in lines[0] or "argument" in lines[0]


def test_usage_errors(tmp_path) -> None:
    r = run_cli()
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("launch", "--model", str(tmp_path))
    assert r.returncode == 2 and "config.json" in r.stderr and "Traceback" not in r.stderr
    assert parse_size("512M") == 512 << 20 and parse_size("2G") == 2 << 30
    assert parse_size("1000") == 1000


def test_port_in_use(model_dir: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("launch", "--model", model_dir, *CPU_ARGS, "--host", "127.0.0.1",
                    "--port", str(port))  # fmt: skip
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stdout
    assert "Traceback" not in r.stderr


def test_default_model(tmp_path) -> None:
    """Without --model, launch serves the embedded model (or says clearly that it is missing)."""
    if not os.path.isfile(os.path.join(default_model_dir(), "config.json")):
        r = run_cli("launch", "--device", "cpu")
        assert r.returncode == 2 and "embedded default model is missing" in r.stderr
        return
    args = ["--host", "127.0.0.1", "--port", "0", *CPU_ARGS]
    launched = Launched(args, str(tmp_path / "launch.log"))
    try:
        url = launched.wait_ready()
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == DEFAULT_MODEL_NAME
        body = {"messages": [{"role": "user", "content": "import os"}], "max_tokens": 8}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert launched.stop() == 0


def test_sigterm_stops_every_process(model_dir: str, tmp_path) -> None:
    """SIGTERM drains; a stream longer than --drain-timeout is aborted with an error event. The
    stream outlasts the drain by construction: its worker is stopped (SIGSTOP) before it starts
    and resumed only once the stream has ended, so no token comes however fast the machine."""
    args = launch_args(model_dir, "--api-servers", "2", "--drain-timeout", "1")
    launched = Launched(args, str(tmp_path / "l.log"))
    worker = None
    try:
        url = launched.wait_ready()
        out = launched.output()
        assert re.search(r"engine ready in [\d.]+ s", out)
        assert re.search(r"2 API server\(s\) ready in [\d.]+ s; listening on", out)
        names = child_pids(launched)
        assert set(names) == {"EngineCore", "API server 0", "API server 1", "worker 0"}
        pids = descendants(launched.proc.pid)
        assert len(pids) >= 4  # + at least one worker under the EngineCore
        worker = names["worker 0"]
        os.kill(worker, signal.SIGSTOP)
        events, thread = stream_in_background(url, 480, chat=True)
        launched.proc.send_signal(signal.SIGTERM)
        thread.join(30)
    finally:
        if worker is not None:
            os.kill(worker, signal.SIGCONT)
        with contextlib.suppress(subprocess.TimeoutExpired):  # the launcher drains and exits
            launched.proc.wait(timeout=30)
        rc = launched.stop(signal.SIGTERM)
    assert rc == 0, launched.output()
    assert "SIGTERM received; shutting down" in launched.output()
    assert wait_gone(pids, 10) == []
    assert not thread.is_alive()
    assert events[-1] == "[DONE]", events[-2:]
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert all("error" not in json.loads(e) for e in events[:-2])  # no token, no other error


def wait_exit(launched: Launched, timeout: float) -> float:
    """Seconds until launch exits (fails after `timeout`)."""
    start = time.monotonic()
    while launched.proc.poll() is None:
        assert time.monotonic() - start < timeout, f"launch still running:\n{launched.output()}"
        time.sleep(0.05)
    return time.monotonic() - start


def health_codes(url: str, until: threading.Event) -> list:
    """What /health answers (a status, or "refused") until `until` is set."""
    seen: list = []
    while not until.is_set():
        try:
            seen.append(httpx.get(url + "/health", timeout=2).status_code)
        except httpx.TransportError:
            seen.append("refused")
        time.sleep(0.02)
    try:  # and once more after `until`: by then every server is gone
        seen.append(httpx.get(url + "/health", timeout=2).status_code)
    except httpx.TransportError:
        seen.append("refused")
    return seen


@pytest.mark.parametrize("victim", ["EngineCore", "API server 1", "worker 0"])
def test_child_death_stops_launch(model_dir: str, tmp_path, victim: str) -> None:
    """kill -9 of any process: the in-flight stream ends (an error event then [DONE], or a broken
    connection when its own API server was killed), /health stops answering 200, launch exits 1
    naming the process and how it died, and nothing is left (descendants recorded before)."""
    launched = Launched(launch_args(model_dir, "--api-servers", "2"), str(tmp_path / "l.log"))
    try:
        url = launched.wait_ready()
        pids = descendants(launched.proc.pid)
        pid = child_pids(launched)[victim]
        events, thread = stream_in_background(url, 480)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        exited = threading.Event()
        health = []
        poller = threading.Thread(target=lambda: health.extend(health_codes(url, exited)))
        poller.start()
        wait_exit(launched, 10)
        exited.set()
        poller.join()
        thread.join(10)
    finally:
        rc = launched.stop()
    output = launched.output()
    assert rc == 1, output
    assert time.monotonic() - killed_at < 15
    if victim == "worker 0":  # the EngineCore exits and says which worker died
        expected = rf"EngineCore \(pid \d+\) exited with code 1 \(worker 0 \(pid {pid}\) killed by"
        assert re.search(rf"error: {expected} SIGKILL\); stopping", output), output
    else:
        assert f"error: {victim} (pid {pid}) killed by SIGKILL; stopping" in output
    assert wait_gone(pids, 10) == []
    assert not thread.is_alive()
    if isinstance(events[-1], Exception):  # the stream's own server was killed
        assert victim == "API server 1", events[-1]
    else:
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-2:]
    first_bad = next((i for i, code in enumerate(health) if code != 200), len(health))
    assert set(health[first_bad:]) <= {503, "refused"} and first_bad < len(health), health


def test_kill_9_launcher_leaves_no_orphans(model_dir: str, tmp_path) -> None:
    launched = Launched(launch_args(model_dir, "--api-servers", "2"), str(tmp_path / "l.log"))
    try:
        launched.wait_ready()
        pids = descendants(launched.proc.pid)
        assert len(pids) >= 4
        with open(f"/proc/{child_pids(launched)['API server 0']}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
    finally:
        assert launched.stop(signal.SIGKILL) == -signal.SIGKILL
    assert wait_gone(pids, 10) == []
    shutil.rmtree(argv[argv.index("--ipc-dir") + 1])  # what the launcher had no chance to remove


def test_gen_key_prints_or_writes_a_private_key_file(tmp_path, capsys):
    """`pagedserve gen-key`: the CURVE key pair every node gets (hex of the secret half)."""
    import stat

    from pagedserve.entrypoints.cli import main
    from pagedserve.ipc.curve import CurveKey

    assert main(["gen-key"]) == 0
    printed = capsys.readouterr().out.strip()
    assert len(printed) == 64 and CurveKey.parse(printed).text() == printed
    path = tmp_path / "curve.key"
    assert main(["gen-key", "--output", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert CurveKey.parse(path.read_text()).text() != printed
    with pytest.raises(SystemExit):  # never overwrites a key
        main(["gen-key", "--output", str(path)])
    with pytest.raises(ValueError, match="64 hex digits"):
        CurveKey.parse(printed[:-2])


def test_served_pipeline_takes_smaller_steps(model_dir: str) -> None:
    """`launch --pp P` (P > 1) plans 512 tokens a step unless told (a whole prompt in one
    micro-batch's step stalls every stage: frontend/engine_args.py); one stage, `LLM` and an
    explicit --max-num-batched-tokens keep theirs."""
    from pagedserve.entrypoints.cli import build_parser, engine_config
    from pagedserve.frontend.engine_args import build_engine_config

    parser, _ = build_parser()

    def budget(*flags: str, serving: bool = True) -> int:
        args = parser.parse_args(["launch", "--model", model_dir, "--device", "cpu", *flags])
        return engine_config(args, serving=serving).scheduler.max_num_batched_tokens

    assert budget("--pp", "2") == 512
    assert budget("--pp", "2", serving=False) == budget() == 8192
    assert budget("--pp", "2", "--max-num-batched-tokens", "4096") == 4096
    llm = build_engine_config(model_dir, device="cpu", pipeline_parallel_size=2)
    assert llm.scheduler.max_num_batched_tokens == 8192
