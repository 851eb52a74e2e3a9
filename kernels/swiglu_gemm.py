"""The gate/up projection with SwiGLU in the GEMM's epilogue, for prompt-sized batches on Hopper.

A prefill step's MLP ran cuBLAS' [M, 2I] gate/up GEMM, then `silu_and_mul` read that back and
wrote [M, I]: at M = 8,192 on an H100 the pair took 2.63-2.89 ms, the GEMM alone 2.39-2.64
(`STEPS=quack-probe`, tests/gpu/probe_quack_mlp.py). quack's CuTe-DSL GEMM (`quack-kernels`,
which FlashAttention 4 installs) applies `silu(gate) * up` to its fp32 accumulators and stores
only that: 2.43 ms in the same run as 2.89. With `concat_layout=("B",)` it reads our stacked
[gate; up] weight (`MergedColumnParallelLinear`, each rank's gate rows then its up rows) as it is.
A Triton GEMM with the same epilogue lost to cuBLAS (probe_gemm_silu.py), which is why this one is
quack's.

It runs for x of at least SWIGLU_GEMM_MIN_ROWS rows on an SM 9.x GPU, model-dtype (bf16/fp16)
weights without a bias, when quack imports and the fusion `swiglu-gemm` is on (kernels/backend.py);
everywhere else the GEMM and `silu_and_mul` run as before. Below ~1k rows the gain shrinks to a
few us (M = 512: 0.165 against 0.173 ms, 1,024: 0.319 against 0.339, 2,048: 0.618 against 0.674).
Its one kernel (default config, no autotuning: that took 9-39 s a shape and was not faster)
compiles on first use, in the start-up memory profile's full-budget forward; M is a runtime
argument, so every row count shares it, and CUDA graphs capture it. Compiled kernels are kept under
`$QUACK_CACHE_DIR` (default `quack` under the cache directory (settings.py)).

End to end on an H100, one lease, FA4 `auto`, each run once with and once without
(`PAGEDSERVE_DISABLE_FUSIONS=swiglu-gemm`): W1 30.05 against 29.22 req/s, W5 1.350 against 1.316.
"""

from __future__ import annotations

import functools

import torch

from pagedserve.kernels.backend import fusion_enabled, use_triton

SWIGLU_GEMM_MIN_ROWS = 1024


@functools.cache
def quack_available() -> bool:
    from pagedserve.kernels.cute_dsl import cute_dsl_importable

    return cute_dsl_importable("quack.gemm_interface")


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def swiglu_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `swiglu_linear(x, weight)` runs here (see the module doc)."""
    return (
        use_triton(x)
        and x.shape[0] >= SWIGLU_GEMM_MIN_ROWS
        and x.dim() == 2
        and x.is_contiguous()
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.shape[1] % 8 == 0  # TMA: rows of x and of the [M, I] output start 16-byte aligned
        and weight.shape[0] % 16 == 0
        and _is_hopper(x.device)
        and fusion_enabled("swiglu-gemm")
        and quack_available()
    )


@functools.cache
def _gemm_act():
    from pagedserve.kernels.cute_dsl import prepare_cute_dsl

    prepare_cute_dsl()
    from quack.gemm_interface import gemm_act

    return gemm_act


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(x @ weight.T)`: x [M, K], weight [2I, K] (gate rows, then up rows) -> [M, I],
    silu and the product taken in fp32 before the one rounding to x's dtype."""
    assert x.shape[1] == weight.shape[1] and weight.shape[0] % 2 == 0, (x.shape, weight.shape)
    out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    _gemm_act()(
        x, weight.t(), activation="swiglu", postact_out=out, store_preact=False,
        concat_layout=("B",), tuned=False,
    )  # fmt: skip
    return out
