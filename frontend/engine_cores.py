"""Data parallel: the engine clients of one frontend (an API server or an `LLM`), one per core.

`--data-parallel-size N` runs N EngineCore processes, each with its own tp x pp workers on its own
devices and its own ipc directory (`core_dirs`); every frontend holds one `EngineClient` per core
and sends each request to the core `PrefixRouter` picks (frontend/prefix_router.py). A request's
messages (its AddRequests, aborts) all go to that one core; outputs come back from each core on
its own socket. Any core's death is the engine's death: `dead_message` names it and the frontend
ends every request, as with one core (and `launch` stops, as on any process death).
With one core this is a thin wrapper around one EngineClient: nothing is routed.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterable

from pagedserve.config import EngineConfig
from pagedserve.errors import EngineDeadError
from pagedserve.frontend.engine_client import EngineClient, start_engine_core
from pagedserve.frontend.prefix_router import PrefixRouter
from pagedserve.ipc.messages import AbortRequests, ClientMessage, CoreToClient, EngineReady
from pagedserve.ipc.process import Child
from pagedserve.parallel_config import ParallelConfig

__all__ = ["EngineCores", "check_devices", "core_dirs", "start_engine_cores"]


def core_dirs(directory: str, num_cores: int) -> list[str]:
    """Each core's ipc directory: `directory` itself for one core, a subdirectory per core for
    several (every core binds the same socket names)."""
    if num_cores == 1:
        return [directory]
    return [os.path.join(directory, f"core-{i}") for i in range(num_cores)]


def core_name(index: int, num_cores: int) -> str:
    return "EngineCore" if num_cores == 1 else f"EngineCore {index}"


def start_engine_cores(
    config: EngineConfig, directory: str, log_level: str, log_stats_interval: float | None
) -> list[Child]:
    """Spawn every data parallel core (`launch`), each in its `core_dirs` directory."""
    configs = config.core_configs()
    children = []
    for i, (core_config, path) in enumerate(
        zip(configs, core_dirs(directory, len(configs)), strict=True)
    ):
        os.makedirs(path, mode=0o700, exist_ok=True)
        name = core_name(i, len(configs))
        children.append(start_engine_core(core_config, path, log_level, log_stats_interval, name))
    return children


def check_devices(parallel: ParallelConfig) -> None:
    """ValueError when this host's workers (dp x tp x pp, per node) need more GPUs than torch
    sees; a no-op on CPU (any number of gloo workers runs there) and for a single worker."""
    need = parallel.local_ranks_of_host
    if need == 1 or parallel.device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        return  # device auto: CPU workers; device cuda: the worker says torch sees no GPU
    have = torch.cuda.device_count()
    if need > have:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ValueError(
            f"--data-parallel-size {parallel.data_parallel_size} x --tp "
            f"{parallel.tensor_parallel_size} x --pp {parallel.pipeline_parallel_size}"
            f"{' / --nnodes ' + str(parallel.nnodes) if parallel.nnodes > 1 else ''} needs "
            f"{need} GPUs on this host; {have} visible{where}"
        )


class EngineCores:
    """One EngineClient per data parallel core, and which core holds which request.

    `directory` None (`LLM`): each client starts its own core in a directory of its own (all
    start at once; `wait_ready` waits for every one).
    Otherwise (an API server of `launch`): connect to the cores `start_engine_cores` started
    under `directory`, whose pids are `core_pids`."""

    def __init__(
        self,
        config: EngineConfig,
        client_index: int = 0,
        directory: str | None = None,
        core_pids: list[int] | None = None,
    ) -> None:
        configs = config.core_configs()
        self.clients: list[EngineClient] = []
        self.client_index = client_index
        if core_pids is not None and len(core_pids) != len(configs):
            raise ValueError(f"{len(core_pids)} core pids for {len(configs)} engine cores")
        pids = core_pids or [None] * len(configs)
        paths = [None] * len(configs) if directory is None else core_dirs(directory, len(configs))
        try:
            if directory is None:
                check_devices(config.parallel)
            for c, path, pid in zip(configs, paths, pids, strict=True):
                self.clients.append(EngineClient(c, client_index, path, pid))
        except BaseException:  # close what started (an LLM's cores are its children)
            self.close()
            raise
        self.router = PrefixRouter(len(configs), config.cache.block_size)
        self.readies: list[EngineReady] = []
        self._core_of: dict[str, int] = {}  # request id -> its core, while in flight
        self._messages: queue.SimpleQueue[tuple[int, CoreToClient]] | None = None

    @property
    def num_cores(self) -> int:
        return len(self.clients)

    def wait_ready(self, timeout: float = 1800.0) -> EngineReady:
        """Every core's EngineReady (in `readies`); the first core's is returned."""
        self.readies = [client.wait_ready(timeout) for client in self.clients]
        return self.readies[0]

    @property
    def dead_message(self) -> str | None:
        for i, client in enumerate(self.clients):
            if client.dead_message is not None:
                return self._named(i, client.dead_message)
        return None

    def set_dead(self, core: int, message: str) -> None:
        self.clients[core].dead_message = message

    def check_alive(self) -> None:
        """Raise EngineDeadError (naming the core) if any core is gone."""
        for i, client in enumerate(self.clients):
            try:
                client.check_alive()
            except EngineDeadError as e:
                raise EngineDeadError(self._named(i, str(e))) from None

    def _named(self, core: int, message: str) -> str:
        """`message` naming the core it is about ("EngineCore 1 failed: ...")."""
        if self.num_cores == 1:
            return message
        name = core_name(core, self.num_cores)
        if message.startswith("EngineCore "):
            return name + message.removeprefix("EngineCore")
        return f"{name}: {message}"

    # ------------------------------------------------------------------ requests
    def route(self, request_id: str, prompt_token_ids: list[int], lora_id: int = 0) -> int:
        """The core for a new request (`lora_id`: its adapter's `lora_int_id`, 0: none); it
        counts as in flight there until `release`."""
        core = self._core_of[request_id] = self.router.route(prompt_token_ids, lora_id)
        return core

    def core_of(self, request_id: str) -> int | None:
        """The core a request in flight was routed to (None: not routed, or released)."""
        return self._core_of.get(request_id)

    def release(self, request_id: str) -> None:
        core = self._core_of.pop(request_id, None)
        if core is not None:
            self.router.release(core)

    def send(self, core: int, msg: ClientMessage) -> None:
        self.clients[core].send(msg)

    def abort(self, ids: Iterable[tuple[str, str]]) -> None:
        """Abort engine requests, given as (request id, child id) pairs, each in its request's
        core (nothing to do once a core is dead: the engine is going down)."""
        by_core: dict[int, list[str]] = {}
        for request_id, child_id in ids:
            core = self._core_of.get(request_id)
            if core is not None:
                by_core.setdefault(core, []).append(child_id)
        if self.dead_message is None:
            for core, child_ids in by_core.items():
                self.clients[core].send(AbortRequests(child_ids))

    def broadcast(self, msg: ClientMessage) -> None:
        for client in self.clients:
            client.send(msg)

    # ------------------------------------------------------------------ outputs
    def set_listener(self, on_message: Callable[[int, CoreToClient], None]) -> None:
        """Deliver each core's outputs to `on_message(core, msg)` (on that core's socket
        thread)."""
        for i, client in enumerate(self.clients):
            client.set_listener(lambda msg, i=i: on_message(i, msg))

    def next_message(self, timeout: float) -> tuple[int, CoreToClient] | None:
        """The next output of any core (blocking up to `timeout` s), for a synchronous reader."""
        if self.num_cores == 1:
            msg = self.clients[0].outputs.get(timeout=timeout)
            return None if msg is None else (0, msg)
        if self._messages is None:
            self._messages = queue.SimpleQueue()
            self.set_listener(lambda core, msg: self._messages.put((core, msg)))  # type: ignore[union-attr]
        try:
            return self._messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        for client in self.clients:
            client.close()
