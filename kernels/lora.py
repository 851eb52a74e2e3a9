"""Batched LoRA, punica style: one batch mixes rows of several adapters and of the base model.

A step's tokens come in segments (one per request, contiguous in the batch), each with the
device slot of its adapter or -1 (the base model). A layer with LoRA adds
`expand(shrink(x))`: `shrink` is `h = x A_s^T` ([T, K] -> [T, R]) and `expand` is
`y += h B_s^T` ([T, R] -> [T, N]), with `s` the row's slot and every adapter's scaling already
folded into its B. Slots hold A `[S, R, K]` and B `[S, N, R]`, rank padded with zeros to R.

The torch reference groups rows by slot once per step (`SlotRows`, on the host: the segments
are host data) and runs one gathered matmul per adapter in the step, so it is also the CPU path.
On CUDA the Triton pair (kernels/triton_lora.py) runs straight over the segments.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.backend import use_triton


class SlotRows:
    """One step's LoRA rows: `seg_starts` [num_seg + 1] / `seg_slots` [num_seg] (int32, on the
    device) for the kernels, and `groups`, (slot, token indices [n]) per adapter in the step,
    for the reference (built on first use: the Triton path never needs them)."""

    def __init__(self, seg_starts: list[int], seg_slots: list[int], device: torch.device) -> None:
        assert len(seg_starts) == len(seg_slots) + 1
        self._host: tuple[list[int], list[int]] | None = (seg_starts, seg_slots)
        self.device = device
        self.seg_starts = torch.tensor(seg_starts, dtype=torch.int32, device=device)
        self.seg_slots = torch.tensor(seg_slots, dtype=torch.int32, device=device)
        lengths = [b - a for a, b in zip(seg_starts, seg_starts[1:], strict=False)]
        self.max_seg_len = max(lengths, default=0)
        self._groups: list[tuple[int, torch.Tensor]] | None = None

    @classmethod
    def static(
        cls, seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int
    ) -> SlotRows:
        """Rows over device buffers a CUDA graph reads (their values change per replay): for the
        Triton pair only, which reads nothing on the host."""
        rows = cls.__new__(cls)
        rows._host, rows._groups, rows.device = None, None, seg_starts.device
        rows.seg_starts, rows.seg_slots, rows.max_seg_len = seg_starts, seg_slots, max_seg_len
        return rows

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        if self._groups is None:
            assert self._host is not None, "static rows serve the Triton pair only"
            seg_starts, seg_slots = self._host
            by_slot: dict[int, list[int]] = {}
            for i, slot in enumerate(seg_slots):
                if slot >= 0:
                    by_slot.setdefault(slot, []).extend(range(seg_starts[i], seg_starts[i + 1]))
            self._groups = [
                (slot, torch.tensor(rows, dtype=torch.long, device=self.device))
                for slot, rows in by_slot.items()
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


def lora_apply(
    y: torch.Tensor,  # [T, N]
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R, K]
    lora_b: torch.Tensor,  # [S, N, R]
    rows: SlotRows,
) -> torch.Tensor:
    """`y += B_s (A_s x)` per row of an adapter; the Triton pair on CUDA, else the reference.
    (worker/lora/manager.py puts LoRA in decode CUDA graphs only where this takes Triton.)"""
    if use_triton(x) and x.dtype in (torch.float16, torch.bfloat16):
        from pagedserve.kernels.triton_lora import triton_lora_expand, triton_lora_shrink

        h = triton_lora_shrink(x, lora_a, rows.seg_starts, rows.seg_slots, rows.max_seg_len)
        return triton_lora_expand(y, h, lora_b, rows.seg_starts, rows.seg_slots, rows.max_seg_len)
    return lora_expand_ref(y, lora_shrink_ref(x, lora_a, rows), lora_b, rows)
