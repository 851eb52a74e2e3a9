"""benchmarks/spec_replay.py (issue 38) replays a greedy output through the ngram proposer and
the core's speculation rules to price each k without an engine per k: its count of
verifications and accepted drafts must be the engine's own."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.benchmarks.spec_replay import cost, replay

from tiny_models import tiny_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tiny_model_dir("llama", tmp_path_factory.mktemp("spec-replay"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(24)] * 3 for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    out = []
    with LLM(path, device="cpu", dtype="float32", max_model_len=512,
             speculative_config=NGRAM) as llm:  # fmt: skip
        for p in prompts:
            before = llm.last_stats
            seen = (before.spec_num_drafts, before.spec_num_accepted_tokens) if before else (0, 0)
            tokens = llm.generate([{"prompt_token_ids": p}], greedy)[0].outputs[0].token_ids
            s = llm.last_stats
            engine = (s.spec_num_drafts - seen[0], s.spec_num_accepted_tokens - seen[1])
            out.append((p, list(tokens), engine))
    return out


def test_replay_counts_what_the_engine_did(runs):
    assert sum(engine[0] for _, _, engine in runs) > 0
    for prompt, tokens, engine in runs:
        steps = replay(prompt, tokens, 3, 2, 3)
        accepted = len(tokens) - 1 - len(steps)  # decode tokens beyond one a step
        assert (sum(1 for s in steps if s), accepted) == engine


def test_cost_interpolates_between_measured_k():
    costs = {0: 10.0, 2: 14.0, 6: 22.0}
    assert cost(costs, 2) == 14.0
    assert cost(costs, 4) == 18.0
    assert cost(costs, 9) == 22.0  # beyond the last measured: its cost
