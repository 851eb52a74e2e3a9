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

GEMV_MAX_M = 32  # kernels/triton_gemv.py's limit, kept here so CPU runs never import triton
# A row count per compiled GEMV variant (Triton specializes an int argument equal to 1 or divisible
# by 16; tiles are 16 rows up to 16, 32 above): what a start-up warm-up runs to compile them all.
GEMV_ROW_CLASSES = (1, 2, 16, 17, 32)
TIMING_RUNS = 9
LAUNCH_COVER_CYCLES = 500_000  # GPU spin before each timed call: ~0.3 ms, past its host launch
# (rows, N, K, kind, dtype, device) -> whether the GEMV beat cuBLAS there (bench_gemv prints it);
# kind: "plain", "gated" (silu folded in) or "rope-cache" (qkv with rotary and the cache write)
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
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [M, K], weight [N, K] -> [M, N]; `out_dtype` (the LM head's
    float32 logits): the result rounded to x's dtype, then cast, as `.to(out_dtype)` after it
    would give, in the GEMV's own store instead of a separate cast kernel."""
    if use_gemv(x, weight):
        from pagedserve.kernels.triton_gemv import triton_gemv

        fast = lambda: triton_gemv(x, weight, bias, out_dtype=out_dtype)  # noqa: E731
        slow = lambda: _torch_linear(x, weight, bias, out_dtype)  # noqa: E731
        if _gemv_wins(x, weight, "plain", fast, slow):
            return fast()
    return _torch_linear(x, weight, bias, out_dtype)


def _torch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None
) -> torch.Tensor:
    y = F.linear(x, weight, bias)
    return y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(silu_and_mul(x), weight, bias)`: x [M, 2K] (gate | up) -> [M, N]; at GEMV sizes
    the activation may happen inside the GEMV's loads (one kernel instead of two)."""
    if use_gemv(x, weight) and fusion_enabled("gated-gemv"):
        from pagedserve.kernels.triton_gemv import triton_gemv

        fast = lambda: triton_gemv(x, weight, bias, gated=True)  # noqa: E731
        slow = lambda: linear(silu_and_mul(x), weight, bias)  # noqa: E731
        return fast() if _gemv_wins(x, weight, "gated", fast, slow) else slow()
    return linear(silu_and_mul(x), weight, bias)


def rope_cache_linear(
    x: torch.Tensor,  # [M, K], M <= GEMV_MAX_M
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K]
    bias: torch.Tensor | None,
    num_q_heads: int,
    positions: torch.Tensor,  # [M]
    cos_sin_cache: torch.Tensor,  # [max_position, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [M]
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:  # [M, Hq * D], rotated
    """A decode batch's qkv projection, rotary and cache write: the rotated query out, rotated
    keys and values into the cache. One kernel (kernels/triton_qkv_rope.py) where it beats
    `linear` + `triton_rope_and_cache` for this shape, measured like the GEMV; the caller
    checks `qkv_rope_applies` and `use_gemv` first."""
    from pagedserve.kernels.triton_qkv_rope import triton_qkv_rope_cache
    from pagedserve.kernels.triton_rope_cache import triton_rope_and_cache

    cache_args = (kv_cache, slot_mapping)
    fast = lambda: triton_qkv_rope_cache(  # noqa: E731
        x, weight, bias, positions, cos_sin_cache, *cache_args, num_q_heads, k_scale, v_scale
    )

    def slow() -> torch.Tensor:
        q_size, kv_size = num_q_heads * kv_cache.shape[4], kv_cache.shape[3] * kv_cache.shape[4]
        q, k, v = linear(x, weight, bias).split([q_size, kv_size, kv_size], dim=-1)
        return triton_rope_and_cache(
            positions, q, k, v, *cache_args, cos_sin_cache, k_scale, v_scale
        )

    return fast() if _gemv_wins(x, weight, "rope-cache", fast, slow) else slow()


def _gemv_wins(
    x: torch.Tensor,
    weight: torch.Tensor,
    kind: str,
    fast: Callable[[], torch.Tensor],
    slow: Callable[[], torch.Tensor],
) -> bool:
    key = (x.shape[0], *weight.shape, kind, x.dtype, x.device)
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
