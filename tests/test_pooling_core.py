"""The core's side of pooling requests (pure Python, milliseconds): prefill-only in the token
budget, chunked for decoders, whole for encoders, finished with their vector (blocks freed), and
the gate's refusals naming the runner."""

from __future__ import annotations

import pytest

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.admission import ModelLimits, check_request
from pagedserve.core.scheduler import Scheduler
from pagedserve.ipc.messages import AddRequest, PoolingParams, SamplingParams, StepResult

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def _scheduler(whole_prompts: bool, async_scheduling: bool = True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        max_model_len=64, num_blocks=32, debug=True, async_scheduling=async_scheduling,
        workers_keep_samples=True, whole_prompts=whole_prompts,
    )  # fmt: skip


def _add(s: Scheduler, req_id: str, n: int) -> None:
    s.add_request(AddRequest(req_id, list(range(3, 3 + n)), ONE, pooling=PoolingParams()))


def test_chunked_then_pooled_and_freed() -> None:
    s = _scheduler(whole_prompts=False)
    _add(s, "a", 20)
    vector = b"\x00\x00\x80\x3f" * 3  # three float32 ones
    steps = []
    while s.has_unfinished_requests():
        plan = s.schedule()
        if not plan.scheduled_ids:
            continue
        steps.append(plan.num_scheduled_tokens[0])
        done = sum(steps) == 20
        result = StepResult(plan.step_id, [[]], pooled=[vector if done else None])
        assert s.check_result(plan, result, 512) is None
        deltas = s.update_from_output(plan, result)
        assert bool(deltas) == done  # nothing reaches the client before the vector
    assert steps == [8, 8, 4]  # the token budget, no decode step after the prompt
    ((_, delta),) = deltas
    assert delta.pooled == vector and delta.finish_reason == "stop" and not delta.new_token_ids
    assert s.kv.num_free_blocks == 32


def test_whole_prompts_wait_for_room() -> None:
    """An encoder's prompt is never chunked: it waits for a step with room for all of it."""
    s = _scheduler(whole_prompts=True, async_scheduling=False)
    _add(s, "a", 5)
    _add(s, "b", 6)
    plan = s.schedule()
    assert plan.scheduled_ids == ["a"] and plan.num_scheduled_tokens == [5]
    s.update_from_output(plan, StepResult(plan.step_id, [[]], pooled=[b"\x00" * 4]))
    plan = s.schedule()
    assert plan.scheduled_ids == ["b"] and plan.num_scheduled_tokens == [6]


def test_gate_names_the_runner() -> None:
    generate = ModelLimits(vocab_size=512, max_model_len=64)
    embed = ModelLimits(512, 64, pooling_task="embed", pooling_dim=8, whole_prompt_limit=16)
    with pytest.raises(ValueError, match="generate runner"):
        check_request(AddRequest("a", [3, 4], ONE, pooling=PoolingParams()), generate)
    with pytest.raises(ValueError, match="pooling runner"):
        check_request(AddRequest("a", [3, 4], ONE), embed)
    with pytest.raises(ValueError, match="pooling task is embed"):
        check_request(AddRequest("a", [3, 4], ONE, pooling=PoolingParams(task="classify")), embed)
    with pytest.raises(ValueError, match="matryoshka"):
        check_request(AddRequest("a", [3, 4], ONE, pooling=PoolingParams(dimensions=4)), embed)
    with pytest.raises(ValueError, match="whole in one step"):
        check_request(AddRequest("a", list(range(3, 20)), ONE, pooling=PoolingParams()), embed)
    check_request(AddRequest("a", [3, 4], ONE, pooling=PoolingParams()), embed)


@pytest.mark.parametrize("kind", ["MEAN", "CLS", "LAST"])
def test_pooler_gathers_over_chunks(kind: str) -> None:
    """The worker's pooler over a prompt split across steps (beside one that ends in the first
    step): the vector of the whole prompt's hidden states, however it was chunked."""
    import torch

    from pagedserve.ipc.messages import CachedDelta, NewRequest, StepPlan
    from pagedserve.pooling_config import PoolingConfig
    from pagedserve.worker.input_batch import InputBatch
    from pagedserve.worker.pooler import Pooler

    config = PoolingConfig("embed", kind, normalize=False, hidden_size=8)
    pooler = Pooler(config, None, torch.device("cpu"), "")
    batch = InputBatch(4, 64, 4, 1)
    new = [NewRequest(r, list(range(3, 3 + n)), list(range(i * 4, i * 4 + 4)), ONE, 0,
                      pooling=PoolingParams())
           for i, (r, n) in enumerate([("a", 10), ("b", 3)])]  # fmt: skip
    steps = [
        StepPlan(0, ["a", "b"], [6, 3], new_requests=new),
        StepPlan(1, ["a"], [4], cached=[CachedDelta("a", [], [], 6)]),
    ]
    hidden = {"a": torch.randn(10, 8), "b": torch.randn(3, 8)}
    got = {}
    for plan in steps:
        batch.apply(plan)
        pooler.track(plan)
        inputs = batch.prepare(plan.scheduled_ids, plan.num_scheduled_tokens)
        starts = inputs.positions[inputs.query_start_loc[:-1]]  # each row's first position
        rows = [
            hidden[r][s : s + n]
            for r, s, n in zip(plan.scheduled_ids, starts, plan.num_scheduled_tokens, strict=True)
        ]
        pooled = pooler.pool(torch.cat(rows), plan, inputs)
        for i, vec in zip(pooled.rows, pooled.vectors, strict=True):
            got[plan.scheduled_ids[i]] = vec
    for req_id, h in hidden.items():
        want = {"MEAN": h.mean(0), "CLS": h[0], "LAST": h[-1]}[kind]
        assert torch.allclose(got[req_id], want, atol=1e-6), req_id
    assert not pooler.sums and not pooler.firsts  # nothing kept after the vectors
