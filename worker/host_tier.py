"""This rank's host-memory KV tier: a copy of each KV cache tensor's block layout in host memory
(pinned on a GPU), and the block copies each plan names (core/kv_tier.py decides them).

On a GPU the copies run on their own stream, ordered against the compute stream both ways: they
start once every step queued before has written its KV (a block copied out holds its final
content; a block copied into is no longer read by an earlier step), and the step that follows
waits for them on the device only, so the host never blocks and queues the step right behind
them. On a CPU they are plain copies, in order.
"""

from __future__ import annotations

import time

import torch

HOST_TIER_BLOCKS_IF_NO_KV = 1 << 30  # a stage without KV layers: the other stages decide


def host_tier_blocks(size_gib: float | None, block_bytes: int) -> int:
    """How many blocks `--kv-offloading-size` GiB hold on this rank (0: the tier is off)."""
    if not size_gib:
        return 0
    return int(size_gib * (1 << 30)) // block_bytes if block_bytes else HOST_TIER_BLOCKS_IF_NO_KV


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs of consecutive pairs whose ids both advance by one."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        last = runs[-1] if runs else None
        if last is not None and src == last[0] + last[2] and dst == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([src, dst, 1])
    return [(s, d, n) for s, d, n in runs]


class HostKVTier:
    def __init__(self, kv_caches: list[torch.Tensor | None], num_blocks: int) -> None:
        unique = {id(c): c for c in kv_caches if c is not None}  # layers may share a tensor
        self.device_caches = list(unique.values())
        pin = any(c.is_cuda for c in self.device_caches)
        # per distinct KV tensor: [num_blocks, 2, block_size, kv_heads, head_dim] on the host
        self.host_caches = [
            torch.empty((num_blocks, *c.shape[1:]), dtype=c.dtype, pin_memory=pin)
            for c in self.device_caches
        ]
        self.stream = torch.cuda.Stream(self.device_caches[0].device) if pin else None

    @property
    def block_bytes(self) -> int:
        return sum(h[0].numel() * h.element_size() for h in self.host_caches)

    def copy(self, to_host: list[tuple[int, int]], from_host: list[tuple[int, int]]) -> None:
        """(device, host) pairs out, then (host, device) pairs in."""
        if not (to_host or from_host):
            return
        if self.stream is None:
            self._copy(to_host, from_host)
            return
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(to_host, from_host)
        compute.wait_stream(self.stream)

    def _copy(self, to_host: list[tuple[int, int]], from_host: list[tuple[int, int]]) -> None:
        for src, dst, n in _runs(to_host):
            for dev, host in zip(self.device_caches, self.host_caches, strict=True):
                host[dst : dst + n].copy_(dev[src : src + n], non_blocking=True)
        for src, dst, n in _runs(from_host):
            for dev, host in zip(self.device_caches, self.host_caches, strict=True):
                dev[dst : dst + n].copy_(host[src : src + n], non_blocking=True)

    def measure_swap(self, num_device_blocks: int) -> tuple[float, float, float]:
        """Seconds per block copied (out and in averaged), and the out and in bandwidths in
        bytes/s, from copies of up to 64 contiguous blocks (before any request: the content
        does not matter)."""
        n = max(1, min(64, num_device_blocks, len(self.host_caches[0]) if self.host_caches else 1))
        if not self.device_caches:
            return 0.0, 0.0, 0.0
        pairs = [(i, i) for i in range(n)]
        seconds = []
        for to_host, from_host in ((pairs, []), ([], pairs)) * 2:  # warm, then timed
            self._sync()
            t0 = time.perf_counter()
            self.copy(to_host, from_host)
            self._sync()
            seconds.append(time.perf_counter() - t0)
        out_s, in_s = seconds[2], seconds[3]
        nbytes = n * self.block_bytes
        return (out_s + in_s) / (2 * n), nbytes / out_s, nbytes / in_s

    def _sync(self) -> None:
        if self.stream is not None:
            torch.cuda.synchronize()


def measure_recompute(model: torch.nn.Module, hidden_size: int, dtype, device) -> float:
    """Seconds one token's forward takes on this rank: 2 FLOPs per weight, at the throughput a
    [512, H] x [H, H] matmul reaches here (attention's share is left out: a lower bound)."""
    a = torch.randn(512, hidden_size, dtype=dtype, device=device)
    b = torch.randn(hidden_size, hidden_size, dtype=dtype, device=device)
    seconds = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append((time.perf_counter() - t0) / 4)
    flops = 2 * 512 * hidden_size * hidden_size / min(seconds)
    num_params = sum(p.numel() for p in model.parameters())
    return 2 * num_params / flops
