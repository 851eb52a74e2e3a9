"""`pagedserve launch` stops cleanly (issue 34): on SIGTERM it exits 0, prints nothing after its
"stopped" line and no traceback or leak report on the way; a configuration error is one line
and exit code 2 before any process starts; a start-up that fails in the EngineCore ends with
the reason and exit code 1, without tracebacks from API servers still importing.

The SIGTERM case runs the embedded model in float32 with the CPU compile on and an empty cache,
so the worker has a compiling child (worker/cpu_compile.py) when it is stopped: with the old
SIGTERM handler (`sys.exit(0)`), the SystemExit landed in that child's `Popen.__del__` during
the worker's teardown (`Exception ignored in ... SystemExit: 0`)."""

from __future__ import annotations

import os

from test_cli import run_cli
from test_server import Launched

from proctools import descendants, wait_gone

ARGS = ["--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--max-model-len", "128"]
NOISE = ("Traceback", "Exception ignored", "leaked")
CURVE_ENV = ("PAGEDSERVE_CURVE_KEY", "PAGEDSERVE_CURVE_KEY_FILE")


def _env(**changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CURVE_ENV}
    return env | changes


def test_sigterm_prints_nothing_after_stopped(tmp_path) -> None:
    env = _env(
        PAGEDSERVE_CACHE=str(tmp_path / "cache"),  # no compiled package: the worker compiles one
        PAGEDSERVE_CPU_COMPILE="auto",
        PAGEDSERVE_CPU_KERNELS="torch",  # no C++ decode kernel to build in the empty cache
    )
    launched = Launched([*ARGS, "--dtype", "float32"], str(tmp_path / "launch.log"), env=env)
    try:
        launched.wait_ready()
        assert "compiling the CPU forward in the background" in launched.output()
        pids = descendants(launched.proc.pid)
    finally:
        rc = launched.stop()
    out = launched.output()
    assert rc == 0, out
    assert out.rstrip().splitlines()[-1] == "pagedserve: stopped", out
    assert [word for word in NOISE if word in out] == [], out
    assert wait_gone(pids, 10) == [], out


def test_config_error_is_one_line_before_any_process() -> None:
    """Several nodes without the CURVE key every node needs: found by the CLI, not by an
    EngineCore that is already started (which printed "serving ..." first)."""
    r = run_cli("launch", *ARGS, "--tp", "2", "--nnodes", "2", "--master-port", "29555", env=_env())
    assert r.returncode == 2, r
    assert r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("pagedserve launch: error:") and "CURVE key" in lines[0]


def test_failed_start_has_no_traceback(tmp_path) -> None:
    """The EngineCore cannot bind its multi-node address (not one of this machine's): it dies
    within a second or two, while the API server is still importing; the launcher reports the
    reason, stops the server without a KeyboardInterrupt traceback, and exits 1."""
    key = run_cli("gen-key").stdout.strip()
    args = [*ARGS, "--tp", "2", "--nnodes", "2", "--master-addr", "192.0.2.1",
            "--master-port", "29555"]  # fmt: skip
    launched = Launched(args, str(tmp_path / "launch.log"), env=_env(PAGEDSERVE_CURVE_KEY=key))
    try:
        launched.proc.wait(timeout=60)
    finally:
        rc = launched.stop()
    out = launched.output()
    assert rc == 1, out
    assert "EngineCore" in out and "192.0.2.1" in out, out
    assert out.rstrip().splitlines()[-1] == "pagedserve: stopped", out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
