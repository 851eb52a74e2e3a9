"""Greedy argmax over a few rows of logits, in Triton: two small kernels where torch's two-pass
form (chunk maxima, the best chunk, a gather) launched five (~13 us a batch-1 decode step of
Llama-3-8B's 128k vocabulary on an H100, in every step).

Pass 1: one program per (row, CHUNK-wide chunk) writes the chunk's maximum and its first index.
Pass 2: one program per row picks the first chunk holding the row's maximum. The result is
`x.argmax(-1)`'s: the first maximum; a NaN counts as larger than any number, as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096


@triton.jit
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN: the maximum, as torch.argmax has it
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, offs, V), 0)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _pick_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    val = tl.load(val_ptr + row * num_chunks + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_chunks + c, mask=ok, other=0)
    best = tl.max(val, 0)
    first = tl.min(tl.where(ok & (val == best), c, BLOCK_C), 0)
    tl.store(out_ptr + row, tl.sum(tl.where(c == first, idx, 0), 0).to(tl.int64))


def triton_argmax(x: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N] int64
    """`x.argmax(dim=-1)` of 2-D logits with a contiguous last dimension."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"expected [N, V] logits, V > 0, contiguous rows, got {tuple(x.shape)}")
    n, v = x.shape
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    chunks = triton.cdiv(v, CHUNK)
    val = torch.empty((n, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, chunks), dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(n, chunks)](x, val, idx, v, x.stride(0), chunks, CHUNK=CHUNK, num_warps=8)
    _pick_kernel[(n,)](val, idx, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)
    return out
