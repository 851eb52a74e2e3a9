"""Round trips of the host KV tier on a GPU (worker/host_tier.py) at the 8B shape (32 layers,
blocks of 16 x 8 heads x 128, bf16), six variants: 16, 32, 64 and 73 scattered blocks (one to three
staging chunks), with and without a sync between out and in, random and counting contents. Each
line says whether the blocks came back equal, which (layer, block) pairs differ, and whether the
host copy holds what was sent.
  python3 tests/gpu/host_tier_round_trip.py"""

from __future__ import annotations

import random

import torch

from pagedserve.worker.host_tier import HostKVTier

LAYERS, BLOCKS, HOST_BLOCKS, N = 32, 1024, 1024, 73
DEV = torch.device("cuda")


def host_holds(tier: HostKVTier, host_ids: list[int], want: torch.Tensor) -> bool:
    return torch.equal(tier.host[host_ids].to(DEV).transpose(0, 1), want)


def trip(tier, stack, seed, sync_after_out=False, n=N, fill="normal") -> str:
    rng = random.Random(seed)
    if fill == "normal":
        stack.normal_()
    else:
        stack.copy_(torch.arange(stack.numel(), device=DEV).view_as(stack).to(stack.dtype))
    dev_ids, host_ids = rng.sample(range(BLOCKS), n), rng.sample(range(HOST_BLOCKS), n)
    want = stack[:, dev_ids].clone()
    tier.copy(list(zip(dev_ids, host_ids, strict=True)), [])
    host_out = None
    if sync_after_out:
        torch.cuda.synchronize()
        host_out = host_holds(tier, host_ids, want)
    stack.zero_()
    back = rng.sample(range(BLOCKS), n)
    tier.copy([], list(zip(host_ids, back, strict=True)))
    torch.cuda.synchronize()
    got = stack[:, back]
    bad = (got != want).flatten(2).any(-1)  # [layers, n]
    extra = int(stack.count_nonzero()) - int(got.count_nonzero())
    layers = bad.any(1).nonzero().flatten().tolist()[:8]
    blocks = bad.any(0).nonzero().flatten().tolist()[:8]
    return (
        f"n={n} fill={fill} sync_after_out={sync_after_out}: equal={torch.equal(got, want)} "
        f"bad (layer, block) pairs={int(bad.sum())} layers={layers} blocks={blocks} "
        f"extra_nonzero_outside={extra} host_after_out_ok={host_out} "
        f"host_after_all_ok={host_holds(tier, host_ids, want)}"
    )


def main() -> None:
    variants = [{}, {"sync_after_out": True}, {"n": 16}, {"n": 32}, {"fill": "arange"},
                {"n": 64, "sync_after_out": True}]  # fmt: skip
    for seed, kwargs in enumerate(variants):
        stack = torch.zeros(LAYERS, BLOCKS, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEV)
        tier = HostKVTier(stack, HOST_BLOCKS)
        if seed == 0:
            print("pinned host:", tier.host.is_pinned(), flush=True)
        print(trip(tier, stack, seed, **kwargs), flush=True)


if __name__ == "__main__":
    main()
