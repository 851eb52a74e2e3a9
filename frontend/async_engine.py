"""`AsyncEngine`: the asyncio client an API server uses to stream requests through EngineCore.

The output socket's IO thread hands each EngineOutputs to the event loop (call_soon_threadsafe);
there it is detokenized and each request it touched is marked ready for its reader (`Collector`:
one pending output per request, never a queue of them, so a reader that falls behind costs
nothing per step). Leaving `generate` early (client disconnect, cancellation) aborts the request in
the core, which frees its KV blocks.

The core answers each request at once: admitted (an output with no tokens, the first item
`generate` yields), rejected because its waiting queue is full (`generate` raises
EngineOverloadedError) or refused by its gate (RequestRefusedError), so a server can wait for that
answer before it sends a status line. The errors are pagedserve/errors.py's; the HTTP layer maps
them to statuses (frontend/openai/protocol.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.errors import EngineDeadError, EngineOverloadedError, RequestRefusedError
from pagedserve.frontend.engine_cores import EngineCores
from pagedserve.frontend.generation_config import sampling_defaults, stop_eos_ids
from pagedserve.frontend.lora_registry import LoRARegistry
from pagedserve.frontend.output_processor import OutputProcessor, ParentRequest
from pagedserve.frontend.outputs import RequestOutput
from pagedserve.frontend.tokenizer import load_tokenizer, max_chars_per_token
from pagedserve.ipc.messages import (
    AbortRequests,
    CoreToClient,
    EngineDead,
    EngineOutputs,
    LoRARequest,
    PoolingParams,
    ResetPrefixCache,
    SamplingParams,
    SchedulerStats,
)

LIVENESS_INTERVAL_S = 1.0


class Collector:
    """One request's hand-off from the engine to its reader: at most one pending output, however
    far behind the reader is (vLLM's RequestOutputCollector merges deltas the same way). Outputs
    are cumulative, so a pending one is not stored but built when the reader takes it: while a
    client reads nothing, each step only marks its request ready, and the memory a stalled stream
    holds is its own output, once."""

    def __init__(self, parent: ParentRequest) -> None:
        self.parent = parent
        self.error: Exception | None = None
        self._ready = asyncio.Event()

    def notify(self) -> None:
        self._ready.set()

    def fail(self, error: Exception) -> None:
        """End the request with `error` (one that finished already keeps its final output)."""
        if not self.parent.finished:
            self.error = error
            self._ready.set()

    async def get(self) -> RequestOutput:
        """The request's output as it stands, once something changed since the last call."""
        await self._ready.wait()
        self._ready.clear()
        if self.error is not None:
            raise self.error
        parent = self.parent
        output = parent.make_output(streamable=True)
        output.inter_token_latencies, parent.token_gaps = parent.token_gaps, []
        output.metrics = {"arrival_time": parent.arrival_time}
        if parent.first_token_time is not None:
            output.metrics["first_token_time"] = parent.first_token_time
        if parent.first_scheduled_time is not None:
            output.metrics["first_scheduled_time"] = parent.first_scheduled_time
        return output


class AsyncEngine:
    """`core_pids`: the engine cores `launch` started under `directory`, one per data parallel
    rank (frontend/engine_cores.py); requests go to the core the router picks."""

    def __init__(
        self,
        config: EngineConfig,
        client_index: int = 0,
        directory: str | None = None,
        core_pids: list[int] | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.config = config
        self.cores = EngineCores(config, client_index, directory, core_pids)
        try:
            self.tokenizer = tokenizer or load_tokenizer(
                config.model.tokenizer_path, config.model.trust_remote_code
            )
            self.ready = self.cores.wait_ready()
        except BaseException:
            self.cores.close()
            raise
        self.eos_token_ids = stop_eos_ids(config.model, self.tokenizer)
        # the most characters one token stands for (None: no safe bound): a prompt longer than
        # max_model_len of them is refused before it is tokenized
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)
        self.default_sampling = sampling_defaults(config.model)
        # the LoRA adapters requests may name in `model` (None: --enable-lora is off)
        self.loras = (
            LoRARegistry(config.lora, config.model.hf, config.model.name)
            if config.lora is not None
            else None
        )
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.stats = [SchedulerStats() for _ in range(self.cores.num_cores)]  # per core
        self.stats_listeners: list[Callable[[int, SchedulerStats], None]] = []  # (core, stats)
        self._collectors: dict[str, Collector] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._liveness: asyncio.Task[None] | None = None
        self._ids = itertools.count()

    @property
    def dead_message(self) -> str | None:
        return self.cores.dead_message

    @property
    def client_index(self) -> int:
        return self.cores.client_index

    def check_alive(self) -> None:
        """Raise EngineDeadError if any engine core is gone."""
        self.cores.check_alive()

    async def start(self) -> None:
        """Attach to the running event loop (call once, from the server's startup)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self.cores.set_listener(
            lambda core, msg: loop.call_soon_threadsafe(self._on_message, core, msg)
        )
        self._liveness = loop.create_task(self._watch_core())

    async def _watch_core(self) -> None:
        while self.cores.dead_message is None:
            await asyncio.sleep(LIVENESS_INTERVAL_S)
            try:
                self.cores.check_alive()
            except EngineDeadError:
                self._fail_all(EngineDeadError(self.cores.dead_message or "engine core died"))

    def _on_message(self, core: int, msg: CoreToClient) -> None:
        if isinstance(msg, EngineDead):
            self.cores.set_dead(core, msg.message)
            self._fail_all(EngineDeadError(self.cores.dead_message or msg.message))
        elif isinstance(msg, EngineOutputs):
            if msg.stats is not None:
                self.stats[core] = msg.stats
                for listener in self.stats_listeners:
                    listener(core, msg.stats)
            touched, to_abort = self.processor.process(msg.outputs)
            if to_abort and self.cores.dead_message is None:
                self.cores.send(core, AbortRequests(to_abort))
            for parent in touched:
                collector = self._collectors.get(parent.request_id)
                if collector is not None:
                    collector.notify()

    def _fail_all(self, error: Exception) -> None:
        """End every request with `error` (raised from its `generate`)."""
        for collector in self._collectors.values():
            collector.fail(error)
        self.processor.fail_all(str(error))

    def abort_all(self, error: Exception) -> None:
        """Abort every request in the cores too (a drain that timed out)."""
        children = self.processor.children.items()
        self.cores.abort((p.request_id, cid) for cid, (p, _) in children)
        self._fail_all(error)

    @property
    def num_tracked(self) -> int:
        """Requests this client holds state for (0 when idle: anything else is a leak)."""
        return len(self._collectors) + len(self.processor.parents)

    def new_request_id(self) -> str:
        return f"{self.cores.client_index}-{next(self._ids)}"

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output whenever engine steps touched it since the last
        one (one output for many steps when the caller is slower than the engine)."""
        self.cores.check_alive()
        request_id = request_id or self.new_request_id()
        messages = self.processor.add(
            request_id, prompt, prompt_token_ids, sampling_params, priority,
            self.cores.client_index, lora_request, pooling,
        )  # fmt: skip
        collector = self._collectors[request_id] = Collector(self.processor.parents[request_id])
        lora_id = lora_request.lora_int_id if lora_request is not None else 0
        core = self.cores.route(request_id, prompt_token_ids, lora_id)
        finished = False
        try:
            try:
                for msg in messages:
                    self.cores.send(core, msg)
            except (TypeError, ValueError) as e:  # encoded here, so nothing is dropped unanswered
                raise RequestRefusedError(f"the request cannot be sent to the engine: {e}") from e
            while not finished:
                item = await collector.get()
                finished = item.finished
                if any(c.finish_reason == "rejected" for c in item.outputs):
                    # admitted siblings (n > 1) are aborted below
                    raise EngineOverloadedError(self.config.scheduler.max_waiting)
                refused = [c.stop_reason for c in item.outputs if c.finish_reason == "invalid"]
                if refused:  # the core's gate refused it: the sender's fault
                    raise RequestRefusedError(refused[0])
                yield item
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self.abort(request_id)
            self.cores.release(request_id)

    def abort(self, request_id: str) -> None:
        self.cores.abort((request_id, cid) for cid in self.processor.abort(request_id))

    def reset_prefix_cache(self) -> None:
        self.cores.broadcast(ResetPrefixCache())

    def shutdown(self) -> None:
        if self._liveness is not None:
            self._liveness.cancel()
        self.cores.close()
