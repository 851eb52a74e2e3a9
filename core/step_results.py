"""Applying a worker's `StepResult` to the scheduler's requests: append the sampled tokens,
apply stop rules, free what finished, give back the blocks of rejected drafts.

A result answers the plan recorded in `Scheduler._inflight` under its step id, row by row; a row
whose request has left since (finished, aborted, preempted: its `num_preemptions` moved on) is
dropped, so plans in flight never write into a request's later life.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.core.admission import check_result
from pagedserve.core.deltas import request_delta
from pagedserve.core.invariants import check_invariants
from pagedserve.core.kv_cache_manager import cdiv
from pagedserve.core.request import Request, RequestStatus, check_stop
from pagedserve.ipc.messages import RequestDelta, StepPlan, StepResult

if TYPE_CHECKING:
    from pagedserve.core.scheduler import Scheduler


def apply_result(
    sched: Scheduler, plan: StepPlan, result: StepResult
) -> list[tuple[int, RequestDelta]]:
    """Append sampled tokens, apply stop rules, free finished requests; one delta per request
    that got tokens. Results for requests that left since the plan was made are dropped."""
    if not plan.scheduled_ids:
        return []  # an empty plan was never recorded (and needs no result)
    record = sched._inflight.pop(plan.step_id, None)
    assert record is not None, f"no plan in flight with step_id {plan.step_id}"
    if result.lora_loads:
        sched.lora_pool_counts = (result.lora_loads, result.lora_evictions)
    assert len(result.sampled_token_ids) == len(record)
    outputs, finished = [], []
    for i, (req, num_preemptions) in enumerate(record):
        token_ids = result.sampled_token_ids[i]
        current = _is_current(sched, req, num_preemptions)
        if result.pooled and current and result.pooled[i] is not None:
            outputs.append(_finish_pooled(sched, req, result.pooled[i]))
            finished.append(req)
            continue
        if result.prompt_logprobs and current and req.scores_prompt:
            req.prompt_logprobs.extend(result.prompt_logprobs[i])
        if not token_ids or not current:
            continue
        assert req.num_placeholders > 0, f"{req} sampled mid-prompt"
        req.num_placeholders -= 1
        rejected = 0
        if sched.spec is not None:
            planned = plan.num_sampler_drafts.get(req.req_id, 0) if plan.num_sampler_drafts else 0
            drafted = result.num_drafts[i] if planned else 0
            rejected = sched.spec.verified(req, len(token_ids), planned, drafted)
        new_ids, status = _append_tokens(req, token_ids, sched.max_model_len)
        if status is not None:
            finished.append(req)
            del sched.requests[req.req_id]
            sched._release(req, status)
        elif rejected:
            _free_rejected(sched, req)
        logprobs = result.logprobs[i] if result.logprobs else None
        if logprobs is not None:
            logprobs = logprobs[: len(new_ids)]
        outputs.append((req.client_index, request_delta(req, new_ids, logprobs)))
    if finished:
        gone = {id(r) for r in finished}
        sched.running = [r for r in sched.running if id(r) not in gone]
    if sched.debug:
        check_invariants(sched)
    return outputs


def _finish_pooled(sched: Scheduler, req: Request, pooled: bytes) -> tuple[int, RequestDelta]:
    """A pooling request ends with its prompt: its vector goes to its client."""
    assert req.pooling is not None and req.num_placeholders == 1, f"{req} pooled mid-prompt"
    req.num_placeholders = 0
    req.pooled = pooled
    del sched.requests[req.req_id]
    sched._release(req, RequestStatus.FINISHED_STOPPED)
    return req.client_index, request_delta(req, [], None)


def _free_rejected(sched: Scheduler, req: Request) -> None:
    """Give back the blocks at `req`'s tail that only its rejected drafts used (a plan in
    flight runs no position past `num_computed_tokens`: core/spec_decode/decoder.py); the next
    plan tells the workers where its new blocks start."""
    if sched.kv.free_tail(req, cdiv(req.num_computed_tokens, sched.block_size)):
        req.num_blocks_sent = min(req.num_blocks_sent, req.num_blocks)
        req.spec.tail_freed = True


def check_plan_result(
    sched: Scheduler, plan: StepPlan, result: StepResult, vocab_size: int
) -> str | None:
    """Why `result` cannot be applied as the answer to `plan` (None: it can)."""
    record = sched._inflight.get(plan.step_id)
    if record is None:
        return f"no plan in flight with step id {plan.step_id}"
    current = [(req, _is_current(sched, req, n)) for req, n in record]
    return check_result(current, result, vocab_size, plan.num_sampler_drafts)


def _is_current(sched: Scheduler, req: Request, num_preemptions: int) -> bool:
    return (
        sched.requests.get(req.req_id) is req
        and req.status == RequestStatus.RUNNING
        and req.num_preemptions == num_preemptions
    )


def _append_tokens(
    req: Request, token_ids: list[int], max_model_len: int
) -> tuple[list[int], RequestStatus | None]:
    """Append tokens one by one; stop at the first that ends the request (later ones drop)."""
    for n, token_id in enumerate(token_ids, 1):
        req.append_output(token_id)
        status = check_stop(req, max_model_len)
        if status is not None:
            return token_ids[:n], status
    return list(token_ids), None
