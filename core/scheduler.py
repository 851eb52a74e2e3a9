"""The scheduler: which requests run which tokens each step, and what the workers must learn.

One token budget per step, no prefill/decode phases (vLLM V1 style). `num_computed_tokens`
advances when a step is planned, so several plans can be in flight (async scheduling, pipeline
parallelism). A request whose sampled token is still in flight is a *placeholder*: with
`async_scheduling` the next plan already decodes it (the workers sample it, keep it in their
batch and feed it in; the core learns it from the result), unless that token is bound to end the
request by length; without it, or with pipeline stages while at least as many requests run as
there are stages (micro-batches fill them; the first stage never sees samples), the request is
skipped until its token is back.

Micro-batches (`num_microbatches` = pipeline stages): a plan takes at most 1/P of the running
requests, so with P plans in flight over disjoint requests every stage has a share of the batch to
work on; without the cap the first plan would take every request and the next plans would find
each one still in flight (stage 1 idle while stage 2 works, and back: a bubble of (P-1)/P).

Each `StepPlan` is a delta against the workers' persistent batch: a request is sent whole once
(`NewRequest`), then only its new blocks (`CachedDelta`), and its sampled tokens only where the
ranks that embed tokens do not sample (pipeline stages before the last; with one stage every rank
keeps its own samples); requests that left the running set (finished, aborted, preempted) are
listed once in `finished_ids`.

With speculative decoding (core/spec_decode/) a decoding row may verify draft tokens: it is
planned with `1 + k` tokens and its drafts travel in the plan; its result brings the accepted
drafts plus one token, and `num_computed_tokens` moves back over the rejected ones. (With a
draft model the plan carries only how many drafts a row verifies: the workers draft.)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from itertools import repeat

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.admission import check_result
from pagedserve.core.deltas import cached_delta, new_request, request_delta
from pagedserve.core.invariants import check_invariants
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.kv_tier import HostTier, TierSpec
from pagedserve.core.policy import make_policy
from pagedserve.core.request import Request, RequestStatus, check_stop
from pagedserve.core.spec_decode.decoder import SpecDecoder
from pagedserve.core.state_pool import StatePool
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
logger = logging.getLogger(__name__)


class _StepBuilder:
    """What one `schedule()` call has decided so far."""

    def __init__(self, budget: int, max_loras: int | None = None) -> None:
        self.budget = budget
        self.scheduled: list[tuple[Request, int]] = []
        self.preempted = False
        self.max_loras = max_loras  # distinct LoRA adapters one step may run (the slots)
        self.lora_ids: set[int] = set()
        self.drafts: dict[str, list[int]] = {}  # req_id -> drafts it verifies (speculation)

    def fits_lora(self, req: Request) -> bool:
        """Whether `req`'s adapter (if any) can run in this step: one of the step's already, or
        a slot is left."""
        lora_id = req.lora_id
        if not lora_id or lora_id in self.lora_ids:
            return True
        return self.max_loras is not None and len(self.lora_ids) < self.max_loras

    def add(self, req: Request, num_tokens: int, drafts: list[int] | None = None) -> None:
        assert 0 < num_tokens <= self.budget and self.fits_lora(req)
        self.scheduled.append((req, num_tokens))
        self.budget -= num_tokens
        if req.lora_id:
            self.lora_ids.add(req.lora_id)
        if drafts:
            self.drafts[req.req_id] = drafts


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
        caching = cache_config.enable_prefix_caching
        if caching and num_state_slots is not None:
            # A hit would have to restore every linear layer's state at the hit's boundary, and
            # the state slots keep only each request's latest state.
            logger.info(
                "prefix caching is off: this model's linear-attention layers keep recurrent "
                "state, which a prefix-cache hit cannot restore"
            )
            caching = False
        if host_tier is not None and (group_windows not in (None, [None]) or num_state_slots):
            raise ValueError(
                "--kv-offloading-size: the host KV tier supports models whose layers all attend "
                "globally (no sliding-window or linear-attention layers)"
            )
        tier = HostTier(host_tier, cache_config.block_size) if host_tier is not None else None
        self.kv = KVCacheManager(
            num_blocks, cache_config.block_size, caching, group_windows or [None], tier
        )
        self.swapped: list[Request] = []  # preempted by swap, oldest first (core/swapping.py)
        # Free blocks kept copied to the host ahead of eviction: about what one step takes
        # (its budget's blocks, and a block per row); core/kv_tier.py
        self._spill_margin = (
            cdiv(scheduler_config.max_num_batched_tokens, cache_config.block_size)
            + scheduler_config.max_num_seqs
        )
        self.states = StatePool(num_state_slots) if num_state_slots is not None else None
        budget = scheduler_config.max_num_batched_tokens
        need = self.kv.max_blocks_per_request(max_model_len, budget)
        if need > num_blocks:
            groups = f" over {self.kv.num_groups} KV cache groups" if self.kv.num_groups > 1 else ""
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {cache_config.block_size} tokens, fewer "
                f"than the {need} blocks one request of max_model_len={max_model_len} can need"
                f"{groups}: lower --max-model-len or give the KV cache more memory"
            )
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
        self.spec = None if speculative is None else SpecDecoder(speculative, max_model_len)
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
        step = _StepBuilder(self.config.max_num_batched_tokens, self.max_loras)
        self._schedule_running(step)
        if not step.preempted:
            schedule_swapped(self, step)
            if not self.swapped:
                self._schedule_waiting(step)
        plan = self._build_plan(step)
        assert sum(plan.num_scheduled_tokens) <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        if self.debug:
            check_invariants(self)
        return plan

    def _schedule_running(self, step: _StepBuilder) -> None:
        max_rows = cdiv(len(self.running), self.num_microbatches)  # this plan's micro-batch
        busy = self.spec is not None and self.spec.is_busy(len(self.requests))
        i = 0
        while i < len(self.running) and step.budget > 0 and len(step.scheduled) < max_rows:
            req = self.running[i]
            if not step.fits_lora(req) or (
                self.spec is not None and not self._schedule_speculative(req, step, busy)
            ):
                i += 1
                continue
            ahead = self.num_microbatches == 1  # with stages: a second pass (below)
            num_new = min(self._num_feedable(req, ahead) - req.num_computed_tokens, step.budget)
            if num_new > 0:
                if not self._allocate_or_preempt(req, num_new, step):
                    return  # it preempted itself: it was the tail, nothing follows it
                step.add(req, num_new)
            i += 1
        if self.async_scheduling and self.num_microbatches > 1:
            self._schedule_ahead(step, max_rows)

    def _schedule_ahead(self, step: _StepBuilder, max_rows: int) -> None:
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

    def _schedule_speculative(self, req: Request, step: _StepBuilder, busy: bool) -> bool:
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

    def _allocate_or_preempt(self, req: Request, num_new: int, step: _StepBuilder) -> bool:
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
            req.spec.drafts = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.push_preempted(req)

    def _schedule_waiting(self, step: _StepBuilder) -> None:
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

    def _build_plan(self, step: _StepBuilder) -> StepPlan:
        """Encode the step as a delta; nothing scheduled gives an empty plan that need not be
        sent (it takes no step id and leaves `finished_ids` for the next plan)."""
        if not step.scheduled:
            return StepPlan(step_id=self._next_step_id, scheduled_ids=[], num_scheduled_tokens=[])
        new_requests, cached = [], []
        for req, num_new in step.scheduled:
            drafts = step.drafts.get(req.req_id, ()) if step.drafts else ()
            if drafts:
                req.spec.drafts = list(drafts)
            known = req.num_tokens + req.num_placeholders + len(drafts)
            assert req.num_computed_tokens + num_new <= known
            assert req.num_blocks >= cdiv(req.num_computed_tokens + num_new, self.block_size)
            if req.in_batch:
                cached.append(cached_delta(req, with_tokens=not self.workers_keep_samples))
            else:
                new_requests.append(new_request(req))
                req.in_batch = True
            req.num_tokens_sent = req.num_tokens
            req.num_blocks_sent = req.num_blocks
            prompt_left = req.num_prompt_tokens - req.num_computed_tokens
            self.num_prompt_tokens_computed += max(0, min(num_new, prompt_left))
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == known:
                req.num_placeholders += 1  # every known token is computed: this step samples
        copies = ([], [], [])
        if self.kv.tier is not None:  # what the next plans may evict, copied beside this one
            self.kv.spill_ahead(self._spill_margin)
            copies = self.kv.tier.end_plan()
        plan = StepPlan(
            step_id=self._next_step_id,
            kv_to_host=copies[0],
            kv_from_host=copies[1],
            kv_to_host_ahead=copies[2],
            scheduled_ids=[req.req_id for req, _ in step.scheduled],
            num_scheduled_tokens=[n for _, n in step.scheduled],
            new_requests=new_requests,
            cached=cached,
            finished_ids=self._finished_ids,
        )
        if self.spec is not None and self.spec.config.in_workers:
            plan.num_model_drafts = {r: len(d) for r, d in step.drafts.items()}
        else:
            plan.draft_token_ids = step.drafts
        self._finished_ids = []
        self._inflight[plan.step_id] = [(req, req.num_preemptions) for req, _ in step.scheduled]
        self._next_step_id += 1
        return plan

    # ---------------------------------------------------------------- results
    def update_from_output(
        self, plan: StepPlan, result: StepResult
    ) -> list[tuple[int, RequestDelta]]:
        """Append sampled tokens, apply stop rules, free finished requests; one delta per request
        that got tokens. Results for requests that left since the plan was made are dropped."""
        if not plan.scheduled_ids:
            return []  # an empty plan was never recorded (and needs no result)
        record = self._inflight.pop(plan.step_id, None)
        assert record is not None, f"no plan in flight with step_id {plan.step_id}"
        if result.lora_loads:
            self.lora_pool_counts = (result.lora_loads, result.lora_evictions)
        assert len(result.sampled_token_ids) == len(record)
        outputs, finished = [], []
        for i, (req, num_preemptions) in enumerate(record):
            token_ids = result.sampled_token_ids[i]
            current = self._is_current(req, num_preemptions)
            if result.pooled and current and result.pooled[i] is not None:
                outputs.append(self._finish_pooled(req, result.pooled[i]))
                finished.append(req)
                continue
            if result.prompt_logprobs and current and req.scores_prompt:
                req.prompt_logprobs.extend(result.prompt_logprobs[i])
            if not token_ids or not current:
                continue
            assert req.num_placeholders > 0, f"{req} sampled mid-prompt"
            req.num_placeholders -= 1
            rejected = self.spec.verified(req, len(token_ids)) if self.spec is not None else 0
            new_ids, status = self._append_tokens(req, token_ids)
            if status is not None:
                finished.append(req)
                del self.requests[req.req_id]
                self._release(req, status)
            elif rejected:
                self._free_rejected(req)
            logprobs = result.logprobs[i] if result.logprobs else None
            if logprobs is not None:
                logprobs = logprobs[: len(new_ids)]
            outputs.append((req.client_index, request_delta(req, new_ids, logprobs)))
        if finished:
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]
        if self.debug:
            check_invariants(self)
        return outputs

    def _finish_pooled(self, req: Request, pooled: bytes) -> tuple[int, RequestDelta]:
        """A pooling request ends with its prompt: its vector goes to its client."""
        assert req.pooling is not None and req.num_placeholders == 1, f"{req} pooled mid-prompt"
        req.num_placeholders = 0
        req.pooled = pooled
        del self.requests[req.req_id]
        self._release(req, RequestStatus.FINISHED_STOPPED)
        return req.client_index, request_delta(req, [], None)

    def _free_rejected(self, req: Request) -> None:
        """Give back the blocks at `req`'s tail that only its rejected drafts used (no plan in
        flight holds it: a speculating row waits for its result); the next plan tells the
        workers where its new blocks start."""
        if self.kv.free_tail(req, cdiv(req.num_computed_tokens, self.block_size)):
            req.num_blocks_sent = min(req.num_blocks_sent, req.num_blocks)
            req.spec.tail_freed = True

    def check_result(self, plan: StepPlan, result: StepResult, vocab_size: int) -> str | None:
        """Why `result` cannot be applied as the answer to `plan` (None: it can)."""
        record = self._inflight.get(plan.step_id)
        if record is None:
            return f"no plan in flight with step id {plan.step_id}"
        current = [(req, self._is_current(req, n)) for req, n in record]
        return check_result(current, result, vocab_size)

    def _is_current(self, req: Request, num_preemptions: int) -> bool:
        return (
            self.requests.get(req.req_id) is req
            and req.status == RequestStatus.RUNNING
            and req.num_preemptions == num_preemptions
        )

    def _append_tokens(
        self, req: Request, token_ids: list[int]
    ) -> tuple[list[int], RequestStatus | None]:
        """Append tokens one by one; stop at the first that ends the request (later ones drop)."""
        for n, token_id in enumerate(token_ids, 1):
            req.append_output(token_id)
            status = check_stop(req, self.max_model_len)
            if status is not None:
                return token_ids[:n], status
        return list(token_ids), None

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
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_unfinished=len(self.requests),
            **(tier_stats(self) if self.kv.tier is not None else {}),
            **self._lora_stats(),
            **(spec_stats(self.spec) if self.spec is not None else {}),
        )

    def _lora_stats(self) -> dict[str, object]:
        """With LoRA on: running and waiting requests per adapter (vLLM's lora_requests_info),
        the workers' adapter loads and evictions."""
        if self.max_loras is None:
            return {}
        loads, evictions = self.lora_pool_counts
        out: dict[str, object] = {"lora_loads": loads, "lora_evictions": evictions}
        if self.lora_users:
            running = Counter(r.lora.lora_name for r in self.running if r.lora is not None)
            out["running_lora_adapters"] = dict(running)
            out["waiting_lora_adapters"] = {
                n: k - running[n] for n, k in self.lora_users.items() if k > running[n]
            }
        return out

    def is_full(self, num_held: int = 0) -> bool:
        """The waiting queue, with `num_held` requests waiting outside it (for their grammar), is
        at `max_waiting`: a new request would be refused."""
        limit = self.config.max_waiting
        return limit is not None and self.num_waiting + num_held >= limit

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()


def tier_stats(sched: Scheduler) -> dict[str, int]:
    """SchedulerStats' host KV tier fields."""
    tier = sched.kv.tier
    return dict(
        num_swapped=len(sched.swapped),
        kv_swap_out_bytes=tier.num_out_blocks * tier.spec.block_bytes,
        kv_swap_in_bytes=tier.num_in_blocks * tier.spec.block_bytes,
        host_cache_hits=tier.num_hit_tokens,
    )


def spec_stats(spec: SpecDecoder) -> dict[str, int | list[int]]:
    """SchedulerStats' speculative decoding fields."""
    s = spec.stats
    return dict(
        spec_num_drafts=s.num_drafts,
        spec_num_draft_tokens=s.num_draft_tokens,
        spec_num_accepted_tokens=s.num_accepted_tokens,
        spec_accepted_per_pos=list(s.accepted_per_pos),
    )
