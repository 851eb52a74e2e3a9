"""A request's state inside the core, and its stop rules.

Invariants:
- `all_token_ids == prompt_token_ids + output_token_ids`;
- `num_computed_tokens <= num_tokens + num_placeholders + spec.num_planned` (draft slots
  planned for verification, core/spec_decode/); it advances when a step is *planned*,
  not when it returns. `num_placeholders` counts tokens sampled by plans still in flight: with
  async scheduling the next plan already feeds such a token back in (the workers know it, the
  core does not yet), so a decoding request has
  `num_computed_tokens == num_tokens + num_placeholders - 1`;
- `blocks` holds one list per KV cache group while it runs (none while waiting), all of one
  length of at least `ceil(num_computed_tokens / block_size)` blocks; in a windowed group `g` the
  first `num_skipped_blocks[g]` are `SKIPPED_BLOCK` (freed, or never taken at a prefix hit:
  wholly behind the window of every token still to compute);
- `num_tokens_sent` / `num_blocks_sent` are what the workers' persistent batch holds, so a plan
  carries only the difference (meaningful while `in_batch`).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from pagedserve.core.block_pool import KVBlock
from pagedserve.ipc.messages import (
    AddRequest,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
)

if TYPE_CHECKING:
    from pagedserve.core.spec_decode.decoder import RowSpec


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # preempted, its KV in the host tier (core/swapping.py)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason ("stop" | "length" | "abort"), None while unfinished."""
        return self.value if self.is_finished else None


class Request:
    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: list[int] | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        client_index: int = 0,
        seq: int = 0,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.eos_token_ids = list(eos_token_ids or [])
        self.arrival_time = arrival_time
        self.priority = priority
        self.client_index = client_index
        self.seq = seq  # admission order: the last tie-break of the priority key
        self.lora = lora  # its adapter (None: the base model)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_placeholders = 0  # tokens sampled by plans in flight, not yet appended
        self.last_step_id: int | None = None  # the last plan that scheduled it (None: none yet)
        self.blocks: list[list[KVBlock]] = []  # per KV cache group
        self.num_hashed_blocks = 0  # leading blocks already registered in the prefix cache
        self.num_skipped_blocks: list[int] = []  # per group: leading blocks behind its window
        self.host_block_ids: list[int] = []  # while swapped: its KV's host blocks, in order
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks of all_token_ids
        self.num_cached_tokens = 0  # prefix-cache hit at the first schedule
        self.num_preemptions = 0
        self.stop_reason: int | None = None
        self.first_scheduled_time: float | None = None
        self.state_slot: int | None = None  # recurrent-state slot while running (state_pool.py)
        self.in_batch = False  # the workers' persistent batch holds it
        self.num_tokens_sent = 0
        self.num_blocks_sent = 0
        self.spec: RowSpec | None = None  # speculative decoding state, once it was considered
        # prompt_logprobs: the entries the workers scored so far (sent with the first token)
        self.prompt_logprobs: list[TokenLogprobs] = []
        # a pooling request (prefill only): its vector, once the workers pooled its prompt
        self.pooling = pooling
        self.pooled: bytes | None = None

    @classmethod
    def from_add(cls, msg: AddRequest, seq: int = 0) -> Request:
        return cls(
            req_id=msg.req_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling=msg.sampling,
            eos_token_ids=msg.eos_token_ids,
            arrival_time=msg.arrival_time,
            priority=msg.priority,
            client_index=msg.client_index,
            seq=seq,
            lora=msg.lora,
            pooling=msg.pooling,
        )

    @property
    def lora_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_blocks(self) -> int:
        """Blocks per group (every group's list has this length)."""
        return len(self.blocks[0]) if self.blocks else 0

    @property
    def block_ids(self) -> list[list[int]]:
        """Per group; a skipped block is -1."""
        return [[b.block_id for b in blocks] for blocks in self.blocks]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt_logprobs and its prompt is not done: every prompt position must
        be computed (no prefix-cache hit may skip one)."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )


def check_stop(req: Request, max_model_len: int) -> RequestStatus | None:
    """Stop rules after the last output token was appended, in order: a stop token id, any of
    the request's EOS ids (both only once `min_tokens` are out, except under a grammar: the
    sampler lets a constrained row take one earlier only when its grammar allows nothing else,
    as vLLM does), `max_tokens`, `max_model_len`. Sets `stop_reason` for a stop token id. Stop
    *strings* are the client's business."""
    sp = req.sampling
    last = req.output_token_ids[-1]
    if req.num_output_tokens >= sp.min_tokens or sp.structured_outputs is not None:
        if sp.stop_token_ids and last in sp.stop_token_ids:
            req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if not sp.ignore_eos and last in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
