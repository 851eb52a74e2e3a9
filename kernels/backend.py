"""Which implementation an op runs: the torch reference or a fast path (Triton, FlashAttention).

The rule is one predicate per tensor: a CUDA tensor takes the fast path when Triton imports,
anything else takes the torch reference, so CPU runs (and CI) never import Triton. Environment
variables, read once per process (they are start-up settings, never flipped at run time):

- `PAGEDSERVE_ATTENTION_BACKEND=torch|triton|flash` forces the attention backend (and, for
  `torch`, the reference KV-cache write too); unset means triton on CUDA, torch elsewhere.
- `PAGEDSERVE_DISABLE_TRITON=1` sends every op to the torch reference (debugging a fast path).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

ATTENTION_BACKENDS = ("torch", "triton", "flash")


@functools.cache
def triton_available() -> bool:
    if os.environ.get("PAGEDSERVE_DISABLE_TRITON", "0") not in ("", "0"):
        return False
    return importlib.util.find_spec("triton") is not None


@functools.cache
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


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
    """`torch`, `triton` or `flash` for a model on `device`; a forced backend must be usable."""
    is_cuda = torch.device(device).type == "cuda"
    forced = forced_attention_backend()
    if forced == "torch":
        return "torch"
    if forced is not None and not is_cuda:
        raise ValueError(f"attention backend {forced!r} needs a CUDA device, not {device}")
    if forced == "flash" and not flash_attn_available():
        raise ValueError("attention backend 'flash' needs the flash-attn package")
    if forced == "triton" and not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package")
    if forced is not None:
        return forced
    return "triton" if is_cuda and triton_available() else "torch"


def use_triton_cache_write(kv_cache: torch.Tensor) -> bool:
    """The KV-cache write follows the attention choice: reference only when forced to torch."""
    return use_triton(kv_cache) and forced_attention_backend() != "torch"
