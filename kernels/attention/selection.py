"""Which attention backend a model runs, picked once at start-up from the registry.

`--attention-backend auto|triton|flash` (ModelConfig.attention_backend) picks on CUDA: `auto` is
triton unless FlashAttention 4 imports and was measured faster for a step kind (prefill, decode,
mixed) on this GPU model, in `attention_choice.json` beside this file (written by
`python -m pagedserve.benchmarks.kernels.bench_attention --write-choice`); then each step kind
runs its faster backend (kernels/attention/dispatch.py). On a CPU `auto` is sdpa, and `triton` or
`flash` are refused. `PAGEDSERVE_ATTENTION_BACKEND` (kernels/attention/registry.py) wins over
the flag.
"""

from __future__ import annotations

import json
import os

import torch

from pagedserve.kernels.attention.dispatch import STEP_KINDS, per_step_kind
from pagedserve.kernels.attention.interface import PagedAttention
from pagedserve.kernels.attention.registry import (
    AUTO,
    AUTO_CANDIDATES,
    check_requested,
    forced_attention_backend,
    get_backend,
)
from pagedserve.kernels.backend import triton_available

CHOICE_FILE = os.path.join(os.path.dirname(__file__), "attention_choice.json")


def attention_backend_name(
    device: torch.device | str,
    requested: str = AUTO,
    kv_fp8: bool = False,
    dtype: torch.dtype | None = None,
    sinks: bool = False,
) -> str:
    """`torch`, `sdpa`, `triton`, `flash` or `auto` (per step kind, see `auto_choices`) for a
    model on `device`; the environment's forced backend wins over `requested`. A backend asked
    for by name must be usable here, with a message that says why not. `sinks`: the model's
    attention has sinks (gpt-oss)."""
    check_requested(requested)
    is_cuda = torch.device(device).type == "cuda"
    name = forced_attention_backend() or requested
    if name != AUTO:
        entry = get_backend(name)
        if not entry.cuda_only:
            if sinks and not entry.caps.sinks:
                raise ValueError(f"attention backend {name!r} has no attention sinks (gpt-oss)")
            return name
        if not is_cuda:
            raise ValueError(f"attention backend {name!r} needs a CUDA device, not {device}")
        if not entry.is_available():
            raise ValueError(f"attention backend {name!r} {entry.missing}")
        if refusal := backend_refusal(name, kv_fp8, dtype, sinks):
            raise ValueError(f"attention backend {name!r} {refusal}; use triton")
        return name
    if not is_cuda:
        return "sdpa"
    if not triton_available():
        return "torch"
    default = AUTO_CANDIDATES[0]
    choices = auto_choices(torch.cuda.get_device_name(device), kv_fp8, dtype, sinks)
    return default if set(choices.values()) == {default} else AUTO


def backend_refusal(
    name: str, kv_fp8: bool, dtype: torch.dtype | None, sinks: bool = False
) -> str | None:
    """Why backend `name` cannot run this model's attention (None: it can), from its
    capabilities: FA4 reads fp16/bf16 only (FP8 on SM100 only), so an FP8 KV cache or a float32
    model stays on Triton."""
    caps = get_backend(name).caps
    if sinks and not caps.sinks:
        return "has no attention sinks (gpt-oss)"
    if kv_fp8 and not caps.fp8_cache:
        return "does not read an FP8 KV cache"
    if not caps.float32 and dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"runs float16/bfloat16 models only, not {str(dtype).removeprefix('torch.')}"
    return None


def auto_choices(
    device_name: str, kv_fp8: bool = False, dtype: torch.dtype | None = None, sinks: bool = False
) -> dict[str, str]:
    """The backend `auto` runs per step kind on a GPU model: what `attention_choice.json` holds
    for it among the candidates that import and can run this model (`backend_refusal`), else
    the first candidate (triton) throughout."""
    default, *others = AUTO_CANDIDATES
    choices = dict.fromkeys(STEP_KINDS, default)
    usable = {default} | {
        n
        for n in others
        if not backend_refusal(n, kv_fp8, dtype, sinks) and get_backend(n).is_available()
    }
    if usable == {default} or not os.path.exists(CHOICE_FILE):
        return choices
    with open(CHOICE_FILE) as f:
        measured = json.load(f).get(device_name, {})
    choices.update({k: v for k, v in measured.items() if k in STEP_KINDS and v in usable})
    return choices


def select_backend(
    device: torch.device,
    requested: str = AUTO,
    kv_fp8: bool = False,
    dtype: torch.dtype | None = None,
    sinks: bool = False,
) -> PagedAttention:
    """Pick the attention implementation once, at model build time: `--attention-backend`
    (`requested`) or what `PAGEDSERVE_ATTENTION_BACKEND` forces; `auto` is Triton on CUDA (or the
    measured faster backend per step kind), batched SDPA on CPU. Every backend keeps
    `paged_attention_ref`'s signature (kernels/attention/interface.py)."""
    name = attention_backend_name(device, requested, kv_fp8, dtype, sinks)
    if torch.device(device).type != "cuda" or (name != AUTO and not get_backend(name).cuda_only):
        return get_backend(name).load()
    names = auto_choices(torch.cuda.get_device_name(device), kv_fp8, dtype, sinks)
    if name != AUTO:
        names = dict.fromkeys(names, name)
    return per_step_kind({kind: get_backend(n).load() for kind, n in names.items()})
