"""GPU probe (issue 18, W3): does an L2 prefetch of the next weight, issued where a decode layer's
memory bus idles (norms, rotary + cache write, attention), shorten a batch-1 decode step?

1. Whether a kernel that issues bulk prefetches waits for them: 32 prefetch launches of o_proj
   weights in a graph, us per launch, by program count (H100: 133 us with 1 program, 10 with
   16: a program's issue is throttled, so prefetching costs time in the kernel that issues it).
2. A W3-shaped chain of 32 layers with the real GEMV kernels and probe_fp8_pdl's one-program
   RMSNorm-like kernel (attention stands in as a GPU spin of ATTN_US), in one CUDA graph, the
   prefetches on a side stream of 16 programs: forked after each GEMV for the next weight
   (`after`, so they run beside the small kernels) or before it (`before`, beside the GEMV),
   by the MB prefetched of each weight.
"""

from __future__ import annotations

import torch
from probe_fp8_pdl import _small_kernel, graph_ms  # run as a script: tests/gpu is on sys.path

from pagedserve.kernels.triton_gemv import triton_gemv
from pagedserve.kernels.triton_prefetch import l2_prefetch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ATTN_US = 7.0
MB = 1 << 20


def spin_cycles(us: float) -> int:
    """torch.cuda._sleep cycles that take about `us` microseconds on this GPU."""
    cycles = 100_000
    ms = graph_ms(lambda: [torch.cuda._sleep(cycles) for _ in range(10)]) / 10
    return int(cycles * us / (ms * 1e3))


def small(x: torch.Tensor, y: torch.Tensor) -> None:
    """A one-program kernel that reads a row and writes one (the norms; rotary stands in too)."""
    _small_kernel[(1,)](x, y, N=4096, PDL=False, num_warps=4)


def part1(weights) -> None:
    for programs in (1, 4, 16):
        ms = graph_ms(lambda p=programs: [l2_prefetch(ws["o"], 64 * MB, p) for ws in weights])
        print(f"1. prefetch launch of a whole o_proj ({programs} programs): "
              f"{ms * 1e3 / len(weights):.1f} us each")  # fmt: skip


def chain(weights, bufs, mode: str, caps: dict[str, int]) -> None:
    """One W3 layer per weight set. The prefetches run on a side stream (16 programs): `after`
    forks the next GEMV's first `caps[next]` bytes after each GEMV, `before` before it."""
    h, n1, mid = bufs["h"], bufs["n"], bufs["mid"]
    main = torch.cuda.current_stream()
    forked = False

    def fork(weight, cap):
        nonlocal forked
        if cap:
            forked = True
            SIDE.wait_stream(main)
            with torch.cuda.stream(SIDE):
                l2_prefetch(weight, cap, 16)

    def gemv(x, name, i, **kw):
        nxt, ws_next = NEXT[name], weights[(i + 1) % len(weights)] if name == "down" else weights[i]
        if mode == "before":
            fork(ws_next[nxt], caps[nxt])
        out = triton_gemv(x, weights[i][name], **kw)
        if mode == "after":
            fork(ws_next[nxt], caps[nxt])
        return out

    for i in range(len(weights)):
        small(h, n1)  # norm 1
        qkv_out = gemv(n1, "qkv", i)
        small(qkv_out[:, :4096], mid)  # rotary + cache write
        torch.cuda._sleep(CYCLES)  # attention + merge
        o_out = gemv(mid, "o", i)
        small(o_out, n1)  # norm 2
        gu_out = gemv(n1, "gate_up", i)
        h = gemv(gu_out, "down", i, gated=True)
    if forked:
        main.wait_stream(SIDE)


NEXT = {"qkv": "o", "o": "gate_up", "gate_up": "down", "down": "qkv"}


def part2(weights, bufs) -> None:
    total = sum(n * k * 2 for n, k in SHAPES.values()) * len(weights)
    print(
        f"2. W3-shaped chain, {len(weights)} layers, {total / 1e9:.2f} GB, attention {ATTN_US} us;"
        f" {total / 3.0e9:.3f} ms at 3.0 TB/s"
    )
    print(f"   {'mode, MB of o / gate_up / down / qkv':<52} {'ms':>7} {'TB/s':>6}")
    variants = [
        ("after", (0, 0, 0, 0)),
        ("after", (24, 0, 0, 0)),
        ("after", (24, 4, 0, 4)),
        ("after", (24, 8, 0, 8)),
        ("after", (24, 8, 8, 8)),
        ("before", (24, 4, 4, 4)),
        ("before", (24, 8, 8, 8)),
        ("before", (24, 16, 16, 16)),
        ("before", (0, 8, 8, 8)),
    ]
    names = ("o", "gate_up", "down", "qkv")
    for mode, mbs in variants:
        caps = {name: mb * MB for name, mb in zip(names, mbs, strict=True)}
        ms = graph_ms(lambda m=mode, c=caps: chain(weights, bufs, m, c))
        label = f"{mode} {'/'.join(map(str, mbs))}"
        print(f"   {label:<52} {ms:7.3f} {total / ms / 1e9:6.2f}")


def main() -> None:
    global CYCLES, SIDE
    SIDE = torch.cuda.Stream()
    torch.manual_seed(0)
    CYCLES = spin_cycles(ATTN_US)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(
        f"{torch.cuda.get_device_name()}, L2 {l2 / MB:.0f} MB, spin {CYCLES} cycles = {ATTN_US} us"
    )
    weights = [
        {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.01
         for name, (n, k) in SHAPES.items()}
        for _ in range(32)
    ]  # fmt: skip
    part1(weights)
    bufs = {
        "h": torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16),
        "n": torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16),
        "mid": torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16),
    }
    part2(weights, bufs)


CYCLES = 0
SIDE: torch.cuda.Stream | None = None

if __name__ == "__main__":
    main()
