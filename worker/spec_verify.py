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

A draft model's random rows sample their drafts from a distribution q they pass along
(worker/draft_model.py), so they take the standard rule instead (Leviathan et al., Chen et
al.): draft x at a position is accepted with probability min(1, p(x) / q(x)); the first
rejected one is replaced by a draw from norm(max(0, p - q)); after the last accepted draft the
next token is a draw from p. Each draw comes from a seeded row's own salted stream, so seeded
requests reproduce (their tokens, though, differ from speculation off: the draws differ).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.ipc.messages import TokenLogprobs
from pagedserve.worker.sampler import (
    Sampler,
    SamplingRow,
    compute_logprobs,
    target_probs,
    to_device,
)

ACCEPT_SALT, RESIDUAL_SALT = 2, 3  # seeded rows' streams for the rule's draws (drafts use 1)


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
    draft_probs: torch.Tensor | None = None,
) -> Verified:
    """`logits [S + D, V]` (row i's positions in order, rows in order) -> the new tokens.
    `draft_probs [D, V]`: the q each draft was sampled from (a draft model's random rows take
    the probabilistic rule); None: the drafts are deterministic."""
    expanded = position_rows(rows, drafts)
    ids = sampler.sample_ids(logits, expanded)  # [S + D]
    host = ids.tolist()
    # per position: whether its draft is accepted, else the token that replaces it
    ok = [False] * len(host)
    pos = 0
    for row_drafts in drafts:
        for i, token in enumerate(row_drafts):
            ok[pos + i] = host[pos + i] == token
        pos += len(row_drafts) + 1
    if draft_probs is not None:
        _rejection_rule(sampler, logits, expanded, drafts, draft_probs, ok, host)
    accepted, last, spans = [], [], []
    pos = 0
    for row_drafts in drafts:
        n = 0
        while n < len(row_drafts) and ok[pos + n]:
            n += 1
        accepted.append([*row_drafts[:n], host[pos + n]])
        spans.append((pos, pos + n + 1))
        last.append(pos + n)
        pos += len(row_drafts) + 1
    if draft_probs is not None:
        flat = [t for row in accepted for t in row]
        chosen = [i for a, b in spans for i in range(a, b)]
        ids = ids.clone()
        ids[to_device(chosen, ids.device)] = to_device(flat, ids.device)
    lps = None
    if logprobs:
        per_position = compute_logprobs(logits, ids, expanded)
        lps = [
            None if row.params.logprobs is None else per_position[a:b]
            for row, (a, b) in zip(rows, spans, strict=True)
        ]
    return Verified(ids[to_device(last, ids.device)], accepted, lps)


def _rejection_rule(
    sampler: Sampler,
    logits: torch.Tensor,
    expanded: list[SamplingRow],
    drafts: list[list[int]],
    draft_probs: torch.Tensor,
    ok: list[bool],
    host: list[int],
) -> None:
    """For random rows' draft positions, set `ok` (accept with probability min(1, p/q)) and
    `host` (the token that replaces a rejected draft: a draw from norm(max(0, p - q)))."""
    positions, qrows, tokens = [], [], []
    pos = qpos = 0
    for row_drafts in drafts:
        if row_drafts and not expanded[pos].params.greedy:
            positions += range(pos, pos + len(row_drafts))
            qrows += range(qpos, qpos + len(row_drafts))
            tokens += row_drafts
        pos += len(row_drafts) + 1
        qpos += len(row_drafts)
    if not positions:
        return
    dev = logits.device
    rows = [expanded[i] for i in positions]
    p = target_probs(logits[to_device(positions, dev)], rows)  # [R, V]
    q = draft_probs[to_device(qrows, dev)]  # [R, V]
    x = to_device(tokens, dev)[:, None]  # [R, 1]
    u = torch.exp(-sampler.noise(rows, 1, dev, ACCEPT_SALT))  # [R, 1] Uniform(0, 1)
    accept = (u * q.gather(1, x) < p.gather(1, x))[:, 0]  # u < p(x) / q(x), q(x) > 0
    residual = (p - q).clamp_min_(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)  # p == q: never used
    replaced = sampler.draw(residual, rows, RESIDUAL_SALT)  # [R]
    for i, a, t in zip(positions, accept.tolist(), replaced.tolist(), strict=True):
        ok[i] = a
        host[i] = t
