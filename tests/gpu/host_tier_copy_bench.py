"""Where a plan's host KV tier copies spend host time (worker/host_tier.py), at the 8B shape
(32 layers, 8 KV heads of 128, blocks of 16, bf16: 2 MiB a block), while the compute stream is
busy (as when the worker queues step N+1 behind step N): host milliseconds per copy() of 73 blocks
out (spills to scattered host blocks) or in, the part spent moving block ids to the device, and
the same with the ids sent through freshly pinned tensors (as the tier did before).
  python3 tests/gpu/host_tier_copy_bench.py"""

from __future__ import annotations

import random
import time

import torch

from pagedserve.worker.host_tier import STAGING_BLOCKS, HostKVTier

LAYERS, BLOCKS, HOST_BLOCKS, N, REPS = 32, 1024, 1024, 73, 20


def pinned_ids(tier: HostKVTier, chunks) -> torch.Tensor:
    blocks = torch.tensor([d for c in chunks for d, _ in c], dtype=torch.int64)
    offsets = torch.arange(tier.num_slots, dtype=torch.int64) * tier.num_device_blocks
    t = (blocks[:, None] + offsets[None, :]).reshape(-1).pin_memory()
    return t.to(tier.staging.device, non_blocking=True)


def run_cases(tier: HostKVTier, ids_fn, label: str) -> None:
    dev = tier.staging.device
    ids_s = [0.0]

    def timed_ids(chunks) -> torch.Tensor:
        t0 = time.perf_counter()
        out = ids_fn(chunks)
        ids_s[0] += time.perf_counter() - t0
        return out

    tier._ids = timed_ids
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    rng = random.Random(0)
    cases = [("out, scattered host ids", True, True), ("out, consecutive host ids", False, True),
             ("in, scattered host ids", True, False)]  # fmt: skip
    for name, scattered, out in cases:
        total, copies0 = 0.0, tier.num_host_copies
        for rep in range(REPS + 2):  # two warm-ups
            for _ in range(20):  # ~30 ms of queued compute
                a @ a
            dev_ids = rng.sample(range(BLOCKS), N)
            host_ids = rng.sample(range(HOST_BLOCKS), N) if scattered else list(range(100, 100 + N))
            pairs = list(zip(dev_ids, host_ids, strict=True))
            if rep == 2:
                ids_s[0] = 0.0
            t0 = time.perf_counter()
            tier.copy(pairs, []) if out else tier.copy([], [(h, d) for d, h in pairs])
            total += (time.perf_counter() - t0) * (rep >= 2)
            torch.cuda.synchronize()
        host_copies = (tier.num_host_copies - copies0) / (REPS + 2)
        print(f"{label:<9} {name:<26}: {total / REPS * 1e3:7.2f} ms host per copy() of {N} "
              f"blocks (block ids to the device: {ids_s[0] / REPS * 1e3:.2f} ms; "
              f"{-(-N // STAGING_BLOCKS)} gathers or scatters, {host_copies:.0f} host "
              "copies)")  # fmt: skip


def main() -> None:
    dev = torch.device("cuda")
    stack = torch.zeros(LAYERS, BLOCKS, 2, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    tier = HostKVTier(stack, HOST_BLOCKS)
    run_cases(tier, HostKVTier._ids.__get__(tier), "torch")
    run_cases(tier, lambda chunks: pinned_ids(tier, chunks), "pinned")
    print(tier.report())
    check_round_trip(tier, stack)


def check_round_trip(tier: HostKVTier, stack: torch.Tensor) -> None:
    """Scattered blocks out and back into other blocks: every layer's content arrives."""
    del tier._ids  # the class's own
    rng = random.Random(1)
    stack.normal_()
    dev_ids, host_ids = rng.sample(range(BLOCKS), N), rng.sample(range(HOST_BLOCKS), N)
    want = stack[:, dev_ids].clone()  # [L, N, ...]
    tier.copy(list(zip(dev_ids, host_ids, strict=True)), [])
    stack.zero_()
    back = rng.sample(range(BLOCKS), N)
    tier.copy([], list(zip(host_ids, back, strict=True)))
    torch.cuda.synchronize()
    # (normal_ may draw an exact 0: count what `want` holds, not its size)
    nonzero = int(want.count_nonzero())
    ok = torch.equal(stack[:, back], want) and int(stack.count_nonzero()) == nonzero
    print(f"round trip of {N} scattered blocks, {LAYERS} layers: {'equal' if ok else 'DIFFERENT'}")
    assert ok


if __name__ == "__main__":
    main()
