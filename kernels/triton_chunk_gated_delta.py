"""The gated delta rule's chunked form (prefill rows), in Triton, from and into the state slots.

Program (row, value head, value-column block) walks its row's tokens in chunks of `BT`, keeping
its `[Dk, BV]` tile of the state in registers: per chunk it builds the chunk's strictly lower
`A = (beta k) k^T * exp(g_i - g_j)`, inverts `I + A` by forward substitution (`BT` vector steps),
and then only matmuls: `u = T (beta v)`, `w = T (beta k exp(g))`, `v_new = u - w S`, the output
`(q exp(g)) S + (q k^T * decay) v_new` and the new state `S exp(g_last) + (k exp(g_last - g))^T
v_new` (the WY form of transformers' `torch_chunk_gated_delta_rule`, kernels/gated_delta.py
`chunk_rule`, its reference). q and k are L2-normed here, q scaled by `Dk ** -0.5`. A row whose
context starts in this step (`fresh`) starts from zeros; its final state is written to its slot.
Matmuls in full float32 (`ieee`): the reference's precision; tf32 or bf16 operands are the first
speed knob to try on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr,
    slots_ptr, starts_ptr, ends_ptr, fresh_ptr,
    num_k_heads, num_v_heads, dk, dv, scale, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
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
    state = tl.load(state_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    state = tl.where(tl.load(fresh_ptr + r) == 0, state, 0.0)
    lower = ts[:, None] > ts[None, :]
    causal = ts[:, None] >= ts[None, :]
    for c0 in range(start, end, BT):
        t = c0 + ts
        t_ok = t < end
        qk_off = (t[:, None] * num_k_heads + key_head) * dk + ks[None, :]
        qk_ok = t_ok[:, None] & k_ok[None, :]
        kt = tl.load(k_ptr + qk_off, mask=qk_ok, other=0.0).to(tl.float32)  # [BT, BK]
        qt = tl.load(q_ptr + qk_off, mask=qk_ok, other=0.0).to(tl.float32)
        kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=1) + eps)[:, None]
        qt = qt * (tl.rsqrt(tl.sum(qt * qt, axis=1) + eps) * scale)[:, None]
        vh = t * num_v_heads + head
        vt = tl.load(v_ptr + vh[:, None] * dv + vs[None, :], mask=t_ok[:, None] & v_ok[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        gc = tl.cumsum(tl.load(g_ptr + vh, mask=t_ok, other=0.0).to(tl.float32), axis=0)  # [BT]
        bt = tl.load(beta_ptr + vh, mask=t_ok, other=0.0).to(tl.float32)
        decay = gc[:, None] - gc[None, :]
        kb = kt * bt[:, None]
        a = tl.dot(kb, tl.trans(kt), input_precision="ieee")
        a = tl.where(lower, a * tl.exp(tl.where(lower, decay, 0.0)), 0.0)  # [BT, BT]
        inv = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0)  # (I + a)^-1, row by row
        for i in range(1, BT):
            a_i = tl.sum(tl.where(ts[:, None] == i, a, 0.0), axis=0)  # row i of a, [BT]
            row = tl.sum(a_i[:, None] * inv, axis=0)
            inv = tl.where(ts[:, None] == i, inv - row[None, :], inv)
        u = tl.dot(inv, vt * bt[:, None], input_precision="ieee")  # [BT, BV]
        w = tl.dot(inv, kb * tl.exp(gc)[:, None], input_precision="ieee")  # [BT, BK]
        v_new = u - tl.dot(w, state, input_precision="ieee")
        attn = tl.dot(qt, tl.trans(kt), input_precision="ieee")
        attn = tl.where(causal, attn * tl.exp(tl.where(causal, decay, 0.0)), 0.0)
        out = tl.dot(qt * tl.exp(gc)[:, None], state, input_precision="ieee")
        out += tl.dot(attn, v_new, input_precision="ieee")
        tl.store(out_ptr + vh[:, None] * dv + vs[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & v_ok[None, :])  # fmt: skip
        g_last = tl.sum(tl.where(ts == BT - 1, gc, 0.0), axis=0)  # padding adds no decay
        k_decayed = kt * tl.exp(g_last - gc)[:, None]
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k_decayed), v_new, input_precision="ieee")
    tl.store(state_ptr + tile, state.to(state_ptr.dtype.element_ty), mask=tile_ok)


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
    chunk_size: int = 64,
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
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size {chunk_size}: a power of two of at least 16")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if out is None:
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    elif out.shape != v.shape or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)}: need a contiguous {tuple(v.shape)}")
    if rows:
        block_k = max(16, triton.next_power_of_2(dk))
        block_v = max(16, min(triton.next_power_of_2(dv), 64))
        grid = (rows, num_v_heads, triton.cdiv(dv, block_v))
        _chunk_kernel[grid](
            q, k, v, g, beta, ssm_state, out, slots, starts, ends, fresh,
            num_k_heads, num_v_heads, dk, dv, dk**-0.5, 1e-6,
            BT=chunk_size, BK=block_k, BV=block_v,
        )  # fmt: skip
    return out
