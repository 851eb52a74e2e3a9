"""The host tier's spill filter (core/spill_filter.py): a stream of unrelated prompts stops
spilling finished requests' blocks, while a preempted request's blocks still spill and come back;
a multi-turn chat keeps spilling (its next turn reads the history). Through the real core at
small shapes (benchmarks/kv_tier_sim.py), and the filter's own rules."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis.stateful import rule
from test_host_tier import TierMachine

from pagedserve.benchmarks.kv_tier_sim import main, multi_turn, parser, w1
from pagedserve.core.spill_filter import PRIOR, SpillFilter, spill_threshold

W1 = ["--num-prompts", "100", "--input-len", "256", "--output-len", "64", "--device-blocks",
      "300", "--host-blocks", "2000", "--max-num-seqs", "64", "--budget", "2048"]  # fmt: skip
MT = ["--workload", "multi-turn", "--num-users", "16", "--device-blocks", "300",
      "--host-blocks", "4000"]  # fmt: skip


def test_unrelated_prompts_spill_only_what_preempted_requests_read_again():
    """W1's shape at a quarter of its KV: with the tier (auto: a lazy swap) no prompt token is
    computed twice, and the blocks copied out are those copied back in and the filter's first
    guesses (before the filter, every evicted block went out: 12x more than came back)."""
    args = parser().parse_args(W1)
    off, auto = w1(args, "off"), w1(args, "auto")
    assert auto["preemptions"] > 0 and auto["into"] > 0
    assert auto["tokens"] < off["tokens"]
    out = auto["out"] + auto["ahead"]
    assert out < auto["into"] + 2 * PRIOR and auto["skipped"] > 2 * out


def test_multi_turn_keeps_spilling_its_histories(capsys):
    """The next turn re-reads the history: the filter stays open and the tier serves most of
    the prompt tokens (the tier off: under a tenth)."""
    args = parser().parse_args(MT)
    off, auto = multi_turn(args, "off"), multi_turn(args, "auto")
    assert auto["cached_tokens"] / auto["prompt_tokens"] > 0.6
    assert off["cached_tokens"] / off["prompt_tokens"] < 0.1
    assert auto["skipped"] == 0
    main(MT + ["--modes", "auto", "--num-users", "4", "--num-turns", "2"])
    assert "multi-turn auto" in capsys.readouterr().out


def test_filter_closes_without_rereads_and_ghost_hits_reopen_it():
    f = SpillFilter(threshold=0.1, window=1000)
    assert f.open and f.admits(b"x")
    spilled = [f.evicted(bytes([i % 256, i // 256]), on_host=False) for i in range(3 * PRIOR)]
    assert all(spilled[: PRIOR // 2]) and not any(spilled[2 * PRIOR :])
    assert not f.open and not f.admits(b"x") and f.num_skipped > PRIOR
    f.want([b"w"])
    assert f.admits(b"w") and f.evicted(b"w", on_host=False) and b"w" not in f.wanted
    # later lookups find what was let go (in a row, from the first key given), once each
    keys = [bytes([i % 256, i // 256]) for i in range(2 * PRIOR, 3 * PRIOR)]
    assert f.ghost_hits(keys) == PRIOR and f.ghost_hits(keys) == 0 and f.open
    assert f.ghost_hits([b"nope", keys[0]]) == 0


def test_spill_threshold_from_the_measured_costs():
    """H100, 8B: 50 us a block copied, 23 us a token's prefill: a spill pays if ~16% are read."""
    assert abs(spill_threshold(50e-6, 16, 23e-6) - 50 / (16 * 23 - 50)) < 1e-9
    assert spill_threshold(0.0, 16, 1e-6) == 0.02 and spill_threshold(1.0, 16, 1e-6) == 0.5


class ClosingFilterMachine(TierMachine):
    """test_host_tier.py's state machine (its fake worker checks every step reads exactly its
    tokens' KV), with a rule that closes the spill filter at any point: spills of wanted blocks
    only, ghosts, and ghost hits reopening it, under the same checks."""

    @rule()
    def close_filter(self):
        tier_filter = self.s.kv.tier.filter
        tier_filter.rereads = 0.0
        assert not tier_filter.open


ClosingFilterMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_closing_filter_state_machine = ClosingFilterMachine.TestCase
