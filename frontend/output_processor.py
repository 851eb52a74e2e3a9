"""Turns the core's token deltas into RequestOutputs: detokenizing, stop strings, logprobs, n > 1.

A user request with `n` choices becomes `n` engine requests (siblings share the prompt's KV blocks
through the prefix cache); a `ParentRequest` gathers them back into one RequestOutput. Shared by the
blocking `LLM` and the asyncio `AsyncEngine`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pagedserve.frontend.detokenizer import (
    IncrementalDetokenizer,
    StopStrings,
    check_stop_strings,
)
from pagedserve.frontend.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedserve.ipc.messages import (
    AddRequest,
    LoRARequest,
    PoolingParams,
    RequestDelta,
    SamplingParams,
    TokenLogprobs,
)


class RequestState:
    """One choice (engine request) of a user request."""

    def __init__(
        self, index: int, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Any
    ) -> None:
        self.index = index
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.pooled: bytes | None = None  # a pooling request's vector (float32 bytes)
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.stops = StopStrings(params.stop or [], params.include_stop_str_in_output)

    def process(self, delta: RequestDelta) -> bool:
        """Apply one delta. True when a stop string ended the request here (the core still runs
        it and must be told to abort)."""
        if self.finish_reason is not None:
            return False
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.pooled is not None:
            self.pooled = delta.pooled
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *map(self._logprob_dict, delta.prompt_logprobs)]
        # The EOS or stop token id that ended the request keeps its id but not its text (vLLM's
        # rule), unless include_stop_str_in_output.
        last = len(delta.new_token_ids) - 1
        hide_last = delta.finish_reason == "stop" and not self.params.include_stop_str_in_output
        for i, token_id in enumerate(delta.new_token_ids):
            self.token_ids.append(token_id)
            new_text = "" if hide_last and i == last else self.detok.add(token_id)
            if delta.new_logprobs is not None and self.logprobs is not None:
                self._add_logprobs(delta.new_logprobs[i])
            if self._check_stop_strings(new_text):
                return delta.finish_reason is None or i < len(delta.new_token_ids) - 1
        self.text = self.detok.text
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            # "invalid": the core refused it, and says why (as fail_all gives its reason)
            self.stop_reason = (
                delta.error if delta.finish_reason == "invalid" else delta.stop_reason
            )
        return False

    def _check_stop_strings(self, new_text: str) -> bool:
        if not self.params.stop or not new_text:
            return False
        hit = self.stops.find(self.detok.text, len(new_text))
        if hit is None:
            return False
        stop, cut = hit
        self.text = self.detok.text[:cut]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _add_logprobs(self, entry: TokenLogprobs) -> None:
        assert self.logprobs is not None
        self.cumulative_logprob += entry.logprobs[0]
        self.logprobs.append(self._logprob_dict(entry))

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        decode = self.detok.decode_one
        return {
            tid: Logprob(lp, rank, decode(tid))
            for tid, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks, strict=True)
        }

    def streamable_text(self) -> str:
        if self.finish_reason is not None or not self.params.stop:
            return self.text
        return self.text[: max(0, len(self.text) - self.stops.hold)]

    def to_output(self, streamable: bool = False) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.streamable_text() if streamable else self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[RequestState]
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when the core first scheduled a child
    last_token_time: float = 0.0
    token_gaps: list[float] = field(default_factory=list)  # since the last output was taken

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def add_token_time(self, now: float) -> None:
        """An engine step brought tokens (counted once per step, however many children)."""
        if self.first_token_time is None:
            self.first_token_time = now
        elif now != self.last_token_time:
            self.token_gaps.append(now - self.last_token_time)
        self.last_token_time = now

    def make_output(self, streamable: bool = False) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.to_output(streamable) for c in self.children],
            finished=self.finished,
            num_cached_tokens=max((c.num_cached_tokens for c in self.children), default=0),
            prompt_logprobs=next(
                (c.prompt_logprobs for c in self.children if c.prompt_logprobs is not None), None
            ),
            pooled=self.children[0].pooled if self.children else None,
        )


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids  # each ends a request (unless ignore_eos)
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, tuple[ParentRequest, RequestState]] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        client_index: int = 0,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> list[AddRequest]:
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already running")
        check_stop_strings(params.stop or [])
        parent = ParentRequest(request_id, prompt, prompt_token_ids, [])
        messages = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:  # each engine request is one choice; choice i samples with seed + i
                seed = None if params.seed is None else params.seed + i
                # the prompt is scored once, by choice 0 (the others may hit the prefix cache)
                scored = params.prompt_logprobs if i == 0 else None
                child_params = _replace(params, n=1, seed=seed, prompt_logprobs=scored)
            state = RequestState(i, prompt_token_ids, child_params, self.tokenizer)
            parent.children.append(state)
            cid = child_id(request_id, i, params.n)
            self.children[cid] = (parent, state)
            messages.append(
                AddRequest(
                    cid,
                    prompt_token_ids,
                    child_params,
                    self.eos_token_ids,
                    parent.arrival_time,
                    priority,
                    client_index,
                    lora,
                    pooling,
                )
            )
        self.parents[request_id] = parent
        return messages

    def process(self, deltas: list[RequestDelta]) -> tuple[list[ParentRequest], list[str]]:
        """Apply deltas; return the parents that changed and child ids the core must abort."""
        touched: dict[str, ParentRequest] = {}
        to_abort: list[str] = []
        now = time.time()
        for delta in deltas:
            entry = self.children.get(delta.req_id)
            if entry is None:
                continue  # finished on our side already (stop string) or aborted
            parent, state = entry
            if delta.new_token_ids:
                parent.add_token_time(now)
            if parent.first_scheduled_time is None and delta.first_scheduled_time:
                parent.first_scheduled_time = delta.first_scheduled_time
            if state.process(delta):
                to_abort.append(delta.req_id)
            if state.finish_reason is not None:
                del self.children[delta.req_id]
            touched[parent.request_id] = parent
        for parent in touched.values():
            if parent.finished:
                self.parents.pop(parent.request_id, None)
        return list(touched.values()), to_abort

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; return the child ids the core must abort."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        ids = [child_id(request_id, c.index, len(parent.children)) for c in parent.children]
        alive = [cid for cid in ids if self.children.pop(cid, None) is not None]
        return alive

    def fail_all(self, message: str) -> list[ParentRequest]:
        parents = list(self.parents.values())
        for parent in parents:
            for child in parent.children:
                if child.finish_reason is None:
                    child.finish_reason, child.stop_reason = "abort", message
        self.parents.clear()
        self.children.clear()
        return parents


def _replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    return msgspec.structs.replace(params, **changes)
