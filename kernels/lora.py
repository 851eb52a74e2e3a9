"""Batched LoRA, punica style: one batch mixes rows of several adapters and of the base model.

A layer with LoRA adds `expand(shrink(x))` on the rows of adapters: `shrink` is `h = x A_s^T`
([T, K] -> [T, R]) and `expand` is `y += h B_s^T` ([T, R] -> [T, N]), with `s` the row's device
slot and every adapter's scaling already folded into its B. Slots hold A `[S, R, K]` and
B `[S, N, R]`, rank padded with zeros to R.

A step's rows are grouped by slot once per step (`SlotRows`): `order` lists the token indices of
adapter rows, those of one slot contiguous, so a kernel program loads its slot's A or B tile once
for a block of rows (vLLM's grouping, not a program per request: a decode row is a request).
Base-model rows are in no group. The torch reference runs one gathered matmul per group, so it is
also the CPU path; on CUDA the Triton pair (kernels/triton_lora.py) reads the groups directly.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.kernels.activation import silu_and_mul
from pagedserve.kernels.backend import use_triton


def packed_offsets(num_rows: int, num_groups: int) -> tuple[int, int, int]:
    """Where `group_starts`, `group_slots` and `token_slots` start in `group_layout`'s form:
    each section at a multiple of 4 int32 (16 bytes). Triton compiles a kernel once per
    alignment of its pointers (16 bytes or not): sections at offsets that moved with a step's
    row count compiled new variants on the step path, ~1.3 s each, twice in one W1 run on an
    H100 (tests/gpu/lora_run.sh's W1_TRACE)."""
    starts = -(-num_rows // 4) * 4
    slots = starts + -(-(num_groups + 1) // 4) * 4
    return starts, slots, slots + -(-num_groups // 4) * 4


def group_layout(
    seg_starts: list[int] | np.ndarray,  # [num_seg + 1] token offsets of the requests
    seg_slots: list[int],  # [num_seg] slot per request, -1: the base model
    num_rows: int | None = None,  # capacity of `order` (a CUDA graph's buffer); None: exact
    num_groups: int | None = None,  # capacity of the groups; None: exact
) -> tuple[np.ndarray, int, int]:
    """`SlotRows`' packed host form, int32 `[order (rows) | group_starts (G + 1) | group_slots
    (G) | token_slots (rows, or every token where exact)]`, each section 16-byte aligned
    (`packed_offsets`; one array: one host-to-device copy per step), with its rows and G.
    Padding: order 0, group starts repeat the end, group slots and token slots -1 (skipped)."""
    starts = np.asarray(seg_starts, dtype=np.int64)
    token_slot = np.repeat(np.asarray(seg_slots, dtype=np.int64), np.diff(starts))
    idx = np.flatnonzero(token_slot >= 0)
    order = idx[np.argsort(token_slot[idx], kind="stable")]
    slots, counts = np.unique(token_slot[order], return_counts=True)
    rows = len(order) if num_rows is None else num_rows
    groups = len(slots) if num_groups is None else num_groups
    assert len(order) <= rows and len(slots) <= groups, "more LoRA rows than the buffer holds"
    tokens = len(token_slot) if num_rows is None else num_rows
    assert len(token_slot) <= tokens, "more tokens than the buffer holds"
    starts_at, slots_at, tokens_at = packed_offsets(rows, groups)
    out = np.zeros(tokens_at + tokens, dtype=np.int32)
    out[: len(order)] = order
    ends = out[starts_at + 1 : starts_at + groups + 1]  # group_starts[1:]
    ends[:] = len(order)
    ends[: len(counts)] = np.cumsum(counts)
    out[slots_at:] = -1
    out[slots_at : slots_at + len(slots)] = slots
    out[tokens_at : tokens_at + len(token_slot)] = token_slot
    return out, rows, groups


class PinnedRing:
    """Pinned host buffers taken round robin for the per-step copies of LoRA rows to a CUDA
    device: the copy goes out without waiting for the GPU (from pageable memory it would wait
    for the queue to drain), and no step pins a fresh tensor (the host allocator's work). A
    buffer is written again only once its last copy is done (its event; normally long since)."""

    def __init__(self, device: torch.device, count: int = 3) -> None:
        self.device, self.size, self.next = device, 0, 0
        self.bufs: list[torch.Tensor] = []
        self.events: list[torch.cuda.Event | None] = [None] * count

    def copy(self, host: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """int32 `host` into `out[: len(host)]` (None: a new device tensor), asynchronously."""
        if len(host) > self.size:  # (re)size: every earlier copy done first
            for event in self.events:
                if event is not None:
                    event.synchronize()
            self.size = max(len(host), 2 * self.size)
            self.bufs = [
                torch.empty(self.size, dtype=torch.int32, pin_memory=True) for _ in self.events
            ]
        i, self.next = self.next, (self.next + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()
        buf = self.bufs[i][: len(host)]
        buf.numpy()[:] = host
        if out is None:
            out = torch.empty(len(host), dtype=torch.int32, device=self.device)
        out[: len(host)].copy_(buf, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record()
        return out


class SlotRows:
    """One step's LoRA rows on the device: `order` [rows] int32 token indices grouped by slot,
    `group_starts` [G + 1] (offsets into `order`), `group_slots` [G] (-1: an empty group),
    `token_slots` [>= T] (each token's slot, -1: the base model; the decode-size path's),
    `max_group_len` (a host int, the kernels' grid). `groups`, (slot, token indices) per group,
    serves the reference (only rows built from host data have it)."""

    def __init__(
        self, packed: torch.Tensor, num_rows: int, num_groups: int, max_group_len: int
    ) -> None:
        self.packed = packed  # int32, `group_layout`'s form
        starts_at, slots_at, tokens_at = packed_offsets(num_rows, num_groups)
        self.order = packed[:num_rows]
        self.group_starts = packed[starts_at : starts_at + num_groups + 1]
        self.group_slots = packed[slots_at : slots_at + num_groups]
        self.token_slots = packed[tokens_at:]
        self.max_group_len = max_group_len
        self.host: np.ndarray | None = None
        self._groups: list[tuple[int, torch.Tensor]] | None = None

    @classmethod
    def from_segments(
        cls,
        seg_starts: list[int] | np.ndarray,
        seg_slots: list[int],
        device: torch.device,
        ring: PinnedRing | None = None,  # on CUDA: the copy's host buffers (None: pin one)
    ) -> SlotRows:
        host, num_rows, num_groups = group_layout(seg_starts, seg_slots)
        starts_at = packed_offsets(num_rows, num_groups)[0]
        longest = int(np.diff(host[starts_at : starts_at + num_groups + 1]).max(initial=0))
        if ring is not None:
            packed = ring.copy(host)
        elif torch.device(device).type == "cuda":  # pinned: the copy does not wait for the GPU
            packed = torch.from_numpy(host).pin_memory().to(device, non_blocking=True)
        else:
            packed = torch.from_numpy(host).to(device)
        rows = cls(packed, num_rows, num_groups, longest)
        rows.host = host
        return rows

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        if self._groups is None:
            assert self.host is not None, "rows over a graph's buffer serve the Triton pair only"
            n, g = len(self.order), len(self.group_slots)
            starts_at, slots_at, _ = packed_offsets(n, g)
            order = torch.from_numpy(self.host[:n].astype(np.int64)).to(self.packed.device)
            starts = self.host[starts_at : starts_at + g + 1]
            self._groups = [
                (int(slot), order[starts[i] : starts[i + 1]])
                for i, slot in enumerate(self.host[slots_at : slots_at + g])
                if slot >= 0
            ]
        return self._groups


def lora_shrink_ref(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R, K]
    rows: SlotRows,
) -> torch.Tensor:  # [T, R] float32; zero on base-model rows
    h = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot, idx in rows.groups:
        h[idx] = (x[idx] @ lora_a[slot].t()).float()
    return h


def lora_expand_ref(
    y: torch.Tensor,  # [T, N], added to in place
    h: torch.Tensor,  # [T, R]
    lora_b: torch.Tensor,  # [S, N, R]
    rows: SlotRows,
) -> torch.Tensor:
    for slot, idx in rows.groups:
        delta = h[idx].to(lora_b.dtype) @ lora_b[slot].t()  # [n, N]
        y.index_add_(0, idx, delta.to(y.dtype))
    return y


def lora_uses_triton(x: torch.Tensor) -> bool:
    return use_triton(x) and x.dtype in (torch.float16, torch.bfloat16)


def lora_apply(
    y: torch.Tensor,  # [T, N]
    x: torch.Tensor,  # [T, K], or [T, 2K] (gate | up) with `gated`
    lora_a: torch.Tensor,  # [S, R, K]
    lora_b: torch.Tensor,  # [S, N, R]
    rows: SlotRows,
    gated: bool = False,
) -> torch.Tensor:
    """`y += B_s (A_s x)` per row of an adapter, x first through `silu_and_mul` if `gated`; on
    CUDA one GEMM over every slot's A and an expand by each row's slot (`triton_lora_dense`), or
    with `gated` (decode sizes, `fuses_gate`) the grouped Triton pair, the activation inside the
    shrink's loads; else the reference. (worker/lora/manager.py puts LoRA in CUDA graphs only
    where this takes Triton.)"""
    x = x if gated else x.to(lora_a.dtype)  # (a gated x comes in lora_a's dtype: fuses_gate)
    if lora_uses_triton(x) and x.dtype == lora_a.dtype:
        from pagedserve.kernels import triton_lora

        if not gated:
            return triton_lora.triton_lora_dense(y, x, lora_a, lora_b, rows.token_slots)
        h = triton_lora.triton_lora_shrink(x, lora_a, rows, gated)
        return triton_lora.triton_lora_expand(y, h, lora_b, rows)
    x = (silu_and_mul(x) if gated else x).to(lora_a.dtype)
    return lora_expand_ref(y, lora_shrink_ref(x, lora_a, rows), lora_b, rows)
