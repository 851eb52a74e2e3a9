"""Sampling with vLLM's semantics, vectorized over the batch.

Order per step: logit bias -> min_tokens masks -> repetition / frequency / presence penalties ->
greedy rows take the argmax; the others: temperature -> min_p -> top_k -> top_p -> an exponential
race, as vLLM samples: `argmax(probs / q)` with `q ~ Exponential(1)` per token draws exactly from
`probs`. The race is why a seed reproduces: the winner beats the runner-up by a ratio, so a
last-bit change in some logit (a prefix-cache hit, another batch shape) almost never moves it,
where inverting a float32 cumulative sum over the vocabulary moved the draw whenever it landed
among the many tiny-probability tokens. On a CPU, where one exponential per vocabulary entry
costs more than the decode step, the race runs in two rounds over blocks of the vocabulary
(`block_race`: the same distribution, ~2 sqrt(V) exponentials a row). A seeded request draws its
noise from a generator seeded by (seed, number of tokens generated), unseeded rows from the
sampler's own generator, so a seeded row's tokens do not depend on which other requests share
the batch or on preemption. Logprobs come from the raw logits (before penalties and
temperature), as vLLM returns by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.ipc.messages import SamplingParams, TokenLogprobs

_MASK = float("-inf")
ARGMAX_SPLIT_MAX_ROWS = 16  # argmax_rows: more rows fill the GPU with one block each


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Sequence[int] = ()

    @property
    def needs_processing(self) -> bool:
        """Whether the row needs more than an argmax of its raw logits."""
        p = self.params
        return (
            not p.greedy
            or bool(p.logit_bias)
            or len(self.output_token_ids) < p.min_tokens
            or has_penalties(p)
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def argmax_rows(x: torch.Tensor, split: bool | None = None) -> torch.Tensor:
    """`x.argmax(-1)` of [N, V] logits (the first maximum); on CUDA, for a few rows, in two
    Triton passes over chunks of the row (kernels/triton_argmax.py): torch reduces a row in one
    thread block (28 us for 128k float32 logits on an H100, in every batch-1 decode step).
    `split` forces the choice (tests, under the Triton interpreter on a CPU); on a CPU one pass
    is cheaper (its host time is the step)."""
    fast = x.is_cuda if split is None else split
    if not fast or x.shape[0] > ARGMAX_SPLIT_MAX_ROWS or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    from pagedserve.kernels.triton_argmax import triton_argmax

    return triton_argmax(x)


def seed_for_step(seed: int, step: int) -> int:
    """A generator seed from the request's seed and how many tokens it has generated."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        if device is not None:
            self._generator(torch.device(device))

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """`logits [N, V]` float32, one row per `rows` entry -> one token (and logprobs) each."""
        token_ids = self.sample_ids(logits, rows)
        return SamplerOutput(token_ids.tolist(), compute_logprobs(logits, token_ids, rows))

    def sample_ids(
        self, logits: torch.Tensor, rows: list[SamplingRow], argmax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The sampled ids [N] on the logits' device; greedy-only batches never touch the host.
        `argmax`: `logits.argmax(-1)` when already computed (inside a decode CUDA graph)."""
        assert logits.shape[0] == len(rows), "one logits row per sampling row"
        if any(r.needs_processing for r in rows):
            return self._sample_processed(logits.clone(), rows)  # [N]
        return argmax_rows(logits) if argmax is None else argmax  # [N]

    def _sample_processed(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        apply_logit_bias(logits, rows)
        apply_min_tokens(logits, rows)
        apply_penalties(logits, rows)
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random:
            return argmax_rows(logits)  # [N]
        sub_rows = [rows[i] for i in random]
        every = len(random) == len(rows)
        index = None if every else to_device(random, logits.device)
        probs = filtered_probs(logits if every else logits[index], sub_rows)  # [R, V]
        sampled = self.draw(probs, sub_rows)  # [R]
        if every:
            return sampled
        token_ids = argmax_rows(logits)  # [N]: the greedy rows'
        token_ids[index] = sampled
        return token_ids

    def draw(self, probs: torch.Tensor, rows: list[SamplingRow], salt: int = 0) -> torch.Tensor:
        """One token per row, drawn from `probs` [R, V] by an exponential race: over the whole
        vocabulary on CUDA (one noise tensor, no scan), in two rounds on a CPU (one exponential
        per vocabulary entry costs 2.7 ms for 32 x 4096 there, more than the forward). `salt`:
        see `noise`."""
        if probs.device.type == "cuda":
            return argmax_rows(probs / self.noise(rows, probs.shape[1], probs.device, salt))
        block = race_block(probs.shape[1])
        return block_race(probs, self.noise(rows, 2 * block, probs.device, salt), block)

    def noise(
        self, rows: list[SamplingRow], width: int, device: torch.device, salt: int = 0
    ) -> torch.Tensor:
        """`[R, width]` Exponential(1): a seeded row's from its (seed, step) generator, so the
        same whatever the batch; the other rows' from this sampler's generator. A nonzero
        `salt` gives a seeded row a stream of its own at the same step (speculative decoding
        draws several independent values per position)."""
        noise = torch.empty(len(rows), width, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            return noise.exponential_(generator=self._generator(device))
        if unseeded:
            noise[to_device(unseeded, device)] = torch.empty(
                len(unseeded), width, device=device
            ).exponential_(generator=self._generator(device))
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                g = torch.Generator(device)
                step_seed = seed_for_step(row.params.seed, len(row.output_token_ids))
                g.manual_seed((step_seed + salt * 0x632BE59BD9B4E019) % (2**63 - 1))
                noise[i].exponential_(generator=g)
        return noise

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]


def race_block(vocab: int) -> int:
    """Tokens per block of `block_race`: about sqrt(V), so both rounds are short; a function of
    the vocabulary only, so a seeded row's draw does not depend on the batch."""
    return math.isqrt(vocab - 1) + 1  # ceil(sqrt(V))


def block_race(probs: torch.Tensor, noise: torch.Tensor, block: int) -> torch.Tensor:
    """`argmax(probs / q)` over the vocabulary, q ~ Exp(1) per token, with `2 * block` noise
    values a row instead of V. Token i's `q_i / p_i` is Exp(p_i); a block's minimum is
    Exp(block mass) and independent of which token attains it (a token with probability
    p_i / mass). So round one races the block masses against `noise[:, :block]`, round two the
    chosen block's tokens against `noise[:, block:]`: the same distribution, and a winner that a
    last-bit change in the masses or probabilities almost never moves.
    probs [R, V], noise [R, 2 * block] -> [R] token ids."""
    num_rows, vocab = probs.shape
    full = vocab // block  # blocks of `block` tokens; a last partial one if V is not a multiple
    masses = probs[:, : full * block].view(num_rows, full, block).sum(-1)  # [R, full]
    partial = full * block < vocab
    if partial:
        masses = torch.cat([masses, probs[:, full * block :].sum(-1, keepdim=True)], dim=1)
    chosen = (masses / noise[:, : masses.shape[1]]).argmax(-1, keepdim=True)  # [R, 1]
    offsets = torch.arange(block, device=probs.device)
    token_ids = torch.add(offsets, chosen, alpha=block)  # [R, block]: the chosen block's
    if partial:  # the last block's ids past the vocabulary race with probability 0
        p = probs.gather(1, token_ids.clamp_max(vocab - 1)).masked_fill_(token_ids >= vocab, 0)
    else:
        p = probs.gather(1, token_ids)  # [R, block]
    winner = (p / noise[:, block:]).argmax(-1, keepdim=True)  # [R, 1]
    return torch.add(winner, chosen, alpha=block)[:, 0]


def to_device(values: list | np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Small host data (a list, numpy array or CPU tensor) on the device without waiting for
    the device: a copy from pageable memory (`torch.tensor(..., device=cuda)`) may synchronize the
    stream, which would stall the worker behind the forward it has just queued."""
    if isinstance(values, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(values))
    else:
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    r_idx, t_idx, vals = [], [], []
    for i, row in enumerate(rows):
        for token, bias in (row.params.logit_bias or {}).items():
            if 0 <= int(token) < logits.shape[1]:
                r_idx.append(i)
                t_idx.append(int(token))
                vals.append(float(bias))
    if r_idx:
        index = (
            to_device(r_idx, logits.device),
            to_device(t_idx, logits.device),
        )
        logits.index_put_(index, to_device(vals, logits.device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Below `min_tokens` outputs, no EOS id nor stop token can be sampled, unless a grammar
    allows nothing else: the grammar wins (a finished JSON value can only end), as in vLLM."""
    r_idx, t_idx, constrained = [], [], []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        for token in [*(row.params.stop_token_ids or ()), *row.eos_token_ids]:
            if 0 <= token < logits.shape[1]:
                r_idx.append(i)
                t_idx.append(token)
                constrained.append(row.params.structured_outputs is not None)
    if not r_idx:
        return
    dev = logits.device
    index = (to_device(r_idx, dev), to_device(t_idx, dev))
    if not any(constrained):
        logits[index] = _MASK
        return
    kept = logits[index]  # [K]: the stop tokens' logits, grammar masks applied
    logits[index] = _MASK
    empty = torch.isneginf(logits[index[0]]).all(dim=-1)  # [K]: the row has no token left
    keep = empty & to_device(constrained, dev)
    logits[index] = torch.where(keep, kept, torch.full_like(kept, _MASK))


def token_counts(
    token_lists: list[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:  # [N, V] int64: occurrences of each token in each row's list
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.int64, device=device)
    width = max((len(t) for t in token_lists), default=0)
    if width:
        padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.int64)
        for i, tokens in enumerate(token_lists):
            padded[i, : len(tokens)] = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        index = to_device(padded, device)
        counts.scatter_add_(1, index, torch.ones_like(index))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition penalty over prompt + output (positive logits divided, negative multiplied);
    frequency (per occurrence) and presence (once) penalties over output tokens, subtracted."""
    if not any(has_penalties(r.params) for r in rows):
        return
    n, vocab = logits.shape
    dev = logits.device
    out_counts = token_counts([r.output_token_ids for r in rows], vocab, dev)  # [N, V]
    prompt_seen = token_counts([r.prompt_token_ids for r in rows], vocab, dev) > 0  # [N, V]
    rep = to_device([r.params.repetition_penalty for r in rows], dev)[:, None]
    freq = to_device([r.params.frequency_penalty for r in rows], dev)[:, None]
    pres = to_device([r.params.presence_penalty for r in rows], dev)[:, None]
    seen = prompt_seen | (out_counts > 0)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= freq * out_counts + pres * (out_counts > 0)


def target_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution a random row samples from [R, V]: bias, min_tokens, penalties, then
    `filtered_probs` (what `Sampler.sample_ids` draws from, for speculative verification)."""
    logits = logits.clone()
    apply_logit_bias(logits, rows)
    apply_min_tokens(logits, rows)
    apply_penalties(logits, rows)
    return filtered_probs(logits, rows)


def filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then min_p, top_k and top_p masks; returns the renormalized probs [R, V]."""
    dev = logits.device
    temp = to_device([r.params.temperature for r in rows], dev)[:, None]
    logits = logits / temp
    if any(r.params.min_p > 0 for r in rows):
        min_p = to_device([r.params.min_p for r in rows], dev)[:, None]
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), _MASK)
    return apply_top_k_top_p(logits, rows).softmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
    p = [r.params.top_p for r in rows]
    if all(x >= vocab for x in k) and all(x >= 1.0 for x in p):
        return logits
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab, device=dev)[None, :]  # [1, V]
    drop = rank >= to_device(k, dev).clamp(max=vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V]
    # top_p 1 must keep the whole tail even where float cumsums reach 1 early: threshold inf.
    top_p = to_device([x if x < 1.0 else float("inf") for x in p], dev)[:, None]
    drop = (mass_before >= top_p) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.full_like(logits, _MASK).scatter(1, order, sorted_logits)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
) -> list[TokenLogprobs | None]:
    """Sampled token's logprob and rank plus the top-N, from the raw logits' log_softmax."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    logprobs = torch.log_softmax(logits[wanted].float(), dim=-1)  # [W, V]
    chosen = token_ids[wanted][:, None]  # [W, 1]
    chosen_lp = logprobs.gather(1, chosen)  # [W, 1]
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1  # [W]
    top_n = max(rows[i].params.logprobs for i in wanted)
    top_lp, top_ids = logprobs.topk(top_n, dim=-1)  # [W, N]
    chosen_l, lp_l, rank_l = chosen[:, 0].tolist(), chosen_lp[:, 0].tolist(), ranks.tolist()
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        result[i] = TokenLogprobs(
            token_ids=[chosen_l[j], *top_ids_l[j][:n]],
            logprobs=[lp_l[j], *top_lp_l[j][:n]],
            ranks=[rank_l[j], *range(1, n + 1)],
        )
    return result
