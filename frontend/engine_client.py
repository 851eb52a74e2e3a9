"""The client end of the ipc link to EngineCore, shared by `LLM` and `AsyncEngine`.

A client either starts its own EngineCore process (the `LLM` case) or connects to one that
`pagedserve launch` started (API servers, each with its own `client_index`). It owns one PUSH
socket to the core and one PULL socket the core pushes this client's outputs to. Liveness: the
core's pid is watched, and the core sends EngineDead with the reason before it exits on a failure.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable

from pagedserve.config import EngineConfig
from pagedserve.errors import EngineDeadError
from pagedserve.ipc.messages import (
    ClientHello,
    ClientMessage,
    CoreToClient,
    EngineDead,
    EngineReady,
    ShutdownEngine,
)
from pagedserve.ipc.process import Child, spawn
from pagedserve.ipc.sockets import Receiver, Sender, ipc_address, ipc_dir

__all__ = ["EngineClient", "start_engine_core"]


def start_engine_core(
    config: EngineConfig,
    directory: str,
    log_level: str = "WARNING",
    log_stats_interval: float | None = None,
    name: str = "EngineCore",
) -> Child:
    """Spawn the EngineCore process (entrypoints/engine_process.py: by module name, so this
    client never imports what it starts); it logs a stats line every `log_stats_interval` s."""
    args = [
        "--config", config.to_json(),
        "--input-address", ipc_address(directory, "input"),
        "--ipc-dir", directory,
        "--log-level", log_level,
    ]  # fmt: skip
    if log_stats_interval is not None:
        args += ["--log-stats-interval", str(log_stats_interval)]
    return spawn("pagedserve.entrypoints.engine_process", args, name)


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        client_index: int = 0,
        directory: str | None = None,
        core_pid: int | None = None,
    ) -> None:
        self.config = config
        self.client_index = client_index
        self.core: Child | None = None
        self._owns_dir = directory is None
        self.directory = directory or ipc_dir()
        if directory is None:
            self.core = start_engine_core(config, self.directory)
            core_pid = self.core.pid
        self.core_pid = core_pid
        out_address = ipc_address(self.directory, f"client-{client_index}-{os.getpid()}")
        self.outputs: Receiver[CoreToClient] = Receiver(out_address, CoreToClient, bind=True)
        self.inputs: Sender[ClientMessage] = Sender(ipc_address(self.directory, "input"), False)
        self.inputs.send(ClientHello(client_index, out_address))
        self.dead_message: str | None = None
        self.ready: EngineReady | None = None
        self._closed = False

    def wait_ready(self, timeout: float = 1800.0) -> EngineReady:
        deadline = time.monotonic() + timeout
        while self.ready is None:
            msg = self.outputs.get(timeout=0.2)
            if isinstance(msg, EngineReady):
                self.ready = msg
            elif isinstance(msg, EngineDead):
                self.dead_message = msg.message
                raise EngineDeadError(f"engine failed to start: {msg.message}")
            else:
                self.check_alive()
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine not ready after {timeout:.0f} s")
        return self.ready

    def set_listener(self, on_message: Callable[[CoreToClient], None]) -> None:
        """Deliver outputs to `on_message` (on the socket thread) instead of the queue."""
        self.outputs._on_message = on_message
        while (msg := self.outputs.get_nowait()) is not None:
            on_message(msg)

    def send(self, msg: ClientMessage) -> None:
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        self.inputs.send(msg)

    def check_alive(self) -> None:
        """Raise EngineDeadError if the core process is gone."""
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        if self.core is not None:
            message = self.core.death_message()
        elif self.core_pid is not None and not _pid_alive(self.core_pid):
            message = f"EngineCore (pid {self.core_pid}) is gone"
        else:
            message = None
        if message is not None:
            self.dead_message = message
            raise EngineDeadError(message)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.core is not None:
            if self.core.proc.poll() is None:
                self.inputs.send(ShutdownEngine())
                try:
                    self.core.proc.wait(timeout=10)
                except Exception:
                    pass
            self.core.stop(timeout=5)
        self.inputs.close()
        self.outputs.close()
        if self._owns_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
