"""The C++ decode attention (kernels/cpu_native.py) built as each of its instruction-set variants,
explicitly, whatever the machine: the AVX2 build (`-mavx2 -mfma`, no `-march=native`) compiles to
256-bit code and runs against `paged_attention_ref` on every x86 CPU, the AVX-512 build compiles to
512-bit code everywhere and runs where the CPU has AVX-512 (skipped otherwise), and a variant the
CPU cannot run is refused with a warning, torch serving, instead of an illegal instruction."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

from pagedserve import settings
from pagedserve.benchmarks.kernels.bench_kernels import random_batch
from pagedserve.kernels import cpu_native
from pagedserve.kernels.attention.cpu import cpu_paged_attention
from pagedserve.kernels.attention.reference import paged_attention_ref

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or cpu_native._compiler() is None,
    reason="x86 variants need an x86 CPU and a C++ compiler",
)
DECODES = ([0, 5, 17, 40, 3, 63], [1] * 6)  # (cached tokens, new tokens) per row
SHAPES = [  # hq, hkv, head_dim, block_size, window, cache dtype
    (4, 2, 32, 16, None, torch.float32),  # the embedded model's heads
    (32, 8, 128, 16, None, torch.bfloat16),  # Llama-3-8B's heads, a bfloat16 model
    (6, 6, 24, 3, 4, torch.float32),  # a head_dim without its own compiled loop, a window
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One build of each variant for the module, in a cache of its own."""
    return str(tmp_path_factory.mktemp("cpu_kernels"))


@pytest.fixture
def variant_env(monkeypatch, cache_dir):
    """Sets PAGEDSERVE_CPU_KERNELS for the kernel's next lookup; restores it all afterwards."""

    def use(variant: str) -> None:
        monkeypatch.setenv("PAGEDSERVE_CACHE", cache_dir)
        monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", variant)
        settings.forget()
        cpu_native._kernel.cache_clear()

    yield use
    monkeypatch.undo()
    settings.forget()
    cpu_native._kernel.cache_clear()


@pytest.mark.parametrize(("variant", "width"), [("avx2", "ymm"), ("avx512", "zmm")])
def test_variant_builds_to_its_vector_width(variant, width, cache_dir, variant_env):
    """Built on any x86 machine (running is another matter): the AVX2 library's vector code is
    256-bit with no 512-bit instruction, the AVX-512 library's is 512-bit."""
    variant_env(variant)
    compiler = cpu_native._compiler()
    path = cpu_native.library_path(compiler, variant)
    cpu_native.build(compiler, path, variant)
    counts = cpu_native.register_counts(path)
    if counts is None:
        pytest.skip("no objdump")
    assert counts[width] > 200, counts
    if variant == "avx2":
        assert counts["zmm"] == 0, counts


@pytest.mark.parametrize("variant", ["avx2", "avx512"])
@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size", "window", "dtype"), SHAPES)
def test_variant_matches_reference(
    variant, hq, hkv, head_dim, block_size, window, dtype, variant_env
):
    if missing := cpu_native.missing_flags(variant):
        pytest.skip(f"this CPU lacks {missing}")
    variant_env(variant)
    assert cpu_native.available()
    q, kv, meta = random_batch(*DECODES, hq, hkv, head_dim, block_size, dtype, "cpu", seed=hq)
    tables, lengths = meta.block_tables.long(), torch.from_numpy(meta.seq_lens_cpu).long()
    out = cpu_native.decode_attention(q, kv, tables, lengths, 0.3, window)
    ref = paged_attention_ref(q, kv, meta, 0.3, window)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, **tol)


def test_variant_this_cpu_lacks_is_refused(variant_env, monkeypatch, caplog):
    """A CPU without AVX-512 asked for the avx512 build: a warning naming what it lacks, and
    the torch path serves (the library is neither built nor loaded)."""
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: "flags : sse2 avx avx2 fma f16c")
    variant_env("avx512")
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert not cpu_native.available()
    assert "lacks avx512f, avx512bw, avx512vl, avx512dq for the avx512" in caplog.text
    q, kv, meta = random_batch(*DECODES, 4, 2, 32, 16, torch.float32, "cpu")
    ref = paged_attention_ref(q, kv, meta, 0.3)
    torch.testing.assert_close(cpu_paged_attention(q, kv, meta, 0.3), ref, atol=1e-5, rtol=1e-5)


def test_native_prefers_512_bit_vectors_where_the_cpu_has_them(monkeypatch):
    """GCC's -march=native stays at 256-bit vectors on AVX-512 CPUs; ours asks for 512 there
    (measured faster, docs/cpu_avx.md) and leaves an AVX2 CPU's build alone."""
    avx2 = "flags : sse2 avx avx2 fma f16c"
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: avx2)
    assert cpu_native.variant_flags("native") == ["-march=native"]
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: f"{avx2} {' '.join(cpu_native.AVX512)}")
    assert cpu_native.variant_flags("native") == ["-march=native", "-mprefer-vector-width=512"]
    assert "-mprefer-vector-width=512" not in cpu_native.variant_flags("avx2")
