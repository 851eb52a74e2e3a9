"""Which implementation an op runs: the torch reference or a fast path (Triton, FlashAttention,
batched SDPA on CPU).

The rule is one predicate per tensor: a CUDA tensor takes the fast path when Triton imports,
anything else takes the torch reference, so CPU runs (and CI) never import Triton. Attention on
a CPU runs the batched SDPA backend (kernels/cpu_attention.py), tested against the reference.
Environment variables, read once per process (start-up settings, never flipped at run time):

- `PAGEDSERVE_ATTENTION_BACKEND=torch|sdpa|triton|flash` forces the attention backend (and, for
  `torch`, the reference KV-cache write too), over `--attention-backend`.
- `PAGEDSERVE_DISABLE_TRITON=1` sends every op to the torch reference (debugging a fast path).
- `PAGEDSERVE_MIXED_SPLIT_TOKENS=N` (default 1024; 0: never): eager mixed steps of at least N
  tokens attend as a decode part and a prompt part (kernels/attention_dispatch.py).
- `PAGEDSERVE_DISABLE_FUSIONS=name,...` turns off single fusions and fast paths on CUDA, to
  measure each one's gain (`tests/gpu/device_run.sh` step `w3-ablate`): `gemv` (the Triton GEMV
  for <= 32 rows, kernels/triton_gemv.py), `gated-gemv` (silu_and_mul folded into the down
  projection's GEMV), `rope-cache` (rotary fused with the KV-cache write), `graph-head` (LM head
  and argmax inside small decode graphs), `cascade` (shared-prefix attention for large batches,
  kernels/cascade.py, and its decode graphs), `fp8-fast-accum` (FP8 prefill GEMMs accumulate
  at the tensor cores' own precision, kernels/fp8.py), `norm-quant` (the RMSNorm before an FP8
  layer writes its per-token quantized input, kernels/triton_norm.py), `l2-prefetch` (o_proj's
  weight pulled into L2 during a decode batch's attention, kernels/prefetch.py), `qkv-rope`
  (rotary and the cache write in the qkv GEMV's epilogue, kernels/triton_qkv_rope.py),
  `swiglu-gemm` (a prompt-sized batch's gate/up GEMM with silu-and-mul in its epilogue, quack's,
  kernels/swiglu_gemm.py); `all` turns off every one.

`--attention-backend auto|triton|flash` (ModelConfig.attention_backend) picks on CUDA: `auto` is
triton unless FlashAttention 4 imports and was measured faster for a step kind (prefill, decode,
mixed) on this GPU model, in `attention_choice.json` beside this file (written by
`python -m pagedserve.kernels.bench_attention --write-choice`); then each step kind runs its
faster backend. On a CPU `auto` is sdpa, and `triton` or `flash` are refused.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os

import torch

ATTENTION_BACKENDS = ("torch", "sdpa", "triton", "flash")
REQUESTABLE_BACKENDS = ("auto", "triton", "flash")  # --attention-backend
STEP_KINDS = ("prefill", "decode", "mixed")
CHOICE_FILE = os.path.join(os.path.dirname(__file__), "attention_choice.json")
FUSIONS = (
    "gemv", "gated-gemv", "rope-cache", "graph-head", "cascade", "fp8-fast-accum", "norm-quant",
    "l2-prefetch", "qkv-rope", "swiglu-gemm",
)  # fmt: skip


@functools.cache
def triton_available() -> bool:
    if os.environ.get("PAGEDSERVE_DISABLE_TRITON", "0") not in ("", "0"):
        return False
    return importlib.util.find_spec("triton") is not None


@functools.cache
def flash_attn_available() -> bool:
    """Whether FlashAttention 4 (`flash_attn.cute`) imports."""
    from pagedserve.kernels.flash_attention import flash_attn_importable

    return flash_attn_importable()


@functools.cache
def disabled_fusions() -> frozenset[str]:
    raw = os.environ.get("PAGEDSERVE_DISABLE_FUSIONS") or ""
    names = {name.strip() for name in raw.split(",") if name.strip()}
    unknown = names - {*FUSIONS, "all"}
    if unknown:
        raise ValueError(
            f"PAGEDSERVE_DISABLE_FUSIONS names {', '.join(sorted(unknown))}: not one of "
            f"{', '.join(FUSIONS)}, all"
        )
    return frozenset(FUSIONS if "all" in names else names)


def fusion_enabled(name: str) -> bool:
    """Whether the fusion or fast path `name` (one of FUSIONS) is on (the default)."""
    assert name in FUSIONS, name
    return name not in disabled_fusions()


def use_triton(x: torch.Tensor) -> bool:
    """Whether an elementwise/norm op on `x` should run its Triton kernel."""
    return x.is_cuda and triton_available()


@functools.cache
def forced_attention_backend() -> str | None:
    name = os.environ.get("PAGEDSERVE_ATTENTION_BACKEND") or None
    if name is not None and name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"PAGEDSERVE_ATTENTION_BACKEND={name!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
        )
    return name


def attention_backend_name(
    device: torch.device | str,
    requested: str = "auto",
    kv_fp8: bool = False,
    dtype: torch.dtype | None = None,
) -> str:
    """`torch`, `sdpa`, `triton`, `flash` or `auto` (per step kind, see `auto_choices`) for a
    model on `device`; the environment's forced backend wins over `requested`. A backend asked
    for by name must be usable here, with a message that says why not."""
    if requested not in REQUESTABLE_BACKENDS:
        raise ValueError(
            f"--attention-backend {requested!r}: choose one of {', '.join(REQUESTABLE_BACKENDS)}"
        )
    is_cuda = torch.device(device).type == "cuda"
    name = forced_attention_backend() or requested
    if name in ("torch", "sdpa"):
        return name
    if name != "auto" and not is_cuda:
        raise ValueError(f"attention backend {name!r} needs a CUDA device, not {device}")
    if name == "flash" and not flash_attn_available():
        raise ValueError(
            "attention backend 'flash' needs FlashAttention 4 (`pip install --pre flash-attn-4`, "
            "or tests/gpu/fa4_wheels.sh for a machine without network): flash_attn.cute does "
            "not import"
        )
    if name == "flash" and (refusal := flash_refusal(kv_fp8, dtype)):
        raise ValueError(f"attention backend 'flash' {refusal}; use triton")
    if name == "triton" and not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package")
    if name != "auto":
        return name
    if not is_cuda:
        return "sdpa"
    if not triton_available():
        return "torch"
    choices = auto_choices(torch.cuda.get_device_name(device), kv_fp8, dtype)
    return "auto" if "flash" in choices.values() else "triton"


def flash_refusal(kv_fp8: bool, dtype: torch.dtype | None) -> str | None:
    """Why FA4 cannot run this model's attention (None: it can): it reads fp16/bf16 only (FP8 on
    SM100 only), so an FP8 KV cache or a float32 model stays on Triton."""
    if kv_fp8:
        return "does not read an FP8 KV cache"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"runs float16/bfloat16 models only, not {str(dtype).removeprefix('torch.')}"
    return None


def auto_choices(
    device_name: str, kv_fp8: bool = False, dtype: torch.dtype | None = None
) -> dict[str, str]:
    """The backend `auto` runs per step kind on a GPU model: what `attention_choice.json` holds
    for it when flash imports and can run this model (`flash_refusal`), else triton throughout."""
    choices = dict.fromkeys(STEP_KINDS, "triton")
    if (
        flash_refusal(kv_fp8, dtype)
        or not flash_attn_available()
        or not os.path.exists(CHOICE_FILE)
    ):
        return choices
    with open(CHOICE_FILE) as f:
        measured = json.load(f).get(device_name, {})
    valid = {k: v for k, v in measured.items() if k in STEP_KINDS and v in ("triton", "flash")}
    choices.update(valid)
    return choices


def use_triton_cache_write(kv_cache: torch.Tensor) -> bool:
    """The KV-cache write follows the attention choice: reference only when forced to torch."""
    return use_triton(kv_cache) and forced_attention_backend() != "torch"
