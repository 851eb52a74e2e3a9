"""The drafter's own CUDA graphs (issue 38, worker/draft_graphs.py), what a CPU can check: the
replays' layout from a step (positions, slots, lengths; rows past their drafts write nowhere),
the bucket choice and the eager fallback, and, on the tiny Llama with a draft model and with an
EAGLE head, drafts through the graphs' static buffers equal the eager drafts, step after step,
with the same KV cache written. On a CPU a graph cannot be captured: `EagerReplay` stands in
for one (its replay runs the captured forward over what the static buffers hold), so every
buffer the graphs read is filled and fed back exactly as on a GPU
(tests/test_spec_draft_graphs_gpu.py runs the real capture)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_spec_eagle import write_head
from test_spec_eagle3 import write_head3

from pagedserve.frontend.engine_args import build_engine_config
from pagedserve.ipc.messages import SamplingParams
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.settings import Settings
from pagedserve.tests.gpu.draft_graphs_bench import step_inputs as bench_step_inputs
from pagedserve.worker.draft_graphs import DraftGraphs, replay_plan
from pagedserve.worker.draft_model import DraftRunner
from pagedserve.worker.eagle import EagleRunner
from pagedserve.worker.eagle3 import Eagle3Runner
from pagedserve.worker.input_batch import StepInputs
from pagedserve.worker.models import build_model
from pagedserve.worker.sampler import Sampler, SamplingRow

from tiny_models import tiny_model_dir

BLOCK, MAX_LEN = 4, 64
PER_ROW = MAX_LEN // BLOCK  # blocks a row owns (row b: blocks b * PER_ROW ..)


def step_inputs(rows: list[tuple[int, int, list[int]]], k: list[int] | None = None) -> StepInputs:
    """A step of rows (batch row id, tokens computed before, tokens now); `k`: each row's
    drafts (the last k of its tokens), all rows sampling; None: a prompt step."""
    return bench_step_inputs(rows, k, PER_ROW, BLOCK)


def test_replay_plan_layout():
    """Replay j of a row reads its token j; past its last draft it holds its last position and
    writes nowhere; padding rows sit at position 0, write nowhere, attend one token."""
    inputs = step_inputs([(0, 5, [1, 2, 3, 4]), (1, 9, [5, 6]), (2, 2, [7, 8, 9])], [3, 1, 2])
    first = np.array([1, 5, 7])  # each row's first draft (its k drafts end the row)
    positions, slots, seq_lens = replay_plan(inputs, first, np.array([3, 1, 2]), 4)
    assert positions.tolist() == [[6, 10, 3, 0], [7, 10, 4, 0], [8, 10, 4, 0]]
    s = inputs.slot_mapping
    assert slots.tolist() == [[s[1], s[5], s[7], -1], [s[2], -1, s[8], -1], [s[3], -1, -1, -1]]
    assert seq_lens.tolist() == [[7, 11, 4, 1], [8, 11, 5, 1], [9, 11, 5, 1]]
    assert s[1] == 0 * PER_ROW * BLOCK + 6 and s[5] == 1 * PER_ROW * BLOCK + 10
    # EAGLE: draft j fed back at n + j - 1 while a row has more to make (k - 1 replays); a row
    # of one draft replays nothing of its own, at its known token
    positions, slots, _ = replay_plan(inputs, first - 1, np.array([2, 0, 1]), 4)
    assert positions.tolist() == [[5, 9, 2, 0], [6, 9, 2, 0]]
    assert slots.tolist() == [[s[0], -1, s[6], -1], [s[1], -1, -1, -1]]


def test_buckets_and_eager_fallback():
    """The target's decode buckets up to max_num_seqs; a step's rows pad up to the smallest
    that holds them, and more rows than the largest (or none to replay) draft eagerly."""
    graphs = DraftGraphs(None, 6, PER_ROW, MAX_LEN, BLOCK, torch.device("cpu"))
    assert graphs.decode.sizes == [6, 4, 2, 1]
    rows = [(b, 3, [1, 2, 3]) for b in range(7)]
    inputs = step_inputs(rows, [2] * 7)
    first = inputs.query_start_loc[1:].astype(np.int64) - 2
    plan = graphs.plan(inputs, np.arange(3), first[:3], np.full(3, 2))
    assert plan.key == (4, False) and plan.num_rows == 3
    assert plan.first.positions.tolist() == [4, 4, 4] and plan.first.block_tables.shape[0] == 3
    assert plan.later64.shape == (1, 2, 4) and plan.later32.tolist() == [[6, 6, 6, 1]]
    assert graphs.plan(inputs, np.arange(7), first, np.full(7, 2)) is None  # past 6 rows
    assert graphs.plan(inputs, np.arange(2), first[:2] - 1, np.zeros(2, np.int64)) is None
    decode_step = step_inputs([(b, 3, [1]) for b in range(7)])
    assert graphs.forward(decode_step, torch.zeros(7, dtype=torch.int64)) is None  # 7 rows
    prompt = step_inputs([(0, 0, [1, 2, 3])])
    assert graphs.forward(prompt, torch.zeros(3, dtype=torch.int64)) is None  # not a token a row


class EagerReplay:
    """A captured graph's stand-in on a CPU: `replay` runs the graph's forward over what the
    static buffers hold now (the host copies the CPU kernels read taken from them) into the
    graph's output buffer."""

    def __init__(self, graphs, key) -> None:
        self.graphs, self.key, self.count = graphs, key, 0

    def replay(self) -> None:
        g, size = self.graphs, self.key[0]
        meta = AttentionMetadata.from_host(
            g.slot_mapping[:size].numpy().copy(), np.arange(size + 1, dtype=np.int32),
            g.seq_lens[:size].numpy().copy(), g.block_tables[:size].numpy().copy(), BLOCK,
            torch.from_numpy,
        )  # fmt: skip
        out = g._graph_forward(self.key, g.input_ids[:size], g.positions[:size], meta)
        g.outputs[self.key][0].copy_(out[0])
        self.count += 1


def cpu_graphs(runner: DraftRunner, max_batch: int) -> DraftGraphs:
    graphs = DraftGraphs(
        runner._graph_forward, max_batch, PER_ROW, MAX_LEN, BLOCK, torch.device("cpu"),
        runner._graph_hidden(),
    )  # fmt: skip
    hidden = int(runner.mc.hf["hidden_size"])
    for key in graphs.decode.keys:
        graphs.decode.graphs[key] = EagerReplay(graphs.decode, key)
        graphs.decode.outputs[key] = (torch.zeros(key[0], hidden),)
    return graphs


def make_runner(target: str, spec: dict, device: torch.device) -> DraftRunner:
    config = build_engine_config(
        target, device=device.type, dtype="float32", block_size=BLOCK, max_model_len=MAX_LEN,
        max_num_seqs=8, speculative_config=spec, enforce_eager=spec["method"] == "eagle3",
    )  # fmt: skip
    sampler = Sampler(seed=0, device=device)
    if spec["method"] in ("eagle", "eagle3"):
        model = build_model(config.model, torch.float32, device)
        cls = Eagle3Runner if spec["method"] == "eagle3" else EagleRunner
        runner = cls(config, torch.float32, device, sampler, model)
    else:
        runner = DraftRunner(config, torch.float32, device, sampler)
    runner.init_cache(8 * PER_ROW)
    return runner


GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=0.8, seed=3, top_k=40)  # its own noise: the same twice
PROMPTS = [[3 + (b * 37 + j * 11) % 400 for j in range(n)] for b, n in enumerate([6, 9, 3, 12, 7])]
# (batch rows, drafts of each, tokens accepted since its last step): 4 speculating rows (bucket
# 4 of 4, 2, 1), 3 of them with new lengths and a one-token pair a row, 5 (eager: past 4), 1
STEPS = [([0, 1, 2, 3, 4], [3, 1, 0, 2, 3]), ([0, 1, 3], [2, 3, 1]), ([0, 1, 2, 3, 4], [1] * 5),
         ([2], [3])]  # fmt: skip


EXPECTED_REPLAYS = {"draft_model": [3, 4, 0, 4], "eagle": [2, 3, 0, 3], "eagle3": [2, 2, 0, 2]}


def run_steps(runner: DraftRunner, graphs: DraftGraphs, hidden_seed: int = 0) -> list[int]:
    """The prompts, then STEPS, each drafted eagerly and then through `graphs` from the same
    state: the same drafts (and q of the seeded row) and the same KV cache. Each step's rows
    accept nothing (their next token follows their last known one). Each step's replays."""
    gen = torch.Generator().manual_seed(hidden_seed)
    hidden = int(runner.mc.hf["hidden_size"])  # (an EAGLE head's is the target's)
    dev = runner.device
    done = [len(p) for p in PROMPTS]
    ids = [f"r{b}" for b in range(len(PROMPTS))]
    prompt = step_inputs([(b, 0, p) for b, p in enumerate(PROMPTS)])
    assert runner.run(prompt, None, {}, ids) is None
    last, last_ids = prompt, ids
    replays = []
    for rows, k in STEPS:
        if isinstance(runner, EagleRunner):  # the target's states of the last step
            states = [torch.randn(len(last.input_ids), hidden, generator=gen).to(dev)
                      for _ in range(3)]  # fmt: skip
            if isinstance(runner, Eagle3Runner):  # (its hooks keep three layers' inputs)
                runner.aux = states
            runner.after_target(last_ids, last, None, states[0])
        tokens = [(b, done[b], [5 + b] + [0] * n) for b, n in zip(rows, k, strict=True)]
        step = step_inputs(tokens, k)
        sampling = {i: SamplingRow(SEEDED if b == 1 else GREEDY, PROMPTS[b], [4] * done[b])
                    for i, b in enumerate(rows)}  # fmt: skip
        step_ids = [ids[b] for b in rows]
        kept = dict(getattr(runner, "rows", {}))
        before = [c.clone() for c in runner.kv_caches]
        runner.graphs = None
        eager = runner.run(step, None, sampling, step_ids)
        after = [c.clone() for c in runner.kv_caches]
        for c, b in zip(runner.kv_caches, before, strict=True):
            c.copy_(b)
        if kept:
            runner.rows.update(kept)
        count = sum(g.count for g in graphs.decode.graphs.values())
        runner.graphs = graphs
        graphed = runner.run(step, None, sampling, step_ids)
        replays.append(sum(g.count for g in graphs.decode.graphs.values()) - count)
        assert graphed.token_ids.tolist() == eager.token_ids.tolist(), (rows, k)
        assert (graphed.probs is None) == (eager.probs is None) == (1 not in rows)
        if eager.probs is not None:  # the seeded row's q
            torch.testing.assert_close(graphed.probs, eager.probs, atol=1e-5, rtol=1e-4)
        for c, a in zip(runner.kv_caches, after, strict=True):
            torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-4)
        for b in rows:
            done[b] += 1
        last, last_ids = step, step_ids
    return replays


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir("llama", str(tmp_path_factory.getbasetemp()))


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_graphed_drafts_equal_eager(target, method, tmp_path_factory):
    """The draft model (the target itself as its draft), an EAGLE and an EAGLE-3 head, a greedy
    and a seeded row among others: each step's drafts, the seeded row's q and the KV cache
    written are those of eager drafting, steps of 4, 3, 5 and 1 speculating rows with buckets of
    4, 2 and 1."""
    base, model = str(tmp_path_factory.getbasetemp()), target
    if method == "eagle":
        model = write_head(target, os.path.join(base, "head-g"))
    elif method == "eagle3":
        model = write_head3(target, os.path.join(base, "head3-g"))
    spec = {"method": method, "model": model, "num_speculative_tokens": 3}
    runner = make_runner(target, spec, torch.device("cpu"))
    replays = run_steps(runner, cpu_graphs(runner, 4))
    # draft model: one replay a draft, and forward 0 (a token a row) where a bucket holds its
    # rows (not 5); EAGLE: one a draft but the last, and the pairs where each row has one (not
    # after the prompt; EAGLE-3's pairs read 3H: eager); the step of 5 speculating rows, eager
    assert replays == EXPECTED_REPLAYS[method], replays


def test_setting_is_on_by_default():
    """PAGEDSERVE_DRAFT_CUDA_GRAPHS: on unless 0 (since its GPU test passed on an H100); any
    other value is refused by name; a CPU never captures."""
    assert Settings.from_env({}).draft_cuda_graphs
    assert not Settings.from_env({"PAGEDSERVE_DRAFT_CUDA_GRAPHS": "0"}).draft_cuda_graphs
    with pytest.raises(ValueError, match="PAGEDSERVE_DRAFT_CUDA_GRAPHS='yes'"):
        Settings.from_env({"PAGEDSERVE_DRAFT_CUDA_GRAPHS": "yes"})
