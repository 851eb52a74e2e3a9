"""One step as `schedule()` builds it (`StepBuilder`), and its encoding as a `StepPlan`: a delta
against the workers' persistent batch (a request whole once, then only its new blocks; the ids
that left the batch once), recorded as in flight until its result comes back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.core.deltas import cached_delta, new_request
from pagedserve.core.kv_cache_manager import cdiv
from pagedserve.core.request import Request
from pagedserve.ipc.messages import StepPlan

if TYPE_CHECKING:
    from pagedserve.core.scheduler import Scheduler


class StepBuilder:
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


def build_plan(sched: Scheduler, step: StepBuilder) -> StepPlan:
    """Encode the step as a delta; nothing scheduled gives an empty plan that need not be
    sent (it takes no step id and leaves `finished_ids` for the next plan)."""
    if not step.scheduled:
        return StepPlan(step_id=sched._next_step_id, scheduled_ids=[], num_scheduled_tokens=[])
    new_requests, cached = [], []
    for req, num_new in step.scheduled:
        drafts = step.drafts.get(req.req_id, ()) if step.drafts else ()
        if drafts:
            sched.spec.planned(req, drafts)
        known = req.num_tokens + req.num_placeholders
        if req.spec is not None:
            known += req.spec.num_planned
        assert req.num_computed_tokens + num_new <= known
        assert req.num_blocks >= cdiv(req.num_computed_tokens + num_new, sched.block_size)
        if req.in_batch:
            cached.append(cached_delta(req, with_tokens=not sched.workers_keep_samples))
        else:
            new_requests.append(new_request(req))
            req.in_batch = True
        req.num_tokens_sent = req.num_tokens
        req.num_blocks_sent = req.num_blocks
        prompt_left = req.num_prompt_tokens - req.num_computed_tokens
        sched.num_prompt_tokens_computed += max(0, min(num_new, prompt_left))
        req.num_computed_tokens += num_new
        req.last_step_id = sched._next_step_id
        if req.num_computed_tokens == known:
            req.num_placeholders += 1  # every known token is computed: this step samples
    copies = ([], [], [])
    if sched.kv.tier is not None:  # what the next plans may evict, copied beside this one
        sched.kv.spill_ahead(sched._spill_margin)
        copies = sched.kv.tier.end_plan()
    plan = StepPlan(
        step_id=sched._next_step_id,
        kv_to_host=copies[0],
        kv_from_host=copies[1],
        kv_to_host_ahead=copies[2],
        scheduled_ids=[req.req_id for req, _ in step.scheduled],
        num_scheduled_tokens=[n for _, n in step.scheduled],
        new_requests=new_requests,
        cached=cached,
        finished_ids=sched._finished_ids,
    )
    if sched.spec is not None and sched.spec.after_sampling:
        plan.num_sampler_drafts = {r: len(d) for r, d in step.drafts.items()}
    elif sched.spec is not None and sched.spec.config.in_workers:
        plan.num_model_drafts = {r: len(d) for r, d in step.drafts.items()}
    else:
        plan.draft_token_ids = step.drafts
    sched._finished_ids = []
    sched._inflight[plan.step_id] = [(req, req.num_preemptions) for req, _ in step.scheduled]
    sched._next_step_id += 1
    return plan
