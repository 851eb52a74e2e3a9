"""ngram drafted by the sampling worker right after it samples (issue 38): the real scheduler and
the real model runner in one process, the runner one step ahead as on a GPU (a plan starts while
the step before is unfinished), two plans in flight as under async scheduling. A speculating
row is planned again before its result returns, and the tokens are those of speculation off
(greedy, seeded, logprobs), with preemptions too."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.core.scheduler import Scheduler
from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import AddRequest, SamplingParams, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.speculative_config import SpeculativeConfig
from pagedserve.worker.model_runner import ModelRunner

from tiny_models import tiny_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
BLOCK = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tiny_model_dir("llama", str(tmp_path_factory.getbasetemp()))
    config = build_engine_config(path, device="cpu", dtype="float32", block_size=BLOCK,
                                 num_gpu_blocks_override=64, max_model_len=80,
                                 speculative_config=NGRAM)  # fmt: skip
    r = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    r.init_cache(64)
    return r


def requests(tag: str) -> list[AddRequest]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(12)] * 3, [7, 8, 9, 10] * 6, [5] * 9]
    params = [
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=30),
        SamplingParams(temperature=0, max_tokens=35),
    ]
    return [
        AddRequest(f"{tag}{i}", p, sampling=s, eos_token_ids=[1])
        for i, (p, s) in enumerate(zip(prompts, params, strict=True))
    ]


def drive(runner: ModelRunner, spec: dict | None, num_blocks: int, tag: str):
    """The engine's loop in one process: the core plans step N+1 before N's result is applied
    (two plans in flight), the runner starts N+1 before it finishes N (the GPU's order).
    Returns each request's tokens and logprobs, the scheduler, how many times a row with
    sampler drafts was planned while its previous plan with them was still in flight, and how
    many such rows ran their token in flight without waiting for it."""
    config = runner.config
    sched = Scheduler(config.scheduler, config.cache, config.max_model_len, num_blocks,
                      debug=True, async_scheduling=True, workers_keep_samples=True,
                      speculative=SpeculativeConfig.from_value(spec) if spec else None)  # fmt: skip
    for msg in requests(tag):
        sched.add_request(msg)
    tokens, logprobs, ahead, not_waited = {}, {}, 0, 0
    pending = None  # (plan, the runner's pending step)
    while sched.has_unfinished_requests() or pending is not None:
        plan = sched.schedule() if sched.has_unfinished_requests() else None
        started = None
        if plan is not None and plan.scheduled_ids:
            if pending is not None:
                ahead += len(plan.num_sampler_drafts.keys() & pending[0].num_sampler_drafts)
            started = runner.start(plan, pending[1] if pending else None)
            unknown = {started.inputs.unknown_ids[i] for i in range(len(started.inputs.unknown))}
            not_waited += len(unknown & plan.num_sampler_drafts.keys())
        if pending is not None:
            result = runner.finish(pending[1])
            assert sched.check_result(pending[0], result, config.model.vocab_size) is None
            for _, delta in sched.update_from_output(pending[0], result):
                tokens.setdefault(delta.req_id[1:], []).extend(delta.new_token_ids)
                logprobs.setdefault(delta.req_id[1:], []).extend(delta.new_logprobs or [])
        pending = (plan, runner.sample(started)) if started is not None else None
    runner.execute(StepPlan(10**6, [], [], finished_ids=sched._finished_ids))
    assert sched.kv.pool.num_free == num_blocks
    return tokens, logprobs, sched, ahead, not_waited


@pytest.mark.parametrize(
    ("num_blocks", "device_busy"),
    [(64, False), (20, False), (64, True)],  # 20: preemptions with drafts in flight
)
def test_sampler_drafts_plan_ahead_and_keep_the_tokens(runner, monkeypatch, num_blocks,
                                                       device_busy):  # fmt: skip
    """`device_busy`: as on a GPU, the step before is still running when a plan is applied
    (its ids are not on the host), so a row keeps it only with a draft in sight."""
    off, off_lps, *_ = drive(runner, None, num_blocks, "a")
    if device_busy:
        monkeypatch.setattr(runner, "is_done", lambda step: False)
    on, on_lps, sched, ahead, not_waited = drive(runner, NGRAM, num_blocks, "b")
    assert (not_waited > 0) == device_busy
    assert on == off
    assert len(on_lps["0"]) == len(on["0"])  # one entry per accepted token
    for x, y in zip(on_lps["0"], off_lps["0"], strict=True):
        assert x.token_ids == y.token_ids
        assert max(abs(a - b) for a, b in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
    stats = sched.get_stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_drafts > 0
    assert ahead > 0, "a speculating row was planned again before its result returned"
    if num_blocks == 20:
        assert sched.num_preemptions > 0


def test_the_core_checks_the_workers_draft_counts():
    """A result must say how many drafts each row left to the workers verified (at most the
    plan's k), and bring at most that many plus one tokens."""
    from pagedserve.config import CacheConfig, SchedulerConfig
    from pagedserve.ipc.messages import StepResult

    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
                      CacheConfig(block_size=BLOCK), 80, 64, debug=True, async_scheduling=True,
                      workers_keep_samples=True,
                      speculative=SpeculativeConfig.from_value(NGRAM))  # fmt: skip
    sched.add_request(requests("c")[1])
    first = sched.schedule()  # the prompt
    second = sched.schedule()  # planned before the prompt's token is back, with 4 slots
    assert second.num_sampler_drafts == {"c1": 4} and second.num_scheduled_tokens == [5]
    assert sched.check_result(first, StepResult(first.step_id, [[11]]), 512) is None
    sched.update_from_output(first, StepResult(first.step_id, [[11]]))
    ok = StepResult(second.step_id, [[7, 8, 9]], num_drafts=[2])
    for bad, words in [
        (StepResult(second.step_id, [[7, 8, 9]]), "0 draft counts for 1"),
        (StepResult(second.step_id, [[7]], num_drafts=[5]), "5 drafts where the plan allowed"),
        (StepResult(second.step_id, [[7, 8, 9]], num_drafts=[1]), "at most 2 ids"),
    ]:
        assert words in sched.check_result(second, bad, 512)
    assert sched.check_result(second, ok, 512) is None
    sched.update_from_output(second, ok)
    req = sched.requests["c1"]
    assert req.output_token_ids == [11, 7, 8, 9] and req.spec.ahead == 0
    assert req.num_computed_tokens == req.num_tokens - 1  # moved back over 2 unused slots
