"""This rank's host-memory KV tier: a copy of each KV cache tensor's block layout in host memory
(pinned on a GPU), and the block copies each plan names (core/kv_tier.py decides them).

The host tier is block-major (`[host blocks, layers, 2, block_size, kv_heads, head_dim]`: one
host block is one contiguous chunk), the device cache layer-major (a tensor per layer), so a plan's
copies go through a device staging buffer of `STAGING_BLOCKS` blocks: one gather (out) or scatter
(in) per layer for a whole chunk of blocks, and one host copy per run of consecutive host blocks;
not a copy per block and layer (a cudaMemcpyAsync costs microseconds of host time, a block's
layer tens of KiB).

On a GPU the copies run on their own stream, ordered against the compute stream both ways: they
start once every step queued before has written its KV (a block copied out holds its final
content; a block copied into is no longer read by an earlier step), and the step that follows
waits for them on the device only, so the host never blocks and queues the step right behind
them. Spills ahead (`StepPlan.kv_to_host_ahead`: blocks the step does not write) follow on the
copy stream after the step's wait point, so they run beside its forward; the next plan's copies
and forward come after them. On a CPU they are plain copies, in order.
"""

from __future__ import annotations

import time
from collections import deque

import torch

HOST_TIER_BLOCKS_IF_NO_KV = 1 << 30  # a stage without KV layers: the other stages decide
STAGING_BLOCKS = 32  # blocks per staged chunk (64 MiB at the 8B shape)


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
        self.num_blocks = num_blocks
        self.host: torch.Tensor | None = None  # [num_blocks, L, 2, block_size, kv_heads, head_dim]
        self.staging: torch.Tensor | None = None  # [STAGING_BLOCKS, L, ...] on the device
        if self.device_caches:
            c = self.device_caches[0]
            shape = (len(self.device_caches), *c.shape[1:])
            self.host = torch.empty((num_blocks, *shape), dtype=c.dtype, pin_memory=pin)
            self.staging = torch.empty((STAGING_BLOCKS, *shape), dtype=c.dtype, device=c.device)
        self.stream = torch.cuda.Stream(self.device_caches[0].device) if pin else None
        # Where the copies' time goes (the report at shutdown): plans with copies, blocks, host
        # seconds issuing them, and (GPU) seconds the copy stream ran before and beside the
        # forward, from events read once done (the host never waits for them).
        self.num_plans = self.num_out = self.num_in = 0
        self.host_s = self.blocking_s = self.ahead_s = 0.0
        self._events: deque[list[torch.cuda.Event]] = deque()  # [start, mid, end] per plan

    @property
    def block_bytes(self) -> int:
        return 0 if self.host is None else self.host[0].numel() * self.host.element_size()

    def copy(
        self,
        to_host: list[tuple[int, int]],
        from_host: list[tuple[int, int]],
        ahead: list[tuple[int, int]] = (),
    ) -> None:
        """(device, host) pairs out, then (host, device) pairs in, both before the forward
        queued next; then `ahead` (device, host) pairs out, beside it (it writes none of them)."""
        if not (to_host or from_host or ahead):
            return
        t0 = time.perf_counter()
        self.num_plans += 1
        self.num_out += len(to_host) + len(ahead)
        self.num_in += len(from_host)
        if self.stream is None:
            self._copy(to_host, from_host)
            self._copy(ahead, [])
        else:
            compute = torch.cuda.current_stream()
            self.stream.wait_stream(compute)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            with torch.cuda.stream(self.stream):
                events[0].record()
                self._copy(to_host, from_host)
                events[1].record()
            compute.wait_stream(self.stream)
            with torch.cuda.stream(self.stream):  # the next plan's copies and forward follow
                self._copy(ahead, [])
                events[2].record()
            self._events.append(events)
            self._drain_events()
        self.host_s += time.perf_counter() - t0

    def _drain_events(self) -> None:
        while self._events and self._events[0][2].query():
            start, mid, end = self._events.popleft()
            self.blocking_s += start.elapsed_time(mid) / 1e3
            self.ahead_s += mid.elapsed_time(end) / 1e3

    def report(self) -> str:
        """Where the copies' time went, for the log at shutdown."""
        if self.stream is not None:
            torch.cuda.synchronize()
            self._drain_events()
        return (
            f"host KV tier copies: {self.num_plans} plans, {self.num_out} blocks out, "
            f"{self.num_in} in ({(self.num_out + self.num_in) * self.block_bytes / 1e9:.2f} GB); "
            f"{self.host_s:.3f} s of host time issuing them; on the copy stream "
            f"{self.blocking_s:.3f} s that steps waited for, {self.ahead_s:.3f} s of spills ahead "
            "beside the forward"
        )

    def _copy(self, to_host: list[tuple[int, int]], from_host: list[tuple[int, int]]) -> None:
        if self.host is None:  # a stage without KV layers
            return
        for i in range(0, len(to_host), STAGING_BLOCKS):
            chunk = to_host[i : i + STAGING_BLOCKS]
            n = len(chunk)
            ids = self._ids([d for d, _ in chunk])
            for layer, dev in enumerate(self.device_caches):  # gather each layer's blocks
                self.staging[:n, layer].copy_(dev.index_select(0, ids))
            for k, dst, m in _runs([(k, h) for k, (_, h) in enumerate(chunk)]):
                self.host[dst : dst + m].copy_(self.staging[k : k + m], non_blocking=True)
        for i in range(0, len(from_host), STAGING_BLOCKS):
            chunk = from_host[i : i + STAGING_BLOCKS]
            n = len(chunk)
            for src, k, m in _runs([(h, k) for k, (h, _) in enumerate(chunk)]):
                self.staging[k : k + m].copy_(self.host[src : src + m], non_blocking=True)
            ids = self._ids([d for _, d in chunk])
            for layer, dev in enumerate(self.device_caches):  # scatter into each layer
                dev.index_copy_(0, ids, self.staging[:n, layer])

    def _ids(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device, without waiting for the step the copy stream waits for: a
        small copy from pageable memory is staged by the driver at once (on an H100 with the
        compute stream busy, 0.07-0.13 ms a plan against 0.14-0.21 ms through a freshly pinned
        tensor: tests/gpu/host_tier_copy_bench.py)."""
        t = torch.tensor(ids, dtype=torch.int64)
        if self.stream is None:
            return t
        return t.to(self.staging.device, non_blocking=True)

    def measure_swap(self, num_device_blocks: int) -> tuple[float, float, float]:
        """Seconds per block copied (out and in averaged), and the out and in bandwidths in
        bytes/s, from copies of up to 64 contiguous blocks (before any request: the content
        does not matter)."""
        if self.host is None:
            return 0.0, 0.0, 0.0
        n = max(1, min(64, num_device_blocks, self.num_blocks))
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

    def measure_plain(self) -> tuple[float, float]:
        """The ceiling: bytes/s out and in of one plain torch copy of `STAGING_BLOCKS` blocks
        between the pinned host tier and a contiguous device buffer (the staging buffer)."""
        if self.host is None:
            return 0.0, 0.0
        n = min(STAGING_BLOCKS, self.num_blocks)
        host, dev = self.host[:n], self.staging[:n]
        seconds = []
        for dst, src in ((host, dev), (dev, host)) * 2:  # warm, then timed
            self._sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            self._sync()
            seconds.append(time.perf_counter() - t0)
        nbytes = n * self.block_bytes
        return nbytes / seconds[2], nbytes / seconds[3]

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
