"""The EngineCore process: binds the sockets, starts the workers, sizes the KV cache, runs the loop.

Run as `python -m pagedserve.entrypoints.engine_process --config JSON --input-address ADDR
--ipc-dir DIR` (frontend/engine_client.py's `start_engine_core`). Start-up: workers load weights
and report how many KV blocks fit -> the core takes the minimum over ranks, broadcasts InitCache,
waits for every rank -> answers each client's hello with EngineReady. If any worker dies or
fails, or a step times out (`--step-timeout`), every client gets EngineDead with the reason, the
reason is also left in `<ipc-dir>/engine-error` (for the launcher's message) and the process
exits 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
import traceback

import zmq

from pagedserve import settings
from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import EngineCore
from pagedserve.core.kv_tier import TierSpec, describe_costs
from pagedserve.errors import EngineDeadError, StepTimeoutError
from pagedserve.ipc.curve import load_key, start_authenticator
from pagedserve.ipc.messages import (
    ClientHello,
    ClientMessage,
    CoreToClient,
    EngineDead,
    EngineOutputs,
    EngineReady,
    InitCache,
    ShutdownWorkers,
    StepPlan,
    WorkerError,
    WorkerReady,
    WorkerToCore,
)
from pagedserve.ipc.process import (
    Child,
    die_with_parent,
    freeze_startup_heap,
    process_state,
    spawn,
    stop_all,
)
from pagedserve.ipc.sockets import (
    CoreAddresses,
    Receiver,
    Sender,
    StepReceiver,
    StepSender,
    free_port,
    ipc_address,
)

logger = logging.getLogger("pagedserve.engine")
STARTUP_TIMEOUT_S = 1800.0
ERROR_FILE = "engine-error"
MAX_CLIENTS = 2**16  # client indices: API servers are numbered from 0
# A client that takes no output for this long with CLIENT_HWM outputs queued (or whose socket is
# gone) is dropped: a live API server drains its socket on its own IO thread at all times.
CLIENT_HWM = 10_000
CLIENT_TIMEOUT_S = 5.0
# Plans queued per subscriber: a worker is at most `max_inflight` plans behind, so only a stalled
# or foreign subscriber reaches it (PUB then drops its copies instead of growing without bound).
PLAN_HWM = 1024


class ZmqTransport:
    """The EngineCore's sockets: client input, per-client output, plan broadcast, results."""

    def __init__(self, config: EngineConfig, input_address: str, ipc_dir: str) -> None:
        self.config = config
        self._auth = None
        self.ipc_dir = ipc_dir
        parallel = config.parallel
        if parallel.nnodes == 1:
            bind = connect = CoreAddresses.local(ipc_dir)
            self.dist_port = free_port()
            secure = None
        else:  # other nodes' workers connect over TCP: listen only where they reach us, CURVE
            assert parallel.master_port is not None, "multi-node needs --master-port"
            key = load_key()
            self._auth = start_authenticator(key)
            secure = key.server_options()
            host = socket.gethostbyname(parallel.master_addr)  # bind takes addresses, not names
            bind = CoreAddresses.tcp(host, parallel.master_port)
            connect = CoreAddresses.tcp(parallel.master_addr, parallel.master_port)
            self.dist_port = parallel.master_port
        self.worker_addresses = connect
        self.clients_in: Receiver[ClientMessage] = Receiver(input_address, ClientMessage, bind=True)
        self.results: StepReceiver[WorkerToCore] = StepReceiver(
            bind.results, WorkerToCore, bind=True, options=secure
        )
        self.plans: StepSender[StepPlan] = StepSender(
            bind.plans, bind=True, kind=zmq.PUB, hwm=PLAN_HWM, options=secure
        )
        self.clients_out: dict[int, Sender[CoreToClient]] = {}
        self.workers: list[Child] = []
        self.ready: EngineReady | None = None  # the answer to each ClientHello, once serving

    # Transport protocol ---------------------------------------------------------------
    def next_client_message(self, timeout: float | None) -> ClientMessage | None:
        return self.clients_in.get_nowait() if timeout is None else self.clients_in.get(timeout)

    def next_worker_message(self, timeout: float) -> WorkerToCore | None:
        return self.results.get(timeout)

    def broadcast(self, plan) -> None:
        self.plans.send(plan)

    def send_outputs(self, client_index: int, outputs: EngineOutputs) -> None:
        sender = self.clients_out.get(client_index)
        if sender is not None and not self._forget_if_gone(client_index, sender):
            sender.send(outputs)

    def add_client(self, hello: ClientHello) -> None:
        sender = self._connect(hello)
        if sender is None:
            return
        old = self.clients_out.pop(hello.client_index, None)
        if old is not None:
            old.close(flush_timeout=0)
        self.clients_out[hello.client_index] = sender
        sender.send(self.ready)

    def client_indices(self) -> list[int]:
        for index, sender in list(self.clients_out.items()):
            self._forget_if_gone(index, sender)
        return list(self.clients_out)

    def _connect(self, hello: ClientHello) -> Sender[CoreToClient] | None:
        """A sender to a new client's output socket, which must be an ipc socket in this engine's
        private directory; None (logged) for a hello that makes no sense (also one that would
        take over a connected client's outputs)."""
        address, inside = hello.output_address, ipc_address(self.ipc_dir, "")
        path = address[len(inside) :]
        known = self.clients_out.get(hello.client_index)
        if not (0 <= hello.client_index < MAX_CLIENTS):
            problem = f"client index {hello.client_index} is not in [0, {MAX_CLIENTS})"
        elif known is not None and not known.gone:  # its outputs stay where they go
            problem = f"client {hello.client_index} is already connected"
        elif not address.startswith(inside) or not path or "/" in path or "\0" in path:
            problem = f"output address {address[:200]!r} is not a socket in {self.ipc_dir}"
        else:
            try:
                return Sender(address, bind=False, hwm=CLIENT_HWM, peer_timeout=CLIENT_TIMEOUT_S)
            except zmq.ZMQError as e:
                problem = f"cannot connect to {address[:200]!r}: {e}"
        logger.error("dropped a ClientHello: %s", problem)
        return None

    def _forget_if_gone(self, client_index: int, sender: Sender[CoreToClient]) -> bool:
        if not sender.gone:
            return False
        logger.warning("client %d went away; its outputs are dropped", client_index)
        del self.clients_out[client_index]
        sender.close(flush_timeout=0)
        return True

    def check_workers(self) -> None:
        if self.ready is not None:  # after start-up, nobody counts subscriptions any more
            self.plans.drain_subscriptions()
        deaths = [child.death_message() for child in self.workers]  # index = rank (node 0)
        dead = {rank: message for rank, message in enumerate(deaths) if message is not None}
        if dead:
            raise EngineDeadError(self._reported_error(set(dead)) or next(iter(dead.values())))

    def _reported_error(self, dead: set[int]) -> str | None:
        """The error a dead worker sent before it exited, if it is among the results not read
        yet (a worker sends its traceback, flushes, then exits: its exit can be seen first).
        Only a dead worker's own: a live peer's error is most often that death seen through a
        collective, and the death is the cause to name."""
        while (msg := self.results.get(0.2)) is not None:
            if isinstance(msg, WorkerError) and msg.rank in dead:
                during = " during start-up" if self.ready is None else ""
                return f"worker {msg.rank} failed{during}: {msg.message}"
        return None

    def describe_workers(self) -> str:
        """Each local worker's state ("worker 0 (pid 12) is stopped"), to name a stuck one."""
        return ", ".join(f"{c.name} (pid {c.pid}) is {process_state(c.pid)}" for c in self.workers)

    # Start-up -------------------------------------------------------------------------
    def start_workers(self, config_json: str) -> None:
        """This node's workers (node 0: ranks [0, ranks_per_node)); other nodes start theirs."""
        ranks = range(self.config.parallel.ranks_per_node)
        self.workers = start_workers(config_json, ranks, self.worker_addresses, self.dist_port)

    def wait_workers(self, phase: str) -> list[WorkerReady]:
        world = self.config.parallel.world_size
        ready: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < world:
            if time.monotonic() > deadline:
                raise EngineDeadError(f"workers did not reach '{phase}' in {STARTUP_TIMEOUT_S} s")
            self.check_workers()
            msg = self.results.get(0.2)
            if isinstance(msg, WorkerError):
                raise EngineDeadError(f"worker {msg.rank} failed during start-up: {msg.message}")
            if isinstance(msg, WorkerReady) and msg.phase == phase:
                ready[msg.rank] = msg
        return list(ready.values())

    def init_cache(self) -> tuple[int, TierSpec | None]:
        """The KV cache's blocks, and its host tier's spec (None: off)."""
        profiled = self.wait_workers("profiled")
        _say_timings(profiled, self.config.settings.launch_t0)
        num_blocks = min(r.num_blocks for r in profiled)
        block_size = self.config.cache.block_size
        max_len = self.config.max_model_len
        if num_blocks * block_size < max_len:
            raise EngineDeadError(
                f"the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks), fewer "
                f"than max_model_len={max_len}: raise the KV cache memory "
                "(--gpu-memory-utilization or --kv-cache-memory) or lower --max-model-len"
            )
        world = self.config.parallel.world_size
        if not self.plans.wait_subscribers(world, timeout=60):
            raise EngineDeadError("workers did not subscribe to the plan broadcast")
        num_host_blocks = min(r.num_host_blocks for r in profiled)
        self.plans.send(InitCache(num_blocks, num_host_blocks))
        ready = self.wait_workers("cache_ready")
        _say_timings(ready, self.config.settings.launch_t0)
        self.ready = EngineReady(num_blocks, block_size, max_len)
        if not num_host_blocks:
            return num_blocks, None
        spec = tier_spec(ready, self.config)
        caching = self.config.cache.enable_prefix_caching
        print(f"pagedserve: {describe_costs(spec, block_size, caching)}", file=sys.stderr)
        return num_blocks, spec

    def fail(self, message: str) -> None:
        """Tell every client (also those whose hello is still queued) that the engine is dead."""
        while (msg := self.clients_in.get_nowait()) is not None:
            if isinstance(msg, ClientHello) and msg.client_index not in self.clients_out:
                sender = self._connect(msg)
                if sender is not None:
                    self.clients_out[msg.client_index] = sender
        for sender in self.clients_out.values():
            sender.send(EngineDead(message))

    def close(self) -> None:
        self.plans.send(ShutdownWorkers())
        time.sleep(0.05)
        stop_all(self.workers, timeout=5)
        for sender in self.clients_out.values():
            sender.close()
        self.plans.close()
        self.results.close()
        self.clients_in.close()
        if self._auth is not None:
            self._auth.stop()


def _say_timings(ready: list[WorkerReady], launch_t0: float | None) -> None:
    """One start-up line per phase: the slowest rank's seconds for each step."""
    steps: dict[str, float] = {}
    for r in ready:
        for name, seconds in r.timings.items():
            steps[name] = max(steps.get(name, 0.0), seconds)
    if steps:
        text = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in steps.items())
        if launch_t0 is not None:  # set by `launch`
            text += f" (done {time.time() - launch_t0:.1f} s after launch)"
        print(f"pagedserve: {text}", file=sys.stderr, flush=True)


def tier_spec(ready: list[WorkerReady], config: EngineConfig) -> TierSpec:
    """The host tier as the core sees it: ranks copy in parallel (the slowest counts), pipeline
    stages recompute one after another."""
    return TierSpec(
        num_blocks=ready[0].num_host_blocks,
        swap_s_per_block=max(r.swap_s_per_block for r in ready),
        recompute_s_per_token=max(r.recompute_s_per_token for r in ready)
        * config.parallel.pipeline_parallel_size,
        block_bytes=sum(r.block_bytes for r in ready),
        mode=config.scheduler.preemption_mode,
    )


def start_workers(
    config_json: str, ranks: range, addresses: CoreAddresses, dist_port: int
) -> list[Child]:
    workers = []
    for rank in ranks:
        args = [
            "--config", config_json, "--rank", str(rank), "--plans", addresses.plans,
            "--results", addresses.results, "--dist-port", str(dist_port),
        ]  # fmt: skip
        workers.append(spawn("pagedserve.worker.worker_process", args, f"worker {rank}"))
    return workers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedserve-engine")
    ap.add_argument("--config", required=True)
    ap.add_argument("--input-address", required=True)
    ap.add_argument("--ipc-dir", required=True)
    ap.add_argument("--parent-pid", type=int)
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--log-stats-interval", type=float, help="seconds (default: no stats lines)")
    args = ap.parse_args(argv)
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C hits the whole group: the parent decides
    config = EngineConfig.from_json(args.config)
    parallel = config.parallel  # data parallel cores say which one logs (stats lines)
    core = f"[{parallel.data_parallel_rank}]" if parallel.data_parallel_size > 1 else ""
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(name)s{core}: %(message)s")
    settings.activate(config.settings)
    try:
        transport = ZmqTransport(config, args.input_address, args.ipc_dir)
    except (ValueError, OSError, zmq.ZMQError) as e:  # no CURVE key, an address not ours
        print(f"pagedserve: engine stopped: {e}", file=sys.stderr, flush=True)
        _leave_reason(args.ipc_dir, str(e))
        return 1
    code = 0
    try:
        transport.start_workers(args.config)
        num_blocks, tier = transport.init_cache()
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, config.cache.block_size)
        core = EngineCore(config, transport, num_blocks, args.log_stats_interval, tier)
        freeze_startup_heap()
        core.run()
    except Exception as e:
        message = str(e) if isinstance(e, EngineDeadError) else traceback.format_exc()
        if isinstance(e, StepTimeoutError):
            message += f"; {transport.describe_workers()}"
        print(f"pagedserve: engine stopped: {message}", file=sys.stderr, flush=True)
        _leave_reason(args.ipc_dir, message if isinstance(e, EngineDeadError) else str(e))
        transport.fail(f"EngineCore failed: {message}")
        time.sleep(0.2)  # let the EngineDead messages leave
        code = 1
    finally:
        transport.close()
    return code


def _leave_reason(directory: str, message: str) -> None:
    """One line for the launcher, which says why the EngineCore exited."""
    try:
        with open(os.path.join(directory, ERROR_FILE), "w") as f:
            f.write(message.strip().splitlines()[-1] if message.strip() else "unknown error")
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
