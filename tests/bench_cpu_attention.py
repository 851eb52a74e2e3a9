"""Decode attention on a CPU: the gather + SDPA path against the C++ kernel
(kernels/cpu_native.py), both through `cpu_paged_attention`, per layer, with the cache warm (one
layer's cache again and again) and cold (four layers' caches in turn with 32 MB written between
rounds, as in a served step). One thread, as a CPU worker of a small model runs. `--paths` picks
what runs: `torch` (gather + SDPA) and the kernel's build variants (`native`, `avx2`, `avx512`;
one this CPU cannot run is left out, with the warning), each with its vector instruction counts.

    python tests/bench_cpu_attention.py [--rows 1 8 32] [--context 190] [--heads 4 2 32]
        [--paths torch native avx2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagedserve import settings
from pagedserve.kernels import cpu_native
from pagedserve.kernels.attention.cpu import cpu_paged_attention
from pagedserve.kernels.attention.metadata import build_attention_metadata

BLOCK, NUM_BLOCKS, LAYERS = 16, 2048, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=190)
    ap.add_argument("--heads", type=int, nargs=3, default=[4, 2, 32], help="Hq Hkv D")
    ap.add_argument("--paths", nargs="+", default=["torch", "native"], choices=settings.CPU_KERNELS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    num_heads, num_kv_heads, head_dim = a.heads
    paths = [p for p in a.paths if p == "torch" or _usable(p)]
    caches = [torch.randn(NUM_BLOCKS, 2, BLOCK, num_kv_heads, head_dim) for _ in range(LAYERS)]
    flush = torch.empty(8 << 20)
    per_row = -(-(a.context + 1) // BLOCK)
    for rows in a.rows:
        tables = [[(i * per_row + j) * 3 % NUM_BLOCKS for j in range(per_row)] for i in range(rows)]
        query = torch.randn(rows, num_heads, head_dim)
        times: dict[str, list[float]] = {}
        for setting in paths:
            name = "gather + SDPA" if setting == "torch" else f"C++ {setting}"
            _use(setting)
            for temp, layers in (("warm", caches[:1] * LAYERS), ("cold", caches)):
                samples = times.setdefault(f"{name}, {temp}", [])
                for _ in range(30):
                    lengths = [a.context] * rows
                    meta, _ = build_attention_metadata(lengths, [1] * rows, tables, BLOCK)
                    cpu_paged_attention(query, layers[0], meta, 0.2)  # the step's layout, once
                    if temp == "cold":
                        flush.add_(1)
                    start = time.perf_counter()
                    for cache in layers:
                        cpu_paged_attention(query, cache, meta, 0.2)
                    samples.append((time.perf_counter() - start) / LAYERS * 1e6)
        cells = ", ".join(f"{k} {statistics.median(v):.0f} us" for k, v in times.items())
        print(f"{rows} rows, context {a.context}, a layer: {cells}")


def _use(setting: str) -> None:
    os.environ["PAGEDSERVE_CPU_KERNELS"] = setting  # read by the next lookup
    settings.forget()
    cpu_native._kernel.cache_clear()


def _usable(variant: str) -> bool:
    """Builds `variant` (printing its vector instruction counts) if this CPU can run it."""
    _use(variant)
    if not cpu_native.available():
        return False
    path = cpu_native.library_path(cpu_native._compiler(), variant)
    counts = cpu_native.register_counts(path)
    print(f"{variant}: {os.path.basename(path)}, instructions naming {counts}")
    return True


if __name__ == "__main__":
    main()
