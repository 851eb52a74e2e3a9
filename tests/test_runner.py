"""The model runner in one process: a step started before the one before it has finished (what
the worker does under async scheduling) feeds that step's sampled tokens in on the device and
gives exactly the tokens of running every step start to finish."""

from __future__ import annotations

import pytest
import torch

from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import CachedDelta, NewRequest, SamplingParams, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.model_runner import ModelRunner

from tiny_models import tiny_model_dir

PROMPTS = [list(range(20, 27)), list(range(40, 53))]
STEPS = 10
BLOCK = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tiny_model_dir("llama", str(tmp_path_factory.getbasetemp()))
    config = build_engine_config(path, device="cpu", dtype="float32", block_size=BLOCK,
                                 num_gpu_blocks_override=64)  # fmt: skip
    r = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    r.init_cache(64)
    return r


def prefill(step_id: int, params: list[SamplingParams]) -> StepPlan:
    news = [
        NewRequest(f"r{i}", p, list(range(i * 16, (i + 1) * 16)), params[i], 0)
        for i, p in enumerate(PROMPTS)
    ]
    return StepPlan(step_id, [n.req_id for n in news], [len(p) for p in PROMPTS], new_requests=news)


def decode(step_id: int, k: int, tokens: list[list[int]] | None) -> StepPlan:
    """Decode step k after the prefill; `tokens`: what the core tells (None: nothing yet)."""
    cached = [
        CachedDelta(f"r{i}", [] if tokens is None else tokens[i], [], len(p) + k)
        for i, p in enumerate(PROMPTS)
    ]
    return StepPlan(step_id, [c.req_id for c in cached], [1, 1], cached=cached)


def finish_all(runner: ModelRunner, step_id: int) -> None:
    runner.execute(StepPlan(step_id, [], [], finished_ids=[f"r{i}" for i in range(len(PROMPTS))]))


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0, max_tokens=64)] * 2,
        [SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.2, max_tokens=64),
         SamplingParams(temperature=1.0, frequency_penalty=0.7, max_tokens=64)],
    ],
)  # fmt: skip
def test_step_started_before_the_last_finished_equals_step_by_step(runner, params):
    # Step by step: every step finishes before the next starts; the core tells each token.
    runner.sampler = type(runner.sampler)(seed=0)
    res = runner.execute(prefill(0, params))
    got = [[t[0]] for t in res.sampled_token_ids]
    for k in range(STEPS):
        res = runner.execute(decode(k + 1, k, [[g[-1]] for g in got]))
        for g, t in zip(got, res.sampled_token_ids, strict=True):
            g.extend(t)
    finish_all(runner, 100)

    # Lookahead: each decode starts while the step before is unfinished, so its input token
    # is only on the device; the core tells nothing.
    runner.sampler = type(runner.sampler)(seed=0)
    pending = runner.sample(runner.start(prefill(200, params), None))
    ahead = [[] for _ in PROMPTS]
    for k in range(STEPS):
        started = runner.start(decode(201 + k, k, None), pending)
        assert len(started.inputs.unknown) == len(PROMPTS), "inputs came from the device"
        res = runner.finish(pending)
        for a, t in zip(ahead, res.sampled_token_ids, strict=True):
            a.extend(t)
        pending = runner.sample(started)
    res = runner.finish(pending)
    for a, t in zip(ahead, res.sampled_token_ids, strict=True):
        a.extend(t)
    finish_all(runner, 300)
    assert ahead == got
