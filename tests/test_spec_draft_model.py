"""Speculative decoding with a draft model (issue 38): the config checks the draft against the
engine by name, the rejection rule for sampled drafts keeps the target distribution (chi-square),
and through the real engine at --tp 2 greedy output is token for token the same with the draft on
and off, seeded sampling reproduces, and drafts are both accepted and rejected."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaForCausalLM

from pagedserve import LLM
from pagedserve.config import ModelConfig
from pagedserve.ipc.messages import SamplingParams
from pagedserve.speculative_config import SpeculativeConfig
from pagedserve.worker.sampler import Sampler, SamplingRow, target_probs
from pagedserve.worker.spec_verify import verify

from tiny_models import tiny_model_dir


def one_layer_draft(target: str, draft: str) -> str:
    """A one-layer draft cut from `target` into `draft` (its embedding, first layer, norm and
    head, so it agrees with the target often but not always), same tokenizer."""
    if not os.path.isdir(draft):
        model = LlamaForCausalLM.from_pretrained(target)
        model.model.layers = model.model.layers[:1]
        model.config.num_hidden_layers = 1
        model.save_pretrained(draft, safe_serialization=True)
        for name in os.listdir(target):
            if name.startswith(("tokenizer", "special_tokens", "generation_config")):
                shutil.copy(os.path.join(target, name), draft)
    return draft


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny Llama target, and a one-layer draft cut from it."""
    base = tmp_path_factory.getbasetemp()
    target = tiny_model_dir("llama", str(base))
    return target, one_layer_draft(target, os.path.join(str(base), "draft-1layer"))


def draft_spec(draft: str, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, **extra}


# ---------------------------------------------------------------- config
def test_config_checks_the_draft_by_name(dirs, tmp_path):
    target, draft = dirs
    mc = ModelConfig(target)
    with pytest.raises(ValueError, match="'draft_model' needs 'model'"):
        SpeculativeConfig.from_value({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="does not apply to 'draft_model'"):
        SpeculativeConfig.from_value({**draft_spec(draft), "prompt_lookup_max": 3})
    spec = SpeculativeConfig.from_value(draft_spec(draft))
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2 is not implemented"):
        spec.check_engine(mc, 1, 2)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 1 with --tp 2"):
        SpeculativeConfig.from_value(draft_spec(draft, draft_tensor_parallel_size=1)).check_engine(
            mc, 2, 1
        )
    other = shutil.copytree(draft, tmp_path / "other-vocab")
    text = (other / "config.json").read_text().replace('"vocab_size": ', '"vocab_size": 1')
    (other / "config.json").write_text(text)
    with pytest.raises(ValueError, match="vocabulary .* is not the target's"):
        SpeculativeConfig.from_value(draft_spec(str(other))).check_engine(mc, 1, 1)
    spec.check_engine(mc, 1, 1)


# ---------------------------------------------------------------- the rejection rule
def test_rejection_rule_keeps_the_target_distribution():
    """Drafts sampled from a q unlike p, thousands of rows of two drafts: the first new token
    follows p0 (penalties, temperature, top-k), after one accepted draft the second follows p1
    (penalties counting the draft), chi-square; drafts are accepted at min(1, p/q)'s rate."""
    vocab, n = 8, 6000
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, vocab, generator=gen) * 1.5  # the target's logits at 3 positions
    q = torch.softmax(torch.randn(2, vocab, generator=gen), -1)  # the draft's, 2 positions
    params = SamplingParams(temperature=1.0, top_k=6, repetition_penalty=1.3)
    x = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in (0, 1)])
    drafts = x.T.tolist()  # [n][2]
    rows = [SamplingRow(params, [1, 2], [3]) for _ in range(n)]
    v = verify(Sampler(seed=1), base.repeat(n, 1), rows, drafts, False, q.repeat(n, 1))
    firsts = [a[0] for a in v.accepted]
    second = [a for a in v.accepted if len(a) >= 2]  # the first token was an accepted draft
    common = max(set(firsts), key=[a[0] for a in second].count)
    cases = [(firsts, 0, [3]), ([a[1] for a in second if a[0] == common], 1, [3, common])]
    for observed, position, outputs in cases:
        p = target_probs(base[position : position + 1], [SamplingRow(params, [1, 2], outputs)])[0]
        counts = torch.bincount(torch.tensor(observed), minlength=vocab).double()
        keep = p > 0
        assert counts[~keep].sum() == 0  # nothing outside top-k
        expected = p[keep].double() / p[keep].double().sum() * len(observed)
        assert chisquare(counts[keep], expected).pvalue > 1e-3
    # min(1, p/q) accepts a draft x ~ q with probability sum(min(p, q)), more than the p(x) of
    # accepting only drafts the target would sample itself
    p0 = target_probs(base[:1], [SamplingRow(params, [1, 2], [3])])[0]
    rate = float(torch.minimum(p0, q[0]).sum())
    assert abs(len(second) / n - rate) < 4 * (rate * (1 - rate) / n) ** 0.5
    assert float((p0 * q[0]).sum()) < rate - 0.05 and 0.1 < rate < 0.9


# ---------------------------------------------------------------- the engine
def generate(target, spec, prompts, params, **kwargs):
    with LLM(target, device="cpu", dtype="float32", block_size=4, speculative_config=spec,
             **kwargs) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0] for o in outs], llm.last_stats


PROMPTS = [[random.Random(0).randrange(3, 500) for _ in range(20)], list(range(40, 110)),
           [7, 8, 9] * 5, [7, 8, 9] * 5]  # fmt: skip
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=20, top_p=0.9)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, logprobs=2),
    SamplingParams(temperature=0, max_tokens=20),  # its 70-token prompt runs in chunks
    SEEDED,
    SEEDED,  # the seeded row twice: the same tokens (its own noise, whatever the batch)
]


@pytest.fixture(scope="module")
def off(dirs):
    return generate(dirs[0], None, PROMPTS, PARAMS, max_num_batched_tokens=32)[0]


def check_on(on, stats, off):
    for a, b in zip(on[:2], off[:2], strict=True):
        assert a.token_ids == b.token_ids
    for x, y in zip(on[0].logprobs, off[0].logprobs, strict=True):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert on[3].token_ids == on[2].token_ids and len(on[2].token_ids) == 20
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_engine_tp2_same_tokens_and_seeded_reproducible(dirs, off):
    """At --tp 2 (gloo; the draft sharded like the target, every rank drafting alike), greedy
    rows (one with logprobs, one with a long prompt in chunks) give the same tokens with the
    draft on as with it off at tp 1; a seeded random row gives the same tokens twice in one
    batch; drafts were accepted and rejected. (One engine with the draft, for CI time: tp 1 runs
    the same code without the collectives.)"""
    target, draft = dirs
    spec = draft_spec(draft, 3, draft_tensor_parallel_size=2)
    on = generate(target, spec, PROMPTS, PARAMS, max_num_batched_tokens=32, tensor_parallel_size=2)
    check_on(*on, off)
