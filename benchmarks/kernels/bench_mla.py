"""Check and time MLA's Triton decode kernel at DeepSeek-V3's head shapes on a GPU (bf16, one
rank: 128 heads, latent R = 512, rope P = 64, block size 16) against the torch latent attention
it replaces (kernels/mla.py `mla_decode_ref`, padded to the host bound as in a decode graph).

Run: `python -m pagedserve.benchmarks.kernels.bench_mla`. Columns as bench_kernels.py's: the
kernel's median time replaying a CUDA graph, the reference's eagerly, and the bandwidth from the
latent bytes a step must read (every row's `[c | k_pe]` once) against the H100's ~3000 GB/s.
`--sweep`: the launch configurations (heads per program, keys per tile, warps, stages) and split
counts instead, each case's time in us, to choose `DECODE_CONFIG` and `choose_mla_splits`.
Tests share `latent_batch`.
"""

from __future__ import annotations

import functools
import itertools

import torch

from pagedserve.benchmarks.kernels.bench_kernels import _row
from pagedserve.kernels.mla import mla_decode_ref

HEADS, RANK, ROPE, BLOCK_SIZE, MAX_MODEL_LEN = 128, 512, 64, 16, 2048
CASES = ((1, 192), (1, 2048), (8, 1152), (32, 1152), (128, 1152))  # (rows, context)


def latent_batch(
    lens: list[int],
    heads: int,
    rank: int,
    rope: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> list[torch.Tensor]:
    """q_lat [B, H, R], q_pe [B, H, P], a paged latent cache whose rows own shuffled blocks
    (block 0 left to padding rows, as in a CUDA graph), block_tables [B, W] and seq_lens [B]
    (int32)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = max(-(-n // block_size) for n in lens) + 1
    num_blocks = len(lens) * width + 1
    shape = (num_blocks, 1, block_size, 1, rank + rope)
    cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen, device=device)
    tables = (order[: len(lens) * width] + 1).view(-1, width).to(torch.int32)
    q_lat = torch.randn(len(lens), heads, rank, generator=gen, device=device) / rank**0.25
    q_pe = torch.randn(len(lens), heads, rope, generator=gen, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return [q_lat.to(dtype), q_pe.to(dtype), cache, tables, seq_lens]


def _time_us(args: list[torch.Tensor], splits: int | None, config: dict[str, int]) -> float:
    from triton.testing import do_bench_cudagraph

    from pagedserve.kernels.triton_mla import triton_mla_decode

    fn = functools.partial(triton_mla_decode, *args, MAX_MODEL_LEN, 0.1, splits, config)
    try:
        return 1e3 * do_bench_cudagraph(fn, return_mode="median")
    except Exception as exc:  # a configuration past the SM's resources
        print(f"  {config}: {type(exc).__name__}")
        return float("nan")


def sweep() -> None:
    from pagedserve.kernels.triton_mla import DECODE_CONFIG

    batches = [latent_batch([ctx] * b, HEADS, RANK, ROPE, BLOCK_SIZE, torch.bfloat16, "cuda")
               for b, ctx in CASES]  # fmt: skip
    print(
        "BLOCK_H BLOCK_N warps stages".ljust(40)
        + "".join(f"B={b},ctx={c}".rjust(15) for b, c in CASES)
    )
    names = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages")
    grid = itertools.product((16, 32), (16, 32, 64), (4, 8), (1, 2))
    launches = [(dict(zip(names, g, strict=True)), None) for g in grid]
    launches += [(DECODE_CONFIG, n) for n in (1, 2, 4, 8, 16)]
    for config, splits in launches:
        times = [_time_us(args, splits, config) for args in batches]
        label = " ".join(f"{v}" for v in config.values()) + (f" splits={splits}" if splits else "")
        print(label.ljust(40) + "".join(f"{t:15.1f}" for t in times))


def main() -> None:
    from pagedserve.kernels.triton_mla import triton_mla_decode

    print(
        f"{'kernel':<22} {'shape':<34} {'ms':>8} {'ref_ms':>9} {'GB/s':>8} {'peak':>6} {'err':>8}"
    )
    scale = (128 + ROPE) ** -0.5
    for rows, ctx in CASES:
        args = latent_batch([ctx] * rows, HEADS, RANK, ROPE, BLOCK_SIZE, torch.bfloat16, "cuda")
        _row(
            "mla decode",
            f"B={rows} ctx={ctx} bound={MAX_MODEL_LEN}",
            lambda args=args: triton_mla_decode(*args, MAX_MODEL_LEN, scale),
            lambda args=args: mla_decode_ref(*args, MAX_MODEL_LEN, scale),
            rows * ctx * (RANK + ROPE) * 2 + 2 * args[0].numel() * 2,
        )


if __name__ == "__main__":
    import sys

    sweep() if "--sweep" in sys.argv else main()
