"""How a request's state is encoded for the other processes, as deltas.

Workers keep a persistent batch: a request is sent whole once (`NewRequest`, also after a
preemption, since the workers dropped it), then only what changed since the last plan
(`CachedDelta`), so a step's message stays small with thousands of running requests. Clients get
only the tokens new since the last output (`RequestDelta`).
"""

from __future__ import annotations

from pagedserve.core.request import Request
from pagedserve.ipc.messages import CachedDelta, NewRequest, RequestDelta, TokenLogprobs


def new_request(req: Request) -> NewRequest:
    """A windowed group's blocks skipped at a prefix hit travel as block 0: the workers need some
    valid id there, and attention masks every position behind the window."""
    block_ids = [[max(i, 0) for i in ids] for ids in req.block_ids]
    return NewRequest(
        req_id=req.req_id,
        prompt_token_ids=req.prompt_token_ids,
        block_ids=block_ids[0],
        group_block_ids=block_ids[1:],
        sampling=req.sampling,
        num_computed_tokens=req.num_computed_tokens,
        output_token_ids=list(req.output_token_ids),
        eos_token_ids=req.eos_token_ids,
        lora=req.lora,
        state_slot=req.state_slot,
        pooling=req.pooling,
    )


def cached_delta(req: Request, with_tokens: bool = True) -> CachedDelta:
    """`with_tokens=False` where every rank that embeds tokens also samples them (one pipeline
    stage): the workers already hold each sampled token, so it need not travel back. Blocks
    skipped behind the sliding window were sent before: the workers keep their (masked) ids."""
    assert all(n <= req.num_blocks_sent for n in req.num_skipped_blocks)
    new_ids = [[b.block_id for b in blocks[req.num_blocks_sent :]] for blocks in req.blocks]
    delta = CachedDelta(
        req_id=req.req_id,
        new_token_ids=req.all_token_ids[req.num_tokens_sent :] if with_tokens else [],
        new_block_ids=new_ids[0],
        num_computed_tokens=req.num_computed_tokens,
        new_group_block_ids=new_ids[1:] if any(new_ids[1:]) else [],
    )
    if req.spec is not None and req.spec.tail_freed:  # the workers hold more blocks than it
        delta.num_blocks_before = req.num_blocks_sent
        req.spec.tail_freed = False
    return delta


def request_delta(
    req: Request, new_ids: list[int], logprobs: list[TokenLogprobs] | None
) -> RequestDelta:
    """`logprobs`: one per new token, or None. The request's prompt logprobs go with its first
    token (then the core forgets them)."""
    prompt_logprobs = None
    if (
        req.sampling.prompt_logprobs is not None
        and new_ids
        and req.num_output_tokens == len(new_ids)
    ):
        prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
    return RequestDelta(
        req_id=req.req_id,
        new_token_ids=new_ids,
        new_logprobs=logprobs,
        finish_reason=req.status.finish_reason,
        stop_reason=req.stop_reason,
        num_cached_tokens=req.num_cached_tokens,
        first_scheduled_time=req.first_scheduled_time or 0.0,
        prompt_logprobs=prompt_logprobs,
        pooled=req.pooled,
    )
