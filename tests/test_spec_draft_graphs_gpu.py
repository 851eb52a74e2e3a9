"""On a GPU: the drafter's own CUDA graphs (worker/draft_graphs.py, PAGEDSERVE_DRAFT_CUDA_GRAPHS)
captured for real draft what eager drafting drafts, at float32. The model runner's drafter
alone (the steps of tests/test_spec_draft_graphs.py: buckets of 4, 2 and 1, a step past the
largest, replays with new lengths): the same drafts, the seeded row's q and the same KV cache;
and the engine: greedy output with the graphs on equals their off and speculation off, at batch
sizes 1, 3 and 8, for a draft model, an EAGLE and an EAGLE-3 head. Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch
from test_spec_draft_graphs import EXPECTED_REPLAYS, PER_ROW, make_runner, run_steps
from test_spec_draft_model import one_layer_draft
from test_spec_eagle import write_head
from test_spec_eagle3 import write_head3

from pagedserve import LLM
from pagedserve.frontend.engine_args import build_engine_config
from pagedserve.ipc.messages import SamplingParams
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.model_runner import ModelRunner

from tiny_models import tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


class CountingGraph:
    """A captured graph that counts its replays."""

    def __init__(self, graph) -> None:
        self.graph, self.count = graph, 0

    def replay(self) -> None:
        self.graph.replay()
        self.count += 1


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny Llama, and what drafts for it by method: a one-layer draft cut from it, an
    EAGLE and an EAGLE-3 head."""
    base = str(tmp_path_factory.getbasetemp())
    target = tiny_model_dir("llama", base)
    return target, {
        "draft_model": one_layer_draft(target, os.path.join(base, "draft-1layer")),
        "eagle": write_head(target, os.path.join(base, "eagle-head-g")),
        "eagle3": write_head3(target, os.path.join(base, "eagle3-head-g")),
    }


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_captured_drafts_equal_eager(dirs, method):
    target, models = dirs
    spec = {"method": method, "model": models[method], "num_speculative_tokens": 3}
    runner = make_runner(target, spec, torch.device("cuda"))
    runner.max_num_seqs = 4  # buckets 4, 2, 1 as on the CPU (the step of 5 rows: eager)
    runner.capture_graphs(PER_ROW)
    graphs = runner.graphs
    for key, graph in list(graphs.decode.graphs.items()):
        graphs.decode.graphs[key] = CountingGraph(graph)
    replays = run_steps(runner, graphs)
    assert replays == EXPECTED_REPLAYS[method], replays


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_model_runner_captures_them(dirs, method, monkeypatch):
    """With the setting on, the worker's model runner captures the drafter's graphs after the
    target's (off: none); EAGLE-3's head though its target runs eager (--enforce-eager)."""
    target, models = dirs
    spec = {"method": method, "model": models[method], "num_speculative_tokens": 3}
    eager = method == "eagle3"
    for on in ("0", "1"):
        monkeypatch.setenv("PAGEDSERVE_DRAFT_CUDA_GRAPHS", on)
        config = build_engine_config(
            target, dtype="float32", max_model_len=256, max_num_seqs=8,
            max_num_batched_tokens=256, speculative_config=spec, enforce_eager=eager,
        )  # fmt: skip
        runner = ModelRunner(config, torch.device("cuda", 0), rank_info(config.parallel, 0))
        runner.init_cache(64)
        assert (runner.graphs is None) == eager
        assert runner.features.draft_cuda_graphs == (on == "1")
        graphs = runner.drafter.graphs
        assert graphs is None if on == "0" else graphs.decode.sizes == [8, 4, 2, 1]
        del runner


def generate(target, spec, graphs: str | None, batches, **kw) -> list[list[list[int]]]:
    if graphs is not None:
        os.environ["PAGEDSERVE_DRAFT_CUDA_GRAPHS"] = graphs
    try:
        with LLM(target, dtype="float32", speculative_config=spec, max_model_len=256,
                 max_num_seqs=8, max_num_batched_tokens=256,
                 gpu_memory_utilization=0.3, **kw) as llm:  # fmt: skip
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            out = []
            for prompts in batches:
                got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                out.append([o.outputs[0].token_ids for o in got])
            stats = llm.last_stats
    finally:
        os.environ.pop("PAGEDSERVE_DRAFT_CUDA_GRAPHS", None)
    if spec is not None:  # drafts, and (but the random EAGLE-3 head's) some accepted
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, (spec, stats)
        assert stats.spec_num_accepted_tokens > 0 or spec["method"] == "eagle3", (spec, stats)
    return out


BATCHES = [
    [list(range(40, 70))],
    [[7, 8, 9] * 5, list(range(100, 190)), [5, 6]],
    [[3 + (i * 29 + j * 13) % 400 for j in range(8 + 9 * i)] for i in range(8)],
]


def test_engine_greedy_same_with_draft_graphs(dirs):
    """Greedy output with the drafter's graphs on equals their off and speculation off (EAGLE-3:
    its target eager, as it needs, in every arm)."""
    target, models = dirs
    for method in ("draft_model", "eagle", "eagle3"):
        kw = {"enforce_eager": True} if method == "eagle3" else {}
        if method != "eagle":  # (eagle's off arm is the draft model's)
            off = generate(target, None, None, BATCHES, **kw)
        spec = {"method": method, "model": models[method], "num_speculative_tokens": 3}
        assert generate(target, spec, "0", BATCHES, **kw) == off, method
        assert generate(target, spec, "1", BATCHES, **kw) == off, method
