"""This rank's host-memory KV tier: a copy of the KV cache's block layout in host memory (pinned
on a GPU), and the block copies each plan names (core/kv_tier.py decides them).

The device cache is one layer-major tensor (`kv_stack`, `[slots, blocks, 2, block_size, kv_heads,
head_dim]`; each layer's cache is a view of its slot, `new_kv_caches`), the host tier block-major
(`[host blocks, slots, ...]`: one host block is one contiguous chunk), so a plan's copies go
through a device staging buffer of `STAGING_BLOCKS` blocks: one indexed gather (out) or scatter
(in) over every layer at once for a whole chunk of blocks, and one host copy per run of
consecutive host blocks (a chunk's pairs sorted by host block, so runs form wherever the host ids
allow). The block ids of a whole plan reach the device in one transfer. A cudaMemcpyAsync through
torch costs ~20 us of host time, a gather ~12 us (tests/gpu/host_tier_copy_bench.py): a copy per
block and layer, or a gather per layer, made the copies cost more host time than the step.

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

import numpy as np
import torch

HOST_TIER_BLOCKS_IF_NO_KV = 1 << 30  # a stage without KV layers: the other stages decide
STAGING_BLOCKS = 32  # blocks per staged chunk (64 MiB at the 8B shape)


def host_tier_blocks(size_gib: float | None, block_bytes: int) -> int:
    """How many blocks `--kv-offloading-size` GiB hold on this rank (0: the tier is off)."""
    if not size_gib:
        return 0
    return int(size_gib * (1 << 30)) // block_bytes if block_bytes else HOST_TIER_BLOCKS_IF_NO_KV


def new_kv_caches(
    kv_slots: list[int | None], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The KV cache of a stage's layers: one zeroed tensor `[num_slots, *shape]` (None: no KV
    layer) and one cache per layer, a view of its slot's row (layers of one slot share the view
    object; None: a layer without KV). One tensor lets the host tier move a block of every layer
    in one indexed copy; each view is contiguous, as kernels expect."""
    slots = sorted(set(kv_slots) - {None})
    if not slots:
        return None, [None] * len(kv_slots)
    stack = torch.zeros((len(slots), *shape), dtype=dtype, device=device)
    views = {slot: stack[i] for i, slot in enumerate(slots)}
    return stack, [views.get(slot) for slot in kv_slots]


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


def _chunks(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(device, host) pairs sorted by host block, in chunks of the staging buffer's size."""
    pairs = sorted(pairs, key=lambda p: p[1])
    return [pairs[i : i + STAGING_BLOCKS] for i in range(0, len(pairs), STAGING_BLOCKS)]


class HostKVTier:
    """`kv_stack`: this rank's device cache, `[slots, device blocks, *block]` (None: a stage
    without KV layers); `num_blocks` host blocks of `[slots, *block]` each."""

    def __init__(self, kv_stack: torch.Tensor | None, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.host: torch.Tensor | None = None  # [num_blocks, S, 2, block_size, kv_heads, head_dim]
        self.staging: torch.Tensor | None = None  # [STAGING_BLOCKS, S, ...] on the device
        self.stream = None
        if kv_stack is not None:
            s, n, *block = kv_stack.shape
            self.num_slots, self.num_device_blocks = s, n
            self.device_rows = kv_stack.view(s * n, -1)  # [S * N, E]: slot i's block b at i*N+b
            pin = kv_stack.is_cuda
            self.host = torch.empty((num_blocks, s, *block), dtype=kv_stack.dtype, pin_memory=pin)
            self.staging = torch.empty(
                (STAGING_BLOCKS, s, *block), dtype=kv_stack.dtype, device=kv_stack.device
            )
            self.staging_rows = self.staging.view(STAGING_BLOCKS * s, -1)  # block k's slot i: k*S+i
            if pin:
                self.stream = torch.cuda.Stream(kv_stack.device)
        # Where the copies' time goes (the report at shutdown): plans with copies, blocks, host
        # copies (runs of host blocks), host seconds issuing them, and (GPU) seconds the copy
        # stream ran before and beside the forward, from events read once done (the host never
        # waits for them).
        self.num_plans = self.num_out = self.num_in = self.num_host_copies = 0
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
        if self.host is not None and self.stream is None:  # (None: a stage without KV layers)
            self._copy(to_host, from_host, ahead)
        elif self.host is not None:
            self._copy_on_stream(to_host, from_host, ahead)
        self.host_s += time.perf_counter() - t0

    def _copy_on_stream(self, to_host, from_host, ahead) -> None:
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

        def step_waits() -> None:  # for the copies so far; the spills ahead run beside it
            events[1].record()
            compute.wait_stream(self.stream)

        with torch.cuda.stream(self.stream):
            events[0].record()
            self._copy(to_host, from_host, ahead, step_waits)
            events[2].record()
        self._events.append(events)
        self._drain_events()

    def _copy(self, to_host, from_host, ahead, step_waits=None) -> None:
        """The plan's copies in order: out, in, `step_waits()`, spills ahead."""
        phases = [(_chunks(to_host), True), (_chunks([(d, h) for h, d in from_host]), False)]
        phases.append((_chunks(ahead), True))
        ids = self._ids([c for chunks, _ in phases for c in chunks])
        start = 0
        for i, (chunks, out) in enumerate(phases):
            if i == 2 and step_waits is not None:
                step_waits()
            for chunk in chunks:
                rows = ids[start : start + len(chunk) * self.num_slots]
                start += len(rows)
                self._out(chunk, rows) if out else self._in(chunk, rows)

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
            f"{self.num_in} in ({(self.num_out + self.num_in) * self.block_bytes / 1e9:.2f} GB) "
            f"in {self.num_host_copies} host copies"
            "; "
            f"{self.host_s:.3f} s of host time issuing them; on the copy stream "
            f"{self.blocking_s:.3f} s that steps waited for, {self.ahead_s:.3f} s of spills ahead "
            "beside the forward"
        )

    def _out(self, chunk: list[tuple[int, int]], rows: torch.Tensor) -> None:
        """Gather the chunk's blocks of every layer into the staging buffer, then to the host."""
        torch.index_select(self.device_rows, 0, rows, out=self.staging_rows[: len(rows)])
        for k, dst, m in _runs([(k, h) for k, (_, h) in enumerate(chunk)]):
            self._host_copy(self.host[dst : dst + m], self.staging[k : k + m])

    def _in(self, chunk: list[tuple[int, int]], rows: torch.Tensor) -> None:
        """The chunk's host blocks into the staging buffer, then scattered into every layer."""
        for k, src, m in _runs([(k, h) for k, (_, h) in enumerate(chunk)]):
            self._host_copy(self.staging[k : k + m], self.host[src : src + m])
        self.device_rows.index_copy_(0, rows, self.staging_rows[: len(rows)])

    def _host_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy between contiguous slices of the host tier and the staging buffer."""
        self.num_host_copies += 1
        dst.copy_(src, non_blocking=True)

    def _ids(self, chunks: list[list[tuple[int, int]]]) -> torch.Tensor:
        """The rows of `device_rows` each chunk's blocks occupy, all chunks' in one tensor (block
        k of a chunk, slot i: row k * S + i of the chunk's slice). On a GPU it is sent without
        waiting for the step the copy stream waits for: a small copy from pageable memory is
        staged by the driver at once (on an H100 with the compute stream busy, 0.07-0.13 ms
        against 0.14-0.21 ms through a freshly pinned tensor: tests/gpu/host_tier_copy_bench.py)."""
        blocks = np.fromiter((d for c in chunks for d, _ in c), dtype=np.int64)
        offsets = np.arange(self.num_slots, dtype=np.int64) * self.num_device_blocks
        t = torch.from_numpy((blocks[:, None] + offsets[None, :]).reshape(-1))
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
