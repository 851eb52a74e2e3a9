"""The gated delta rule's chunked form (prefill rows), in Triton, from and into the state slots:
two kernels, as in fla's `chunk_gated_delta_rule` (the WY form of transformers'
`torch_chunk_gated_delta_rule`, kernels/gated_delta.py `chunk_rule`, its reference).

1. `_intra_kernel`, one program per (64-token chunk, value head), every chunk of every row at
   once: the chunk's strictly lower `A = (beta k) k^T * exp(g_i - g_j)` in 16 x 16 blocks,
   `T = (I + A)^-1` (forward substitution inside the four diagonal blocks, the others from
   `T_ij = -T_ii sum_m A_im T_mj`), then `u = T (beta v)` and `w = T (beta k exp(g))` into
   float32 scratch rows beside the tokens.
2. `_state_kernel`, one program per (row, value head, value-column block): the only serial
   part, the state `S` (`[Dk, BV]` in registers) across the row's chunks: `v_new = u - w S`, the
   output `(q exp(g)) S + (q k^T * decay) v_new` and `S exp(g_last) + (k exp(g_last - g))^T v_new`.

q and k are L2-normed here, q scaled by `Dk ** -0.5`. A row whose context starts in this step
(`fresh`) starts from zeros; its final state is written to its slot. Matmuls in float32 ("ieee")
for a float32 model, TF32 for 16-bit inputs (kernels/backend.dot_precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.backend import dot_precision

CHUNK = 64  # tokens per chunk: four 16-row blocks
SUB = 16


@triton.jit
def _mm(a, b, DT: tl.constexpr, P: tl.constexpr):
    """a @ b with float32 accumulation, operands in `DT` (the inputs' dtype: bf16 operands for a
    bf16 model, as fla does; float32 at precision `P` for a float32 one)."""
    return tl.dot(a.to(DT), b.to(DT), input_precision=P)


@triton.jit
def _keys(k_ptr, beta_ptr, g_ptr, t0, tok1, hk, BK: tl.constexpr):
    """The 16-token block from `t0`: L2-normed keys [16, BK], beta [16] and raw log decays [16].
    `hk`: (value head, key head, key heads, value heads, Dk, eps)."""
    head, key_head, num_k_heads, num_v_heads, dk, eps = hk
    ks = tl.arange(0, BK)
    t = t0 + tl.arange(0, 16)
    t_ok = t < tok1
    off = (t[:, None] * num_k_heads + key_head) * dk + ks[None, :]
    k = tl.load(k_ptr + off, mask=t_ok[:, None] & (ks < dk)[None, :], other=0.0).to(tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    vh = t * num_v_heads + head
    beta = tl.load(beta_ptr + vh, mask=t_ok, other=0.0).to(tl.float32)
    return k, beta, tl.load(g_ptr + vh, mask=t_ok, other=0.0).to(tl.float32)


@triton.jit
def _a_block(ki, bi, gi, kj, gj, DIAG: tl.constexpr, DT: tl.constexpr, P: tl.constexpr):
    """Block (i, j) of A: (beta_i k_i) k_j^T * exp(g_i - g_j), strictly lower where i == j."""
    a = _mm(ki * bi[:, None], tl.trans(kj), DT, P)
    if DIAG:
        ts = tl.arange(0, 16)
        lower = ts[:, None] > ts[None, :]
        return tl.where(lower, a * tl.exp(tl.where(lower, gi[:, None] - gj[None, :], 0.0)), 0.0)
    return a * tl.exp(gi[:, None] - gj[None, :])


@triton.jit
def _inv_diag(a):
    """(I + a)^-1 for a strictly lower [16, 16] a, row by row (forward substitution)."""
    ts = tl.arange(0, 16)
    inv = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0)
    for i in range(1, 16):
        a_i = tl.sum(tl.where(ts[:, None] == i, a, 0.0), axis=0)  # row i of a
        row = tl.sum(a_i[:, None] * inv, axis=0)
        inv = tl.where(ts[:, None] == i, inv - row[None, :], inv)
    return inv


@triton.jit
def _store_wu(w_ptr, u_ptr, v_ptr, keys, betas, decays, row, hv, I: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, P: tl.constexpr):  # fmt: skip
    """Block row I of w = T (beta k exp(g)) and u = T (beta v): `keys`, `betas`, `decays` the
    four blocks', `row` T's blocks (I, 0..3) (those past I unused), `hv` (first token, end,
    value head, value heads, Dk, Dv)."""
    t0, tok1, head, num_v_heads, dk, dv = hv
    ts, ks, vs = tl.arange(0, 16), tl.arange(0, BK), tl.arange(0, BV)
    w = tl.zeros((16, BK), dtype=tl.float32)
    u = tl.zeros((16, BV), dtype=tl.float32)
    for j in tl.static_range(I + 1):
        kb = keys[j] * (betas[j] * tl.exp(decays[j]))[:, None]
        w += _mm(row[j], kb, DT, P)
        vb = _v(v_ptr, t0 + 16 * j + ts, tok1, head, num_v_heads, dv, BV) * betas[j][:, None]
        u += _mm(row[j], vb, DT, P)
    t = t0 + I * 16 + ts
    rows = (t * num_v_heads + head)[:, None]
    t_ok = (t < tok1)[:, None]
    tl.store(w_ptr + rows * dk + ks[None, :], w.to(DT), mask=t_ok & (ks < dk)[None, :])
    tl.store(u_ptr + rows * dv + vs[None, :], u, mask=t_ok & (vs < dv)[None, :])


@triton.jit
def _v(v_ptr, t, tok1, head, num_v_heads, dv, BV: tl.constexpr):
    vs = tl.arange(0, BV)
    off = (t * num_v_heads + head)[:, None] * dv + vs[None, :]
    return tl.load(v_ptr + off, mask=(t < tok1)[:, None] & (vs < dv)[None, :], other=0.0).to(
        tl.float32
    )


@triton.jit
def _intra_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, chunks_ptr, num_chunks,
    num_k_heads, num_v_heads, dk, dv, eps,
    BK: tl.constexpr, BV: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    head = tl.program_id(1)
    t0 = tl.load(chunks_ptr + c).to(tl.int64)
    tok1 = tl.load(chunks_ptr + num_chunks + c).to(tl.int64)
    key_head = head // (num_v_heads // num_k_heads)
    DT: tl.constexpr = k_ptr.dtype.element_ty
    F32: tl.constexpr = tl.float32
    hk = (head, key_head, num_k_heads, num_v_heads, dk, eps)
    k0, b0, g0 = _keys(k_ptr, beta_ptr, g_ptr, t0, tok1, hk, BK)
    k1, b1, g1 = _keys(k_ptr, beta_ptr, g_ptr, t0 + 16, tok1, hk, BK)
    k2, b2, g2 = _keys(k_ptr, beta_ptr, g_ptr, t0 + 32, tok1, hk, BK)
    k3, b3, g3 = _keys(k_ptr, beta_ptr, g_ptr, t0 + 48, tok1, hk, BK)
    c0 = tl.cumsum(g0, axis=0)  # the chunk's cumulative log decay, block by block
    c1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
    c2 = tl.cumsum(g2, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
    c3 = tl.cumsum(g3, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0)
    t00 = _inv_diag(_a_block(k0, b0, c0, k0, c0, True, DT, P))
    t11 = _inv_diag(_a_block(k1, b1, c1, k1, c1, True, DT, P))
    t22 = _inv_diag(_a_block(k2, b2, c2, k2, c2, True, DT, P))
    t33 = _inv_diag(_a_block(k3, b3, c3, k3, c3, True, DT, P))
    a10 = _a_block(k1, b1, c1, k0, c0, False, DT, P)
    a20 = _a_block(k2, b2, c2, k0, c0, False, DT, P)
    a21 = _a_block(k2, b2, c2, k1, c1, False, DT, P)
    a30 = _a_block(k3, b3, c3, k0, c0, False, DT, P)
    a31 = _a_block(k3, b3, c3, k1, c1, False, DT, P)
    a32 = _a_block(k3, b3, c3, k2, c2, False, DT, P)
    t10 = -_mm(t11, _mm(a10, t00, F32, P), F32, P)
    t21 = -_mm(t22, _mm(a21, t11, F32, P), F32, P)
    t20 = _mm(a20, t00, F32, P) + _mm(a21, t10, F32, P)
    t20 = -_mm(t22, t20, F32, P)
    t32 = -_mm(t33, _mm(a32, t22, F32, P), F32, P)
    t31 = _mm(a31, t11, F32, P) + _mm(a32, t21, F32, P)
    t31 = -_mm(t33, t31, F32, P)
    t30 = _mm(a30, t00, F32, P) + _mm(a31, t10, F32, P)
    t30 = -_mm(t33, t30 + _mm(a32, t20, F32, P), F32, P)
    keys, betas, decays = (k0, k1, k2, k3), (b0, b1, b2, b3), (c0, c1, c2, c3)
    hv = (t0, tok1, head, num_v_heads, dk, dv)
    _store_wu(w_ptr, u_ptr, v_ptr, keys, betas, decays, (t00, t00, t00, t00), hv, 0, BK, BV, DT, P)
    _store_wu(w_ptr, u_ptr, v_ptr, keys, betas, decays, (t10, t11, t11, t11), hv, 1, BK, BV, DT, P)
    _store_wu(w_ptr, u_ptr, v_ptr, keys, betas, decays, (t20, t21, t22, t22), hv, 2, BK, BV, DT, P)
    _store_wu(w_ptr, u_ptr, v_ptr, keys, betas, decays, (t30, t31, t32, t33), hv, 3, BK, BV, DT, P)


@triton.jit
def _state_kernel(
    q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, state_ptr, out_ptr,
    slots_ptr, starts_ptr, ends_ptr, fresh_ptr,
    num_k_heads, num_v_heads, dk, dv, scale, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    head = tl.program_id(1)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    ks, ts = tl.arange(0, BK), tl.arange(0, BT)
    k_ok, v_ok = ks < dk, vs < dv
    start = tl.load(starts_ptr + r).to(tl.int64)
    end = tl.load(ends_ptr + r).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    key_head = head // (num_v_heads // num_k_heads)
    tile = ((slot * num_v_heads + head) * dk + ks[:, None]) * dv + vs[None, :]  # [BK, BV]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    DT: tl.constexpr = k_ptr.dtype.element_ty
    state = tl.load(state_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    state = tl.where(tl.load(fresh_ptr + r) == 0, state, 0.0)
    causal = ts[:, None] >= ts[None, :]
    for c0 in range(start, end, BT):
        t = c0 + ts
        t_ok = t < end
        qk_off = (t[:, None] * num_k_heads + key_head) * dk + ks[None, :]
        qk_ok = t_ok[:, None] & k_ok[None, :]
        kt = tl.load(k_ptr + qk_off, mask=qk_ok, other=0.0).to(tl.float32)  # [BT, BK]
        qt = tl.load(q_ptr + qk_off, mask=qk_ok, other=0.0).to(tl.float32)
        kt = (kt * tl.rsqrt(tl.sum(kt * kt, axis=1) + eps)[:, None]).to(DT)
        qt = (qt * (tl.rsqrt(tl.sum(qt * qt, axis=1) + eps) * scale)[:, None]).to(DT)
        vh = t * num_v_heads + head
        gc = tl.cumsum(tl.load(g_ptr + vh, mask=t_ok, other=0.0).to(tl.float32), axis=0)  # [BT]
        w = tl.load(w_ptr + vh[:, None] * dk + ks[None, :], mask=qk_ok, other=0.0)  # [BT, BK]
        tv_ok = t_ok[:, None] & v_ok[None, :]
        v_new = tl.load(u_ptr + vh[:, None] * dv + vs[None, :], mask=tv_ok, other=0.0)
        v_new -= _mm(w, state, DT, P)  # [BT, BV]
        attn = _mm(qt, tl.trans(kt), DT, P)
        decay = tl.where(causal, gc[:, None] - gc[None, :], 0.0)
        attn = tl.where(causal, attn * tl.exp(decay), 0.0)
        out = _mm(qt * tl.exp(gc)[:, None], state, DT, P)
        out += _mm(attn, v_new, DT, P)
        tl.store(out_ptr + vh[:, None] * dv + vs[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=tv_ok)  # fmt: skip
        g_last = tl.sum(tl.where(ts == BT - 1, gc, 0.0), axis=0)  # padding adds no decay
        k_decayed = kt * tl.exp(g_last - gc)[:, None]
        state = state * tl.exp(g_last) + _mm(tl.trans(k_decayed), v_new, DT, P)
    tl.store(state_ptr + tile, state.to(state_ptr.dtype.element_ty), mask=tile_ok)


def chunk_bounds(starts: list[int], ends: list[int]) -> list[int]:
    """Every row's 64-token chunks, as the first tokens of all, then their ends (2 x C)."""
    firsts = [c for lo, hi in zip(starts, ends, strict=True) for c in range(lo, hi, CHUNK)]
    lasts = [min(c + CHUNK, hi) for lo, hi in zip(starts, ends, strict=True)
             for c in range(lo, hi, CHUNK)]  # fmt: skip
    return firsts + lasts


def triton_chunk_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] float32, log decay
    beta: torch.Tensor,  # [T, Hv]
    ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv], rows `slots` read (unless fresh) and written
    slots: torch.Tensor,  # [R] int64: each row's state slot
    starts: torch.Tensor,  # [R] int64: each row's first token in q/k/v
    ends: torch.Tensor,  # [R] int64: one past its last
    fresh: torch.Tensor,  # [R] int32: 1 where the row starts from a zero state
    chunks: torch.Tensor | None = None,  # [2 * C] int64: chunk_bounds (default: a host sync)
    out: torch.Tensor | None = None,  # [T, Hv, Dv] to write into (default: a new float32 one)
) -> torch.Tensor:  # [T, Hv, Dv]: the named rows' tokens written, the others left as they were
    num_k_heads, dk = q.shape[1:]
    num_v_heads, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != q.shape[0] or num_v_heads % num_k_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if ssm_state.shape[1:] != (num_v_heads, dk, dv) or not ssm_state.is_contiguous():
        raise ValueError(f"ssm_state {tuple(ssm_state.shape)}: need a contiguous [S, Hv, Dk, Dv]")
    rows = slots.shape[0]
    if not (starts.shape == ends.shape == fresh.shape == (rows,)):
        raise ValueError("slots, starts, ends and fresh are [R] each")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if out is None:
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    elif out.shape != v.shape or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)}: need a contiguous {tuple(v.shape)}")
    if not rows:
        return out
    if chunks is None:
        chunks = torch.tensor(chunk_bounds(starts.tolist(), ends.tolist()), device=v.device)
    num_chunks = chunks.shape[0] // 2
    precision = dot_precision(q.dtype)
    block_k = max(16, triton.next_power_of_2(dk))
    w = torch.empty((q.shape[0], num_v_heads, dk), dtype=k.dtype, device=v.device)
    u = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    _intra_kernel[(num_chunks, num_v_heads)](
        k, v, g, beta, w, u, chunks, num_chunks, num_k_heads, num_v_heads, dk, dv, 1e-6,
        BK=block_k, BV=max(16, triton.next_power_of_2(dv)), P=precision, num_warps=8,
    )  # fmt: skip
    # Few rows (one long prompt): narrower value blocks, more programs for the serial part.
    block_v = max(16, min(triton.next_power_of_2(dv), 64 if rows * num_v_heads >= 256 else 32))
    _state_kernel[(rows, num_v_heads, triton.cdiv(dv, block_v))](
        q, k, g, w, u, ssm_state, out, slots, starts, ends, fresh,
        num_k_heads, num_v_heads, dk, dv, dk**-0.5, 1e-6,
        BT=CHUNK, BK=block_k, BV=block_v, P=precision, num_warps=8, num_stages=2,
    )  # fmt: skip
    return out
