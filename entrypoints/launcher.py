"""`pagedserve launch`: EngineCore processes (one per data parallel rank, `-dp N`; each starts its
own tp x pp workers) and N API server processes sharing one port, each a client of every core.

The launcher binds the listening socket itself and hands the fd to every API server (pass_fds),
so the kernel spreads connections over the servers without a proxy. It then only watches:
- start-up: servers report "engine I" / "server I" on a pipe; the launcher prints phase times;
- run: if any child dies, print which one and how (`Child.death_message`, plus the EngineCore's
  own reason: which worker died or which step hung), then stop the rest: API servers get SIGINT
  (abort running requests with an error, /health 503, exit; SIGTERM to one still starting, where
  SIGINT would print a KeyboardInterrupt traceback), then the EngineCore; exit 1;
- SIGINT / SIGTERM: drain. API servers get SIGTERM: they answer 503 to new requests and /health,
  let running requests and streams finish for up to `--drain-timeout` s (then abort them with an
  error event), and exit; then the EngineCore stops; exit 0. A second signal aborts at once.
Children also die with the launcher (PR_SET_PDEATHSIG), so even `kill -9` leaves no orphans.
API servers run in their own session so a terminal's Ctrl-C reaches only the launcher, which
then shuts them down in order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.engine_process import ERROR_FILE, start_workers
from pagedserve.frontend.engine_cores import core_dirs, core_name, start_engine_cores
from pagedserve.frontend.generation_config import describe_defaults
from pagedserve.ipc.process import Child, stop_all
from pagedserve.ipc.sockets import CoreAddresses, ipc_dir
from pagedserve.settings import API_KEY_ENV

POLL_S = 0.2
ABORT_GRACE_S = 5.0  # for API servers to end aborted requests and exit


@dataclass
class LaunchOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    api_servers: int = 1
    api_key: str | None = None
    log_level: str = "info"
    drain_timeout: float = 30.0
    max_request_bytes: int = 4 << 20
    log_requests: bool = True  # one line per HTTP request (--disable-log-requests: none)
    log_prompts: bool = False  # the prompt text in that line (--log-prompts)
    log_stats_interval: float | None = 10.0  # the EngineCore's stats line (None: none)
    chat_template: str | None = None  # the template's text (--chat-template, loaded)
    trust_request_chat_template: bool = False
    uvicorn_log_level: str = "info"
    allowed_origins: list[str] | None = None  # CORS; None: no CORS headers
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    root_path: str = ""
    api_server_args: tuple[str, ...] = ()  # chat flags passed through (tool and reasoning parsers)

    def server_argv(self) -> list[str]:
        """The API server's flags for these options (entrypoints/api_server.py)."""
        argv = [
            "--log-level", self.log_level,
            "--uvicorn-log-level", self.uvicorn_log_level,
            "--drain-timeout", str(self.drain_timeout),
            "--max-request-bytes", str(self.max_request_bytes),
            "--root-path", self.root_path,
        ]  # fmt: skip
        if self.log_requests:
            argv.append("--log-requests")
        if self.log_prompts:
            argv.append("--log-prompts")
        if self.trust_request_chat_template:
            argv.append("--trust-request-chat-template")
        if self.chat_template is not None:
            argv += ["--chat-template", self.chat_template]
        if self.allowed_origins is not None:
            argv += ["--allowed-origins", json.dumps(self.allowed_origins)]
        if self.ssl_keyfile is not None and self.ssl_certfile is not None:
            argv += ["--ssl-keyfile", self.ssl_keyfile, "--ssl-certfile", self.ssl_certfile]
        return argv + list(self.api_server_args)


def say(message: str) -> None:
    print(f"pagedserve: {message}", flush=True)


def bind(host: str, port: int) -> socket.socket:
    """The shared listening socket (port 0 picks a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=4096)
    sock.set_inheritable(True)
    return sock


def start_api_server(
    index: int, config_json: str, directory: str, core_pids: list[int], sock: socket.socket,
    ready_fd: int, opts: LaunchOptions, metrics_dir: str,
) -> Child:  # fmt: skip
    cmd = [
        sys.executable, "-m", "pagedserve.entrypoints.api_server",
        "--parent-pid", str(os.getpid()),
        "--config", config_json,
        "--ipc-dir", directory,
        "--core-pid", ",".join(map(str, core_pids)),
        "--client-index", str(index),
        "--fd", str(sock.fileno()),
        "--ready-fd", str(ready_fd),
        *opts.server_argv(),
    ]  # fmt: skip
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir)
    env.pop(API_KEY_ENV, None)
    if opts.api_key:
        env[API_KEY_ENV] = opts.api_key
    # A session of its own: a terminal's Ctrl-C reaches the launcher only, which stops servers.
    fds = (sock.fileno(), ready_fd)
    proc = subprocess.Popen(cmd, env=env, pass_fds=fds, start_new_session=True)
    return Child(proc, f"API server {index}")


class Launcher:
    def __init__(self, config: EngineConfig, opts: LaunchOptions) -> None:
        self.config = config
        self.opts = opts
        self.children: list[Child] = []
        self.stop_signal: int | None = None
        self.num_signals = 0
        self.directory = ""
        self.servers_ready: set[int] = set()  # indices of API servers that said "server I"

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum
        self.num_signals += 1

    def run(self) -> int:
        t0 = time.monotonic()
        # children say when they are ready, since launch
        when = dataclasses.replace(self.config.settings, launch_t0=time.time())
        self.config = dataclasses.replace(self.config, settings=when)
        try:
            sock = bind(self.opts.host, self.opts.port)
        except OSError as e:
            say(f"error: cannot listen on {self.opts.host}:{self.opts.port}: {e.strerror or e}")
            return 1
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        directory = self.directory = ipc_dir()
        metrics_dir = os.path.join(directory, "metrics")  # private, and removed with it
        os.mkdir(metrics_dir)
        ready_r, ready_w = os.pipe()
        code = 1
        try:
            self._start(sock, directory, metrics_dir, ready_w)
            os.close(ready_w)
            ready_w = -1
            code = self._watch(t0, sock, ready_r)
            return code
        finally:
            self._shutdown(drain=code == 0)
            for fd in (ready_r, ready_w):
                if fd >= 0:
                    os.close(fd)
            sock.close()
            shutil.rmtree(directory, ignore_errors=True)
            for s, handler in old.items():
                signal.signal(s, handler)

    def _start(self, sock: socket.socket, directory: str, metrics_dir: str, ready_w: int) -> None:
        mc, parallel = self.config.model, self.config.parallel
        dp = parallel.data_parallel_size
        say(
            f"serving {mc.model} as {mc.name!r} (max_model_len {self.config.max_model_len}, "
            f"tp {parallel.tensor_parallel_size}, pp {parallel.pipeline_parallel_size}, "
            f"{f'dp {dp}, ' if dp > 1 else ''}{self.opts.api_servers} API server(s))"
        )
        defaults = describe_defaults(mc)
        if defaults is not None:
            say(defaults)
        opts = self.opts
        cores = start_engine_cores(
            self.config, directory, opts.log_level.upper(), opts.log_stats_interval
        )
        self.children += cores
        pids = [core.pid for core in cores]
        config_json = self.config.to_json()
        for i in range(self.opts.api_servers):
            child = start_api_server(
                i, config_json, directory, pids, sock, ready_w, self.opts, metrics_dir
            )
            self.children.append(child)

    def _watch(self, t0: float, sock: socket.socket, ready_r: int) -> int:
        engine_ready = False
        pending = b""
        pipe_open = True
        while self.stop_signal is None:
            for child in self.children:
                message = child.death_message()
                if message is not None:
                    say(f"error: {message}{self._reason(child)}; stopping")
                    return 1
            if not pipe_open:
                time.sleep(POLL_S)
                continue
            readable, _, _ = select.select([ready_r], [], [], POLL_S)
            if not readable:
                continue
            data = os.read(ready_r, 4096)
            if not data:  # every server closed the pipe; deaths are reported above
                pipe_open = False
                continue
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                what, _, index = line.decode().partition(" ")
                if what == "engine" and not engine_ready:
                    engine_ready = True
                    say(f"engine ready in {time.monotonic() - t0:.1f} s")
                elif what == "server":
                    self.servers_ready.add(int(index))
                    if len(self.servers_ready) == self.opts.api_servers:
                        self._say_listening(t0, sock)
        say(f"{signal.Signals(self.stop_signal).name} received; shutting down")
        return 0

    def _say_listening(self, t0: float, sock: socket.socket) -> None:
        host, port = sock.getsockname()[:2]
        shown = "[" + host + "]" if ":" in host else host
        scheme = "http" if self.opts.ssl_certfile is None else "https"
        say(
            f"{self.opts.api_servers} API server(s) ready in {time.monotonic() - t0:.1f} s; "
            f"listening on {scheme}://{shown}:{port}"
        )

    def _reason(self, child: Child) -> str:
        """Why an EngineCore exited, in its own words (it names the worker or the step)."""
        dp = self.config.parallel.data_parallel_size
        names = [core_name(i, dp) for i in range(dp)]
        if child.name not in names:
            return ""
        path = core_dirs(self.directory, dp)[names.index(child.name)]
        try:
            with open(os.path.join(path, ERROR_FILE)) as f:
                return f" ({f.read().strip()})"
        except OSError:
            return ""

    def _shutdown(self, drain: bool) -> None:
        """API servers first (drained, or told to abort), then the EngineCores."""
        servers = [c for c in self.children if c.name.startswith("API server")]
        if drain:
            say(f"draining: running requests may finish for up to {self.opts.drain_timeout:g} s")
            self._wait_servers(servers, signal.SIGTERM, self.opts.drain_timeout + ABORT_GRACE_S)
        else:
            self._wait_servers(servers, None, ABORT_GRACE_S)
        stop_all(servers, timeout=0)  # whatever is left: SIGTERM, then SIGKILL
        stop_all([c for c in self.children if c not in servers], timeout=10)
        say("stopped")

    def _wait_servers(self, servers: list[Child], sig: int | None, timeout: float) -> None:
        """Signal the servers (`sig`, or None: abort) and wait for them to exit; a further
        signal to the launcher turns a drain into an abort."""
        self._signal_servers(servers, sig)
        seen = self.num_signals
        deadline = time.monotonic() + timeout
        while any(c.proc.poll() is None for c in servers) and time.monotonic() < deadline:
            if self.num_signals != seen:
                seen = self.num_signals
                say("signal received again; aborting running requests")
                self._signal_servers(servers, None)
            time.sleep(0.05)

    def _signal_servers(self, servers: list[Child], sig: int | None) -> None:
        """`sig` to each live server; None aborts: SIGINT to a serving one (it ends its requests
        with an error), SIGTERM to one still starting, which has no requests, and which SIGINT
        would stop with a KeyboardInterrupt traceback from wherever its imports are."""
        for index, child in enumerate(servers):
            if child.proc.poll() is None:
                abort = signal.SIGINT if index in self.servers_ready else signal.SIGTERM
                child.proc.send_signal(abort if sig is None else sig)


def run_worker_node(config: EngineConfig) -> int:
    """`launch --node-rank K` (K > 0): only this node's workers, which join node 0's EngineCore
    over TCP; exit 1 if one dies (node 0 then reports it too), 0 on SIGTERM/SIGINT."""
    parallel = config.parallel
    assert parallel.master_port is not None
    per_node = parallel.ranks_per_node
    ranks = range(parallel.node_rank * per_node, (parallel.node_rank + 1) * per_node)
    addresses = CoreAddresses.tcp(parallel.master_addr, parallel.master_port)
    stop: list[int] = []
    old = {
        s: signal.signal(s, lambda sig, _f: stop.append(sig))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    workers = start_workers(config.to_json(), ranks, addresses, parallel.master_port)
    say(f"node {parallel.node_rank}: workers {ranks.start}-{ranks.stop - 1} joining "
        f"{parallel.master_addr}:{parallel.master_port}")  # fmt: skip
    code = 0
    try:
        while not stop:
            dead = next((m for w in workers if (m := w.death_message()) is not None), None)
            if dead is not None:
                say(f"error: {dead}; stopping")
                code = 1
                break
            time.sleep(POLL_S)
    finally:
        stop_all(workers, timeout=10)
        for s, handler in old.items():
            signal.signal(s, handler)
    return code
