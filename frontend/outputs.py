"""What `LLM.generate` and `AsyncEngine.generate` return, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token (vLLM's prompt_logprobs): None for the first, which nothing scores.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs is set
    pooled: bytes | None = None  # a pooling request's vector, float32 (frontend/pooling.py)
    metrics: dict[str, float] = field(default_factory=dict)
    # seconds between the engine steps that brought tokens since the previous output (several
    # when the reader fell behind: one output then stands for many steps)
    inter_token_latencies: list[float] = field(default_factory=list)
