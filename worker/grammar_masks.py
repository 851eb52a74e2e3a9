"""Each step's grammar masks: advance the constrained rows' matchers, fill their bitmasks, mask
the logits in place (the sampling ranks; see worker/grammar.py for where matchers live and why).

This runs on the worker's critical path, between one step's sampled ids reaching the host and
the next step's sampling, so it is built to cost little and to hide behind the GPU:
- the worker queues step N+1's forward before it reads step N's ids (worker_process.py), so
  advancing and filling run on the host while the device runs that forward;
- the matchers know only the tokenizer's own vocabulary (`mask_vocab_size`), not the LM head's
  padded one: xgrammar treats every id past the tokenizer as a special token and scans them on
  each accept (32 us a token with a 4k tokenizer padded to 128k ids, 4 us unpadded); the logits
  past the tokenizer are masked with one fill on the device;
- every row with exactly one new token is advanced in one batched C++ accept; only rows with
  several (a resumed request, a plan's tokens under PP) or behind a reasoning gate take the
  per-token Python path;
- the bitmasks fill in one batched call over xgrammar's C++ threads (the GIL released);
- the bitmasks go to the GPU in one non-blocking copy from pinned memory and are applied by
  xgrammar's Triton kernel just before sampling; the host never waits for the device here.
A step without a constrained row does none of this (the runner skips it when no matcher exists).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedserve.ipc.messages import StructuredOutputs
from pagedserve.worker.grammar import GrammarCompiler
from pagedserve.worker.sampler import to_device

logger = logging.getLogger("pagedserve.worker")
MAX_FILL_THREADS = 8


def fill_threads(ranks_per_node: int) -> int:
    """xgrammar's fill threads for one rank: half its share of the cores this process may use
    (xgrammar's own default reads the host's core count, not a container's), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_FILL_THREADS, (cores or 1) // max(ranks_per_node, 1) // 2))


class RowMatcher:
    """One constrained request's matcher and how many of its outputs it has consumed."""

    def __init__(self, compiled: Any, spec: StructuredOutputs, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr

        vocab = compiled.tokenizer_info.vocab_size
        stops = [t for t in eos_token_ids if 0 <= t < vocab]  # every EOS id may end the grammar
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self.stop_token_ids = frozenset(stops or compiled.tokenizer_info.stop_token_ids)
        self.after_token_id = spec.after_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.num_seen = 0
        self.terminated = False  # it accepted a stop token: the row is free again
        self.broken = False  # a token the grammar refused got in: only EOS from here

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        """Accept every output not seen yet, one at a time (the general path)."""
        for token in output_token_ids[self.num_seen :]:
            self.num_seen += 1
            if self.after_token_id is not None:
                self.after_token_id = None if token == self.after_token_id else self.after_token_id
                continue
            if self.broken or self.terminated:
                continue
            self.accepted(int(token), self.matcher.accept_token(int(token)))

    def takes_one(self, output_token_ids: Sequence[int]) -> bool:
        """Whether the outputs hold exactly one new token that the grammar must accept (the
        common case, batched by `GrammarMasks`)."""
        return (
            len(output_token_ids) == self.num_seen + 1
            and self.after_token_id is None
            and not (self.broken or self.terminated)
        )

    def accepted(self, token: int, ok: bool) -> None:
        """Record the matcher's answer to `token`."""
        if not ok:
            logger.warning("the grammar refused sampled token %d; ending the request", token)
            self.broken = True
        elif token in self.stop_token_ids:
            self.terminated = self.matcher.is_terminated()

    @property
    def active(self) -> bool:
        """Whether this row's next token is constrained."""
        return self.after_token_id is None and not self.terminated


class GrammarMasks:
    """The bitmask rows of one step's constrained samples, applied to the logits in place.

    On a GPU the host bitmask goes over in a non-blocking copy that runs only when the stream
    reaches it, and the worker fills the next step's masks before that (it runs a step ahead):
    two pinned buffers take turns, and a buffer is refilled only once its last copy is done (an
    event, normally long passed), so a step never reads the next step's masks.
    """

    def __init__(
        self, max_rows: int, mask_vocab_size: int, device: torch.device, threads: int = 1
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.mask_vocab_size = mask_vocab_size  # the tokenizer's ids: the rest is always masked
        self.device = device
        self._batch = xgr.BatchGrammarMatcher(threads)
        # [R, ceil(mask_vocab_size / 32)] int32 each
        self._hosts = [xgr.allocate_token_bitmask(max_rows, mask_vocab_size) for _ in range(2)]
        if device.type == "cuda":
            self._hosts = [h.pin_memory() for h in self._hosts]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.host = self._hosts[0]

    def apply(
        self, logits: torch.Tensor, matchers: list[RowMatcher | None], outputs: list[Sequence[int]]
    ) -> None:
        """`logits [S, V]`; `matchers[j]` None for an unconstrained row, `outputs[j]` its outputs
        so far (the matcher catches up on those it has not seen)."""
        self._advance(matchers, outputs)
        self._next_buffer()
        rows = self._fill(matchers)
        if rows:
            self._mask_logits(logits, rows)

    def _advance(self, matchers: list[RowMatcher | None], outputs: list[Sequence[int]]) -> None:
        ones: list[RowMatcher] = []
        tokens: list[int] = []
        for m, out in zip(matchers, outputs, strict=True):
            if m is None or len(out) == m.num_seen:
                continue
            if m.takes_one(out):
                m.num_seen += 1
                ones.append(m)
                tokens.append(int(out[-1]))
            else:
                m.catch_up(out)
        if ones:
            answers = self._xgr.BatchGrammarMatcher.batch_accept_token(
                [m.matcher for m in ones], tokens
            )
            for m, token, ok in zip(ones, tokens, answers, strict=True):
                m.accepted(token, ok)

    def _next_buffer(self) -> None:
        """Switch to the other host buffer, waiting for its previous copy to the GPU if needed."""
        self._turn ^= 1
        self.host = self._hosts[self._turn]
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()

    def _fill(self, matchers: list[RowMatcher | None]) -> list[int]:
        """Fill the host bitmask rows of the constrained rows; their indices, ascending."""
        rows, active, filled = [], [], []
        for j, m in enumerate(matchers):
            if m is None:
                continue
            if m.broken:
                self._only(j, m.eos_token_ids)
                rows.append(j)
            elif m.active:
                active.append(m.matcher)
                filled.append(j)
                rows.append(j)
        if filled:
            self._batch.batch_fill_next_token_bitmask(active, self.host, indices=filled)
        return rows

    def _mask_logits(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Mask `logits [S, V]` in place on its device: the rows' bitmasks over the tokenizer's
        ids, and every id past them (the LM head's padding)."""
        num_rows, vocab = logits.shape
        bitmask = self.host[:num_rows]
        if self.device.type == "cuda":
            bitmask = bitmask.to(self.device, non_blocking=True)
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()
        index = None  # every row masked
        if len(rows) < num_rows:
            index = to_device(np.asarray(rows, dtype=np.int64), self.device)  # [M]
        known = min(self.mask_vocab_size, vocab)
        self._xgr.apply_token_bitmask_inplace(
            logits[:, :known], bitmask, vocab_size=known, indices=index
        )
        if known < vocab:
            padding = logits[:, known:]  # [S, V - known]
            if index is None:
                padding.fill_(float("-inf"))
            else:
                padding.index_fill_(0, index, float("-inf"))

    def _only(self, j: int, token_ids: list[int]) -> None:
        """Row j allows only `token_ids` (its EOS ids; none: every logit masked)."""
        self.host[j].zero_()
        for token in token_ids:
            if token >= self.mask_vocab_size:
                continue  # past the tokenizer: masked with the padding
            bit = 1 << (token % 32) if token % 32 != 31 else -(2**31)
            self.host[j, token // 32] |= bit


class ConstrainedRows:
    """The batch's rows under a grammar (sampling ranks only): a matcher per constrained request,
    started when its plan brings it (a resumed request starts over) and dropped when it finishes,
    and the masks, made at the first constrained step. False while no row is constrained."""

    def __init__(
        self, grammars: GrammarCompiler, max_rows: int, device: torch.device, ranks_per_node: int
    ) -> None:
        self.grammars = grammars
        self.matchers: dict[str, RowMatcher] = {}
        self._masks: GrammarMasks | None = None
        self._shape = (max_rows, device, fill_threads(ranks_per_node))

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def track(self, finished_ids: Sequence[str], new_requests: Sequence[Any]) -> None:
        for req_id in finished_ids:
            self.matchers.pop(req_id, None)
        for new in new_requests:
            spec = new.sampling.structured_outputs
            if spec is not None:
                compiled = self.grammars.get(spec)
                self.matchers[new.req_id] = RowMatcher(compiled, spec, new.eos_token_ids)

    def mask(self, logits: torch.Tensor, req_ids: list[str], outputs: list[Sequence[int]]) -> None:
        """Mask the constrained rows' logits [S, V] in place with their grammars' next tokens;
        row j is `req_ids[j]`, its output tokens so far `outputs[j]`."""
        if self._masks is None:
            max_rows, device, threads = self._shape
            self._masks = GrammarMasks(max_rows, self.grammars.mask_vocab_size, device, threads)
        self._masks.apply(logits, [self.matchers.get(r) for r in req_ids], outputs)
