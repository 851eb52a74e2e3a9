"""Verification of draft tokens: which drafts the target model accepts, in one sampling pass.

A row that verifies `k` drafts has logits at its `k + 1` last positions. Position `i` is sampled
as if the drafts before it had been generated (its sampling row's outputs include them, so
penalties, min_tokens and a seeded row's noise are exactly those of plain decoding there); the
drafts are accepted while each equals the token sampled at its position, and the first token that
differs (or the one after the last draft) is the row's next token.

Why this is exact: the drafts of prompt lookup and suffix matching are deterministic (a point
mass q at draft x), and speculative sampling's rule for such a draft is to accept x with
probability p(x) and, on rejection, to sample from p with x removed and renormalized. Drawing
y ~ p and accepting iff y == x does both at once: P(accept) = p(x), and y given y != x is p
without x, renormalized. Greedy rows are the special case p = one-hot(argmax). So the outputs
have the target's distribution whatever the drafts, and a seeded row draws exactly the tokens it
would draw without speculation (its noise at each position depends on its seed and position
only).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.ipc.messages import TokenLogprobs
from pagedserve.worker.sampler import Sampler, SamplingRow, compute_logprobs, to_device


@dataclasses.dataclass
class Verified:
    token_ids: torch.Tensor  # [S] on the device: each row's last new token
    accepted: list[list[int]]  # [S] each row's new tokens: its accepted drafts, then one more
    logprobs: list[list[TokenLogprobs] | None] | None  # [S], one per new token


def position_rows(rows: list[SamplingRow], drafts: list[list[int]]) -> list[SamplingRow]:
    """One sampling row per verified position: row i's `len(drafts[i]) + 1` positions, each
    with the drafts before it as outputs."""
    out = []
    for row, row_drafts in zip(rows, drafts, strict=True):
        out.append(row)
        outputs = list(row.output_token_ids)
        for token in row_drafts:
            outputs.append(token)
            out.append(dataclasses.replace(row, output_token_ids=list(outputs)))
    return out


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[list[int]],
    logprobs: bool,
) -> Verified:
    """`logits [S + D, V]` (row i's positions in order, rows in order) -> the new tokens."""
    expanded = position_rows(rows, drafts)
    ids = sampler.sample_ids(logits, expanded)  # [S + D]
    host = ids.tolist()
    accepted, last, spans = [], [], []
    pos = 0
    for row_drafts in drafts:
        n = 0
        while n < len(row_drafts) and host[pos + n] == row_drafts[n]:
            n += 1
        accepted.append(host[pos : pos + n + 1])
        spans.append((pos, pos + n + 1))
        last.append(pos + n)
        pos += len(row_drafts) + 1
    lps = None
    if logprobs:
        per_position = compute_logprobs(logits, ids, expanded)
        lps = [
            None if row.params.logprobs is None else per_position[a:b]
            for row, (a, b) in zip(rows, spans, strict=True)
        ]
    return Verified(ids[to_device(last, ids.device)], accepted, lps)
