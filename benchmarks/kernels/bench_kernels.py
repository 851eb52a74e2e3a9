"""Check and time every Triton kernel at Llama-3-8B sizes on a GPU (bf16, one rank).

Run: `python -m pagedserve.benchmarks.kernels.bench_kernels` (`--sweep`: the attention kernel's
launch configurations on prefill and mixed batches instead). Each row checks the kernel against its
torch reference first, then prints the median time (`triton.testing.do_bench`) and the bandwidth it
achieves from the bytes it must move, against the H100's ~3000 GB/s: decode-time kernels are memory
bound, so that ratio is the figure of merit. Triton kernels are timed replaying a CUDA graph (`ms`:
GPU time without Python launch overhead, as the model runner's decode graphs run them); the
references, which are not all capturable, run eagerly (`ref_ms`). Tests share `random_batch`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from pagedserve.kernels.attention.reference import paged_attention_ref, write_kv_cache_ref

HQ, HKV, D, HIDDEN, INTER, BLOCK_SIZE = 32, 8, 128, 4096, 14336, 16
PEAK_GBPS = 3000.0
# W1's steps with 128-row tiles (name, cached tokens per row, new tokens per row): the sweeps'
PROMPT_CASES = (
    ("prefill 8x1024", [0] * 8, [1024] * 8),
    ("mixed 256 dec@1100+7x1024", [1100] * 256 + [0] * 7, [1] * 256 + [1024] * 7),
)


def random_batch(
    computed: list[int],
    new: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    shared_blocks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Query [T, Hq, D], a random cache (spare blocks hold garbage) and metadata whose rows own
    shuffled, disjoint blocks: row i has `computed[i]` cached tokens and adds `new[i]`; the
    first `shared_blocks` blocks of every row are the same ones (a cached common prefix)."""
    rng = random.Random(seed)
    needed = [-(-(c + n) // block_size) for c, n in zip(computed, new, strict=True)]
    num_blocks = sum(max(k - shared_blocks, 0) for k in needed) + shared_blocks + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_blocks)]
    tables = [shared[:k] + [free.pop() for _ in range(k - shared_blocks)] for k in needed]
    meta, _ = build_attention_metadata(computed, new, tables, block_size, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    query = torch.randn(sum(new), num_q_heads, head_dim, generator=gen, device=device).to(dtype)
    return query, kv_cache, meta


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def _row(
    name: str,
    shape: str,
    fn: Callable[[], object],
    ref: Callable[[], object],
    nbytes: int,
    check: Callable[[], float] | None = None,
) -> None:
    from triton.testing import do_bench, do_bench_cudagraph

    err = check() if check is not None else relative_error(fn(), ref())
    ms = do_bench_cudagraph(fn, return_mode="median")  # GPU time, as the runner's graphs see it
    ref_ms = do_bench(ref, return_mode="median")
    gbps = nbytes / ms / 1e6
    print(
        f"{name:<22} {shape:<34} {ms:>8.4f} {ref_ms:>9.4f} {gbps:>8.0f} "
        f"{100 * gbps / PEAK_GBPS:>5.1f}% {err:>8.1e}"
    )
    if err > 1e-2:
        print(f"  !! {name} relative error {err:.2e} > 1e-2")


def bench_attention(dev: str) -> None:
    from pagedserve.kernels.attention.triton import triton_paged_attention

    cases = [("decode", [ctx] * b, [1] * b) for b, ctx in ((1, 4096), (64, 2048), (256, 2048))]
    cases.append(("mixed 2x512+62 dec", [1024, 1024] + [2048] * 62, [512, 512] + [1] * 62))
    for name, computed, new in cases:
        q, kv, meta = random_batch(computed, new, HQ, HKV, D, BLOCK_SIZE, torch.bfloat16, dev)
        kv_bytes = sum(c + n for c, n in zip(computed, new, strict=True)) * HKV * D * 2 * 2
        _row(
            f"attention {name}",
            f"B={len(new)} T={q.shape[0]} ctx<={meta.max_seq_len}",
            lambda q=q, kv=kv, meta=meta: triton_paged_attention(q, kv, meta, D**-0.5),
            lambda q=q, kv=kv, meta=meta: paged_attention_ref(q, kv, meta, D**-0.5),
            kv_bytes + 2 * q.numel() * 2,
        )


def bench_cache_write(dev: str) -> None:
    from pagedserve.kernels.triton_cache import triton_write_kv_cache

    for num_tokens in (256, 8192):
        kv = torch.zeros(num_tokens // BLOCK_SIZE + 8, 2, BLOCK_SIZE, HKV, D, device=dev).bfloat16()
        k, v = (torch.randn(num_tokens, HKV, D, device=dev).bfloat16() for _ in range(2))
        slots = torch.randperm(kv.shape[0] * BLOCK_SIZE, device=dev)[:num_tokens]
        slots[::7] = -1

        def check(kv=kv, k=k, v=v, slots=slots) -> float:
            expected = kv.clone()
            write_kv_cache_ref(k, v, expected, slots)
            triton_write_kv_cache(k, v, kv, slots)
            return float(not torch.equal(kv, expected))

        _row(
            "kv cache write",
            f"T={num_tokens} Hkv={HKV} D={D}",
            lambda kv=kv, k=k, v=v, slots=slots: triton_write_kv_cache(k, v, kv, slots),
            lambda kv=kv, k=k, v=v, slots=slots: write_kv_cache_ref(k, v, kv, slots),
            4 * k.numel() * 2,
            check,
        )


def bench_elementwise(dev: str) -> None:
    from pagedserve.kernels.activation import silu_and_mul_ref
    from pagedserve.kernels.norm import rms_norm
    from pagedserve.kernels.rotary import rope_config, rotate
    from pagedserve.kernels.triton_activation import triton_silu_and_mul
    from pagedserve.kernels.triton_norm import triton_rms_norm
    from pagedserve.kernels.triton_rotary import triton_rotary_embedding
    from pagedserve.worker.layers.rotary import RotaryEmbedding

    w = torch.randn(HIDDEN, device=dev).bfloat16()
    hf = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}}  # fmt: skip
    rope = RotaryEmbedding(D, 8192, rope_config(hf)).to(dev)

    def ref_rotate(q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return rotate(q, *rope.cos_sin_cache[pos].chunk(2, dim=-1), D, rope.rotary_dim)

    for t in (256, 8192):
        x, r = (torch.randn(t, HIDDEN, device=dev).bfloat16() for _ in range(2))
        _row(
            "add + rmsnorm",
            f"T={t} H={HIDDEN}",
            lambda x=x, r=r: triton_rms_norm(x, w, 1e-5, r)[0],
            lambda x=x, r=r: rms_norm(x + r, w, 1e-5),
            4 * x.numel() * 2,
        )
        qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=dev).bfloat16()
        pos = torch.randint(0, 8192, (t,), device=dev)
        q, k = qkv[:, : HQ * D], qkv[:, HQ * D : (HQ + HKV) * D]
        ref_q = ref_rotate(q, pos)  # before any rotation
        _row(
            "rotary (in place)",
            f"T={t} Hq={HQ} Hkv={HKV} D={D}",
            lambda q=q, k=k, pos=pos: triton_rotary_embedding(pos, q, k, rope.cos_sin_cache, D),
            lambda q=q, pos=pos: ref_rotate(q, pos),
            2 * (q.numel() + k.numel()) * 2,
            lambda q=q.clone(), k=k.clone(), pos=pos, ref_q=ref_q: relative_error(
                triton_rotary_embedding(pos, q, k, rope.cos_sin_cache, D)[0], ref_q
            ),
        )
        gu = torch.randn(t, 2 * INTER, device=dev).bfloat16()
        _row(
            "silu_and_mul",
            f"T={t} I={INTER}",
            lambda gu=gu: triton_silu_and_mul(gu),
            lambda gu=gu: silu_and_mul_ref(gu),
            gu.numel() * 2 * 3 // 2,
        )


def sweep_attention(dev: str) -> None:
    """Time the attention kernel's launch configurations (key tile x warps x stages) on a
    prefill and a mixed batch: where `_launch_config`'s choices come from."""
    import itertools

    from triton.testing import do_bench

    from pagedserve.kernels.attention.triton import triton_paged_attention

    for name, computed, new in PROMPT_CASES:
        q, kv, meta = random_batch(computed, new, HQ, HKV, D, BLOCK_SIZE, torch.bfloat16, dev)
        flops = sum(4 * n * (c + n / 2) * HQ * D for c, n in zip(computed, new, strict=True))
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (1, 2, 3)):
            launch = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            ms = do_bench(
                lambda q=q, kv=kv, meta=meta, launch=launch: triton_paged_attention(
                    q, kv, meta, D**-0.5, launch=launch
                ),
                return_mode="median",
            )
            print(
                f"attention {name:<28} BLOCK_N={block_n:<4} warps={warps} stages={stages}: "
                f"{1000 * ms:7.0f} us {flops / ms / 1e9:5.0f} TFLOP/s"
            )


def sweep_decode(dev: str) -> None:
    """Decode batches (W1's 256 and 512 rows at ~1,100 tokens, 64 at 2,048) over a bf16 and an
    FP8 cache: every launch configuration (key tile x warps x stages; for FP8 also the float16
    dots) with its GB/s of KV read, the best per case last; then W1's prefill and mixed steps
    over an FP8 cache with bfloat16 or float16 dots."""
    import itertools

    from triton.testing import do_bench_cudagraph

    from pagedserve.kernels.attention.triton import triton_paged_attention

    best = []
    for rows, ctx in ((256, 1088), (512, 1088), (64, 2048)):
        q, kv, meta = random_batch([ctx] * rows, [1] * rows, HQ, HKV, D, BLOCK_SIZE,
                                   torch.bfloat16, dev)  # fmt: skip
        for cache in ("bf16", "fp8"):
            cache_kv = kv if cache == "bf16" else kv.to(torch.float8_e4m3fn)
            nbytes = rows * (ctx + 1) * HKV * D * 2 * cache_kv.element_size()
            results = []
            for block_n, warps, stages, f16 in itertools.product(
                (32, 64, 128), (4, 8), (2, 3, 4), (False, True) if cache == "fp8" else (False,)
            ):
                launch = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, DOT_F16=f16)
                fn = lambda q=q, kv=cache_kv, meta=meta, launch=launch: (  # noqa: E731
                    triton_paged_attention(q, kv, meta, D**-0.5, launch=launch)
                )
                try:
                    ms = do_bench_cudagraph(fn, return_mode="median")
                except Exception as e:  # out of shared memory for the largest tiles
                    print(f"{rows}x{ctx} {cache} {launch}: {type(e).__name__}")
                    continue
                results.append((ms, launch))
                print(f"{rows}x{ctx} {cache} {launch}: {1e3 * ms:7.1f} us "
                      f"{nbytes / ms / 1e6:6.0f} GB/s")  # fmt: skip
            ms, launch = min(results, key=lambda r: r[0])
            best.append(f"{rows}x{ctx} {cache}: best {launch} {1e3 * ms:.1f} us "
                        f"{nbytes / ms / 1e6:.0f} GB/s")  # fmt: skip
    # 128-row tiles over an FP8 cache: bfloat16 or float16 dots at the configs near the default
    for name, computed, new in PROMPT_CASES:
        q, kv, meta = random_batch(computed, new, HQ, HKV, D, BLOCK_SIZE, torch.bfloat16, dev)
        kv8 = kv.to(torch.float8_e4m3fn)
        for block_n, stages, f16 in itertools.product((32, 64), (2, 3), (False, True)):
            launch = dict(BLOCK_N=block_n, num_warps=4, num_stages=stages, DOT_F16=f16)
            fn = lambda q=q, kv=kv8, meta=meta, launch=launch: (  # noqa: E731
                triton_paged_attention(q, kv, meta, D**-0.5, launch=launch)
            )
            print(f"{name} fp8 {launch}: {1e3 * do_bench_cudagraph(fn):7.1f} us")
    print("\n".join(best))


def sweep_long(dev: str) -> None:
    """W5's decode-only steps: 12-40 rows at 16k tokens, bf16 cache of 16- and 128-token blocks,
    over split counts and launch configurations, GB/s of KV read; the best per case last (what
    `choose_num_splits` and `_launch_config` should pick there)."""
    import itertools

    from triton.testing import do_bench_cudagraph

    from pagedserve.kernels.attention.triton import (
        _launch_config,
        choose_num_splits,
        triton_paged_attention,
    )
    from pagedserve.kernels.backend import num_sms

    best = []
    for block_size, rows, ctx in itertools.product((16, 128), (12, 24, 40), (16384,)):
        q, kv, meta = random_batch([ctx] * rows, [1] * rows, HQ, HKV, D, block_size,
                                   torch.bfloat16, dev)  # fmt: skip
        nbytes = rows * (ctx + 1) * HKV * D * 2 * kv.element_size()
        results = []
        configs = [(64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2), (32, 4, 4)]
        for splits, (block_n, warps, stages) in itertools.product((1, 2, 3, 4, 6, 8), configs):
            launch = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            fn = lambda q=q, kv=kv, meta=meta, launch=launch, s=splits: (  # noqa: E731
                triton_paged_attention(q, kv, meta, D**-0.5, launch=launch, num_splits=s)
            )
            ms = do_bench_cudagraph(fn, return_mode="median")
            results.append((ms, splits, launch))
            print(f"bs{block_size} {rows}x{ctx} splits={splits} {launch}: {1e3 * ms:7.1f} us "
                  f"{nbytes / ms / 1e6:6.0f} GB/s")  # fmt: skip
        now = [r for r in results if r[2] == _launch_config(16, False)]
        chosen = choose_num_splits(rows, HKV, 1, 32768, num_sms(0))
        picks = {"best": results, f"default config (choose_num_splits: {chosen})": now}
        for label, picked in picks.items():
            ms, splits, launch = min(picked, key=lambda r: r[0])
            best.append(f"bs{block_size} {rows}x{ctx}: {label} splits={splits} {launch} "
                        f"{1e3 * ms:.1f} us {nbytes / ms / 1e6:.0f} GB/s")  # fmt: skip
    print("\n".join(best))


def main() -> None:
    import sys

    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    torch.manual_seed(0)
    if "--sweep-long" in sys.argv[1:]:
        sweep_long("cuda")
        return
    if "--sweep-decode" in sys.argv[1:]:
        sweep_decode("cuda")
        return
    if "--sweep" in sys.argv[1:]:
        sweep_attention("cuda")
        return
    print(torch.cuda.get_device_name(), "bf16, Llama-3-8B shapes; ref_ms is the torch reference")
    print(
        f"{'kernel':<22} {'shape':<34} {'ms':>8} {'ref_ms':>9} {'GB/s':>8} {'peak':>6} "
        f"{'rel_err':>8}"
    )
    bench_attention("cuda")
    bench_cache_write("cuda")
    bench_elementwise("cuda")


if __name__ == "__main__":
    main()
