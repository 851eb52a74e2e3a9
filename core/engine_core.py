"""EngineCore: the step loop that ties clients, the scheduler and the workers together.

Pure Python: it talks to the outside world only through a `Transport` (queues and send calls)
that entrypoints/engine_process.py builds from ZeroMQ sockets and tests can build from plain
queues. One loop: drain client messages -> schedule while fewer than `max_inflight` plans are
out -> take the oldest result -> update requests -> emit per-request deltas to the client that
owns each request.

Every AddRequest is answered at once with an empty delta (admitted), a "rejected" one (the
waiting queue is at `max_waiting`) or an "invalid" one with the reason (core/admission.py checks it
against the model: the core is the gate, whoever sent it), so an API server knows before it sends
a 200 whether the request will run; a request with a grammar not compiled yet is answered once
it is (core/grammar_gate.py: admitted, or "invalid" if it did not compile), and one with a LoRA
adapter the workers' host pools lack once every worker has read it on a thread
(core/lora_gate.py; "invalid" if it could not be read). A message that makes
no sense (from an unknown client, a result for no plan in flight or that does not fit its plan)
is logged and dropped, never asserted on: no message can kill the loop. A watchdog declares the
engine dead when the oldest plan in flight gets no result within `step_timeout` (a worker stuck
in a step never reports anything by itself).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from typing import Protocol

from pagedserve.config import EngineConfig
from pagedserve.core.admission import ModelLimits, check_request
from pagedserve.core.grammar_gate import GrammarGate
from pagedserve.core.kv_tier import TierSpec
from pagedserve.core.lora_gate import LoRAGate
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.stats_log import StatsLog
from pagedserve.errors import EngineDeadError, StepTimeoutError
from pagedserve.ipc.messages import (
    AbortRequests,
    AddRequest,
    ClientHello,
    ClientMessage,
    CompileGrammar,
    EngineOutputs,
    GrammarCompiled,
    LoadLoRA,
    LoRALoaded,
    LoRARequest,
    RequestDelta,
    ResetPrefixCache,
    ShutdownEngine,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerToCore,
)

logger = logging.getLogger("pagedserve.engine")
IDLE_POLL_S = 0.5
GRAMMAR_POLL_S = 0.002  # nothing in flight, a grammar compiling: how long to wait for its answer
STATS_INTERVAL_S = 0.5
LIVENESS_INTERVAL_S = 0.2


class Transport(Protocol):
    def next_client_message(self, timeout: float | None) -> ClientMessage | None: ...
    def next_worker_message(self, timeout: float) -> WorkerToCore | None: ...
    def broadcast(self, plan: StepPlan | CompileGrammar | LoadLoRA) -> None: ...
    def send_outputs(self, client_index: int, outputs: EngineOutputs) -> None: ...
    def add_client(self, hello: ClientHello) -> None: ...
    def client_indices(self) -> list[int]: ...
    def check_workers(self) -> None:
        """Raise EngineDeadError naming the worker that died."""
        ...


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        transport: Transport,
        num_blocks: int,
        log_stats_interval: float | None = None,
        host_tier: TierSpec | None = None,
    ) -> None:
        """`log_stats_interval`: seconds between stats lines in the log (None: none);
        `host_tier`: the KV cache's host tier (None: off)."""
        self.transport = transport
        # One plan per pipeline stage keeps every stage busy; under async scheduling two (each
        # micro-batch planned again while its step is in flight), or while fewer requests run
        # than stages, one request in several (the last stage sends its tokens to the first:
        # worker/stage_tokens.py). With one stage, async scheduling keeps a second plan queued
        # behind the running one: the workers start it the moment the first ends, while this
        # loop digests the first's result (the GPU never waits for it). `Scheduler.max_inflight`.
        pp = config.parallel.pipeline_parallel_size
        async_scheduling = config.scheduler.async_scheduling and (pp == 1 or config.pipelined_async)
        pooling = config.model.pooling
        cache = config.cache
        if pooling is not None and (pooling.pooling_type != "LAST" or not pooling.chunkable):
            cache = dataclasses.replace(cache, enable_prefix_caching=False)  # no position skipped
        self.scheduler = Scheduler(
            config.scheduler,
            cache,
            config.max_model_len,
            num_blocks,
            async_scheduling=async_scheduling,
            workers_keep_samples=pp == 1,
            group_windows=config.model.kv_group_windows,
            num_microbatches=pp,
            max_loras=config.lora.max_loras if config.lora is not None else None,
            num_state_slots=config.num_state_slots,
            speculative=config.speculative,
            host_tier=host_tier,
            whole_prompts=pooling is not None and not pooling.chunkable,
        )
        tp = config.parallel.tensor_parallel_size
        self.grammars = GrammarGate(
            sampling_ranks=range((pp - 1) * tp, pp * tp),
            in_use=self._grammar_in_use,
        )
        self.loras = LoRAGate(  # every rank holds its stage's layers of an adapter
            ranks=range(config.parallel.world_size),
            capacity=config.lora.max_cpu_loras if config.lora is not None else 1,
            in_use=self._lora_in_use,
        )
        self.limits = ModelLimits(
            config.model.vocab_size,
            config.max_model_len,
            lora=config.lora is not None,
            pooling_task=None if pooling is None else pooling.task,
            pooling_dim=0 if pooling is None else pooling.out_dim,
            matryoshka=pooling is not None and pooling.is_matryoshka,
            whole_prompt_limit=(
                config.scheduler.max_num_batched_tokens
                if pooling is not None and not pooling.chunkable
                else None
            ),
        )
        self.world_size = config.parallel.world_size
        self.inflight: deque[StepPlan] = deque()
        self.step_timeout = config.scheduler.step_timeout
        self._sent_at: dict[int, float] = {}  # step_id -> when its plan was broadcast
        self.running = True
        self._last_stats = 0.0
        self._last_liveness = 0.0
        now = time.monotonic()
        self.stats_log = None if log_stats_interval is None else StatsLog(log_stats_interval, now)
        # PAGEDSERVE_STEP_TRACE=FILE: one line per step (sent, result in, result handled,
        # requests, tokens), to see where a benchmark's time goes; off by default. Line-buffered:
        # a process stopped by a signal keeps every line.
        trace = config.settings.step_trace
        self._trace = open(trace, "w", buffering=1) if trace else None  # noqa: SIM115

    def run(self) -> None:
        try:
            self._loop()
        finally:
            if self._trace is not None:
                self._trace.close()

    def _loop(self) -> None:
        while self.running:
            idle = not self.inflight and not self.scheduler.has_unfinished_requests()
            gated = self.grammars.pending or self.loras.pending
            self._drain_client_messages(block=idle and not gated)
            self._check_workers()
            self._schedule_steps()
            if self.inflight:
                self._collect_one_result()
            elif gated:  # a grammar compiles or an adapter loads: wait for the answer
                self._handle_worker_message(self.transport.next_worker_message(GRAMMAR_POLL_S))
            elif idle:
                self._maybe_send_stats(force=False)

    def _check_workers(self) -> None:
        """Poll the workers' pids a few times a second, not every step (a waitpid per worker per
        step showed up in py-spy profiles of the decode loop); a death is still seen well
        within a second, and a worker's error message arrives at once on its own."""
        now = time.monotonic()
        if now - self._last_liveness >= LIVENESS_INTERVAL_S:
            self._last_liveness = now
            self.transport.check_workers()

    # ------------------------------------------------------------------ clients
    def _drain_client_messages(self, block: bool) -> None:
        """Handle every queued client message; their answers leave in one EngineOutputs per
        client (so the n AddRequests of one user request are answered together)."""
        deltas: list[tuple[int, RequestDelta]] = []
        msg = self.transport.next_client_message(IDLE_POLL_S if block else None)
        while msg is not None:
            deltas.extend(self._handle_client_message(msg))
            msg = self.transport.next_client_message(None)
        self._emit(deltas)

    def _handle_client_message(self, msg: ClientMessage) -> list[tuple[int, RequestDelta]]:
        if isinstance(msg, AddRequest):
            if msg.client_index not in self.transport.client_indices():
                logger.error(
                    "dropped request %.64r of unknown client %d", msg.req_id, msg.client_index
                )
                return []
            delta = self._add_request(msg)
            return [] if delta is None else [(msg.client_index, delta)]
        if isinstance(msg, AbortRequests):
            held = self.grammars.abort(msg.req_ids) if self.grammars.pending else []
            held += self.loras.abort(msg.req_ids) if self.loras.pending else []
            return [_aborted(r) for r in held] + self.scheduler.abort_requests(msg.req_ids)
        if isinstance(msg, ClientHello):
            self.transport.add_client(msg)
        elif isinstance(msg, ResetPrefixCache):
            self.scheduler.reset_prefix_cache()
        elif isinstance(msg, ShutdownEngine):
            self.running = False
        return []

    def _add_request(self, msg: AddRequest) -> RequestDelta | None:
        """The answer to an AddRequest: admitted (no tokens yet), rejected or invalid; None for
        a request that waits in a gate (answered once its grammar or adapter is ready)."""
        if self.stats_log is not None:
            self.stats_log.num_arrived += 1
        try:
            check_request(msg, self.limits)
        except ValueError as e:
            logger.warning("refused request %.64r: %s", msg.req_id, e)
            return RequestDelta(msg.req_id, [], finish_reason="invalid", error=str(e))
        if self.scheduler.is_full(num_held=self.grammars.num_waiting + self.loras.num_waiting):
            return RequestDelta(msg.req_id, [], finish_reason="rejected")
        return self._through_gates(msg)

    def _through_gates(self, msg: AddRequest) -> RequestDelta | None:
        """Schedule the request, or None while it waits in a gate, outside the scheduler (its
        grammar compiling, its adapter loading). A request a gate releases passes every gate
        again (the first lets it on at once: what it waits for is never dropped)."""
        try:
            for gate in (self.grammars, self.loras):
                go_on, order = gate.admit(msg)
                if order is not None:
                    self.transport.broadcast(order)
                if not go_on:
                    return None
        except ValueError as e:
            logger.warning("refused request %.64r: %s", msg.req_id, e)
            return RequestDelta(msg.req_id, [], finish_reason="invalid", error=str(e))
        return self._schedule_request(msg)

    def _grammar_in_use(self, key: str) -> bool:
        """Whether an unfinished request has the grammar: the scheduler's or one that waits for
        its adapter (the gates never drop what the other's requests will need)."""
        if key in self.scheduler.grammar_users:
            return True
        return any(_grammar_key(r) == key for r in self.loras.waiting())

    def _lora_in_use(self, lora: LoRARequest) -> bool:
        """Whether an unfinished request has the adapter: the scheduler's (by name, as it counts
        them) or one that waits for its grammar."""
        if lora.lora_name in self.scheduler.lora_users:
            return True
        return any(r.lora == lora for r in self.grammars.waiting())

    def _schedule_request(self, msg: AddRequest) -> RequestDelta:
        try:
            self.scheduler.add_request(msg)
        except ValueError as e:
            logger.warning("refused request %.64r: %s", msg.req_id, e)
            return RequestDelta(msg.req_id, [], finish_reason="invalid", error=str(e))
        return RequestDelta(msg.req_id, [])

    def _release(self, released: list[AddRequest], error: str | None) -> None:
        """Answer the requests a gate let go: on to the next gate or the scheduler, or refused
        with the reason their grammar did not compile (over --max-grammar-compile-seconds; or a
        grammar only a raw client could send, as API servers check grammars first) or their
        adapter could not be read, which an API server returns as a 400."""
        if error is not None and released:
            logger.warning("%d requests refused: %s", len(released), error)
        deltas = []
        for req in released:
            if error is not None:
                delta = RequestDelta(req.req_id, [], finish_reason="invalid", error=error)
            else:
                delta = self._through_gates(req)
            if delta is not None:
                deltas.append((req.client_index, delta))
        self._emit(deltas)

    # ------------------------------------------------------------------ steps
    def _schedule_steps(self) -> None:
        """Plan until `max_inflight` plans are out; an empty plan is not sent (the scheduler keeps
        its finished ids for the next real one)."""
        while (
            len(self.inflight) < self.scheduler.max_inflight
            and self.scheduler.has_unfinished_requests()
        ):
            plan = self.scheduler.schedule()
            if not plan.scheduled_ids:
                return
            self.transport.broadcast(plan)
            self.inflight.append(plan)
            self._sent_at[plan.step_id] = time.monotonic()

    def _collect_one_result(self) -> None:
        msg = self.transport.next_worker_message(IDLE_POLL_S)
        if msg is None:
            self._check_step_timeout()
            return
        if not isinstance(msg, StepResult):
            self._handle_worker_message(msg)
            return
        if not self._fits(msg):
            return
        plan = self.inflight.popleft()
        sent = self._sent_at.pop(plan.step_id)
        received = time.monotonic()
        deltas = self.scheduler.update_from_output(plan, msg)
        self._schedule_steps()  # the next plan leaves before outputs are encoded: GPU idles less
        self._emit(deltas)
        if self._trace is not None:  # sent, result in, result handled, requests, tokens
            self._trace.write(
                f"{sent:.6f} {received:.6f} {time.monotonic():.6f} {len(plan.scheduled_ids)} "
                f"{sum(plan.num_scheduled_tokens)}\n"
            )

    def _handle_worker_message(self, msg: WorkerToCore | None) -> None:
        """A worker message other than a step result."""
        if isinstance(msg, WorkerError) and 0 <= msg.rank < self.world_size:
            self._blame_dead_worker()
            raise EngineDeadError(f"worker {msg.rank} failed: {msg.message}")
        if isinstance(msg, GrammarCompiled):
            self._release(*self.grammars.compiled(msg))
        elif isinstance(msg, LoRALoaded):
            self._release(*self.loras.loaded(msg))

    def _fits(self, result: StepResult) -> bool:
        """The result answers the oldest plan in flight (results come in plan order); else it is
        logged and dropped, and a worker that never sends the right one trips the step timeout."""
        plan = self.inflight[0]
        if result.step_id != plan.step_id:
            problem = f"step {result.step_id} is not the oldest in flight ({plan.step_id})"
        else:
            problem = self.scheduler.check_result(plan, result, self.limits.vocab_size)
        if problem is not None:
            logger.error("dropped a step result that fits no plan: %s", problem)
        return problem is None

    def _check_step_timeout(self) -> None:
        plan = self.inflight[0]
        waited = time.monotonic() - self._sent_at[plan.step_id]
        if waited > self.step_timeout:
            raise StepTimeoutError(
                f"step {plan.step_id} ({len(plan.scheduled_ids)} requests, "
                f"{sum(plan.num_scheduled_tokens)} tokens) got no result from the workers in "
                f"{waited:.1f} s (--step-timeout {self.step_timeout:g})"
            )

    def _blame_dead_worker(self) -> None:
        """A worker's error is often a peer's death seen through a collective ("connection reset"):
        give the dead process a moment to be reaped, and report it as the cause if it is there."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            self.transport.check_workers()
            time.sleep(0.05)

    # ------------------------------------------------------------------ outputs
    def _emit(self, deltas: list[tuple[int, RequestDelta]]) -> None:
        if not deltas:
            return
        by_client: dict[int, list[RequestDelta]] = defaultdict(list)
        for client_index, delta in deltas:
            by_client[client_index].append(delta)
        if self.stats_log is not None:
            self.stats_log.count(deltas)
        stats = self.scheduler.get_stats()
        for client_index, outputs in by_client.items():
            self.transport.send_outputs(client_index, EngineOutputs(outputs, stats))
        self._maybe_send_stats(force=False, skip=by_client.keys())

    def _maybe_send_stats(self, force: bool, skip: Iterable[int] = ()) -> None:
        """Refresh every client's gauges (running/waiting/KV usage) at least once a second, also
        clients with no request in flight, so each API server's /metrics stays current."""
        if not force and time.monotonic() - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = time.monotonic()
        stats = self.scheduler.get_stats()
        if self.stats_log is not None:
            computed = self.scheduler.num_prompt_tokens_computed
            self.stats_log.maybe_log(self._last_stats, stats, computed)
        for client_index in self.transport.client_indices():
            if client_index not in skip:
                self.transport.send_outputs(client_index, EngineOutputs([], stats))


def _grammar_key(req: AddRequest) -> str | None:
    spec = req.sampling.structured_outputs
    return None if spec is None else spec.key


def _aborted(req: AddRequest) -> tuple[int, RequestDelta]:
    return req.client_index, RequestDelta(req.req_id, [], finish_reason="abort")
