"""`pagedserve launch` as a process: flag errors, the embedded default model, a port already in
use, shutdown on SIGTERM, when a child dies and when the launcher is killed (no orphans left)."""

from __future__ import annotations

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

from pagedserve.frontend.cli import DEFAULT_MODEL_NAME, default_model_dir, parse_size

from proctools import descendants, wait_gone
from tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir("llama", tmp_path_factory.getbasetemp())


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedserve.frontend.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def child_pids(launched: Launched) -> dict[str, int]:
    """Name -> pid of the launcher's direct children, from their command lines."""
    out = {}
    for pid in descendants(launched.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if "pagedserve.ipc.engine_process" in argv:
            out["EngineCore"] = pid
        elif "pagedserve.frontend.api_server" in argv:
            out[f"API server {argv[argv.index('--client-index') + 1]}"] = pid
    return out


BAD_FLAGS = [
    ("--block-size", "3"),
    ("--port", "abc"),
    ("--kv-cache-memory", "12Q"),
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
    launched = Launched(launch_args(model_dir, "--api-servers", "2"), str(tmp_path / "l.log"))
    try:
        url = launched.wait_ready()
        out = launched.output()
        assert re.search(r"engine ready in [\d.]+ s", out)
        assert re.search(r"2 API server\(s\) ready in [\d.]+ s; listening on", out)
        names = child_pids(launched)
        assert set(names) == {"EngineCore", "API server 0", "API server 1"}
        pids = descendants(launched.proc.pid)
        assert len(pids) >= 4  # + at least one worker under the EngineCore
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        streaming = threading.Event()

        def stream() -> None:  # a request still streaming when SIGTERM arrives
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                    for _ in r.iter_lines():
                        streaming.set()
            except httpx.HTTPError:
                pass

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        assert streaming.wait(30)
    finally:
        rc = launched.stop(signal.SIGTERM)
    assert rc == 0, launched.output()
    assert "SIGTERM received; shutting down" in launched.output()
    assert wait_gone(pids, 10) == []
    thread.join(10)


@pytest.mark.parametrize("victim", ["EngineCore", "API server 1"])
def test_child_death_stops_launch(model_dir: str, tmp_path, victim: str) -> None:
    launched = Launched(launch_args(model_dir, "--api-servers", "2"), str(tmp_path / "l.log"))
    try:
        launched.wait_ready()
        pids = descendants(launched.proc.pid)
        pid = child_pids(launched)[victim]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while launched.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        rc = launched.stop()
    assert rc == 1, launched.output()
    assert f"error: {victim} (pid {pid}) killed by SIGKILL; stopping" in launched.output()
    assert wait_gone(pids, 10) == []


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
