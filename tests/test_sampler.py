"""Sampler semantics (vLLM's): greedy, seeded reproducibility, top-k/top-p/min-p, penalties,
min_tokens, logprobs, and that temperature-1 sampling follows softmax."""

from __future__ import annotations

import math

import pytest
import torch
from triton_env import HAS_CUDA, needs_triton, tiny

from pagedserve.ipc.messages import SamplingParams
from pagedserve.worker.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    block_race,
    filtered_probs,
    race_block,
)

V = 32


def row(output=(), prompt=(1, 2), eos=None, **params) -> SamplingRow:
    eos_ids = () if eos is None else (eos,)
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), eos_ids)


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_for(5)
    out = Sampler().sample(logits, [row(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_seeded_sampling_reproducible_and_batch_independent():
    logits = logits_for(4)
    seeded = row(temperature=1.0, seed=42, output=[5, 6])
    alone = [Sampler(seed=s).sample(logits[2:3], [seeded]).token_ids[0] for s in range(3)]
    assert len(set(alone)) == 1
    batch = [row(temperature=1.0), row(temperature=0.0), seeded, row(temperature=0.7, seed=1)]
    in_batch = Sampler(seed=9).sample(logits, batch).token_ids[2]
    assert in_batch == alone[0]
    # A different step (number of generated tokens) draws different noise.
    steps = {
        Sampler().sample(logits[2:3], [row(temperature=1.0, seed=42, output=[0] * k)]).token_ids[0]
        for k in range(20)
    }
    assert len(steps) > 1


def test_seeded_draw_ignores_last_bit_noise():
    """Issue 33, finding 12: logits that differ by a relative 1e-6 (another batch shape, a
    prefix-cache hit) give a seeded row the same token. Half the mass on one token and the rest
    over 32k unlikely ones, where a draw by inverse cumulative sum moved on 6 of these rows."""
    gen = torch.Generator().manual_seed(0)
    vocab, num_rows = 32768, 256
    logits = torch.randn(num_rows, vocab, generator=gen) * 0.5
    logits[:, 0] = math.log(vocab)  # about half the mass
    noise = (torch.rand(logits.shape, generator=gen) - 0.5) * 2e-6
    rows = [row(temperature=1.0, seed=5, output=[0] * k) for k in range(num_rows)]
    drawn = Sampler().sample_ids(logits, rows)
    assert (drawn != 0).sum() > num_rows // 3  # many draws land in the tail
    assert torch.equal(Sampler().sample_ids(logits * (1 + noise), rows), drawn)


@pytest.mark.parametrize("vocab", [1, 7, 64, 4096, 4097])
def test_block_race_draws_from_probs(vocab):
    """The CPU race in two rounds (blocks, then a token of the chosen block) draws each token
    with its probability (a chi-square test), partial last block included; tokens of
    probability 0 (top-k, top-p) never."""
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.rand(vocab, generator=gen) + 0.2
    probs[1::3] = 0.0
    probs /= probs.sum()
    n, block = 200_000, race_block(vocab)
    noise = torch.empty(n, 2 * block).exponential_(generator=gen)
    counts = torch.bincount(block_race(probs.expand(n, -1), noise, block), minlength=vocab)
    live = probs > 0
    assert counts[~live].sum() == 0
    expected = n * probs[live]
    chi2, dof = float(((counts[live] - expected) ** 2 / expected).sum()), int(live.sum()) - 1
    assert chi2 <= dof + 6 * (2 * dof) ** 0.5 + 1, (chi2, dof)


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = logits_for(8, seed=3)
    greedy = logits.argmax(-1).tolist()
    s = Sampler()
    assert s.sample(logits, [row(temperature=1.5, top_k=1) for _ in range(8)]).token_ids == greedy
    assert (
        s.sample(logits, [row(temperature=1.5, top_p=1e-6) for _ in range(8)]).token_ids == greedy
    )


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    probs = filtered_probs(logits, [row(top_k=2)])
    assert (probs[0, :2] > 0).all() and (probs[0, 2:] == 0).all()
    assert torch.allclose(probs[0, :2], torch.tensor([0.625, 0.375]))
    probs = filtered_probs(logits, [row(top_p=0.7)])  # 0.5 + 0.3 reaches 0.7
    assert (probs[0, :2] > 0).all() and (probs[0, 2:] == 0).all()
    probs = filtered_probs(logits, [row(min_p=0.25)])  # keep p >= 0.125
    assert (probs[0, :3] > 0).all() and (probs[0, 3:] == 0).all()
    probs = filtered_probs(logits, [row()])
    assert (probs[0] > 0).all()


def test_penalties_follow_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4)])
    r = row(
        prompt=[0],
        output=[1, 2, 2],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    out = logits.clone()
    apply_penalties(out, [r])
    expected = logits.clone()
    expected[0, 0] = 2.0 / 2  # prompt token, positive: divided
    expected[0, 1] = -2.0 * 2 - 0.5 * 1 - 0.25  # output once, negative: multiplied
    expected[0, 2] = 1.0 / 2 - 0.5 * 2 - 0.25  # output twice
    assert torch.allclose(out, expected)
    greedy_penalized = Sampler().sample(
        logits, [row(temperature=0.0, prompt=[0], repetition_penalty=4.0)]
    )
    assert greedy_penalized.token_ids == [2]  # 2.0 / 4 < 1.0


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(2, V)
    logits[:, 7] = 5.0
    out = Sampler().sample(
        logits,
        [
            row(temperature=0.0, logit_bias={3: 10.0}),
            row(temperature=0.0, eos=7, min_tokens=2, output=[4]),
        ],
    )
    assert out.token_ids[0] == 3
    assert out.token_ids[1] != 7
    stop = Sampler().sample(logits[:1], [row(temperature=0.0, stop_token_ids=[7], min_tokens=1)])
    assert stop.token_ids[0] != 7
    done = Sampler().sample(logits[:1], [row(temperature=0.0, eos=7, min_tokens=1, output=[4])])
    assert done.token_ids == [7]


def test_min_tokens_yields_to_a_grammar_that_allows_only_eos():
    """vLLM's rule: below min_tokens EOS stays masked unless a grammar left nothing else (a
    finished JSON value can only end); without a grammar, or with other tokens left, it is
    masked."""
    from pagedserve.ipc.messages import StructuredOutputs

    grammar = StructuredOutputs(choice=["a"])
    logits = torch.full((4, V), float("-inf"))
    logits[:, 7] = 1.0  # the grammar masks allow only EOS (7) ...
    logits[1, 3] = 0.5  # ... except in row 1, which may still say token 3
    rows = [
        row(temperature=0.0, eos=7, min_tokens=5, structured_outputs=grammar),
        row(temperature=0.0, eos=7, min_tokens=5, structured_outputs=grammar),
        row(temperature=1.0, seed=1, eos=7, min_tokens=5, structured_outputs=grammar),
        row(temperature=0.0, eos=7, min_tokens=5),  # no grammar: min_tokens wins
    ]
    out = Sampler().sample(logits.clone(), rows).token_ids
    assert out[:3] == [7, 3, 7] and out[3] != 7


def test_logprobs_from_raw_logits_with_ranks():
    logits = logits_for(3, seed=5)
    rows = [
        row(temperature=1.0, logprobs=3, repetition_penalty=1.5, output=[0, 1]),
        row(temperature=0.0),
        row(temperature=0.0, logprobs=0),
    ]
    out = Sampler().sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    lp = out.logprobs[0]
    token = out.token_ids[0]
    assert lp.token_ids[0] == token
    assert lp.logprobs[0] == pytest.approx(ref[0, token].item(), abs=1e-5)
    assert lp.ranks[0] == int((ref[0] > ref[0, token]).sum()) + 1
    top = ref[0].topk(3)
    assert lp.token_ids[1:] == top.indices.tolist() and lp.ranks[1:] == [1, 2, 3]
    assert lp.logprobs[1:] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.logprobs[1] is None
    assert out.logprobs[2].ranks == [1] and out.logprobs[2].token_ids == [out.token_ids[2]]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_frequencies_match_softmax(temperature):
    """Many rows of the same logits in one batch: empirical frequencies vs softmax(logits / T)."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0, 0.2]])
    n = 20000
    out = Sampler(seed=0).sample(
        logits.expand(n, -1).contiguous(), [row(temperature=temperature) for _ in range(n)]
    )
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=8).float() / n
    probs = torch.softmax(logits[0] / temperature, -1)
    assert (freq - probs).abs().max().item() < 0.015


@needs_triton
@tiny
def test_argmax_rows_split_matches_argmax():
    """The two-pass Triton argmax (CUDA's path; forced here, interpreted on a CPU) returns
    torch's: the first maximum, across chunk borders and within a chunk, a NaN as the maximum,
    a vocabulary shorter than a chunk and one not a multiple of it."""
    from pagedserve.kernels.triton_argmax import CHUNK
    from pagedserve.worker.sampler import argmax_rows

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128256, generator=gen)
    x[1, CHUNK * 7 + 5] = x[1, CHUNK * 20 + 3] = 99.0  # ties in two chunks: the first one wins
    x[2, 10] = x[2, 11] = 99.0  # a tie inside one chunk
    x[3] = 0.0  # every value tied: index 0
    x[4, 5000] = float("nan")
    x[5, -1] = 99.0  # in the last, partial chunk
    want = x.argmax(dim=-1)
    assert want.tolist()[1:6] == [CHUNK * 7 + 5, 10, 0, 5000, 128255]
    dev = "cuda" if HAS_CUDA else "cpu"  # compiled Triton needs a GPU; the interpreter a CPU
    assert torch.equal(argmax_rows(x.to(dev), split=True).cpu(), want)
    assert torch.equal(argmax_rows(x, split=False), want)
    y = torch.randn(2, 131, generator=gen)
    assert torch.equal(argmax_rows(y.to(dev), split=True).cpu(), y.argmax(dim=-1))
