"""The gated delta rule's one-token step (decode rows), in Triton, in place on the state slots.

Program (row, value head, value-column block) loads its `[Dk, BV]` tile of the row's state from
slot `state_slots[row]`, decays it by `exp(g)`, applies the delta update with the row's L2-normed
key (the value head's key head is `h // (Hv / Hk)`), writes the tile back and reads the output
with the scaled, L2-normed query: one read and one write of the state per token, which is the
whole cost of a decode here (the reference reads and writes it several times). Arithmetic in
float32 as kernels/gated_delta.py `recurrent_step`, its reference. No host sync and fixed shapes
per batch size, so it can run inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _recurrent_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr,
    num_k_heads, num_v_heads, dk, dv, scale, eps,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    ks = tl.arange(0, BK)
    k_ok, v_ok = ks < dk, cols < dv
    key_head = head // (num_v_heads // num_k_heads)
    qk_off = (row * num_k_heads + key_head) * dk + ks
    q = tl.load(q_ptr + qk_off, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk_off, mask=k_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + eps)
    vh = row * num_v_heads + head
    v = tl.load(v_ptr + vh * dv + cols, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + vh).to(tl.float32)
    beta = tl.load(beta_ptr + vh).to(tl.float32)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    tile = ((slot * num_v_heads + head) * dk + ks[:, None]) * dv + cols[None, :]  # [BK, BV]
    ok = k_ok[:, None] & v_ok[None, :]
    state = tl.load(state_ptr + tile, mask=ok, other=0.0).to(tl.float32) * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta  # [BV]
    state = state + k[:, None] * delta[None, :]
    tl.store(state_ptr + tile, state.to(state_ptr.dtype.element_ty), mask=ok)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + vh * dv + cols, out.to(out_ptr.dtype.element_ty), mask=v_ok)


def triton_recurrent_step(
    q: torch.Tensor,  # [R, Hk, Dk]
    k: torch.Tensor,  # [R, Hk, Dk]
    v: torch.Tensor,  # [R, Hv, Dv]
    g: torch.Tensor,  # [R, Hv] float32
    beta: torch.Tensor,  # [R, Hv]
    ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv], updated in place at rows `state_slots`
    state_slots: torch.Tensor,  # [R] int64
) -> torch.Tensor:  # [R, Hv, Dv] float32
    rows, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != rows or num_v_heads % num_k_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if ssm_state.shape[1:] != (num_v_heads, dk, dv) or not ssm_state.is_contiguous():
        raise ValueError(f"ssm_state {tuple(ssm_state.shape)}: need a contiguous [S, Hv, Dk, Dv]")
    if g.shape != (rows, num_v_heads) or beta.shape != g.shape or state_slots.shape != (rows,):
        raise ValueError("g, beta are [R, Hv] and state_slots [R]")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty((rows, num_v_heads, dv), dtype=torch.float32, device=q.device)
    if rows:
        block_k = triton.next_power_of_2(dk)
        block_v = min(triton.next_power_of_2(dv), max(16, 8192 // block_k))
        grid = (rows, num_v_heads, triton.cdiv(dv, block_v))
        _recurrent_step_kernel[grid](
            q, k, v, g, beta, ssm_state, state_slots, out, num_k_heads, num_v_heads, dk, dv,
            dk**-0.5, 1e-6, BK=block_k, BV=block_v,
        )  # fmt: skip
    return out
