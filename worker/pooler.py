"""Pooling (`--runner pooling`, pooling_config.py): a prompt's hidden states -> its vector.

LAST pools the hidden state of the prompt's last token, which the step that completes the prompt
computes (causal attention: it has seen the whole prompt, however many chunks it took). MEAN and
CLS gather over those steps: each step adds its tokens' hidden states to the request's running
sum (and keeps position 0's), so chunked prefill never holds `[prompt_len, H]`. The head (cut to
`dimensions`, normalize; or a classifier) runs on the device; the driver sends each vector as
float32 bytes in the StepResult, the only form in which it crosses ipc.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.ipc.messages import PoolingParams, StepPlan
from pagedserve.pooling_config import PoolingConfig
from pagedserve.worker.input_batch import StepInputs
from pagedserve.worker.sampler import to_device

# checkpoints saved from a base model (sentence-transformers' AutoModel) name its weights bare
_BARE = ("embed_tokens.", "layers.", "norm.")


def prepare_model(model: nn.Module, pooling: PoolingConfig | None) -> None:
    """Before weights load: a classifier's `score` head [L, H]; no LM head where the pooler
    reads no logits (classifier checkpoints have none)."""
    if pooling is None or not hasattr(model, "lm_head"):  # (a stage before the last)
        return
    if pooling.num_labels:
        model.score = nn.Linear(pooling.hidden_size, pooling.num_labels, bias=False)
    if not pooling.uses_lm_head:
        del model.lm_head


def pooling_weights(
    weights: Iterable[tuple[str, Any]], pooling: PoolingConfig | None
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors under the names the model takes: bare base-model names get
    `model.`, an unused LM head is skipped."""
    for name, tensor in weights:
        if pooling is not None:
            if name.startswith("lm_head.") and not pooling.uses_lm_head:
                continue
            if name.startswith(_BARE):
                name = "model." + name
        yield name, tensor


def classifier_token_ids(tokenizer_path: str, tokens: tuple[str, ...]) -> list[int]:
    """The ids of `classifier_from_token`'s tokens (each must be one token of the vocabulary)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_path, "tokenizer.json"))
    ids = []
    for token in tokens:
        tid = tokenizer.token_to_id(token)
        if tid is None:
            encoded = tokenizer.encode(token, add_special_tokens=False).ids
            tid = encoded[0] if len(encoded) == 1 else None
        if tid is None:
            raise ValueError(f"classifier_from_token: {token!r} is not one token")
        ids.append(tid)
    return ids


@dataclass
class PooledRows:
    """A step's vectors on the device, for the rows (plan indices) whose prompt ended."""

    rows: list[int]
    vectors: list[torch.Tensor]  # [D_i] float32 each

    def to_messages(self, num_scheduled: int) -> list[bytes | None]:
        """One entry per scheduled request (None: no vector this step); waits for the device."""
        out: list[bytes | None] = [None] * num_scheduled
        flat = torch.cat(self.vectors).cpu().numpy().astype("<f4")
        p = 0
        for row, vec in zip(self.rows, self.vectors, strict=True):
            out[row] = flat[p : p + len(vec)].tobytes()
            p += len(vec)
        return out


class Pooler:
    def __init__(
        self, config: PoolingConfig, model: nn.Module, device: torch.device, tokenizer_path: str
    ) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.params: dict[str, PoolingParams] = {}  # the batch's pooling requests
        self.sums: dict[str, torch.Tensor] = {}  # MEAN: [H] float32, prompt positions so far
        self.firsts: dict[str, torch.Tensor] = {}  # CLS: position 0's hidden state [H]
        self.token_ids = None
        if config.classifier_from_token:
            ids = classifier_token_ids(tokenizer_path, config.classifier_from_token)
            self.token_ids = torch.tensor(ids, device=device)  # [2]: no, yes

    def track(self, plan: StepPlan) -> None:
        """Requests leave (finished, preempted: a resumed one starts its prompt again)."""
        for req_id in plan.finished_ids:
            self._forget(req_id)
        for new in plan.new_requests:
            self._forget(new.req_id)
            self.params[new.req_id] = new.pooling or PoolingParams(task=self.config.task)

    def _forget(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self.sums.pop(req_id, None)
        self.firsts.pop(req_id, None)

    def pool(self, hidden: torch.Tensor, plan: StepPlan, inputs: StepInputs) -> PooledRows | None:
        """Gather this step's part of each prompt from `hidden` [T, H]; the vectors of the
        prompts that end here (queued on the device)."""
        kind = self.config.pooling_type
        if kind != "LAST":
            self._gather(hidden, plan, inputs)
        rows = inputs.sample_rows
        if not rows:
            return None
        ids = [plan.scheduled_ids[i] for i in rows]
        if kind == "LAST":
            pooled = hidden[to_device(inputs.logits_indices, hidden.device)].float()  # [S, H]
        elif kind == "MEAN":
            lens = inputs.seq_lens[rows].astype(np.float32)  # the prompt lengths
            sums = torch.stack([self.sums.pop(r) for r in ids])  # [S, H]
            pooled = sums / to_device(lens, hidden.device)[:, None]
        else:
            pooled = torch.stack([self.firsts.pop(r) for r in ids])
        return PooledRows(list(rows), self.head(pooled, [self.params[r] for r in ids]))

    def _gather(self, hidden: torch.Tensor, plan: StepPlan, inputs: StepInputs) -> None:
        qs = inputs.query_start_loc
        for i, req_id in enumerate(plan.scheduled_ids):
            a, b = int(qs[i]), int(qs[i + 1])
            if self.config.pooling_type == "MEAN":
                part = hidden[a:b].float().sum(dim=0)  # [H]
                prev = self.sums.get(req_id)
                self.sums[req_id] = part if prev is None else prev + part
            elif int(inputs.positions[a]) == 0:
                self.firsts[req_id] = hidden[a].float()

    def head(self, pooled: torch.Tensor, params: list[PoolingParams]) -> list[torch.Tensor]:
        """Pooled states [S, H] float32 -> each request's result vector."""
        c = self.config
        if c.task == "classify":
            if self.token_ids is not None:  # LM-head logits of (no, yes): one score
                logits = self.model.compute_logits(pooled.to(self._dtype()))[:, self.token_ids]
                return list(torch.sigmoid(logits[:, 1:] - logits[:, :1]))
            if hasattr(self.model, "classify"):  # an encoder's own head (worker/models/bert.py)
                logits = self.model.classify(pooled.to(self._dtype())).float()  # [S, L]
            else:
                logits = F.linear(pooled, self.model.score.weight.float())  # [S, L]
            probs = torch.sigmoid(logits) if c.num_labels == 1 else logits.softmax(dim=-1)
            return list(probs)
        if all(p.dimensions is None and p.normalize is None for p in params):
            return list(F.normalize(pooled, dim=-1) if c.normalize else pooled)
        out = []
        for vec, p in zip(pooled, params, strict=True):
            if p.dimensions is not None:
                vec = vec[: p.dimensions]
            if c.normalize if p.normalize is None else p.normalize:
                vec = F.normalize(vec, dim=-1)
            out.append(vec)
        return out

    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype
