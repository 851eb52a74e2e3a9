"""Preemption by swap, and the swapped queue (the third queue, beside waiting and running).

A request preempted with the host tier on may keep its state: its KV moves to host blocks
(`KVCacheManager.swap_out`, when the cost model prefers it and the host has room), it waits in
`Scheduler.swapped` holding no device block, and resumes by copying them back (`swap_in`) before
any waiting request is admitted (vLLM V0's order: a swapped request was admitted once already).

It keeps the KV of its first `num_tokens - 1` known tokens at most: tokens sampled by plans in
flight are dropped with those plans' results (as after a recompute preemption), and one known
token is computed again on resuming, so that step has logits to sample from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.core.scheduler import Scheduler
    from pagedserve.core.step_builder import StepBuilder


def try_swap_out(sched: Scheduler, req: Request) -> bool:
    """Preempt `req` by swap (True), or do nothing (False: recompute it)."""
    if sched.kv.tier is None or req.scores_prompt or req.state_slot is not None:
        return False
    num_keep = min(req.num_computed_tokens, req.num_tokens - 1)
    host_ids = sched.kv.swap_out(req, num_keep)
    if host_ids is None:
        return False
    sched._release(req, RequestStatus.SWAPPED)
    req.host_block_ids = host_ids
    req.num_computed_tokens = num_keep
    req.num_placeholders = 0  # results of plans in flight are dropped (num_preemptions)
    if req.spec is not None:
        req.spec.forget_inflight()
    req.num_preemptions += 1
    sched.num_preemptions += 1
    sched.swapped.append(req)
    return True


def schedule_swapped(sched: Scheduler, step: StepBuilder) -> None:
    """Resume swapped requests, oldest preemption first, while budget, max_num_seqs, LoRA slots
    and device blocks allow; stop at the first that does not fit."""
    while sched.swapped and step.budget > 0 and len(sched.running) < sched.config.max_num_seqs:
        req = sched.swapped[0]
        num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
        if not step.fits_lora(req) or not sched.kv.swap_in(req, num_new):
            return
        sched.swapped.pop(0)
        req.status = RequestStatus.RUNNING
        sched.policy.add_running(sched.running, req)
        step.add(req, num_new)


def release_swapped(sched: Scheduler, reqs: list[Request]) -> None:
    """Aborted swapped requests leave the queue and give their host blocks back."""
    gone = {id(r) for r in reqs}
    sched.swapped = [r for r in sched.swapped if id(r) not in gone]
    for req in reqs:
        sched.kv.tier.pool.unref(req.host_block_ids)
        req.host_block_ids = []
