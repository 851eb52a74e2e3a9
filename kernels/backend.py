"""Which implementation an op runs: the torch reference or a fast path (Triton).

The rule is one predicate per tensor: a CUDA tensor takes the fast path when Triton imports,
anything else takes the torch reference, so CPU runs (and CI) never import Triton. Attention has
its own choice among backends (kernels/attention/selection.py). Environment variables, read once
once per process into `settings.Settings` (start-up settings, never flipped at run time):

- `PAGEDSERVE_ATTENTION_BACKEND=torch|sdpa|triton|flash` forces the attention backend (and, for
  `torch`, the reference KV-cache write too), over `--attention-backend`
  (kernels/attention/registry.py).
- `PAGEDSERVE_DISABLE_TRITON=1` sends every op to the torch reference (debugging a fast path).
- `PAGEDSERVE_MIXED_SPLIT_TOKENS=N` (default 1024; 0: never): eager mixed steps of at least N
  tokens attend as a decode part and a prompt part (kernels/attention/dispatch.py).
- `PAGEDSERVE_DISABLE_FUSIONS=name,...` turns off single fusions and fast paths on CUDA, to measure
  each one's gain (`tests/gpu/device_run.sh` step `w3-ablate`): `gemv` (the Triton GEMV for <= 32
  rows, kernels/triton_gemv.py), `gated-gemv` (silu_and_mul folded into the down projection's GEMV),
  `rope-cache` (rotary fused with the KV-cache write), `graph-head` (LM head and argmax inside small
  decode graphs), `cascade` (shared-prefix attention for large batches,
  kernels/attention/cascade.py, and its decode graphs), `fp8-fast-accum` (FP8 prefill GEMMs
  accumulate at the tensor cores' own precision, kernels/fp8.py), `norm-quant` (the RMSNorm before
  an FP8 layer writes its per-token quantized input, kernels/triton_norm.py), `l2-prefetch`
  (o_proj's weight pulled into L2 during a decode batch's attention, kernels/prefetch.py),
  `qkv-rope` (rotary and the cache write in the qkv GEMV's epilogue, kernels/triton_qkv_rope.py),
  `swiglu-gemm` (a prompt-sized batch's gate/up GEMM with silu-and-mul in its epilogue, quack's,
  kernels/swiglu_gemm.py), `lora-gemv` (a decode batch's LoRA shrink inside the base GEMV,
  kernels/triton_lora.py), `lora-swiglu` (a prompt's gate/up LoRA deltas formed inside its
  silu-and-mul), `moe-gemv` (a few tokens' experts as two GEMVs, kernels/triton_moe_decode.py),
  `mla-decode` (MLA's absorbed decode in Triton, kernels/triton_mla.py); `all` turns off every one.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from pagedserve import settings
from pagedserve.settings import FUSIONS

__all__ = [
    "FUSIONS", "dot_precision", "fusion_enabled", "num_sms", "triton_available", "use_triton",
]  # fmt: skip


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input_precision for operands of `dtype`: a float32 model gets float32 products
    ("ieee"; Triton's default would round them to TF32, which turns greedy ties on a float32
    model's MoE layer or LoRA delta); 16-bit operands are exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def num_sms(device_index: int) -> int:
    """The GPU's SM count (launch grids are sized by it; looked up once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return not settings.current().disable_triton and _triton_importable()


def fusion_enabled(name: str) -> bool:
    """Whether the fusion or fast path `name` (one of FUSIONS) is on (the default)."""
    return settings.current().fusion_enabled(name)


def use_triton(x: torch.Tensor) -> bool:
    """Whether an elementwise/norm op on `x` should run its Triton kernel."""
    return x.is_cuda and triton_available()
