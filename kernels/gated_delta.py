"""Gated DeltaNet's two sequence ops over a batch of rows with per-request state slots: the causal
depthwise conv1d and the gated delta rule, as torch references (the oracle of the Triton kernels,
kernels/triton_gated_delta.py, and the CPU path).

A step's rows are sequences whose new tokens are flattened into one `[T, ...]` batch
(`query_start_loc`). Each row owns one state slot (`state_slots[i]`): the last `K - 1` conv
inputs `conv_state [S, C, K - 1]` and the delta rule's matrix `ssm_state [S, H, Dk, Dv]`. A row
whose context starts at 0 (`fresh`) starts from zeros; any other row continues from its slot, so a
prompt cut into chunks by the scheduler (anywhere, also inside the delta rule's own 64-token
chunks) computes what the whole prompt computes at once. Both ops write each row's final state
back into its slot.

The arithmetic follows transformers' `torch_chunk_gated_delta_rule` (prefill: chunks of 64 tokens,
a triangular solve per chunk, one state update per chunk) and `torch_recurrent_gated_delta_rule`
(one token: decay, delta update, read), in float32, so greedy decoding is token-exact against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.kernels.backend import use_triton

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@dataclass
class StateLayout:
    """A step's rows as the linear-attention ops see them, derived once per step from the
    attention metadata (every linear layer of the step reuses it): rows continuing with one token
    take the recurrent step together (`step_*`), every other row the chunked form alone.

    A decode CUDA graph (`decode`) knows its rows' slots only on the device: every row steps,
    and padding rows step in a scratch slot of their own, so the graph replays for any slots."""

    state_slots: list[int]  # [B]
    query_start_loc: list[int]  # [B + 1]
    fresh: list[bool]  # [B]: the row's context starts in this step (its state starts at zero)
    chunk_rows: list[int]
    step_tokens: torch.Tensor  # [R] int64 on the device: the step rows' token indices
    step_slots: torch.Tensor  # [R] int64 on the device: their state slots
    # The chunk rows' slots, first and one-past-last tokens, fresh flags ([C] each, on the
    # device) and their 64-token chunks (`chunk_bounds`) for the Triton kernel; None off CUDA.
    chunk_tensors: tuple[torch.Tensor, ...] | None = None
    conv_plan: ConvPlan | None = None  # the chunk rows' conv windows, all rows at once

    @classmethod
    def build(
        cls,
        state_slots: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        device: torch.device,
        conv_width: int = 3,
    ) -> StateLayout:
        """`conv_width`: the conv state's length, `K - 1`."""
        lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(state_slots))]
        fresh = [n == s for n, s in zip(lens, seq_lens, strict=True)]
        steps = [i for i, n in enumerate(lens) if n == 1 and not fresh[i]]
        step_set = set(steps)
        tokens = torch.tensor([query_start_loc[i] for i in steps], dtype=torch.int64)
        slots = torch.tensor([state_slots[i] for i in steps], dtype=torch.int64)
        chunk_rows = [i for i in range(len(state_slots)) if i not in step_set]
        chunk_tensors = None
        if device.type == "cuda" and chunk_rows:
            from pagedserve.kernels.triton_chunk_gated_delta import chunk_bounds

            starts = [query_start_loc[i] for i in chunk_rows]
            ends = [query_start_loc[i + 1] for i in chunk_rows]
            host = [state_slots[i] for i in chunk_rows] + starts + ends
            host += [int(fresh[i]) for i in chunk_rows]
            host += chunk_bounds(starts, ends)
            flat = torch.tensor(host, dtype=torch.int64).to(device)  # one copy
            parts = flat.split([len(chunk_rows)] * 4 + [len(host) - 4 * len(chunk_rows)])
            chunk_tensors = (*parts[:3], parts[3].to(torch.int32), parts[4])
        rows = [(state_slots[i], *query_start_loc[i : i + 2], fresh[i]) for i in chunk_rows]
        conv_plan = ConvPlan.build(rows, query_start_loc[-1], conv_width, device) if rows else None
        return cls(
            state_slots, query_start_loc, fresh, chunk_rows, tokens.to(device),
            slots.to(device), chunk_tensors, conv_plan,
        )  # fmt: skip

    @classmethod
    def decode(cls, state_slots: torch.Tensor) -> StateLayout:
        """Every row continues with one token from its slot (`state_slots` [B] int64, on the
        device only): a decode CUDA graph's layout."""
        tokens = torch.arange(len(state_slots), dtype=torch.int64, device=state_slots.device)
        return cls([], [], [], [], tokens, state_slots)


@dataclass
class ConvPlan:
    """The chunk rows' conv as gathers over `[x ; their previous inputs]` (`[T + R (K - 1), C]`:
    the step's tokens, then each row's conv state as `K - 1` token rows, zeros for a fresh
    row): `windows[j]` indexes the `j`-th input of every output token's window, `tails` the
    last `K - 1` inputs of each row (its new conv state)."""

    slots: torch.Tensor  # [R] int64
    keep: torch.Tensor  # [R, 1, 1] bool: False for a fresh row (its previous inputs are zeros)
    tokens: torch.Tensor  # [N] int64: the chunk rows' token indices
    windows: torch.Tensor  # [K, N] int64 into the extended inputs
    tails: torch.Tensor  # [R * (K - 1)] int64 into the extended inputs

    @classmethod
    def build(
        cls, rows: list[tuple[int, int, int, bool]], num_tokens: int, width: int,
        device: torch.device,
    ) -> ConvPlan:  # fmt: skip
        """`rows`: (slot, first token, one past the last, fresh) of each chunk row."""
        seqs, tokens, windows, tails, at = [], [], [], [], 0
        for r, (_, lo, hi, _) in enumerate(rows):
            prev = num_tokens + r * width + np.arange(width)
            seqs.append(np.concatenate([prev, np.arange(lo, hi)]))  # the row's inputs in order
            tokens.append(np.arange(lo, hi))
            windows.append(at + np.arange(hi - lo)[None, :] + np.arange(width + 1)[:, None])
            tails.append(at + (hi - lo) + np.arange(width))
            at += hi - lo + width
        seq = np.concatenate(seqs)
        host = [
            np.array([row[0] for row in rows]),
            np.array([0 if row[3] else 1 for row in rows]),
            np.concatenate(tokens),
            seq[np.concatenate(windows, axis=1)].reshape(-1),
            seq[np.concatenate(tails)],
        ]
        flat = torch.from_numpy(np.concatenate(host).astype(np.int64)).to(device)  # one copy
        parts = list(flat.split([len(h) for h in host]))
        parts[1] = parts[1].view(-1, 1, 1).bool()
        parts[3] = parts[3].view(width + 1, -1)
        return cls(*parts)


def causal_conv1d(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [S, C, K - 1], updated in place
    layout: StateLayout,
) -> torch.Tensor:  # [T, C], SiLU-activated
    """Depthwise causal conv over each row's previous `K - 1` inputs and its new ones: the step
    rows as `[R, C, K]` windows, the chunk rows by `layout.conv_plan`'s gathers; no host sync,
    so it runs inside a CUDA graph."""
    out = torch.empty_like(x)
    if len(layout.step_tokens):  # one token each: [R, C, K] windows, all rows at once
        idx, slots = layout.step_tokens, layout.step_slots
        seq = torch.cat([conv_state[slots], x[idx].unsqueeze(-1).to(conv_state.dtype)], dim=-1)
        conv_state[slots] = seq[..., 1:]
        out[idx] = F.silu((seq.to(weight.dtype) * weight).sum(-1)).to(x.dtype)
    plan = layout.conv_plan
    if plan is None:
        return out
    prev = torch.where(plan.keep, conv_state[plan.slots], 0)  # [R, C, K - 1]
    ext = torch.cat([x.to(conv_state.dtype), prev.transpose(1, 2).reshape(-1, x.shape[1])])
    acc = torch.zeros((plan.windows.shape[1], x.shape[1]), dtype=torch.float32, device=x.device)
    for j in range(weight.shape[1]):  # [N, C] per tap, accumulated in float32
        acc += ext[plan.windows[j]].float() * weight[:, j].float()
    out[plan.tokens] = F.silu(acc).to(x.dtype)
    tails = ext[plan.tails].view(len(plan.slots), -1, x.shape[1])  # [R, K - 1, C]
    conv_state[plan.slots] = tails.transpose(1, 2)
    return out


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv], updated in place
    layout: StateLayout,
) -> torch.Tensor:  # [T, Hv, Dv] in v's dtype
    """q and k are L2-normalized here and q scaled by `Dk ** -0.5`; value heads share key heads
    in groups of `Hv / Hk`. The step rows take the recurrent step, all at once; the others the
    chunked form (here one row at a time). On CUDA the step is one Triton kernel
    (kernels/triton_gated_delta.py), the chunked form two over all rows at once
    (kernels/triton_chunk_gated_delta.py)."""
    out = torch.empty_like(v)
    reps = v.shape[1] // q.shape[1]
    if len(layout.step_tokens):
        idx, slots = layout.step_tokens, layout.step_slots
        if use_triton(q):
            from pagedserve.kernels.triton_gated_delta import triton_recurrent_step

            o = triton_recurrent_step(q[idx], k[idx], v[idx], g[idx], beta[idx], ssm_state, slots)
        else:
            qs, ks = (t[idx].repeat_interleave(reps, dim=1) for t in (q, k))
            o, state = recurrent_step(qs, ks, v[idx], g[idx], beta[idx], ssm_state[slots])
            ssm_state[slots] = state.to(ssm_state.dtype)
        out[idx] = o.to(out.dtype)
    if not layout.chunk_rows:
        return out
    if layout.chunk_tensors is not None and use_triton(q):
        from pagedserve.kernels.triton_chunk_gated_delta import triton_chunk_rule

        return triton_chunk_rule(q, k, v, g, beta, ssm_state, *layout.chunk_tensors, out=out)
    if reps > 1:
        q, k = q.repeat_interleave(reps, dim=1), k.repeat_interleave(reps, dim=1)
    for i in layout.chunk_rows:
        slot, lo, hi = (
            layout.state_slots[i],
            layout.query_start_loc[i],
            layout.query_start_loc[i + 1],
        )
        init = None if layout.fresh[i] else ssm_state[slot]
        o, state = chunk_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], init)
        ssm_state[slot] = state.to(ssm_state.dtype)
        out[lo:hi] = o.to(out.dtype)
    return out


def recurrent_step(
    q: torch.Tensor,  # [R, H, Dk], one token per row
    k: torch.Tensor,  # [R, H, Dk]
    v: torch.Tensor,  # [R, H, Dv]
    g: torch.Tensor,  # [R, H]
    beta: torch.Tensor,  # [R, H]
    state: torch.Tensor,  # [R, H, Dk, Dv]
) -> tuple[torch.Tensor, torch.Tensor]:  # [R, H, Dv] fp32, [R, H, Dk, Dv] fp32
    """One token of the gated delta rule per row: S <- S exp(g); S += k (beta (v - S^T k))^T;
    o = S^T q."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = l2norm(q)
    k = l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    state = state.float() * g.exp()[..., None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)  # [R, H, Dv]
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def chunk_rule(
    q: torch.Tensor,  # [n, H, Dk]
    k: torch.Tensor,  # [n, H, Dk]
    v: torch.Tensor,  # [n, H, Dv]
    g: torch.Tensor,  # [n, H]
    beta: torch.Tensor,  # [n, H]
    initial_state: torch.Tensor | None,  # [H, Dk, Dv]; None: zeros
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:  # [n, H, Dv] fp32, [H, Dk, Dv] fp32
    """The chunked (WY / UT-transform) form over one row, as transformers computes it."""
    n, num_heads, dk = k.shape
    dv = v.shape[-1]
    # [H, n, D] in float32
    q, k, v, beta, g = (x.transpose(0, 1).float().contiguous() for x in (q, k, v, beta, g))
    q = l2norm(q)
    k = l2norm(k)
    q = q * dk**-0.5
    pad = (chunk_size - n % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    # [H, N, C, D]: N chunks of C tokens
    q, k, k_beta, v_beta = (x.reshape(num_heads, -1, chunk_size, x.shape[-1]) for x in
                            (q, k, k_beta, v_beta))  # fmt: skip
    g = g.reshape(num_heads, -1, chunk_size).cumsum(dim=-1)  # [H, N, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay  # [H, N, C, C]
    intra = (q @ k.transpose(-1, -2)) * decay
    decayed_k_beta = k_beta * g.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, decayed_k_beta, upper=False, unitriangular=True
    )
    if initial_state is None:
        state = torch.zeros(num_heads, dk, dv, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.float()
    out = torch.zeros_like(new_values)  # [H, N, C, Dv]
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    for c in range(q.shape[1]):
        v_new = new_values[:, c] - k_cumdecay[:, c] @ state
        out[:, c] = q[:, c] @ state + intra[:, c] @ v_new
        state = state * chunk_decay[:, c] + k[:, c].transpose(-1, -2) @ v_new
    out = out.reshape(num_heads, -1, dv)[:, :n]
    return out.transpose(0, 1), state
