"""Warm the L2 cache with a weight a decode step is about to read, while the GPU is busy with
kernels that leave memory idle.

At batch 1 a decode step streams every weight once, but between the matmuls run kernels that
read almost nothing (the norms, rotary + cache write, attention at short context and its merge):
~14 us a layer of Llama-3-8B in which the memory bus idles. `cp.async.bulk.prefetch.L2` (SM90)
asks the memory system to pull a byte range into L2 and returns at once; nothing waits for it, so
a kernel that issues it finishes as fast as before while the lines arrive behind it. The next
matmul then finds its first `nbytes` in L2.

`prefetch_l2` is the device-side helper any kernel can call with a base address (an int64) and
a byte count; `l2_prefetch` launches it alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16384  # bytes per bulk prefetch instruction (a multiple of 16)


@triton.jit
def prefetch_l2(addr, nbytes, pid, num_programs, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program `pid` of `num_programs` asks for its share of [addr, addr + nbytes) in L2, in
    CHUNK-byte pieces (a partial last piece is left out: the range never reads past its end)."""
    n_chunks = nbytes // CHUNK
    for start in range(pid * BLOCK, n_chunks, num_programs * BLOCK):
        i = tl.minimum(start + tl.arange(0, BLOCK), n_chunks - 1)  # repeats the last: harmless
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
            "=r,l,r",
            [addr + i.to(tl.int64) * CHUNK, tl.full([BLOCK], CHUNK, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _prefetch_kernel(addr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    prefetch_l2(addr, nbytes, tl.program_id(0), tl.num_programs(0), CHUNK, BLOCK)


def prefetch_span(weight: torch.Tensor, max_bytes: int) -> tuple[int, int]:
    """(address, bytes) of the first `max_bytes` of a contiguous weight, for `prefetch_l2`."""
    if not weight.is_contiguous():
        raise ValueError("only a contiguous tensor can be prefetched as one byte range")
    return weight.data_ptr(), min(weight.numel() * weight.element_size(), max_bytes)


def l2_prefetch(weight: torch.Tensor, max_bytes: int, programs: int = 1) -> None:
    """Launch `prefetch_l2` alone for the first `max_bytes` of `weight`."""
    addr, nbytes = prefetch_span(weight, max_bytes)
    if nbytes >= CHUNK:
        _prefetch_kernel[(programs,)](addr, nbytes, CHUNK=CHUNK, BLOCK=128, num_warps=4)
