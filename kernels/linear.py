"""The model-dtype matmul of every linear layer and the LM head: `F.linear`, except that on CUDA
a few rows (a decode batch of <= 32) may take the Triton GEMV (kernels/triton_gemv.py), which reads
the weight once without cuBLAS' split-K reduce kernel.

Which one runs is measured, not assumed: the first call for a (rows, N, K, kind) key outside a
CUDA-graph capture times both (a few runs each, CUDA events) and keeps the faster for the rest of
the process, so the GEMV only replaces cuBLAS where it wins on this GPU. Each call is timed after
an L2 flush, as a decode step meets its weights. Decode graphs warm up before they capture, so
every choice they hold is made then; an eager step meeting a new key pays one short
synchronizing measurement. The row count is a host int, fixed per graph bucket.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels.activation import silu_and_mul
from pagedserve.kernels.backend import fusion_enabled, use_triton
from pagedserve.kernels.norm import NormRows

GEMV_MAX_M = 32  # kernels/triton_gemv.py's limit, kept here so CPU runs never import triton
TIMING_RUNS = 9
LAUNCH_COVER_CYCLES = 500_000  # GPU spin before each timed call: ~0.3 ms, past its host launch
# (rows, N, K, kind, dtype, device) -> whether the GEMV beat cuBLAS there (bench_gemv prints it);
# kind: "plain", "gated" (silu folded in) or "norm" (the RMSNorm before folded in)
GEMV_WINS: dict[tuple[object, ...], bool] = {}


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Device and dtype first: a CPU trace (torch.export) then never guards on the row count.
    return (
        use_triton(x)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_M
        and x.stride(1) == 1
        and fusion_enabled("gemv")
    )


def linear(
    x: torch.Tensor | NormRows, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [M, K], weight [N, K] -> [M, N]; `NormRows` (the norm
    before said `takes_norm_rows`) are normalized inside the GEMV."""
    if isinstance(x, NormRows):
        from pagedserve.kernels.triton_gemv import triton_gemv

        return triton_gemv(x.x, weight, bias, norm=x)
    if use_gemv(x, weight):
        from pagedserve.kernels.triton_gemv import triton_gemv

        fast = lambda: triton_gemv(x, weight, bias)  # noqa: E731
        if _gemv_wins(x, weight, "plain", fast, lambda: F.linear(x, weight, bias)):
            return fast()
    return F.linear(x, weight, bias)


def takes_norm_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the RMSNorm making x (its input rows, [M, K]) should leave them to this weight's
    GEMV (`NormRows`): at GEMV batch sizes where, measured, the fused kernel beats the norm
    kernel plus this layer's own matmul."""
    if not (use_gemv(x, weight) and fusion_enabled("norm-gemv")):
        return False
    won = GEMV_WINS.get(_gemv_key(x, weight, "norm"))
    if won is not None:  # (measured: no timing tensors to make, inside a graph least of all)
        return won
    from pagedserve.kernels.triton_gemv import triton_gemv
    from pagedserve.kernels.triton_norm import triton_rms_norm

    ones = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    rows = NormRows(x, x, ones, 1e-6, torch.empty_like(x))
    fast = lambda: triton_gemv(x, weight, None, norm=rows)  # noqa: E731
    slow = lambda: linear(triton_rms_norm(x, ones, 1e-6, x)[0], weight, None)  # noqa: E731
    return _gemv_wins(x, weight, "norm", fast, slow)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(silu_and_mul(x), weight, bias)`: x [M, 2K] (gate | up) -> [M, N]; at GEMV sizes
    the activation may happen inside the GEMV's loads (one kernel instead of two)."""
    if use_gemv(x, weight) and fusion_enabled("gated-gemv"):
        from pagedserve.kernels.triton_gemv import triton_gemv

        fast = lambda: triton_gemv(x, weight, bias, gated=True)  # noqa: E731
        slow = lambda: linear(silu_and_mul(x), weight, bias)  # noqa: E731
        return fast() if _gemv_wins(x, weight, "gated", fast, slow) else slow()
    return linear(silu_and_mul(x), weight, bias)


def _gemv_wins(
    x: torch.Tensor,
    weight: torch.Tensor,
    kind: str,
    fast: Callable[[], torch.Tensor],
    slow: Callable[[], torch.Tensor],
) -> bool:
    key = _gemv_key(x, weight, kind)
    won = GEMV_WINS.get(key)
    if won is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return True  # nothing to time against here (the interpreter; a capture's first call)
        from triton.runtime.errors import OutOfResources

        try:
            won = _median_ms(fast) <= _median_ms(slow)
        except OutOfResources:  # a launch config this GPU's shared memory cannot hold
            won = False
        GEMV_WINS[key] = won
    return won


def _gemv_key(x: torch.Tensor, weight: torch.Tensor, kind: str) -> tuple[object, ...]:
    return (x.shape[0], *weight.shape, kind, x.dtype, x.device)


def _median_ms(fn: Callable[[], torch.Tensor]) -> float:
    """Median GPU time of one call, as a decode graph runs it: the L2 cache flushed before it
    (in a decode step every weight arrives from memory; timed back to back the smaller ones,
    qkv and o_proj, would be read partly from L2), and the GPU kept busy past the host's
    launch of it (a Triton launch takes the host tens of microseconds, longer than the kernel:
    timed bare, the GPU's wait for it would count, though a graph replay has none)."""
    fn()  # compile / cuBLAS heuristics outside the timing
    device = torch.cuda.current_device()
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    flush = torch.empty(2 * l2_bytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(TIMING_RUNS):
        flush.zero_()
        torch.cuda._sleep(LAUNCH_COVER_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
