"""Pull o_proj's weight into L2 while a decode layer attends (CUDA, SM90+, <= 8 rows).

Between the qkv and output projections of a small decode batch run rotary + cache write,
attention and its split merge: ~10 us a layer of Llama-3-8B at short context in which the
memory bus idles. `prefetch_weight` forks a side-stream kernel there that asks for the first
PREFETCH_BYTES of the next weight in L2 (kernels/triton_prefetch.py), so o_proj reads them from
L2 instead of memory; `join_prefetches` joins the side stream back once o_proj is launched, in
the same attention layer's `forward_layer` (a CUDA-graph capture needs every fork joined, and a
model or draft head built of these layers then has none left to join). The fork and join are
graph edges, so captured decode graphs replay them.

Measured on an H100. The probe (`tests/gpu/probe_l2_prefetch.py`, step `l2-probe`: a W3-shaped
chain of the real GEMVs, attention as a 7 us spin) went 5.50 -> 5.35 ms for 32 layers with 24 MB
of o_proj prefetched by 16 programs; the whole 34 MB or more programs were no better, and
prefetching gate/up, down or qkv too, or any weight while the GEMV before it still streams, was
slower (the GEMVs already keep memory busy). In the engine (W3, `STEPS=w3-ablate` with
`ABLATE="none l2-prefetch"`) the GEMVs of a token take 104 us less, but rotary + cache write and
attention, latency-bound, take 53 us more beside the prefetch's traffic: graph replay 5.920 ->
5.873 ms, W3 5.97 -> 5.92-5.95 ms/token. Batches over PREFETCH_MAX_ROWS are left alone: their
attention reads more of the cache, which would evict the prefetched lines (W5's 24 rows at 16k
tokens read 1.6 GB a layer) and was not measured to gain. `PAGEDSERVE_DISABLE_FUSIONS=l2-prefetch`
turns it off.

W2 once looked worse with this and the qkv + rotary GEMV both on (TTFT p99 686 and 770 ms, where
runs with one or both off gave 101-111), but those two were each the first W2 run on a fresh
machine: Triton compiled the float32 LM head's variants for 16-32 rows while serving. Start-up now
compiles them (`worker/warm_up.py`'s `warm_up_head`), and the first W2 run on a fresh H100 with both
fusions on gives TTFT p99 117 ms, TPOT p99 11.4 ms (`STEPS=w2`).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.backend import fusion_enabled, use_triton

PREFETCH_BYTES = 24 << 20  # of the 50 MB L2 of an H100
PREFETCH_PROGRAMS = 16  # enough to stream at memory speed (3.2 TB/s; 1 program: 0.25)
PREFETCH_MAX_ROWS = 8
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the prefetch stream
_FORKED: set[int] = set()  # devices whose side stream has work not yet joined


def prefetch_wanted(x: torch.Tensor) -> bool:
    """Whether a layer whose rows are `x` ([T, ...]) prefetches its next weight: a decode-sized
    batch on a GPU with bulk L2 prefetch (compute capability 9.0+)."""
    return (
        x.is_cuda
        and use_triton(x)
        and 0 < x.shape[0] <= PREFETCH_MAX_ROWS
        and torch.cuda.get_device_capability(x.device)[0] >= 9
        and fusion_enabled("l2-prefetch")
    )


def prefetch_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Fork the L2 prefetch of `weight`'s first PREFETCH_BYTES off the current stream, if
    `prefetch_wanted(x)`; it runs beside the kernels that follow."""
    if not prefetch_wanted(x) or not weight.is_contiguous():
        return
    from pagedserve.kernels.triton_prefetch import l2_prefetch

    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.get(index)
    if side is None:
        side = _SIDE_STREAMS[index] = torch.cuda.Stream(device=x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        l2_prefetch(weight, PREFETCH_BYTES, PREFETCH_PROGRAMS)
    _FORKED.add(index)


def join_prefetches(x: torch.Tensor) -> None:
    """Make the current stream wait for the prefetches forked on x's device (a no-op if none)."""
    if not x.is_cuda:
        return
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index in _FORKED:
        torch.cuda.current_stream(x.device).wait_stream(_SIDE_STREAMS[index])
        _FORKED.discard(index)
