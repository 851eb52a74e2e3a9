"""Prompt log-probabilities (vLLM's `prompt_logprobs`), scored with the prompt's prefill.

The hidden state at prompt position p scores prompt token p + 1, so a step that computes positions
[start, start + n) of a prompt scores the tokens after those of them below `prompt_len - 1` (the
last prompt position's logits are the ones the sampler reads). The LM head runs over at most
`CHUNK` of those positions at a time: a long prompt's prefill never holds `[prompt_len, vocab]`
float32 logits (vLLM #5907 ran out of memory there), only `[CHUNK, vocab]` and what each position
keeps, the prompt token's logprob and rank and the top-N, on the device until the step finishes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.ipc.messages import TokenLogprobs
from pagedserve.worker.sampler import to_device

CHUNK = 512  # prompt positions per LM head call (the memory profile runs one such call)


@dataclass
class PromptRows:
    """Which hidden rows of a step score which prompt tokens."""

    rows: list[int]  # indices into the plan's scheduled requests
    counts: list[int]  # [R] positions each row scores this step
    token_idx: np.ndarray  # [P] the hidden rows (indices into the step's tokens)
    targets: np.ndarray  # [P] the prompt token each scores
    top_ns: list[int]  # [R] each row's prompt_logprobs


@dataclass
class PromptScores:
    """A step's prompt logprobs on the device: the prompt token's logprob and rank, top-N."""

    rows: list[int]
    counts: list[int]
    chosen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    top_ns: list[int]  # [R] each row's prompt_logprobs

    def to_messages(self, num_scheduled: int) -> list[list[TokenLogprobs]]:
        """One list per scheduled request (empty where it scores nothing); waits for the device."""
        ids, lps, ranks, top_lps, top_ids = (
            torch.cat([c[k] for c in self.chosen]).tolist() for k in range(5)
        )
        out: list[list[TokenLogprobs]] = [[] for _ in range(num_scheduled)]
        p = 0
        for row, count, n in zip(self.rows, self.counts, self.top_ns, strict=True):
            out[row] = [
                TokenLogprobs(
                    token_ids=[ids[j], *top_ids[j][:n]],
                    logprobs=[lps[j], *top_lps[j][:n]],
                    ranks=[ranks[j], *range(1, n + 1)],
                )
                for j in range(p, p + count)
            ]
            p += count
        return out


def prompt_rows(
    wanted: list[tuple[int, int, int, int, int, int]],
    token_ids: np.ndarray,
    query_start_loc: np.ndarray,
) -> PromptRows | None:
    """`wanted`: (scheduled index, batch row, first position computed, positions computed,
    prompt_len, prompt_logprobs) per request that asks for prompt logprobs; `token_ids`
    [max_num_seqs, L] the batch's tokens; `query_start_loc` [B + 1]."""
    rows, counts, idx, targets, top_ns = [], [], [], [], []
    for i, batch_row, start, n, prompt_len, top_n in wanted:
        count = max(0, min(start + n, prompt_len - 1) - start)
        if count == 0:
            continue
        rows.append(i)
        counts.append(count)
        top_ns.append(top_n)
        idx.append(np.arange(count) + query_start_loc[i])
        targets.append(token_ids[batch_row, start + 1 : start + 1 + count])
    if not rows:
        return None
    return PromptRows(rows, counts, np.concatenate(idx), np.concatenate(targets), top_ns)


def score_prompt(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: PromptRows,
) -> PromptScores:
    """Queue the scores of `rows` from the step's hidden states [T, H] (nothing waits)."""
    token_idx = to_device(rows.token_idx, hidden.device)
    targets = to_device(rows.targets, hidden.device)
    chosen = score_positions(compute_logits, hidden, token_idx, targets, max(rows.top_ns))
    return PromptScores(rows.rows, rows.counts, chosen, rows.top_ns)


def score_positions(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    token_idx: torch.Tensor,
    targets: torch.Tensor,
    top_n: int,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """log_softmax of the logits at `token_idx` [P] of `hidden` [T, H], `CHUNK` rows at a time:
    per chunk, the target's id, logprob and rank [c], and the top-`top_n` logprobs and ids [c, N].
    `compute_logits` may be a TP collective: every rank of the last stage calls it alike."""
    out = []
    for s in range(0, len(token_idx), CHUNK):
        idx, tgt = token_idx[s : s + CHUNK], targets[s : s + CHUNK, None]  # [c], [c, 1]
        logprobs = torch.log_softmax(compute_logits(hidden[idx]).float(), dim=-1)  # [c, V]
        chosen = logprobs.gather(1, tgt)  # [c, 1]
        ranks = (logprobs > chosen).sum(dim=-1) + 1  # [c]
        top_lp, top_ids = logprobs.topk(top_n, dim=-1)  # [c, N]
        out.append((tgt[:, 0], chosen[:, 0], ranks, top_lp, top_ids))
        del logprobs
    return out
