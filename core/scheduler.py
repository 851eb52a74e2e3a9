"""The scheduler: which requests run which tokens each step, and what the workers must learn.

One token budget per step, no prefill/decode phases (vLLM V1 style). `num_computed_tokens`
advances when a step is planned, so several plans can be in flight (async scheduling, pipeline
parallelism). A request whose sampled token is still in flight is a *placeholder*: with
`async_scheduling` the next plan already decodes it (the workers sample it, keep it in their
batch and feed it in; the core learns it from the result), unless that token is bound to end the
request by length; without it the request is skipped until its token is back.

Micro-batches (`num_microbatches` = pipeline stages): a plan takes at most 1/P of the running
requests, so with P plans in flight over disjoint requests every stage has a share of the batch to
work on; without the cap the first plan would take every request and the next plans would find
each one still in flight (stage 1 idle while stage 2 works, and back: a bubble of (P-1)/P).
Under async scheduling with at least P running requests (`plans_ahead`) the core keeps 2P plans
in flight: a request with a token in flight is planned again once P plans have left since its
last one (`_is_due`), so plan N+P carries plan N's micro-batch on placeholders and the first
stage, which gets each sampled token from the last on the device (worker/stage_tokens.py), finds
it there when it gets to N+P; without it every micro-batch's turn waited for the core's round
trip (result in, next plan out). A request fed a placeholder is in no other of the P-1 plans
before it (a prompt's chunks, which wait for no sample, may follow one another at once). With
fewer running requests than stages a request is planned again at once (`_schedule_ahead`).

Each `StepPlan` is a delta against the workers' persistent batch: a request is sent whole once
(`NewRequest`), then only its new blocks (`CachedDelta`), and its sampled tokens only where the
ranks that embed tokens do not sample (pipeline stages before the last; with one stage every rank
keeps its own samples); requests that left the running set (finished, aborted, preempted) are
listed once in `finished_ids`.

With speculative decoding (core/spec_decode/) a decoding row may verify draft tokens: it is
planned with `1 + k` tokens and its drafts travel in the plan; its result brings the accepted
drafts plus one token, and `num_computed_tokens` moves back over the rejected ones. (With a
draft model, and with ngram on one stage, the plan carries only how many drafts a row
verifies: the workers draft.)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from itertools import repeat

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.deltas import request_delta
from pagedserve.core.invariants import check_invariants
from pagedserve.core.kv_cache_manager import cdiv
from pagedserve.core.kv_setup import make_kv_cache
from pagedserve.core.kv_tier import TierSpec
from pagedserve.core.policy import make_policy
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched_stats import scheduler_stats
from pagedserve.core.spec_decode.decoder import SpecDecoder
from pagedserve.core.state_pool import StatePool
from pagedserve.core.step_builder import StepBuilder, build_plan
from pagedserve.core.step_results import apply_result, check_plan_result
from pagedserve.core.swapping import release_swapped, schedule_swapped, try_swap_out
from pagedserve.ipc.messages import (
    AddRequest,
    RequestDelta,
    SchedulerStats,
    StepPlan,
    StepResult,
)
from pagedserve.speculative_config import SpeculativeConfig

MAX_LORA_SKIPS = 256  # waiting requests of slot-less adapters one step may pass over


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        debug: bool = False,
        async_scheduling: bool = False,
        workers_keep_samples: bool = False,
        group_windows: list[int | None] | None = None,
        num_microbatches: int = 1,
        max_loras: int | None = None,
        num_state_slots: int | None = None,
        speculative: SpeculativeConfig | None = None,
        host_tier: TierSpec | None = None,
        whole_prompts: bool = False,
    ) -> None:
        """`group_windows`: each KV cache group's sliding window (None: global attention);
        absent, one global group. `num_microbatches`: plans in flight over disjoint requests
        (pipeline stages; see the module docstring). `max_loras`: distinct LoRA adapters per
        step (None: LoRA is off, and a request with an adapter never runs: the core refuses it
        first). `num_state_slots`: models with recurrent state (linear attention) get that many
        state slots (core/state_pool.py), one per running request. `speculative`: speculative
        decoding's config (None: off). `host_tier`: the KV cache's host-memory tier
        (core/kv_tier.py; None: off). `whole_prompts`: a prompt is never chunked (encoders:
        it waits for a step with room for all of it)."""
        self.kv = make_kv_cache(
            scheduler_config,
            cache_config,
            max_model_len,
            num_blocks,
            group_windows,
            num_state_slots,
            host_tier,
        )
        self.swapped: list[Request] = []  # preempted by swap, oldest first (core/swapping.py)
        # Free blocks kept copied to the host ahead of eviction: about what one step takes
        # (its budget's blocks, and a block per row); core/kv_tier.py
        self._spill_margin = (
            cdiv(scheduler_config.max_num_batched_tokens, cache_config.block_size)
            + scheduler_config.max_num_seqs
        )
        self.states = StatePool(num_state_slots) if num_state_slots is not None else None
        self.config = scheduler_config
        self.max_loras = max_loras
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.debug = debug  # full (O(blocks)) invariant checks after every call
        self.async_scheduling = async_scheduling
        # One pipeline stage: the ranks that embed tokens sampled them, so plans carry no tokens.
        self.workers_keep_samples = workers_keep_samples
        assert num_microbatches >= 1
        self.num_microbatches = num_microbatches
        self.policy = make_policy(scheduler_config.policy)
        self.running: list[Request] = []  # policy order: the tail is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # cumulative; prefix-cache hits are not computed
        self._finished_ids: list[str] = []  # left the workers' batch since the last plan
        # Per plan in flight: (request, its num_preemptions when planned), aligned with
        # scheduled_ids, so a result for a request that has since left is dropped.
        self._inflight: dict[int, list[tuple[Request, int]]] = {}
        self._next_step_id = 0
        self._next_seq = 0
        # Grammar key -> unfinished requests under it (waiting, running or preempted): the
        # workers must hold these compiled until the last one ends (core/grammar_gate.py).
        self.grammar_users: Counter[str] = Counter()
        self._grammar_of: dict[str, str] = {}  # req_id -> grammar key, constrained requests
        self.lora_users: Counter[str] = Counter()  # adapter name -> its unfinished requests
        self.lora_pool_counts = (0, 0)  # the workers' adapter loads and evictions (cumulative)
        self.spec = None
        if speculative is not None:  # ngram on one stage: the sampling ranks draft
            after_sampling = speculative.method == "ngram" and workers_keep_samples
            # (not where blocks behind a window are freed by `num_computed_tokens`, which runs
            # ahead of a row's real position while its drafts are in flight)
            after_sampling &= not any(group_windows or []) and num_state_slots is None
            self.spec = SpecDecoder(speculative, max_model_len, after_sampling)
        self.whole_prompts = whole_prompts

    # ---------------------------------------------------------------- requests in and out
    def add_request(self, msg: AddRequest) -> None:
        if msg.req_id in self.requests:
            raise ValueError(f"request id {msg.req_id!r} is already in use")
        if not msg.prompt_token_ids:
            raise ValueError(f"request {msg.req_id!r}: the prompt is empty")
        if len(msg.prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"request {msg.req_id!r}: prompt of {len(msg.prompt_token_ids)} tokens exceeds "
                f"max_model_len={self.max_model_len}"
            )
        req = Request.from_add(msg, seq=self._next_seq)
        self._next_seq += 1
        self.requests[req.req_id] = req
        self.policy.push(req)
        if req.lora is not None:
            self.lora_users[req.lora.lora_name] += 1
        spec = msg.sampling.structured_outputs
        if spec is not None:
            key = self._grammar_of[req.req_id] = spec.key
            self.grammar_users[key] += 1

    def _drop_grammar_user(self, req_id: str) -> None:
        key = self._grammar_of.pop(req_id, None)
        if key is not None:
            self.grammar_users[key] -= 1
            if not self.grammar_users[key]:
                del self.grammar_users[key]

    def abort_requests(self, req_ids: Iterable[str]) -> list[tuple[int, RequestDelta]]:
        """Drop unfinished requests (unknown ids are ignored: they may have just finished), in
        one pass over `running` and a lazy removal from the waiting queue (core/policy.py)."""
        aborted = [r for r in map(self.requests.pop, req_ids, repeat(None)) if r is not None]
        if not aborted:
            return []
        gone = {id(r) for r in aborted if r.status == RequestStatus.RUNNING}
        if gone:
            self.running = [r for r in self.running if id(r) not in gone]
        swapped = [r for r in aborted if r.status == RequestStatus.SWAPPED]
        if swapped:
            release_swapped(self, swapped)
            gone.update(id(r) for r in swapped)
        self.policy.remove(r for r in aborted if id(r) not in gone)
        for req in aborted:
            self._release(req, RequestStatus.FINISHED_ABORTED)
        return [(req.client_index, request_delta(req, [], None)) for req in aborted]

    def _release(self, req: Request, status: RequestStatus) -> None:
        """Free the blocks of a request that left `running`; the workers hear it next plan."""
        req.status = status
        if self._grammar_of and status.is_finished:
            self._drop_grammar_user(req.req_id)
        if req.lora is not None and status.is_finished:
            self.lora_users[req.lora.lora_name] -= 1
            if not self.lora_users[req.lora.lora_name]:
                del self.lora_users[req.lora.lora_name]
        self.kv.free(req)
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None
        if req.in_batch:
            self._finished_ids.append(req.req_id)
            req.in_batch = False

    # ---------------------------------------------------------------- planning
    def schedule(self) -> StepPlan:
        """Plan one step.

        Algorithm: one budget of `max_num_batched_tokens` tokens, no prefill/decode phases.
        1. Running requests, in policy order, at most 1/`num_microbatches` of them: each takes
           min(tokens left to compute, budget) tokens (a decode is 1, an unfinished prompt a
           chunk; tokens in flight count as known under async scheduling, else such a request
           has none left and is skipped). If its blocks don't fit, preempt the tail of `running`
           (lowest priority / latest) by recompute, until it fits or it was the tail.
           A request whose LoRA adapter would exceed `max_loras` distinct adapters in the step
           waits for a later step.
        2. Unless step 1 preempted, swapped requests (host KV tier) resume first, oldest first,
           while the same limits allow (core/swapping.py); then, once none is left swapped,
           waiting requests in policy order while budget, max_num_seqs,
           state slots (models with recurrent state) and blocks allow: reuse the longest cached
           prefix, take a chunk (with `whole_prompts`, encoders: all of it, or stop), allocate,
           run. Stop at the first that does not fit (no skipping
           ahead), except that a request whose adapter finds no slot left in the step is passed
           over (up to MAX_LORA_SKIPS per step, as vLLM does) and keeps its place.
        3. Emit the plan as a delta and advance `num_computed_tokens` (at plan time).
        """
        step = StepBuilder(self.config.max_num_batched_tokens, self.max_loras)
        self._schedule_running(step)
        if not step.preempted:
            schedule_swapped(self, step)
            if not self.swapped:
                self._schedule_waiting(step)
        plan = build_plan(self, step)
        assert sum(plan.num_scheduled_tokens) <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        if self.debug:
            check_invariants(self)
        return plan

    def _schedule_running(self, step: StepBuilder) -> None:
        max_rows = cdiv(len(self.running), self.num_microbatches)  # this plan's micro-batch
        busy = self.spec is not None and self.spec.is_busy(len(self.requests))
        # with stages: placeholders only in chains of micro-batches, or in a second pass (below)
        ahead = self.num_microbatches == 1 or self.plans_ahead
        i = 0
        while i < len(self.running) and step.budget > 0 and len(step.scheduled) < max_rows:
            req = self.running[i]
            if (
                not self._is_due(req)
                or not step.fits_lora(req)
                or (self.spec is not None and not self._schedule_speculative(req, step, busy))
            ):
                i += 1
                continue
            num_new = min(self._num_feedable(req, ahead) - req.num_computed_tokens, step.budget)
            if num_new > 0:
                if not self._allocate_or_preempt(req, num_new, step):
                    return  # it preempted itself: it was the tail, nothing follows it
                step.add(req, num_new)
            i += 1
        if self.async_scheduling and self.num_microbatches > 1:
            self._schedule_ahead(step, max_rows)

    @property
    def plans_ahead(self) -> bool:
        """Pipeline stages under async scheduling with at least as many running requests as
        stages: each micro-batch is planned again while its step is in flight (module docstring)."""
        return (
            self.async_scheduling
            and self.num_microbatches > 1
            and self.spec is None
            and len(self.running) >= self.num_microbatches
        )

    @property
    def max_inflight(self) -> int:
        """Plans to keep in flight now: one per pipeline stage, twice that while micro-batches
        are planned ahead; with one stage, a second plan queued under async scheduling."""
        if self.num_microbatches == 1:
            return 2 if self.async_scheduling else 1
        return self.num_microbatches * (2 if self.plans_ahead else 1)

    def _is_due(self, req: Request) -> bool:
        """Whether `req` may be in the plan being built: with stages, a request whose token is
        in flight only P plans or more after its last one (a plan just behind that one would
        wait on the first stage until it has passed every stage)."""
        if self.num_microbatches == 1 or not req.num_placeholders:
            return True
        return req.last_step_id <= self._next_step_id - self.num_microbatches

    def _schedule_ahead(self, step: StepBuilder, max_rows: int) -> None:
        """Pipeline stages under async scheduling: while fewer requests run than there are
        stages (micro-batches cannot fill them), a request whose token is in flight is planned
        again, fewest placeholders first (so every one gets its turn); no preemption for it
        (its result will come back). With more, micro-batches over disjoint requests fill the
        pipeline and each request waits for its token."""
        if len(self.running) >= self.num_microbatches or self.spec is not None:
            return
        planned = {id(r) for r, _ in step.scheduled}
        for req in sorted(self.running, key=lambda r: r.num_placeholders):
            if len(step.scheduled) >= max_rows or step.budget <= 0:
                return
            if id(req) in planned or not req.num_placeholders or not step.fits_lora(req):
                continue
            num_new = min(self._num_feedable(req, True) - req.num_computed_tokens, step.budget)
            if num_new > 0 and self.kv.allocate_slots(req, num_new):
                step.add(req, num_new)

    def _schedule_speculative(self, req: Request, step: StepBuilder, busy: bool) -> bool:
        """Plan `req` with drafts if it has some and their slots fit (then, or when it waits
        for its token in flight to draft from, False); True: plan it as usual."""
        drafts = self.spec.drafts_for(req, step.budget, busy)
        if drafts is None:
            return False
        if not drafts or not self.kv.allocate_slots(req, 1 + len(drafts)):
            return True  # no room for the drafts: a plain step (which may preempt)
        step.add(req, 1 + len(drafts), drafts)
        return False

    def _num_feedable(self, req: Request, ahead: bool = True) -> int:
        """Tokens the workers can feed in: the known ones, and under async scheduling (`ahead`)
        those in flight too, unless they will end the request by length (then it just waits to
        finish)."""
        if not (self.async_scheduling and ahead and req.num_placeholders):
            return req.num_tokens
        with_placeholders = req.num_tokens + req.num_placeholders
        max_tokens = req.sampling.max_tokens
        if with_placeholders >= self.max_model_len or (
            max_tokens is not None and req.num_output_tokens + req.num_placeholders >= max_tokens
        ):
            return req.num_tokens
        return with_placeholders

    def _allocate_or_preempt(self, req: Request, num_new: int, step: StepBuilder) -> bool:
        while not self.kv.allocate_slots(req, num_new):
            victim = self.running.pop()
            assert all(victim is not r for r, _ in step.scheduled), "victims come unplanned"
            self._preempt(victim)
            step.preempted = True
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        if try_swap_out(self, req):
            return
        self._release(req, RequestStatus.PREEMPTED)
        if req.scores_prompt:  # its prompt is computed again, from position 0
            req.prompt_logprobs = []
        req.num_computed_tokens = 0
        req.num_placeholders = 0  # results of plans in flight are dropped (num_preemptions)
        if req.spec is not None:
            req.spec.forget_inflight()
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.push_preempted(req)

    def _schedule_waiting(self, step: StepBuilder) -> None:
        now = time.time()
        skipped: list[Request] = []  # of adapters with no slot left in this step
        while len(self.policy) and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self.states is not None and not self.states.num_free:
                break
            req = self.policy.peek()
            if not step.fits_lora(req):
                if len(skipped) == MAX_LORA_SKIPS:
                    break
                skipped.append(self.policy.pop())
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            host_hits = self.kv.host_hits(req, num_hit // self.block_size)
            num_hit += len(host_hits) * self.block_size
            num_new = min(req.num_tokens - num_hit, step.budget)
            if self.whole_prompts and num_new < req.num_tokens - num_hit:
                break  # (the core refused prompts longer than the whole budget)
            if not self.kv.allocate_slots(req, num_new, hits, host_hits):
                break
            if host_hits:
                self.kv.tier.num_hit_tokens += len(host_hits) * self.block_size
            self.policy.pop()
            if self.states is not None:
                req.state_slot = self.states.allocate()
            self.kv.record_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.policy.add_running(self.running, req)
            step.add(req, num_new)
        for req in reversed(skipped):  # back where they were
            self.policy.push_preempted(req)

    # ---------------------------------------------------------------- results
    def update_from_output(
        self, plan: StepPlan, result: StepResult
    ) -> list[tuple[int, RequestDelta]]:
        """Apply a step's result (core/step_results.py): one delta per request that got tokens."""
        return apply_result(self, plan, result)

    def check_result(self, plan: StepPlan, result: StepResult, vocab_size: int) -> str | None:
        """Why `result` cannot be applied as the answer to `plan` (None: it can)."""
        return check_plan_result(self, plan, result, vocab_size)

    # ---------------------------------------------------------------- queries
    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> SchedulerStats:
        return scheduler_stats(self)

    def is_full(self, num_held: int = 0) -> bool:
        """The waiting queue, with `num_held` requests waiting outside it (for their grammar), is
        at `max_waiting`: a new request would be refused."""
        limit = self.config.max_waiting
        return limit is not None and self.num_waiting + num_held >= limit

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()
