"""LoRA slots of one parallel linear layer, and the step's rows that use them.

Every wrapped layer holds `max_loras` device slots of A `[S, P * R, in / tp]` and B
`[S, out / tp, P * R]`: P parts (q, k, v of `qkv_proj`; gate, up of `gate_up_proj`; one for the
row-parallel layers), each of rank up to R (`--max-lora-rank`, zero padded), every adapter's
scaling folded into its B. Part p reads A rows `[p R, p R + r)` and writes B's rows of its output
slice, so one shrink and one expand serve a merged layer. Shards follow the layer's: a
column-parallel layer keeps A whole and this rank's rows of B; a row-parallel one keeps this
rank's columns of A and B whole, and its delta, a partial sum like `x W^T`, rides the layer's
all-reduce.

`LoRABatch` is one object shared by every wrapped layer: the model runner sets it before each
forward (which slot each request of the batch uses), so no layer signature changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kernels.backend import fusion_enabled
from pagedserve.kernels.linear import GEMV_MAX_M, use_gemv
from pagedserve.kernels.lora import PinnedRing, SlotRows, lora_apply, lora_uses_triton


@dataclass(frozen=True)
class OutPart:
    """One part of a layer's output on this rank: rows `[offset, offset + size)` of the output,
    taken from rows `[shard_start, shard_start + size)` of the whole checkpoint part of
    `full_size` rows."""

    offset: int
    size: int
    full_size: int
    shard_start: int


class LoRABatch:
    """Which rows of the current step use which slot: the requests' token offsets and slots
    (`segments`, host data), grouped on the device on first use (`rows`: a step that replays a
    CUDA graph copies them into the graph's buffer instead), or rows over a graph's buffer
    (`static`). Neither: no adapter in this step (the layers skip LoRA entirely)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.segments: tuple[np.ndarray, list[int]] | None = None  # query_start_loc, slots
        self._rows: SlotRows | None = None
        # the per-step copies of rows (here and the graphs' buffer's): pinned buffers reused
        self.ring = PinnedRing(device) if device.type == "cuda" else None

    def set(
        self, segments: tuple[np.ndarray, list[int]] | None = None, static: SlotRows | None = None
    ) -> None:
        self.segments, self._rows = segments, static

    @property
    def active(self) -> bool:
        return self._rows is not None or self.segments is not None

    @property
    def rows(self) -> SlotRows | None:
        if self._rows is None and self.segments is not None:
            self._rows = SlotRows.from_segments(*self.segments, self.device, self.ring)
        return self._rows


class LoRASlots:
    """A layer's `max_loras` slots; `add(x, y)` adds the step's deltas to y in place."""

    def __init__(
        self,
        parts: list[OutPart],
        in_size: int,  # per rank
        in_shard: tuple[int, int],  # (start, size) of this rank's columns of A's full input
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        batch: LoRABatch,
    ) -> None:
        self.parts, self.in_shard, self.max_rank, self.batch = parts, in_shard, max_rank, batch
        out = sum(p.size for p in parts)
        width = len(parts) * max_rank
        self.lora_a = torch.zeros(max_loras, width, in_size, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out, width, dtype=dtype, device=device)

    @property
    def active(self) -> bool:
        return self.batch.active

    def fuses_gate(self, x: torch.Tensor) -> bool:
        """Whether `add(..., gated=True)` forms silu(gate) * up itself (in the Triton shrink's
        loads), so the layer may keep its gated matmul (a GEMV's: decode sizes); else it passes
        activated rows."""
        return lora_uses_triton(x) and x.dtype == self.lora_a.dtype and x.shape[0] <= GEMV_MAX_M

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool
    ) -> torch.Tensor | None:
        """`x W^T + b` plus the deltas in two kernels at decode sizes (the shrink inside the
        base GEMV, kernels/triton_lora.py's `triton_lora_linear`); None where that does not
        apply (the caller runs its matmul, then `add`)."""
        rows = self.batch.rows
        if (
            rows is None
            or not use_gemv(x, weight)
            or x.dtype != self.lora_a.dtype
            or rows.token_slots.shape[0] < x.shape[0]
            or not fusion_enabled("lora-gemv")
        ):
            return None
        from pagedserve.kernels.triton_lora import triton_lora_linear

        return triton_lora_linear(
            x, weight, bias, self.lora_a, self.lora_b, rows.token_slots, gated
        )

    def swiglu(self, x: torch.Tensor, matmul: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """A merged gate/up layer's `silu_and_mul(x W^T + deltas)` above GEMV sizes on CUDA,
        the deltas formed in the activation's loads (`triton_lora_swiglu`); None elsewhere."""
        rows = self.batch.rows
        if (
            rows is None
            or x.shape[0] <= GEMV_MAX_M
            or not lora_uses_triton(x)
            or x.dtype != self.lora_a.dtype
            or not fusion_enabled("lora-swiglu")
        ):
            return None
        from pagedserve.kernels.triton_lora import triton_lora_swiglu

        return triton_lora_swiglu(matmul(), x, self.lora_a, self.lora_b, rows.token_slots)

    def add(self, x: torch.Tensor, y: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """`y += B_s A_s x` on rows of adapters: x [T, in / tp] (gated: [T, 2 in / tp], gate |
        up, activated here), y [T, out]."""
        rows = self.batch.rows
        if rows is None:
            return y
        return lora_apply(y, x, self.lora_a, self.lora_b, rows, gated)

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_part(
        self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, parts: list[int]
    ) -> None:
        """Checkpoint A `[r, in]` and (scaled) B `[sum of parts' full rows, r]` into `slot` at
        rank columns of `part`; B's rows fill the output parts `parts` (one, or all of a fused
        module), each cut to this rank's shard."""
        r = a.shape[0]
        col = part * self.max_rank
        start, size = self.in_shard
        self.lora_a[slot, col : col + r].copy_(a[:, start : start + size])
        row = 0
        for i in parts:
            p = self.parts[i]
            shard = b[row + p.shard_start : row + p.shard_start + p.size]
            self.lora_b[slot, p.offset : p.offset + p.size, col : col + r].copy_(shard)
            row += p.full_size
        assert row == b.shape[0], "B's rows are the parts' whole rows"
