"""Scheduler: unit tests of each rule, then a hypothesis state machine with a fake worker that
rebuilds its persistent batch from the plans' deltas alone and checks them against the core."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.invariants import check_invariants
from pagedserve.core.scheduler import Scheduler
from pagedserve.ipc.messages import AddRequest, SamplingParams, StepPlan, StepResult, TokenLogprobs

EOS = 2


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 8,
    policy: str = "fcfs",
    max_model_len: int = 64,
    caching: bool = True,
    async_scheduling: bool = False,
    workers_keep_samples: bool = False,
    window: int | None = None,
    windows: list[int | None] | None = None,
    num_microbatches: int = 1,
) -> Scheduler:
    """`window`: one windowed KV cache group; `windows`: one group per entry."""
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        debug=True,
        async_scheduling=async_scheduling,
        workers_keep_samples=workers_keep_samples,
        group_windows=windows or ([window] if window else None),
        num_microbatches=num_microbatches,
    )


def add(s: Scheduler, req_id: str, prompt, priority: int = 0, arrival: float = 0.0, **sp) -> None:
    sp.setdefault("max_tokens", 100)
    s.add_request(
        AddRequest(
            req_id=req_id,
            prompt_token_ids=list(prompt),
            sampling=SamplingParams(**sp),
            eos_token_ids=[EOS],
            arrival_time=arrival,
            priority=priority,
        )
    )


def result_for(s: Scheduler, plan: StepPlan, token: int = 7) -> StepResult:
    """A result sampling `token` for every request whose prompt+outputs are now all computed."""
    sampled = []
    for rid in plan.scheduled_ids:
        req = s.requests.get(rid)
        done = req is not None and req.num_computed_tokens == req.num_tokens
        sampled.append([token] if done else [])
    return StepResult(step_id=plan.step_id, sampled_token_ids=sampled)


def step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    return plan, (
        s.update_from_output(plan, result_for(s, plan, token)) if plan.scheduled_ids else []
    )


def sched(plan: StepPlan) -> dict[str, int]:
    return dict(zip(plan.scheduled_ids, plan.num_scheduled_tokens, strict=True))


# ---------------------------------------------------------------- budget and chunking
def test_long_prompt_is_chunked_across_steps():
    s = make(budget=4)
    add(s, "a", range(10, 20))
    sizes, outs = [], []
    for _ in range(4):
        plan, out = step(s)
        sizes.append(sched(plan)["a"])
        outs.append(out)
    assert sizes == [4, 4, 2, 1]
    assert outs[:2] == [[], []] and outs[2][0][1].new_token_ids == [7]
    assert s.requests["a"].output_token_ids == [7, 7]


def test_prefill_chunks_pipeline_but_decode_waits_for_its_token():
    s = make(budget=4)
    add(s, "a", range(10, 20))
    p1, p2, p3 = s.schedule(), s.schedule(), s.schedule()
    assert [sched(p)["a"] for p in (p1, p2, p3)] == [4, 4, 2]
    assert [c.num_computed_tokens for c in p2.cached + p3.cached] == [4, 8]
    assert s.schedule().scheduled_ids == [], "its token for step 3 is not back yet"
    for p in (p1, p2, p3):
        s.update_from_output(p, result_for(s, p))
    assert s.requests["a"].output_token_ids == [7]
    assert sched(s.schedule()) == {"a": 1}


def test_async_scheduling_decodes_the_token_in_flight():
    s = make(async_scheduling=True)
    add(s, "a", range(10, 14))
    p1, p2 = s.schedule(), s.schedule()
    assert sched(p1) == {"a": 4} and sched(p2) == {"a": 1}, "p2 feeds p1's sample back in"
    a = s.requests["a"]
    assert (a.num_tokens, a.num_computed_tokens, a.num_placeholders) == (4, 5, 2)
    ((_, d),) = s.update_from_output(p1, StepResult(p1.step_id, [[7]]))
    assert d.new_token_ids == [7] and (a.num_tokens, a.num_placeholders) == (5, 1)
    p3 = s.schedule()
    assert sched(p3) == {"a": 1} and p3.cached[0].new_token_ids == [7]
    s.update_from_output(p2, StepResult(p2.step_id, [[8]]))
    assert a.output_token_ids == [7, 8]


def test_async_scheduling_does_not_run_past_max_tokens():
    s = make(async_scheduling=True)
    add(s, "a", range(10, 14), max_tokens=2)
    p1, p2 = s.schedule(), s.schedule()
    assert sched(p2) == {"a": 1}
    assert s.schedule().scheduled_ids == [], "the two tokens in flight are its last"
    s.update_from_output(p1, StepResult(p1.step_id, [[7]]))
    ((_, d),) = s.update_from_output(p2, StepResult(p2.step_id, [[8]]))
    assert d.finish_reason == "length" and s.kv.pool.num_free == s.kv.pool.num_blocks


def test_async_scheduling_drops_the_step_after_a_stop():
    s = make(async_scheduling=True)
    add(s, "a", range(10, 14))
    p1, p2 = s.schedule(), s.schedule()
    ((_, d),) = s.update_from_output(p1, StepResult(p1.step_id, [[EOS]]))
    assert d.finish_reason == "stop" and s.kv.pool.num_free == s.kv.pool.num_blocks
    assert s.update_from_output(p2, StepResult(p2.step_id, [[7]])) == [], "its token is dropped"
    add(s, "b", range(10, 12))
    assert s.schedule().finished_ids == ["a"]


def test_async_placeholder_block_is_cached_once_its_token_is_known():
    s = make(block_size=4, async_scheduling=True)
    add(s, "a", range(10, 13))
    p1, p2 = s.schedule(), s.schedule()  # p2 fills the block's 4th slot with p1's sample
    a = s.requests["a"]
    assert a.num_hashed_blocks == 0, "its last token is not known yet"
    s.update_from_output(p1, StepResult(p1.step_id, [[7]]))
    s.update_from_output(p2, StepResult(p2.step_id, [[8]]))
    s.schedule()
    assert a.num_hashed_blocks == 1


def test_budget_is_shared_running_first_then_waiting():
    s = make(budget=6)
    add(s, "a", range(5))
    step(s)  # a: 5 tokens, sampled one
    add(s, "b", range(100, 110))
    plan, _ = step(s)
    assert sched(plan) == {"a": 1, "b": 5}


def test_max_num_seqs():
    s = make(max_seqs=2)
    for r in "abc":
        add(s, r, range(5))
    plan, _ = step(s)
    assert plan.scheduled_ids == ["a", "b"] and s.num_waiting == 1
    assert s.get_stats().num_running == 2


# ---------------------------------------------------------------- prefix caching
def test_prefix_hit_skips_computed_tokens_and_counts_stats():
    s = make()
    add(s, "a", range(9), max_tokens=1)
    step(s)
    assert not s.has_unfinished_requests()
    add(s, "b", [*range(8), 50, 51])
    plan, out = step(s)
    (nr,) = plan.new_requests
    assert nr.num_computed_tokens == 8 and sched(plan) == {"b": 2}
    assert out[0][1].num_cached_tokens == 8
    stats = s.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9 + 10, 8)


def test_prefix_hit_leaves_one_token_to_compute():
    s = make()
    add(s, "a", range(8), max_tokens=1)
    step(s)
    add(s, "b", range(8))
    plan, _ = step(s)
    assert plan.new_requests[0].num_computed_tokens == 4 and sched(plan) == {"b": 4}


def test_siblings_share_full_prompt_blocks_in_the_same_step():
    s = make()
    for r in "abc":
        add(s, r, range(9), max_tokens=3)
    plan, _ = step(s)
    a, b, c = plan.new_requests
    assert sched(plan) == {"a": 9, "b": 1, "c": 1}
    assert b.num_computed_tokens == c.num_computed_tokens == 8
    assert a.block_ids[:2] == b.block_ids[:2] == c.block_ids[:2]
    assert len({a.block_ids[2], b.block_ids[2], c.block_ids[2]}) == 3
    assert a.group_block_ids == [], "one KV cache group: nothing more travels"
    assert s.kv.pool.blocks[a.block_ids[0]].ref_cnt == 3
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.pool.num_free == 64


def test_sliding_window_frees_blocks_behind_it_and_keeps_them_cached():
    """Window 6, blocks of 4: a decode at position p needs keys from p - 5 on, so the request
    holds at most 3 blocks; the freed ones stay in the prefix cache for a later request."""
    s = make(window=6, budget=8, max_model_len=64)
    add(s, "a", range(10, 40), max_tokens=20)
    held = []
    while s.has_unfinished_requests():
        step(s)
        req = s.requests.get("a")
        if req is not None:
            live = req.blocks[0][req.num_skipped_blocks[0] :]
            assert req.num_skipped_blocks[0] * 4 <= req.num_computed_tokens - 6 + 1
            held.append(len(live))
    assert len(held) == 4 + 18 and max(held[4:]) == 3, held  # decodes: 6 positions, <= 3 blocks
    assert s.kv.num_free_blocks == 64
    add(s, "b", [*range(10, 38), 99])  # its first 7 blocks were all freed by "a"
    plan, _ = step(s)
    assert plan.new_requests[0].num_computed_tokens == 28 and sched(plan) == {"b": 1}
    # A token at 28 reads keys 23.. (blocks 5 and 6): blocks 0-4 are never taken.
    assert s.requests["b"].num_skipped_blocks == [5]
    assert plan.new_requests[0].block_ids[:5] == [0] * 5, "skipped blocks travel as block 0"
    step(s)
    assert s.requests["b"].num_skipped_blocks == [6]  # (29 - 6 + 1) // 4


def test_no_caching_means_no_hits():
    s = make(caching=False)
    add(s, "a", range(9), max_tokens=1)
    add(s, "b", range(9), max_tokens=1)
    plan, _ = step(s)
    assert sched(plan) == {"a": 9, "b": 9}
    assert s.get_stats().prefix_cache_hits == 0


def test_reset_prefix_cache():
    s = make()
    add(s, "a", range(9), max_tokens=2)
    step(s)
    assert s.reset_prefix_cache() is False
    step(s)
    assert s.reset_prefix_cache() is True
    add(s, "b", range(9))
    plan, _ = step(s)
    assert plan.new_requests[0].num_computed_tokens == 0


# ---------------------------------------------------------------- preemption
def test_preemption_frees_the_latest_and_resends_it_with_outputs():
    s = make(num_blocks=4, block_size=4, max_model_len=16)
    add(s, "a", range(4), ignore_eos=True)
    add(s, "b", range(10, 14), ignore_eos=True)
    step(s)  # a, b: one block each
    step(s)  # tokens 5: second block each -> pool full
    for _ in range(3):
        step(s)  # 9 tokens each: 8 computed, 5 outputs
    plan, _ = step(s)  # a needs a 3rd block: b is preempted
    assert s.get_stats().num_preemptions == 1 and s.num_waiting == 1
    assert sched(plan) == {"a": 1} and plan.finished_ids == ["b"]
    while "b" not in {r.req_id for r in s.running}:
        plan, _ = step(s)
    (nr,) = [n for n in plan.new_requests if n.req_id == "b"]
    # a's growth evicted b's freed cached blocks, so b recomputes prompt + 5 outputs
    assert nr.output_token_ids == [7] * 5 and nr.num_computed_tokens == 0
    assert sched(plan)["b"] == 9 and s.requests["b"].num_preemptions == 1


def test_result_of_a_preempted_request_is_dropped():
    s = make(num_blocks=3, block_size=4, budget=6, max_model_len=12)
    add(s, "a", range(4), ignore_eos=True)
    add(s, "b", range(10, 16), ignore_eos=True)
    p1 = s.schedule()
    assert sched(p1) == {"a": 4, "b": 2}
    r1 = result_for(s, p1)
    p2 = s.schedule()  # a waits for its token; b's last chunk (it will sample) goes in flight
    assert sched(p2) == {"b": 4}
    r2 = result_for(s, p2)
    s.update_from_output(p1, r1)
    p3 = s.schedule()  # a needs a 2nd block: b (tail) is preempted, its token still in flight
    assert sched(p3) == {"a": 1} and p3.finished_ids == ["b"]
    assert s.update_from_output(p2, r2) == []
    assert s.requests["b"].output_token_ids == [] and s.requests["b"].num_preemptions == 1


def test_stale_result_is_dropped_even_after_the_request_resumed():
    s = make(num_blocks=3, block_size=4, budget=6, max_model_len=12)
    add(s, "a", range(4), ignore_eos=True)
    add(s, "b", range(10, 16), ignore_eos=True)
    p1 = s.schedule()
    r1 = result_for(s, p1)
    p2 = s.schedule()
    r2 = result_for(s, p2)  # b samples here
    s.update_from_output(p1, r1)
    s.schedule()  # b preempted, its p2 token in flight
    s.abort_requests(["a"])
    p4 = s.schedule()  # b resumes: its first block is a prefix hit, it computes the rest
    assert sched(p4) == {"b": 2} and p4.new_requests[0].num_computed_tokens == 4
    assert s.requests["b"].num_computed_tokens == 6, "r2 would look like its answer"
    assert s.update_from_output(p2, r2) == []
    assert s.requests["b"].output_token_ids == []


def test_no_admission_in_a_step_that_preempted():
    s = make(num_blocks=3, block_size=4, max_seqs=2, max_model_len=12, policy="priority")
    add(s, "a", range(4), priority=1, ignore_eos=True)
    add(s, "b", range(10, 14), priority=1, ignore_eos=True)
    step(s)
    add(s, "c", range(20, 22), priority=0)
    plan, _ = step(s)  # b preempts itself; c would fit in b's freed block, but waits
    assert sched(plan) == {"a": 1} and s.requests["b"].num_preemptions == 1
    plan, _ = step(s)
    assert sched(plan) == {"a": 1, "c": 2}


# ---------------------------------------------------------------- policies
def test_priority_policy_admits_by_priority_then_arrival():
    s = make(max_seqs=1, policy="priority")
    add(s, "low", range(4), priority=5, arrival=0.0, max_tokens=1)
    add(s, "late", range(4), priority=1, arrival=2.0, max_tokens=1)
    add(s, "early", range(4), priority=1, arrival=1.0, max_tokens=1)
    order = [step(s)[0].scheduled_ids for _ in range(3)]
    assert order == [["early"], ["late"], ["low"]]


def test_priority_preempts_the_lowest_priority_running():
    s = make(num_blocks=2, block_size=4, max_model_len=8, policy="priority")
    add(s, "low", range(4), priority=9, ignore_eos=True)
    add(s, "high", range(10, 14), priority=0, ignore_eos=True)
    step(s)
    plan, _ = step(s)
    assert plan.scheduled_ids == ["high"] and s.requests["low"].num_preemptions == 1


def test_fcfs_does_not_skip_ahead():
    s = make(num_blocks=4, block_size=4, max_model_len=16)
    add(s, "big", range(12))
    add(s, "huge", range(100, 116))
    add(s, "small", range(2))
    plan, _ = step(s)
    assert plan.scheduled_ids == ["big"]


# ---------------------------------------------------------------- stops
def run_one(s: Scheduler, tokens: list[int], **sp):
    add(s, "r", range(3), **sp)
    deltas = []
    for t in tokens:
        plan, out = step(s, t)
        deltas += [d for _, d in out]
        if not s.has_unfinished_requests():
            break
    return deltas


def test_stop_on_eos():
    d = run_one(make(), [5, EOS, 5])
    assert [x.new_token_ids for x in d] == [[5], [EOS]]
    assert d[-1].finish_reason == "stop" and d[-1].stop_reason is None


def test_ignore_eos():
    d = run_one(make(), [EOS, EOS, 5], ignore_eos=True, max_tokens=3)
    assert d[-1].finish_reason == "length" and len(d) == 3


def test_stop_token_ids_set_stop_reason():
    d = run_one(make(), [5, 9, 5], stop_token_ids=[9])
    assert d[-1].finish_reason == "stop" and d[-1].stop_reason == 9 and len(d) == 2


def test_min_tokens_defers_stops():
    d = run_one(make(), [EOS, 9, EOS, 5], stop_token_ids=[9], min_tokens=3)
    assert len(d) == 3 and d[-1].finish_reason == "stop" and d[-1].stop_reason is None


def test_a_grammar_ends_before_min_tokens():
    """A constrained request samples EOS below min_tokens only when its grammar allows nothing
    else (worker/sampler.py): it ends there, with reason stop."""
    from pagedserve.ipc.messages import StructuredOutputs

    d = run_one(make(), [5, EOS, 5], min_tokens=3, structured_outputs=StructuredOutputs(regex="a"))
    assert len(d) == 2 and d[-1].finish_reason == "stop"


def test_max_tokens():
    d = run_one(make(), [5] * 9, max_tokens=4)
    assert len(d) == 4 and d[-1].finish_reason == "length"


def test_max_model_len_and_none_max_tokens():
    d = run_one(make(max_model_len=8), [5] * 20, max_tokens=None)
    assert len(d) == 5 and d[-1].finish_reason == "length"


def test_logprobs_and_first_scheduled_time_pass_through():
    s = make()
    add(s, "a", range(3))
    plan = s.schedule()
    lp = TokenLogprobs(token_ids=[7], logprobs=[-0.5], ranks=[1])
    res = StepResult(step_id=plan.step_id, sampled_token_ids=[[7]], logprobs=[[lp]])
    ((_, d),) = s.update_from_output(plan, res)
    assert d.new_logprobs == [lp] and d.first_scheduled_time > 0


# ---------------------------------------------------------------- abort and deltas
def test_abort_frees_blocks_and_is_finished_in_next_plan():
    s = make()
    add(s, "a", range(9))
    add(s, "b", range(20, 29))
    add(s, "w", range(3))
    step(s)
    out = s.abort_requests(["a", "nope"])
    assert [(d.req_id, d.finish_reason) for _, d in out] == [("a", "abort")]
    assert "a" not in s.requests and s.kv.pool.num_free == 64 - 3 - 1
    plan, _ = step(s)
    assert plan.finished_ids == ["a"]
    add(s, "x", range(3))
    s.abort_requests(["x"])  # never sent to the workers
    plan, _ = step(s)
    assert plan.finished_ids == []


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_cancellation_storm_takes_milliseconds(policy):
    """20,000 waiting requests aborted in a random order, in batches of 128 (an n=128 stream
    closing) and one by one, with the survivors still admitted in policy order. The priority
    queue used to be rebuilt per aborted id: 4,000 took 9 s, 20,000 minutes."""
    s = make(policy=policy, max_seqs=1)
    add(s, "running", [6, 7], priority=-1, arrival=-1.0, max_tokens=2, ignore_eos=True)
    ids = [f"r{i}" for i in range(20_000)]
    for i, rid in enumerate(ids):
        add(s, rid, [3, 4, 5], priority=i % 7, arrival=float(i), max_tokens=1)
    step(s)  # "running" runs, the rest wait
    keep = {"r1", "r7", "r14", "r19999"}
    doomed = [rid for rid in ids if rid not in keep]
    random.Random(0).shuffle(doomed)
    batches = [doomed[k : k + 128] + ["unknown", doomed[k]] for k in range(0, 10_000, 128)]
    batches += [[rid] for rid in doomed[10_000:]]
    start = time.perf_counter()
    for n, batch in enumerate(batches):
        s.abort_requests(batch)
        elapsed = time.perf_counter() - start
        assert elapsed < 3.0, f"{n} of {len(batches)} aborts took {elapsed:.2f} s"
    check_invariants(s)
    assert len(s.policy) == len(list(s.policy)) == len(keep)
    order = [rid for _ in range(8) for rid in step(s)[0].scheduled_ids]
    expected = (
        ["r7", "r14", "r19999", "r1"] if policy == "priority" else ["r1", "r7", "r14", "r19999"]
    )
    assert [rid for rid in dict.fromkeys(order) if rid != "running"] == expected


def test_result_of_an_aborted_request_is_dropped():
    s = make()
    add(s, "a", range(3))
    plan = s.schedule()
    s.abort_requests(["a"])
    add(s, "a", range(3))  # the id is reused
    assert s.update_from_output(plan, result_for(s, plan)) == []
    assert s.requests["a"].output_token_ids == []


def test_cached_delta_carries_only_the_new_token_and_blocks():
    s = make(block_size=4)
    add(s, "a", range(4), ignore_eos=True)
    plan, _ = step(s)
    assert plan.new_requests[0].block_ids == [0]
    plan, _ = step(s, 8)
    assert plan.cached[0].new_group_block_ids == []
    (cd,) = plan.cached
    assert (cd.new_token_ids, cd.new_block_ids, cd.num_computed_tokens) == ([7], [1], 4)
    plan, _ = step(s, 9)
    (cd,) = plan.cached
    assert (cd.new_token_ids, cd.new_block_ids, cd.num_computed_tokens) == ([8], [], 5)
    assert plan.new_requests == [] and plan.step_id == 2


def test_no_tokens_travel_back_when_the_workers_keep_their_samples():
    s = make(block_size=4, workers_keep_samples=True)
    add(s, "a", range(4), ignore_eos=True)
    step(s)
    plan, _ = step(s, 8)
    (cd,) = plan.cached
    assert (cd.new_token_ids, cd.new_block_ids, cd.num_computed_tokens) == ([], [1], 4)
    assert s.requests["a"].output_token_ids == [7, 8]


def test_pipeline_micro_batches_split_the_running_requests():
    """Two stages: each plan takes half of the running requests, disjoint from the plan in
    flight, so both stages work (without the cap the second plan finds every request busy)."""
    s = make(block_size=4, budget=64, num_microbatches=2)
    for i in range(5):
        add(s, f"r{i}", range(3), ignore_eos=True)
    step(s)  # the prompts: every request samples its first token
    first, second = s.schedule(), s.schedule()
    assert first.scheduled_ids == ["r0", "r1", "r2"] and second.scheduled_ids == ["r3", "r4"]
    s.update_from_output(first, result_for(s, first))
    third = s.schedule()  # the first micro-batch again, while the second is in flight
    assert third.scheduled_ids == ["r0", "r1", "r2"]
    s.update_from_output(second, result_for(s, second))
    assert s.schedule().scheduled_ids == ["r3", "r4"]
    assert not s.schedule().scheduled_ids  # both micro-batches in flight


def test_pipeline_async_plans_each_micro_batch_ahead():
    """Two stages under async scheduling: four running requests form two micro-batches, each
    planned again on placeholders while its step is in flight (2P plans out; plan N+P carries
    plan N's requests: the last stage sends their tokens to the first on the device), never in
    two plans less than P apart; a lone request is planned again at once."""
    s = make(block_size=4, budget=64, num_microbatches=2, async_scheduling=True)
    for i in range(4):
        add(s, f"r{i}", range(3), ignore_eos=True)
    assert s.max_inflight == 2  # nothing runs yet: one plan per stage
    step(s)  # the prompts: every request samples its first token
    assert s.max_inflight == 4
    plans = [s.schedule() for _ in range(4)]
    halves = [["r0", "r1"], ["r2", "r3"]]
    assert [p.scheduled_ids for p in plans] == halves * 2
    assert s.requests["r0"].num_placeholders == 2 and not plans[2].cached[0].new_token_ids
    s.update_from_output(plans[0], StepResult(plans[0].step_id, [[7], [8]]))
    fifth = s.schedule()  # the first micro-batch a third time, its second step still out
    assert fifth.scheduled_ids == halves[0] and fifth.cached[1].new_token_ids == [8]
    s = make(block_size=4, budget=64, num_microbatches=2, async_scheduling=True)
    add(s, "a", range(3), ignore_eos=True)
    p1, p2, p3 = s.schedule(), s.schedule(), s.schedule()
    assert sched(p1) == {"a": 3} and sched(p2) == {"a": 1} == sched(p3)
    assert s.requests["a"].num_placeholders == 3 and not p2.cached[0].new_token_ids
    for plan, token in ((p1, 7), (p2, 8), (p3, 9)):
        s.update_from_output(plan, StepResult(plan.step_id, [[token]]))
    assert s.schedule().cached[0].new_token_ids == [7, 8, 9]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        make(num_blocks=3, block_size=4, max_model_len=16)
    s = make(max_model_len=8)
    add(s, "a", range(3))
    with pytest.raises(ValueError, match="in use"):
        add(s, "a", range(3))
    with pytest.raises(ValueError, match="exceeds"):
        add(s, "b", range(9))


# ---------------------------------------------------------------- property / state machine
@dataclass
class Mirror:
    tokens: list[int]  # known to the worker: told by the core or sampled here
    block_ids: list[list[int]]  # per KV cache group
    num_computed: int
    num_told: int  # tokens the core's messages carried so far
    state_slot: int | None = None


@dataclass
class FakeWorker:
    """Rebuilds the persistent batch from the plans alone, as a real worker must, executing them
    in order: it samples the tokens itself and keeps them (async scheduling feeds them back in
    before the core has seen them), and checks every token it must feed is known."""

    rng: random.Random
    block_size: int
    windows: list[int | None]  # per KV cache group
    batch: dict[str, Mirror] = field(default_factory=dict)

    def execute(self, plan: StepPlan, snapshot: dict) -> list[list[int]]:
        """Apply the delta, check it against the core's state at plan time, sample."""
        for rid in plan.finished_ids:
            del self.batch[rid]
        for nr in plan.new_requests:
            assert nr.req_id not in self.batch
            tokens = nr.prompt_token_ids + nr.output_token_ids
            block_ids = [list(nr.block_ids), *map(list, nr.group_block_ids)]
            assert len(block_ids) == len(self.windows)
            self.batch[nr.req_id] = Mirror(
                tokens, block_ids, nr.num_computed_tokens, len(tokens), nr.state_slot
            )
            # a state slot's state starts over: nothing computed before (no prefix-cache hits)
            assert nr.state_slot is None or nr.num_computed_tokens == 0
        slots = [m.state_slot for m in self.batch.values() if m.state_slot is not None]
        assert len(set(slots)) == len(slots), "two requests in the batch share a state slot"
        for cd in plan.cached:
            m = self.batch[cd.req_id]
            assert m.num_computed == cd.num_computed_tokens
            for k, token in enumerate(cd.new_token_ids):  # what the core learned since
                pos = m.num_told + k
                if pos < len(m.tokens):
                    assert m.tokens[pos] == token, "the core's token differs from the sample"
                else:
                    m.tokens.append(token)
            m.num_told += len(cd.new_token_ids)
            new_ids = [cd.new_block_ids, *cd.new_group_block_ids]
            if len(self.windows) > 1 and not cd.new_group_block_ids:
                assert not cd.new_block_ids, "groups grow in step"
                new_ids = [[]] * len(self.windows)
            for ids, new in zip(m.block_ids, new_ids, strict=True):
                ids += new
        sampled = []
        for rid, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens, strict=True):
            m = self.batch[rid]
            tokens, block_ids, num_computed = snapshot[rid]
            assert m.tokens[: len(tokens)] == tokens
            for window, ids, core_ids in zip(self.windows, m.block_ids, block_ids, strict=True):
                assert len(ids) == len(core_ids) == len(m.block_ids[0])
                assert all(c in (m_id, -1) for m_id, c in zip(ids, core_ids, strict=True))
                first_needed = 0 if window is None else max(num_computed - window + 1, 0)
                needed = core_ids[first_needed // self.block_size :]  # keys this step reads
                assert -1 not in needed, "a block inside the window was freed"
            assert m.num_computed == num_computed
            m.num_computed += n
            assert n > 0 and m.num_computed <= len(m.tokens), "a token to feed is unknown"
            assert len(m.block_ids[0]) * self.block_size >= m.num_computed
            if m.num_computed == len(m.tokens):
                m.tokens.append(self.rng.choice([EOS, 9] + [7] * 12))
                sampled.append([m.tokens[-1]])
            else:
                sampled.append([])
        return sampled


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([1, 2, 4, 8]),
        budget=st.integers(1, 40),
        max_seqs=st.integers(1, 6),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
        max_inflight=st.integers(1, 3),
        async_scheduling=st.booleans(),
        keep_samples=st.booleans(),
        windows=st.lists(st.none() | st.integers(1, 12), min_size=1, max_size=3),
        num_state_slots=st.none() | st.integers(1, 6),
        seed=st.integers(0, 2**32),
    )
    def setup(
        self,
        num_blocks,
        block_size,
        budget,
        max_seqs,
        policy,
        caching,
        max_inflight,
        async_scheduling,
        keep_samples,
        windows,
        num_state_slots,
        seed,
    ):
        # KV cache groups (windowed and global layers mixed) share one pool: one request of
        # max_model_len can need blocks in every group at once.
        num_blocks *= len(windows)
        self.max_model_len = min(num_blocks // len(windows) * block_size, 40)
        self.s = Scheduler(
            SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy),
            CacheConfig(block_size=block_size, enable_prefix_caching=caching),
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            debug=True,
            async_scheduling=async_scheduling,
            workers_keep_samples=keep_samples,
            group_windows=windows,
            num_microbatches=max_inflight if not keep_samples else 1,  # pipeline stages
            num_state_slots=num_state_slots,
        )
        self.rng = random.Random(seed)
        self.worker = FakeWorker(self.rng, block_size, windows)
        self.inflight: list[tuple[StepPlan, dict]] = []
        self.max_inflight = max_inflight
        self.num_added = 0
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.params: dict[str, tuple[int, int | None, int]] = {}

    @rule(
        prompt_len=st.integers(1, 40),
        max_tokens=st.none() | st.integers(1, 12),
        min_tokens=st.integers(0, 3),
        priority=st.integers(0, 3),
        shared_prefix=st.booleans(),
    )
    def add(self, prompt_len, max_tokens, min_tokens, priority, shared_prefix):
        prompt_len = min(prompt_len, self.max_model_len)
        if shared_prefix:  # prefix-cache hits, siblings in one step
            prompt = list(range(100, 100 + prompt_len))
        else:
            prompt = [self.rng.randrange(3, 50) for _ in range(prompt_len)]
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        rid = f"r{self.num_added}"
        self.num_added += 1
        add(self.s, rid, prompt, priority, arrival=float(self.num_added), max_tokens=max_tokens,
            min_tokens=min_tokens, stop_token_ids=[9])  # fmt: skip
        self.outputs[rid] = []
        self.params[rid] = (prompt_len, max_tokens, min_tokens)

    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        live = sorted(self.s.requests)
        rid = live[pick % len(live)] if live and pick % 4 else "unknown"
        self.record(self.s.abort_requests([rid]))

    @rule(picks=st.lists(st.integers(0, 1000), max_size=8))
    def abort_batch(self, picks):
        """One AbortRequests of several ids: running and waiting ones, repeats, unknown ids."""
        live = sorted(self.s.requests)
        ids = [live[p % len(live)] if live and p % 5 else f"unknown{p}" for p in picks]
        deltas = self.s.abort_requests(ids)
        assert sorted(d.req_id for _, d in deltas) == sorted({i for i in ids if i in live})
        self.record(deltas)

    def limit(self) -> int:
        """Plans the engine keeps out: the scheduler's own limit with pipeline stages under async
        scheduling (2P while micro-batches are planned ahead), else the drawn one."""
        return self.s.max_inflight if self.s.plans_ahead else self.max_inflight

    @precondition(lambda self: len(self.inflight) < self.limit())
    @rule()
    def schedule(self):
        chained, num_preemptions = self.s.plans_ahead, self.s.num_preemptions
        plan = self.s.schedule()
        if not plan.scheduled_ids:
            assert not plan.finished_ids and not plan.new_requests and not plan.cached
            return
        assert sum(plan.num_scheduled_tokens) <= self.s.config.max_num_batched_tokens
        assert len(set(plan.scheduled_ids)) == len(plan.scheduled_ids) <= self.s.config.max_num_seqs
        snapshot = {}  # what the core held when planning, for the worker to check against
        for rid, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens, strict=True):
            req = self.s.requests[rid]
            before = req.num_computed_tokens - n
            snapshot[rid] = (list(req.all_token_ids), req.block_ids, before)
            if not self.s.async_scheduling:
                assert req.num_computed_tokens <= req.num_tokens, "fed an unknown token"
            if chained and num_preemptions == self.s.num_preemptions and before >= req.num_tokens:
                self.check_chain(plan, rid)
        self.inflight.append((plan, snapshot))

    def check_chain(self, plan: StepPlan, rid: str) -> None:
        """A row fed a placeholder while micro-batches are planned ahead: its plans in flight
        are at least P apart, in order (the first stage finds each token arrived)."""
        num_stages = self.s.num_microbatches
        steps = [p.step_id for p, _ in self.inflight if rid in p.scheduled_ids]
        assert len(self.inflight) < 2 * num_stages, "more than 2P plans in flight"
        assert not steps or plan.step_id - steps[-1] >= num_stages, (steps, plan.step_id)

    @precondition(lambda self: self.inflight)
    @rule()
    def complete(self):
        plan, snapshot = self.inflight.pop(0)
        tokens = self.worker.execute(plan, snapshot)
        self.record(self.s.update_from_output(plan, StepResult(plan.step_id, tokens)))

    def record(self, deltas):
        for _, d in deltas:
            assert d.req_id not in self.finished, f"{d.req_id} emitted after finishing"
            self.outputs[d.req_id] += d.new_token_ids
            if d.finish_reason is not None:
                self.finished[d.req_id] = d.finish_reason
            else:
                assert self.outputs[d.req_id] == self.s.requests[d.req_id].output_token_ids

    @invariant()
    def consistent(self):
        if hasattr(self, "s"):
            check_invariants(self.s)
            waiting = list(self.s.policy)
            assert len(self.s.policy) == len(waiting)
            if waiting:  # the head past lazily removed requests, in policy order
                assert self.s.policy.peek() is waiting[0]

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(5000):  # drain: every request must finish
            if not self.s.has_unfinished_requests() and not self.inflight:
                break
            if len(self.inflight) < self.limit() and self.s.has_unfinished_requests():
                self.schedule()
            if self.inflight:
                self.complete()
            check_invariants(self.s)
        assert not self.s.has_unfinished_requests() and not self.inflight, self.s.requests
        assert set(self.finished) == set(self.outputs)
        pool = self.s.kv.pool
        assert pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
        states = self.s.states
        assert states is None or states.num_free == states.num_slots, "a state slot leaked"
        for rid, reason in self.finished.items():
            out, (prompt_len, max_tokens, min_tokens) = self.outputs[rid], self.params[rid]
            at_limit = len(out) == max_tokens or prompt_len + len(out) >= self.max_model_len
            assert not (set(out[min_tokens:-1]) & {EOS, 9}), "a stop token did not stop"
            if reason == "stop":
                assert out[-1] in (EOS, 9) and len(out) >= min_tokens
            elif reason == "length":
                assert at_limit


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase


# ---------------------------------------------------------------- results that do not fit
def test_results_that_do_not_fit_their_plan_are_named():
    """The core drops (never asserts on) a result that cannot answer its plan."""
    s = make(budget=8, async_scheduling=True)
    add(s, "a", range(10))
    plan = s.schedule()  # "a" runs 8 of its 10 prompt tokens: nothing is sampled
    assert s.check_result(plan, result_for(s, plan), vocab_size=100) is None
    bad = {
        "no sample lists": StepResult(plan.step_id, []),
        "mid-prompt sample": StepResult(plan.step_id, [[7]]),
        "unknown step": StepResult(plan.step_id + 5, [[]]),
    }
    for name, result in bad.items():
        other = StepPlan(result.step_id, plan.scheduled_ids, plan.num_scheduled_tokens)
        assert s.check_result(other, result, vocab_size=100) is not None, name
    s.update_from_output(plan, result_for(s, plan))
    plan = s.schedule()  # the last 2 prompt tokens: "a" samples
    lp = TokenLogprobs([7, 8], [-0.1], [1, 2])
    bad = [([[100]], None), ([[7, 8]], None), ([[-1]], None), ([[7]], [[lp]]), ([[7]], [[]])]
    for sampled, logprobs in bad:
        result = StepResult(plan.step_id, sampled, logprobs)
        assert s.check_result(plan, result, vocab_size=100) is not None, result
    assert s.check_result(plan, StepResult(plan.step_id, [[7]]), vocab_size=100) is None


def test_async_blocks_of_a_leaving_request_are_cached():
    """Under async scheduling a request's last full block may hold a placeholder when allocated;
    when the request finishes (or is preempted) it is registered all the same, so a follow-up
    that repeats its prompt and outputs (a chat's next turn) hits it."""
    s = make(block_size=4, async_scheduling=True, workers_keep_samples=True)
    add(s, "a", range(10, 15), max_tokens=4, ignore_eos=True)  # computes 5 + 3 = 8 tokens
    plans = [s.schedule(), s.schedule()]
    for token in (7, 8, 9, 11):
        plan = plans.pop(0)
        deltas = s.update_from_output(plan, StepResult(plan.step_id, [[token]]))
        nxt = s.schedule()
        if nxt.scheduled_ids:
            plans.append(nxt)
    assert deltas[0][1].finish_reason == "length" and not plans
    add(s, "b", [*range(10, 15), 7, 8, 9, 11, 12])
    plan = s.schedule()
    assert s.requests["b"].num_cached_tokens == 8, "both full blocks of 'a' are hits"
    assert sched(plan) == {"b": 2}


# ---------------------------------------------------------------- recurrent-state slots
def test_state_slots_bound_admission_and_come_back_on_preemption():
    """A model with linear attention: each running request holds one state slot; admission
    stops when none is free, preemption and finishing give the slot back, and prefix caching is
    off (a hit could not restore the recurrent state)."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        max_model_len=32, num_blocks=12, debug=True, num_state_slots=2,
    )  # fmt: skip
    assert not s.kv.enable_caching
    for rid in "abc":
        add(s, rid, range(10, 18), max_tokens=20)
    plan, _ = step(s)
    assert plan.scheduled_ids == ["a", "b"], "two slots: the third waits"
    assert sorted(nr.state_slot for nr in plan.new_requests) == [0, 1]
    while not s.num_preemptions:  # a and b grow until the 12 blocks run out
        step(s)
    assert s.requests["b"].state_slot is None and s.states.num_free == 1
    plan, _ = step(s)
    assert s.requests["a"].state_slot is not None
    s.abort_requests(["a"])
    assert s.states.num_free == 2


# ---------------------------------------------------------------- prompt logprobs
def _scored(s: Scheduler, plan: StepPlan) -> StepResult:
    """`result_for`, plus one prompt logprob entry per prompt token this step scored (its
    position as the logprob), as the workers score them (worker/prompt_logprobs.py)."""
    res = result_for(s, plan)
    res.prompt_logprobs = []
    for rid, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens, strict=True):
        req = s.requests[rid]
        start = req.num_computed_tokens - n
        end = min(start + n, req.num_prompt_tokens - 1)
        res.prompt_logprobs.append(
            [TokenLogprobs([req.prompt_token_ids[p + 1]], [-p], [1]) for p in range(start, end)]
        )
    return res


def test_prompt_logprobs_gather_over_chunks_and_go_with_the_first_token():
    s = make(budget=4)
    add(s, "a", range(10, 20), prompt_logprobs=0, max_tokens=2)
    deltas = []
    while s.has_unfinished_requests():
        plan = s.schedule()
        deltas += [d for _, d in s.update_from_output(plan, _scored(s, plan))]
    first, last = deltas
    assert [e.logprobs[0] for e in first.prompt_logprobs] == [-p for p in range(9)]
    assert [e.token_ids[0] for e in first.prompt_logprobs] == list(range(11, 20))
    assert last.prompt_logprobs is None


def test_prompt_logprobs_skip_the_prefix_cache_lookup():
    """A hit would skip prompt positions to score: such a request computes its whole prompt
    (its blocks are cached all the same); after its prompt, a preemption may hit again."""
    s = make()
    add(s, "warm", range(9), max_tokens=1)
    step(s)
    add(s, "scored", range(9), max_tokens=1, prompt_logprobs=1)
    plan = s.schedule()
    assert plan.new_requests[0].num_computed_tokens == 0 and sched(plan) == {"scored": 9}
    ((_, d),) = s.update_from_output(plan, _scored(s, plan))
    assert len(d.prompt_logprobs) == 8 and d.num_cached_tokens == 0
    add(s, "plain", range(9), max_tokens=1)
    assert s.schedule().new_requests[0].num_computed_tokens == 8


def test_prompt_logprobs_that_do_not_fit_the_prompt_are_refused():
    s = make()
    add(s, "a", range(3), prompt_logprobs=0)
    plan = s.schedule()
    res = result_for(s, plan)
    res.prompt_logprobs = [[TokenLogprobs([1], [-1.0], [1])] * 3]  # 3 entries, 2 prompt tokens
    assert "prompt logprob" in s.check_result(plan, res, vocab_size=100)
    res.prompt_logprobs = [[TokenLogprobs([1], [-1.0], [1])] * 2]
    assert s.check_result(plan, res, vocab_size=100) is None


class PipelineMachine(SchedulerMachine):
    """SchedulerMachine with P pipeline stages under async scheduling, as the engine keeps them
    (the scheduler's `max_inflight`: 2P while micro-batches are planned ahead): at most 2P
    plans out, a placeholder fed only P plans or more after the request's last plan, and every
    output, stop and block as with one stage."""

    @initialize(
        num_blocks=st.integers(8, 48),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(2, 40),
        max_seqs=st.integers(2, 8),
        caching=st.booleans(),
        num_stages=st.integers(2, 4),
        prompt_lens=st.lists(st.integers(1, 6), min_size=2, max_size=8),
        seed=st.integers(0, 2**32),
    )
    def setup(
        self, num_blocks, block_size, budget, max_seqs, caching, num_stages, prompt_lens, seed
    ):
        SchedulerMachine.setup(self, num_blocks, block_size, budget, max_seqs, "fcfs", caching,
                               num_stages, True, False, [None], None, seed)  # fmt: skip
        for n in prompt_lens:  # a load that fills the stages from the start
            self.add(n, self.rng.choice([None, 12]), 0, 0, False)

    @rule()
    def fill(self):
        """Plan until the engine's limit or an empty plan, as its loop does after a result."""
        while len(self.inflight) < self.limit():
            num = len(self.inflight)
            self.schedule()
            if len(self.inflight) == num:
                return


PipelineMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pipeline_state_machine = PipelineMachine.TestCase
