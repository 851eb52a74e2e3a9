"""Which implementation an op runs: the torch reference or a fast path (Triton, FlashAttention,
batched SDPA on CPU).

The rule is one predicate per tensor: a CUDA tensor takes the fast path when Triton imports,
anything else takes the torch reference, so CPU runs (and CI) never import Triton. Attention on
a CPU runs the batched SDPA backend (kernels/cpu_attention.py), tested against the reference.
Environment variables, read once per process (start-up settings, never flipped at run time):

- `PAGEDSERVE_ATTENTION_BACKEND=torch|sdpa|triton|flash` forces the attention backend (and, for
  `torch`, the reference KV-cache write too); unset means triton on CUDA (torch without Triton),
  sdpa elsewhere.
- `PAGEDSERVE_DISABLE_TRITON=1` sends every op to the torch reference (debugging a fast path).
- `PAGEDSERVE_DISABLE_FUSIONS=name,...` turns off single decode-latency fusions on CUDA, to
  measure each one's gain (`tests/gpu/device_run.sh` step `w3-ablate`): `gemv` (the Triton GEMV
  for <= 8 rows, kernels/triton_gemv.py), `gated-gemv` (silu_and_mul folded into the down
  projection's GEMV), `rope-cache` (rotary fused with the KV-cache write), `graph-head` (LM head
  and argmax inside small decode graphs), `short-splits` (decode graphs without split-KV for
  short contexts); `all` turns off every one.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

ATTENTION_BACKENDS = ("torch", "sdpa", "triton", "flash")
FUSIONS = ("gemv", "gated-gemv", "rope-cache", "graph-head", "short-splits")


@functools.cache
def triton_available() -> bool:
    if os.environ.get("PAGEDSERVE_DISABLE_TRITON", "0") not in ("", "0"):
        return False
    return importlib.util.find_spec("triton") is not None


@functools.cache
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


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
    """Whether the decode fusion `name` (one of FUSIONS) is on (the default)."""
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


def attention_backend_name(device: torch.device | str) -> str:
    """`torch`, `sdpa`, `triton` or `flash` for a model on `device`; a forced backend must be
    usable (`torch` and `sdpa` run anywhere)."""
    is_cuda = torch.device(device).type == "cuda"
    forced = forced_attention_backend()
    if forced in ("torch", "sdpa"):
        return forced
    if forced is not None and not is_cuda:
        raise ValueError(f"attention backend {forced!r} needs a CUDA device, not {device}")
    if forced == "flash" and not flash_attn_available():
        raise ValueError("attention backend 'flash' needs the flash-attn package")
    if forced == "triton" and not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package")
    if forced is not None:
        return forced
    if not is_cuda:
        return "sdpa"
    return "triton" if triton_available() else "torch"


def use_triton_cache_write(kv_cache: torch.Tensor) -> bool:
    """The KV-cache write follows the attention choice: reference only when forced to torch."""
    return use_triton(kv_cache) and forced_attention_backend() != "torch"
