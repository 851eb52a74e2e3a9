"""Starting and watching child processes.

Children are started with `python -m <module>` (no multiprocessing, so nothing is pickled) and ask
the kernel to SIGKILL them when their parent dies (PR_SET_PDEATHSIG), so no process outlives the
one that started it, even after a kill -9. Parents poll their children and report which one died.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Called first thing in a child: get SIGKILL when the parent exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before prctl took effect


def freeze_startup_heap() -> None:
    """Called once a long-lived process has started, before its step loop: moves every object
    alive now (imported modules, torch, the model, tokenizers: millions of objects) out of the
    garbage collector's reach, so that a full collection during serving scans only what serving
    allocates. Without it a generation-2 collection stalls a step by tens to hundreds of ms."""
    gc.collect()
    gc.freeze()


def spawn(module: str, args: list[str], name: str, env: dict[str, str] | None = None) -> Child:
    cmd = [sys.executable, "-m", module, "--parent-pid", str(os.getpid()), *args]
    full_env = dict(os.environ)
    full_env.update(env or {})
    return Child(subprocess.Popen(cmd, env=full_env), name)


class Child:
    """A started process and the name it is reported by ("worker 3", "EngineCore")."""

    def __init__(self, proc: subprocess.Popen, name: str) -> None:
        self.proc = proc
        self.name = name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def death_message(self) -> str | None:
        """None while alive, else a sentence saying how it ended."""
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return f"{self.name} (pid {self.pid}) {how}"

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait up to `timeout`, then SIGKILL."""
        stop_all([self], timeout)


def stop_all(children: list[Child], timeout: float = 5.0) -> None:
    for child in children:
        if child.proc.poll() is None:
            _terminate(child.proc)
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait(timeout=5)


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGCONT: a stopped process (SIGSTOP, a debugger) handles SIGTERM only once
    it runs again."""
    proc.terminate()
    try:
        proc.send_signal(signal.SIGCONT)
    except ProcessLookupError:
        pass


def process_state(pid: int) -> str:
    """A process's scheduler state from /proc ("running", "stopped", ...), for error messages."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    names = {"R": "running", "S": "sleeping", "D": "in uninterruptible IO", "T": "stopped",
             "t": "stopped by a debugger", "Z": "a zombie"}  # fmt: skip
    return names.get(code, f"in state {code}")
