"""The host KV tier in the core (core/host_pool.py, core/kv_tier.py, core/swapping.py): unit tests,
then the scheduler's state machine with the tier on and a fake worker that keeps what every
device and host block slot holds, executes each plan's copies, and checks that every step reads
exactly the KV of its request's tokens: no block lost or in two states, every swapped request
resumable with its KV intact, budgets respected."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from test_scheduler import FakeWorker, SchedulerMachine, add, result_for

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.host_pool import HostPool
from pagedserve.core.invariants import check_invariants
from pagedserve.core.kv_tier import TierSpec
from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.ipc.messages import StepPlan


def make(
    num_blocks: int, num_host_blocks: int, mode: str | None = "swap", caching: bool = True, **kw
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        CacheConfig(block_size=4, enable_prefix_caching=caching),
        max_model_len=32,
        num_blocks=num_blocks,
        debug=True,
        host_tier=TierSpec(num_host_blocks, 1e-4, 1e-3, 100, mode),
        **kw,
    )


def run(s: Scheduler) -> list[StepPlan]:
    plans = []
    while s.has_unfinished_requests():
        plan = s.schedule()
        plans.append(plan)
        if plan.scheduled_ids:
            s.update_from_output(plan, result_for(s, plan))
    return plans


def test_host_pool_lru_refs_and_reset():
    pool = HostPool(3)
    a, b = pool.allocate(2)
    pool.set_hash(a, b"a")
    pool.set_hash(b, b"b")
    pool.unref([a, b])  # both cached: a is the least recently used
    pool.touch(a)
    (c,) = pool.allocate(1)  # the free one first
    (d,) = pool.allocate(1)  # then the LRU: b
    assert d == b and pool.lookup(b"b") is None and pool.lookup(b"a") == a
    with pytest.raises(ValueError, match="host blocks"):
        pool.allocate(2)
    pool.unref([c, d])
    pool.reset()
    assert pool.lookup(b"a") is None and pool.num_free == 3
    pool.check([])


def test_preemption_swaps_out_and_resumes_with_the_same_kv():
    """9 blocks of 4: two requests of 16-token prompts cannot both decode; the later one is
    swapped out (its 4 blocks to the host), resumes from its 15 computed tokens."""
    s = make(num_blocks=9, num_host_blocks=8)
    add(s, "a", range(10, 26), max_tokens=8)
    add(s, "b", range(30, 46), max_tokens=8)
    plans = run(s)
    outs = [p for p in plans if p.kv_to_host]
    ins = [p for p in plans if p.kv_from_host]
    assert outs and ins and s.num_preemptions >= 1
    assert s.get_stats().kv_swap_out_bytes >= 400 and s.get_stats().num_swapped == 0
    resumed = next(nr for p in ins for nr in p.new_requests if nr.req_id == "b")
    assert resumed.num_computed_tokens >= 15  # kept, not recomputed
    assert s.kv.tier.pool.num_free == 8


def test_swap_in_takes_blocks_still_cached_on_the_device():
    """b's first 3 blocks outlive its swap-out in the GPU prefix cache: resuming copies in only
    its 4th (a swap-in is no dearer than a recompute's prefix hits)."""
    s = make(num_blocks=9, num_host_blocks=8)
    add(s, "a", range(10, 26), max_tokens=8)
    add(s, "b", range(30, 46), max_tokens=8)
    plans = run(s)
    (resume,) = [p for p in plans if any(nr.req_id == "b" for nr in p.new_requests)][1:]
    assert resume.new_requests[0].num_computed_tokens == 16 and len(resume.kv_from_host) == 1


def test_cost_model():
    """Auto mode: with the prefix cache on, recompute (a lazy swap); without it, the cheaper."""
    s = make(num_blocks=9, num_host_blocks=8, mode=None)
    assert not s.kv.tier.prefers_swap(4, 16, caching=True)
    assert s.kv.tier.prefers_swap(4, 16, caching=False)  # 8e-4 s of copies < 1.6e-2 s of compute
    s.kv.tier.spec = TierSpec(8, 1.0, 1e-9, 100, None)
    assert not s.kv.tier.prefers_swap(4, 16, caching=False)


def test_recompute_mode_and_cost_model_choose_recompute():
    for mode, spec in [("recompute", None), (None, (1.0, 1e-9))]:
        s = make(num_blocks=9, num_host_blocks=8, mode=mode, caching=False)  # no spills
        if spec is not None:
            s.kv.tier.spec = TierSpec(8, *spec, 100, None)  # copying is dear: recompute
        add(s, "a", range(10, 26), max_tokens=8)
        add(s, "b", range(30, 46), max_tokens=8)
        plans = run(s)
        assert s.num_preemptions >= 1 and not any(p.kv_from_host for p in plans)


def test_evicted_prefix_spills_to_host_and_hits_there():
    s = make(num_blocks=8, num_host_blocks=16)
    add(s, "a", range(10, 27), max_tokens=1)  # 4 full blocks cached
    run(s)
    add(s, "b", range(50, 82), max_tokens=1)  # takes all 8 blocks: a's spill
    run(s)
    add(s, "c", range(10, 27), max_tokens=1)
    plans = run(s)
    assert plans[0].kv_from_host and plans[0].new_requests[0].num_computed_tokens == 16
    assert s.get_stats().host_cache_hits == 16
    assert s.requests == {} and s.kv.prefix_cache_hits >= 16


def test_free_cached_blocks_spill_ahead_of_their_eviction():
    """a's 4 cached blocks, free once it finished, are copied out beside c's step (not before
    it); b's step then evicts them without a copy; a again hits them on the host."""
    s = make(num_blocks=8, num_host_blocks=16)
    add(s, "a", range(10, 27), max_tokens=1)
    run(s)
    add(s, "c", range(90, 93), max_tokens=1)
    (plan_c,) = run(s)
    assert len(plan_c.kv_to_host_ahead) == 4 and not plan_c.kv_to_host
    add(s, "b", range(50, 82), max_tokens=1)  # takes all 8 blocks
    assert not any(p.kv_to_host for p in run(s))
    add(s, "a2", range(10, 27), max_tokens=1)
    plans = run(s)
    assert plans[0].kv_from_host and s.get_stats().host_cache_hits == 16


def test_abort_of_a_swapped_request_frees_its_host_blocks():
    s = make(num_blocks=9, num_host_blocks=8)
    add(s, "a", range(10, 26), max_tokens=20)
    add(s, "b", range(30, 46), max_tokens=20)
    while not s.swapped:
        plan = s.schedule()
        s.update_from_output(plan, result_for(s, plan))
    (req,) = s.swapped
    s.abort_requests([req.req_id])
    assert req.status == RequestStatus.FINISHED_ABORTED and not s.swapped
    check_invariants(s)
    run(s)
    assert s.kv.tier.pool.num_free == 8


def test_tier_refuses_windowed_models():
    with pytest.raises(ValueError, match="kv-offloading-size"):
        make(num_blocks=9, num_host_blocks=8, group_windows=[None, 4])


@dataclass
class ContentWorker(FakeWorker):
    """Each device and host slot holds (position, token) of the KV written there."""

    device: dict[int, list] = field(default_factory=dict)
    host: dict[int, list] = field(default_factory=dict)

    def execute(self, plan: StepPlan, snapshot: dict) -> list[list[int]]:
        empty = [None] * self.block_size
        for dev, host in plan.kv_to_host:
            self.host[host] = list(self.device.get(dev, empty))
        for host, dev in plan.kv_from_host:
            self.device[dev] = list(self.host[host])
        ahead = {dev: list(self.device.get(dev, empty)) for dev, _ in plan.kv_to_host_ahead}
        sampled = super().execute(plan, snapshot)
        rows = list(zip(plan.scheduled_ids, plan.num_scheduled_tokens, strict=True))
        bs = self.block_size
        for rid, n in rows:  # every layer writes the step's K/V before attending
            m, before = self.batch[rid], snapshot[rid][2]
            for p in range(before, before + n):
                self.device.setdefault(m.block_ids[0][p // bs], list(empty))[p % bs] = (
                    p, m.tokens[p])  # fmt: skip
        for dev, host in plan.kv_to_host_ahead:  # beside the forward: it must not write them
            assert self.device.get(dev, empty) == ahead[dev], f"the step wrote block {dev}"
            self.host[host] = ahead[dev]
        for rid, n in rows:
            m, before = self.batch[rid], snapshot[rid][2]
            for p in range(before + n):
                got = self.device[m.block_ids[0][p // bs]][p % bs]
                assert got == (p, m.tokens[p]), f"{rid} reads {got} at {p}, not {m.tokens[p]}"
        return sampled


class TierMachine(SchedulerMachine):
    @initialize(
        num_blocks=st.integers(4, 16),
        num_host_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(1, 40),
        max_seqs=st.integers(1, 6),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
        max_inflight=st.integers(1, 3),
        async_scheduling=st.booleans(),
        keep_samples=st.booleans(),
        mode=st.sampled_from([None, "swap", "recompute"]),
        costs=st.tuples(st.floats(0, 1), st.floats(0, 1)),
        seed=st.integers(0, 2**32),
    )
    def setup(self, num_blocks, num_host_blocks, block_size, budget, max_seqs, policy, caching,
              max_inflight, async_scheduling, keep_samples, mode, costs, seed):  # fmt: skip
        self.max_model_len = min(num_blocks * block_size, 40)
        self.s = Scheduler(
            SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy),
            CacheConfig(block_size=block_size, enable_prefix_caching=caching),
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            debug=True,
            async_scheduling=async_scheduling,
            workers_keep_samples=keep_samples,
            num_microbatches=max_inflight if not keep_samples else 1,
            host_tier=TierSpec(num_host_blocks, *costs, 1, mode),
        )
        self.rng = random.Random(seed)
        self.worker = ContentWorker(self.rng, block_size, [None])
        self.inflight = []
        self.max_inflight = max_inflight
        self.num_added = 0
        self.outputs, self.finished, self.params = {}, {}, {}

    def teardown(self):
        super().teardown()
        if hasattr(self, "s"):
            pool = self.s.kv.tier.pool
            assert pool.num_free == pool.num_blocks, "a host block leaked"


TierMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tier_state_machine = TierMachine.TestCase


def test_worker_copies_round_trip_through_the_staging_buffer():
    """worker/host_tier.py: more blocks than one staged chunk, layers sharing a slot, a layer
    without KV, ids out of order: what goes out comes back into the blocks named, in every layer,
    through one gather (scatter) over all layers per chunk and one host copy per run of host
    blocks."""
    torch = pytest.importorskip("torch")
    from pagedserve.worker.host_tier import (
        STAGING_BLOCKS,
        HostKVTier,
        host_tier_blocks,
        new_kv_caches,
    )

    stack, caches = new_kv_caches([0, 0, None, 3], (60, 2, 4, 2, 8), torch.float32, "cpu")
    a, b = caches[0], caches[3]
    assert stack.shape == (2, 60, 2, 4, 2, 8) and caches[1] is a and caches[2] is None
    assert a.data_ptr() == stack.data_ptr() and b.data_ptr() == stack[1].data_ptr()
    gen = torch.Generator().manual_seed(0)
    stack.copy_(torch.randn(stack.shape, generator=gen))
    tier = HostKVTier(stack, 70)
    assert tier.block_bytes == 2 * a[0].numel() * 4 and host_tier_blocks(1e-6, 1024) == 1
    n = STAGING_BLOCKS + 5
    want_a, want_b = a[:n].clone(), b[:n].clone()
    tier.copy([(i, 69 - i) for i in range(n)], [])  # sorted by host block: 2 runs, not n
    assert tier.num_host_copies == 2
    for i in range(n):
        assert torch.equal(tier.host[69 - i, 0], want_a[i]) and torch.equal(
            tier.host[69 - i, 1], want_b[i]
        )
    stack.zero_()
    tier.copy([], [(69 - i, (i * 7) % 60) for i in range(n)])
    for i in range(n):
        assert torch.equal(a[(i * 7) % 60], want_a[i]) and torch.equal(b[(i * 7) % 60], want_b[i])
    assert stack.count_nonzero() == 2 * n * a[0].numel()  # no other block written


def test_worker_spills_ahead_after_the_plans_copies():
    """worker/host_tier.py: `ahead` pairs go out after the plan's own copies (on CPU, in order:
    a block filled by the plan's copy in is spilled with its new content) and are counted."""
    torch = pytest.importorskip("torch")
    from pagedserve.worker.host_tier import HostKVTier

    gen = torch.Generator().manual_seed(1)
    stack = torch.randn(1, 8, 2, 4, 2, 8, generator=gen)
    a = stack[0]
    tier = HostKVTier(stack, 6)
    tier.copy([(3, 0)], [], [])
    want = a[3].clone()
    tier.copy([], [(0, 5)], [(5, 4), (6, 2)])
    assert torch.equal(tier.host[4, 0], want) and torch.equal(tier.host[2, 0], a[6])
    assert (tier.num_plans, tier.num_out, tier.num_in) == (2, 3, 1)


def test_start_up_line_states_the_preemption_choice():
    """core/kv_tier.py: the cost model's per-block figures and its choice, as logged."""
    from pagedserve.core.kv_tier import TierSpec, describe_costs

    spec = TierSpec(num_blocks=8, swap_s_per_block=50e-6, recompute_s_per_token=30e-6)
    text = describe_costs(spec, 16, caching=False)
    assert "swap out and in 100.0 us, recompute >= 480.0 us; chosen: swap" in text
    assert describe_costs(spec, 2, caching=False).endswith("chosen: recompute")
    assert "lazy swap" in describe_costs(spec, 16, caching=True)
    assert describe_costs(spec, 16, caching=True).endswith(">= 12% of them are read again")
    forced = TierSpec(num_blocks=8, mode="recompute")
    assert describe_costs(forced, 16, caching=False).endswith("--preemption-mode recompute")


def test_runner_kv_caches_are_views_of_the_tiers_one_tensor(tmp_path):
    """worker/model_runner.py: each layer's KV cache is a view of one tensor (`kv_stack`), the
    one the host tier gathers from: a block copied out holds every layer's KV of that block, in
    layer order, and comes back into another block of every layer."""
    torch = pytest.importorskip("torch")
    from pagedserve.frontend.llm import build_engine_config
    from pagedserve.parallel.groups import rank_info
    from pagedserve.worker.model_runner import ModelRunner

    from tiny_models import make_tiny_model

    path = make_tiny_model("llama", str(tmp_path / "llama"))
    config = build_engine_config(
        path,
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_offloading_size=0.001,
        enforce_eager=True,  # no background CPU compile
    )
    runner = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    runner.init_cache(12, runner.num_host_blocks())
    stack, caches = runner.kv_stack, runner.kv_caches
    assert stack.shape[:2] == (len(caches), 12) and len(caches) > 1
    assert [c.data_ptr() for c in caches] == [stack[i].data_ptr() for i in range(len(caches))]
    for i, c in enumerate(caches):
        c.fill_(i + 1)
        c[5] = -(i + 1)
    runner.host_tier.copy([(5, 3)], [])
    runner.host_tier.copy([], [(3, 9)])
    for i, c in enumerate(caches):
        assert torch.equal(runner.host_tier.host[3, i], c[5])
        assert torch.equal(c[9], c[5]) and bool((c[8] == i + 1).all())
