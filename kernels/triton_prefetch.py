"""Warm the L2 cache with the first bytes of a weight, in Triton (kernels/prefetch.py says when).

Each program asks for its share of the byte range with `cp.async.bulk.prefetch.L2` (SM90), one
instruction per CHUNK bytes; nothing is loaded into registers or shared memory. A program's
issue is throttled (H100, `tests/gpu/probe_l2_prefetch.py`: 33.5 MB take 133 us from one
program, 10 us from 16), so the kernel takes as long as the transfer and runs beside the work it
hides behind, on a side stream, rather than inside a one-program kernel such as the norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16384  # bytes per bulk prefetch instruction (a multiple of 16)
BLOCK = 128  # instructions a program issues at once


@triton.jit
def _prefetch_kernel(addr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p asks for chunks p*BLOCK.. of every num_programs*BLOCK; a partial last chunk is
    left out (the range never reads past its end)."""
    n_chunks = nbytes // CHUNK
    step = tl.num_programs(0) * BLOCK
    for start in range(tl.program_id(0) * BLOCK, n_chunks, step):
        i = tl.minimum(start + tl.arange(0, BLOCK), n_chunks - 1)  # repeats the last: harmless
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
            "=r,l,r",
            [addr + i.to(tl.int64) * CHUNK, tl.full([BLOCK], CHUNK, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def l2_prefetch(weight: torch.Tensor, max_bytes: int, programs: int) -> None:
    """Ask for the first `max_bytes` of a contiguous `weight` in L2, from `programs` programs."""
    if not weight.is_contiguous():
        raise ValueError("only a contiguous tensor can be prefetched as one byte range")
    nbytes = min(weight.numel() * weight.element_size(), max_bytes)
    if nbytes >= CHUNK:
        _prefetch_kernel[(programs,)](weight.data_ptr(), nbytes, CHUNK=CHUNK, BLOCK=BLOCK)
