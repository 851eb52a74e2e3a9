"""Linear layers on a CPU: the weight prepared once, at load time, for oneDNN or our C++ kernel.

`F.linear` on a CPU calls MKL's sgemm with the plain `[N, K]` weight, which repacks panels of it
on every call: a decode step (M = 1..32 rows) pays that per matmul, and at M = 16 it runs at about
half the speed of the same GEMM on a prepacked weight (oneDNN's inner product, the path vLLM's CPU
build and inductor's freezing pass take too). `pack_weight` reorders a float32 or bfloat16 weight
once; `packed_linear` is then `x @ W^T + b` with it, the same math as `F.linear` (a different
summation order only). oneDNN's call costs ~12 us more than MKL's, so a weight under
`MIN_PACKED_ELEMENTS` (a tiny model's projections, where that overhead is the whole matmul)
stays plain. Packed weights are opaque (`torch._mkldnn` layout): nothing else can read
them, so a layer that packs keeps no plain copy unless something else shares it (tied embeddings).

oneDNN packs bfloat16 only where the CPU has AVX-512 (bw, vl, dq) or AVX-NE-CONVERT. On an
AVX2-only CPU, `F.linear` in bfloat16 runs torch's slow fallback (measured 2-4.6x slower than
float32 at M = 8-32 on a 2-core AMD EPYC, docs/cpu_avx.md), so there a bfloat16 weight is packed
as float32 (twice its memory, a warning says so once) and `packed_linear` computes in float32 and
rounds the result to bfloat16: more precise than a bfloat16 GEMM, and faster.

A float32 weight of a model too large for the CPU's caches (`STREAMED_MODEL_BYTES`: its decode
steps are bound by reading the weights from memory) stays in its plain layout where the C++
kernels load (kernels/cpu_native.py): a step of at most `SMALL_M` rows (decode) runs
`small_linear`, which reads the weight once, in order (on the 2-core AVX2 EPYC, one thread:
1.4x faster than oneDNN's blocked layout at M = 1, 1.1x at M = 16, even at 32;
docs/cpu_avx.md), and larger steps (prefill) run oneDNN's inner product on the plain weight (as
fast as the prepacked one from M ~ 64 up: oneDNN packs inside the call). One copy either way,
and a tied LM head shares the embedding's; its weights too small to pack (`MIN_PACKED_ELEMENTS`)
take `small_linear` too. A smaller model's weights sit in cache, where the step is compute-bound
and oneDNN's blocked GEMM is the faster one (the embedded model's 4096 x 128 LM head: 0.24
against 0.39 ms at M = 8), so `settle_layouts` packs them once the whole model is loaded.

`PAGEDSERVE_CPU_LINEAR` (read once per process): `onednn` (the default, as above), `packed`
(every weight in oneDNN's blocked layout, the previous default; the A/B arm) or `torch` (every CPU
linear on `F.linear`).
"""

from __future__ import annotations

import functools
import logging

import torch

from pagedserve import settings
from pagedserve.kernels import cpu_native

logger = logging.getLogger(__name__)

_PACKABLE = (torch.float32, torch.bfloat16)
MIN_PACKED_ELEMENTS = 1 << 19  # e.g. 4096 x 128: measured faster packed from here on, at M >= 1
SMALL_M = 32  # rows up to which `small_linear` beats oneDNN on the plain weight (measured: 48)
STREAMED_MODEL_BYTES = 64 << 20  # weights beyond any L3 here: a decode step streams them


def packing_enabled() -> bool:
    return settings.current().cpu_linear != "torch" and torch.backends.mkldnn.is_available()


def keeps_plain(weight: torch.Tensor) -> bool:
    """Whether a float32 weight stays plain for `small_linear` (else it goes to oneDNN's layout)."""
    return (
        weight.dtype == torch.float32
        and settings.current().cpu_linear == "onednn"
        and cpu_native.available()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight [N, K]` in oneDNN's layout for `packed_linear`, or None where it does not apply
    (not on a CPU, another dtype, too small to gain, packing turned off or refused by this
    build)."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE or weight.dim() != 2:
        return None
    if weight.numel() < MIN_PACKED_ELEMENTS:
        return None
    if not packing_enabled():
        return None
    if keeps_plain(weight):
        return weight.detach().contiguous()  # no copy for a contiguous (or tied) weight
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except RuntimeError:  # a build or CPU without this oneDNN path
        if weight.dtype != torch.bfloat16:
            return None  # stay on F.linear
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), None)
    except RuntimeError:
        return None
    _warn_bf16_as_float32()
    return packed


@functools.cache
def _warn_bf16_as_float32() -> None:
    logger.warning(
        "this CPU has no bfloat16 matmul (AVX-512 bw/vl/dq or AVX-NE-CONVERT): bfloat16 linear "
        "weights are held as float32 (twice their memory) and their matmuls run in float32, "
        "2-4x faster here than bfloat16 F.linear; PAGEDSERVE_CPU_LINEAR=torch keeps bfloat16"
    )


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [..., K] @ W^T + bias` -> `[..., N]` in x's dtype with `packed = pack_weight(W)`."""
    if packed.layout == torch.strided and x.numel() <= SMALL_M * x.shape[-1]:
        rows = x.reshape(-1, x.shape[-1]).to(packed.dtype)
        out = cpu_native.small_linear(rows, packed, bias)  # plain float32 weight, a few rows
        return out.reshape(*x.shape[:-1], packed.shape[0]).to(x.dtype)
    if x.dtype == packed.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    bias = None if bias is None else bias.to(packed.dtype)  # a bfloat16 layer packed as float32
    out = torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, bias, "none", [], "")
    return out.to(x.dtype)


def settle_layouts(model: torch.nn.Module) -> None:
    """Once every layer is loaded: a model under `STREAMED_MODEL_BYTES` moves its plain weights to
    oneDNN's layout (compute-bound steps; the module's doc), a tied LM head packing a copy."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "packed", None), torch.Tensor)]
    plain = [m for m in layers if m.packed.layout == torch.strided]
    if not plain:
        return
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *(m.packed for m in plain))}
    if sum(t.numel() * t.element_size() for t in tensors.values()) >= STREAMED_MODEL_BYTES:
        _small_weights_to_kernel(model)
        return
    for module in plain:
        try:
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.packed, None)
        except RuntimeError:  # a build without this oneDNN path: the plain weight serves
            return


def _small_weights_to_kernel(model: torch.nn.Module) -> None:
    """In a streamed model, the float32 weights under `MIN_PACKED_ELEMENTS` (SmolLM2's 576 x 576
    o_proj) run `small_linear` too: oneDNN's call overhead that kept them on `F.linear` is not
    this kernel's, and MKL's sgemm on them took ~0.17 ms at M = 1 and ~0.35 at M = 9 (a
    speculative verification) on the 2-core EPYC, a few times the kernel's time."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "packed") or module.packed is not None or weight is None:
            continue
        if getattr(module, "weight_scale", None) is not None or weight.device.type != "cpu":
            continue
        if weight.dim() == 2 and keeps_plain(weight) and not getattr(module, "tied", False):
            module.packed = weight.detach().contiguous()
            module.weight = None
