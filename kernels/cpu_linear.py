"""Linear layers on a CPU with the weight packed once, at load time, in oneDNN's blocked layout.

`F.linear` on a CPU calls MKL's sgemm with the plain `[N, K]` weight, which repacks panels of it
on every call: a decode step (M = 1..32 rows) pays that per matmul, and at M = 16 it runs at about
half the speed of the same GEMM on a prepacked weight (oneDNN's inner product, the path vLLM's CPU
build and inductor's freezing pass take too). `pack_weight` reorders a float32 or bfloat16 weight
once; `packed_linear` is then `x @ W^T + b` with it, the same math as `F.linear` (a different
summation order only). oneDNN's call costs ~12 us more than MKL's, so a weight under
`MIN_PACKED_ELEMENTS` (a tiny model's projections, where that overhead is the whole matmul)
stays plain. Packed weights are opaque (`torch._mkldnn` layout): nothing else can read
them, so a layer that packs keeps no plain copy unless something else shares it (tied embeddings).

`PAGEDSERVE_CPU_LINEAR=torch` (read once per process) keeps every CPU linear on `F.linear`.
"""

from __future__ import annotations

import torch

from pagedserve import settings

_PACKABLE = (torch.float32, torch.bfloat16)
MIN_PACKED_ELEMENTS = 1 << 19  # e.g. 4096 x 128: measured faster packed from here on, at M >= 1


def packing_enabled() -> bool:
    return settings.current().cpu_linear == "onednn" and torch.backends.mkldnn.is_available()


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
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except RuntimeError:  # a build without this oneDNN path: stay on F.linear
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [..., K] @ W^T + bias` -> `[..., N]` with `packed = pack_weight(W)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
