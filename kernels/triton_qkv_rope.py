"""The qkv projection of a few rows with rotary and the KV-cache write in its epilogue, in Triton:
one kernel where a decode layer ran the GEMV (kernels/triton_gemv.py) and then the rotary + cache
kernel (kernels/triton_rope_cache.py), ~3 us a layer of Llama-3-8B at batch 1.

Each program owns `BLOCK_H` rotary pairs of one head: output features `j` and `j + R/2` for
`BLOCK_H` consecutive `j`, so both halves of every pair it rotates come out of its own
accumulator. Its weight tile gathers those `2 BLOCK_H` rows (two runs of `BLOCK_H` consecutive
rows) into one `[2 BLOCK_H, BLOCK_K]` tile and one dot, as the GEMV's 32-row tile: the same bytes
and programs; the halves split after the loop. Two 16-row tiles and two dots per step were
slower (`python -m pagedserve.benchmarks.kernels.bench_gemv --qkv-rope`, H100, M = 1, weights out
of L2: 22.8 us against 21.2, where the GEMV alone takes 20.9 and the GEMV + rotary/cache pair
24.0).
The positions, cos/sin rows and slots load before the weight loop, off the kernel's tail.

Heads are q, then k, then v (the qkv weight's row order): q pairs are rotated and stored to the
query output, k pairs rotated and v pairs as they are go straight into each row's cache slot
(slot < 0, CUDA-graph padding, writes nothing), so keys and values never round-trip through
memory. The arithmetic follows the two unfused kernels: the projection rounded to the model
dtype, the rotation in float32, one rounding to the model dtype, then (FP8 cache) the division
by the scale and the clamp.

Applies to full-width neox rotary (`rotary_dim == head_dim`, Llama, Qwen2, Mistral...) with
`head_dim / 2` a multiple of 16 (the smallest dot) and a weight in the model dtype; anything else
runs the GEMV and the rotary + cache kernel (`qkv_rope_applies`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.backend import num_sms
from pagedserve.kernels.triton_gemv import GEMV_MAX_M, gemv_config
from pagedserve.kernels.triton_rope_cache import _to_cache

# Rotary pairs per program. Where 16 leave SMs idle (Llama-3-70B's qkv at `--tp 4`: 16 + 2 + 2
# heads a rank, 80 programs on an H100's 132 SMs), 8 were slower still: 22.2 us against 19.3
# (`bench_gemv --shapes llama3-70b-tp4 --qkv-rope`, H100, 2026-11-27), as was splitting K over two
# programs (19.9 us); deeper pipelines help there instead (`qkv_rope_config`). A config's BLOCK_H
# sets it.
BLOCK_H = 16


@triton.jit
def _qkv_rope_cache_kernel(
    x_ptr, w_ptr, bias_ptr, q_ptr, positions_ptr, cos_sin_ptr, kv_cache_ptr, slot_ptr,
    M, K, stride_xm, stride_wn, stride_qm, stride_cos, stride_cb, stride_ckv, stride_cs,
    k_inv_scale, v_inv_scale, num_q_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_H)
    j0 = (pid % (HALF // BLOCK_H)) * BLOCK_H
    j = j0 + tl.arange(0, BLOCK_H)  # [H] first-half features of the head
    f1 = head * HEAD_DIM + j  # [H] output features; their partners are f1 + HALF
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    # The epilogue's inputs load first, so their latency hides behind the weight stream.
    is_v = head >= num_q_heads + num_kv_heads
    pos = tl.load(positions_ptr + rm, mask=m_ok, other=0).to(tl.int64)
    cs_ptrs = cos_sin_ptr + pos[:, None] * stride_cos + j[None, :]
    head_m = head + 0 * rm  # [BM]: the head as a row vector, for masks
    cs_mask = (m_ok & (head_m < num_q_heads + num_kv_heads))[:, None]
    cos = tl.load(cs_ptrs, mask=cs_mask, other=0.0)  # [BM, H]
    sin = tl.load(cs_ptrs + HALF, mask=cs_mask, other=0.0)
    slot = tl.load(slot_ptr + rm, mask=m_ok & (head_m >= num_q_heads), other=-1).to(tl.int64)
    # One [2H, BK] weight tile of rows f1 | f1 + HALF, one dot; the halves split after the loop.
    r = tl.arange(0, 2 * BLOCK_H)
    rows = head * HEAD_DIM + j0 + (r % BLOCK_H) + (r // BLOCK_H) * HALF  # [2H]
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_H], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        if EVEN_K:
            w = tl.load(w_ptrs)  # [2H, BK]
        else:
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
    acc1, acc2 = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_H]), [0, 2, 1]))
    model_ty = q_ptr.dtype.element_ty
    x1 = acc1.to(model_ty).to(tl.float32)  # the projection's output, as the GEMV rounds it
    x2 = acc2.to(model_ty).to(tl.float32)
    if not is_v:  # q and k rotate
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if head < num_q_heads:
        q_ptrs = q_ptr + rm[:, None] * stride_qm + f1[None, :]
        tl.store(q_ptrs, x1.to(model_ty), mask=m_ok[:, None])
        tl.store(q_ptrs + HALF, x2.to(model_ty), mask=m_ok[:, None])
    else:
        ok = (m_ok & (slot >= 0))[:, None]
        kv_head = head - num_q_heads - is_v.to(tl.int32) * num_kv_heads
        dst = kv_cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        dst += kv_head * HEAD_DIM + is_v.to(tl.int64) * stride_ckv
        inv_scale = tl.where(is_v, v_inv_scale, k_inv_scale)
        cache_ty = kv_cache_ptr.dtype.element_ty
        ptrs = dst[:, None] + j[None, :]  # [BM, H]
        tl.store(ptrs, _to_cache(x1, inv_scale, model_ty, cache_ty, FP8), mask=ok)
        tl.store(ptrs + HALF, _to_cache(x2, inv_scale, model_ty, cache_ty, FP8), mask=ok)


def qkv_rope_config(
    n: int, k: int, programs: int, m: int, elem_bytes: int, num_sms: int
) -> dict[str, int]:
    """BLOCK_K, warps and stages: the GEMV's, except for 16-bit rows of a decode (<= 16 rows):
    where the pair programs are fewer than the SMs, each keeps 4 tiles of 512 columns in flight
    (its SM's share of the bus is then what limits it), else 3 of 256. Measured at M = 1 with
    the weights out of L2 (`python -m pagedserve.benchmarks.kernels.bench_gemv --qkv-rope`, H100,
    2026-11-27): Llama-3-70B's qkv at `--tp 4` (80 programs) 19.6 -> 18.6 us, Llama-3-8B's (192
    programs) 20.7 -> 19.9 us, where the plain GEMV takes 18.5 and 20.4."""
    cfg = gemv_config(n, k, m=m, elem_bytes=elem_bytes)
    if elem_bytes <= 2 and m <= 16:
        wide = programs < num_sms
        cfg.update(BLOCK_K=512 if wide else 256, num_stages=4 if wide else 3)
    return cfg


def qkv_rope_applies(x: torch.Tensor, weight: torch.Tensor, rotary_dim: int, head_dim: int) -> bool:
    """Whether `triton_qkv_rope_cache` takes this projection (see the module doc)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_M
        and weight.dtype == x.dtype
        and rotary_dim == head_dim
        and (head_dim // 2) % BLOCK_H == 0
    )


def triton_qkv_rope_cache(
    x: torch.Tensor,  # [M, K], M <= GEMV_MAX_M
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K]: q heads, k heads, v heads
    bias: torch.Tensor | None,  # [(Hq + 2 Hkv) * D]
    positions: torch.Tensor,  # [M] int
    cos_sin_cache: torch.Tensor,  # [max_position, D] float32: cos | sin
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [M] int64, < 0: no write
    num_q_heads: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    config: dict[str, int] | None = None,  # BLOCK_K, num_warps, num_stages, BLOCK_H (tests)
) -> torch.Tensor:  # [M, Hq * D], rotated
    """The rotated query of `x @ weight.T + bias`; the rotated keys and the values go into the
    cache at `slot_mapping` (what the GEMV, then `triton_rope_and_cache`, do)."""
    m, k = x.shape
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    heads = num_q_heads + 2 * num_kv_heads
    if not qkv_rope_applies(x, weight, cos_sin_cache.shape[-1], head_dim):
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype}, weight {weight.dtype}, rotary dim "
            f"{cos_sin_cache.shape[-1]}, head_dim {head_dim}: not a fused qkv + rotary projection"
        )
    if weight.shape != (heads * head_dim, k) or (
        bias is not None and bias.shape != (heads * head_dim,)
    ):
        raise ValueError(f"weight {tuple(weight.shape)} is not {heads} heads x {head_dim} by {k}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or cos_sin_cache.dtype != torch.float32:
        raise ValueError("x and weight need contiguous rows, cos_sin_cache float32")
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_dim:
        raise ValueError("kv_cache needs contiguous [Hkv, D] rows")
    if positions.shape != (m,) or slot_mapping.shape != (m,):
        raise ValueError(f"positions and slot_mapping must be [{m}]")
    q = torch.empty((m, num_q_heads * head_dim), dtype=x.dtype, device=x.device)
    half = head_dim // 2
    if config is None:
        sms = num_sms(x.device.index or 0) if x.is_cuda else 132
        programs = heads * (half // BLOCK_H)
        config = qkv_rope_config(heads * head_dim, k, programs, m, x.element_size(), sms)
    block_h = config.get("BLOCK_H", BLOCK_H)
    cfg = {key: config[key] for key in ("BLOCK_K", "num_warps", "num_stages")}
    _qkv_rope_cache_kernel[(heads * (half // block_h),)](
        x, weight, bias if bias is not None else x, q, positions, cos_sin_cache, kv_cache,
        slot_mapping, m, k, x.stride(0), weight.stride(0), q.stride(0), cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), 1.0 / k_scale, 1.0 / v_scale,
        num_q_heads, num_kv_heads,
        HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_M=16 if m <= 16 else 32,
        BLOCK_SIZE=kv_cache.shape[2], HAS_BIAS=bias is not None,
        EVEN_K=k % cfg["BLOCK_K"] == 0, FP8=kv_cache.dtype == torch.float8_e4m3fn, **cfg,
    )  # fmt: skip
    return q
