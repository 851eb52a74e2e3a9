"""Pooling requests on the client side (`--runner pooling`, pooling_config.py): what `LLM.embed`,
`classify` and `score` return (vLLM's output shapes), and the prompts a score runs.

A pooling request is an engine request whose prompt runs and nothing is sampled; the core sends
its vector once, as float32 bytes (`RequestDelta.pooled`), which is decoded here.
"""

from __future__ import annotations

import math
import sys
from array import array
from dataclasses import dataclass
from typing import Any

from pagedserve.ipc.messages import SamplingParams
from pagedserve.pooling_config import PoolingConfig

# a pooling request's engine sampling params: it runs its prompt only
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def decode_vector(data: bytes) -> list[float]:
    """The float32 little-endian bytes of a pooled vector -> floats."""
    values = array("f")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def runner_error(pooling: PoolingConfig | None, wants_pooling: bool, what: str) -> str | None:
    """Why `what` cannot run on this model (a generation request to a pooling model or the
    reverse, a pooling task it does not run); None: it can."""
    if pooling is None:
        if wants_pooling:
            return f"{what} needs a pooling model: this model runs the generate runner"
        return None
    if not wants_pooling:
        return f"{what}: this model runs the pooling runner ({pooling.task}), it does not generate"
    return None


def task_error(pooling: PoolingConfig | None, task: str, what: str) -> str | None:
    """Why `what` (needing pooling `task`) cannot run on this model; None: it can."""
    error = runner_error(pooling, True, what)
    if error is None and pooling.task != task:
        error = f"{what} needs a {task} model: this model's pooling task is {pooling.task}"
    return error


def truncate(ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last N tokens (-1: up to max_model_len, which the
    length check then enforces; None: all)."""
    if truncate_prompt_tokens is None or truncate_prompt_tokens < 0:
        return ids
    if truncate_prompt_tokens == 0:
        raise ValueError("truncate_prompt_tokens must be -1 or >= 1")
    return ids[-truncate_prompt_tokens:]


def score_prompts(tokenizer: Any, queries: list[str], documents: list[str]) -> list[list[int]]:
    """A cross-encoder's (classify model's) prompt per (query, document): the tokenizer's pair
    encoding, as vLLM runs it (BERT: [CLS] q [SEP] d [SEP]; a decoder's tokenizer without a pair
    template: the two concatenated; Qwen3-Reranker's prompt template is the client's to apply,
    as in vLLM's example)."""
    if hasattr(tokenizer, "encode_pair"):  # frontend/tokenizer.py's FastTokenizer
        return [tokenizer.encode_pair(q, d) for q, d in zip(queries, documents, strict=True)]
    return [tokenizer(q, d)["input_ids"] for q, d in zip(queries, documents, strict=True)]


def pair_up(data_1: Any, data_2: Any) -> tuple[list[str], list[str]]:
    """vLLM's score pairing: one query against N documents, or N against N."""
    queries = [data_1] if isinstance(data_1, str) else list(data_1)
    documents = [data_2] if isinstance(data_2, str) else list(data_2)
    if not queries or not documents:
        raise ValueError("score needs at least one query and one document")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        raise ValueError(f"{len(queries)} queries for {len(documents)} documents: give one "
                         "query, or one per document")  # fmt: skip
    return queries, documents


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def data(self) -> list[float]:
        return self.embedding


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def data(self) -> list[float]:
        return self.probs

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @property
    def data(self) -> list[float]:
        return [self.score]


@dataclass
class PoolingRequestOutput:
    """vLLM's EmbeddingRequestOutput / ClassificationRequestOutput / ScoringRequestOutput."""

    request_id: str
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
