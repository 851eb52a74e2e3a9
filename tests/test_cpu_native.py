"""The C++ decode attention (kernels/cpu_native.py) against `paged_attention_ref`: head sizes
with and without a compiled-in head_dim, GQA groups, block sizes that split rows mid-block,
windows, float32 and bfloat16 caches, one and two threads; the CPU backend runs its decode rows
through it in mixed steps; a failed build, or `PAGEDSERVE_CPU_KERNELS=torch`, leaves the torch
path serving."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from pagedserve import settings
from pagedserve.benchmarks.kernels.bench_kernels import random_batch
from pagedserve.kernels import cpu_native
from pagedserve.kernels.attention.cpu import cpu_paged_attention
from pagedserve.kernels.attention.reference import paged_attention_ref

DECODES = ([0, 5, 17, 40, 3, 63], [1] * 6)  # (cached tokens, new tokens) per row
MIXED = ([9, 0, 30, 2, 0, 11], [1, 6, 1, 1, 3, 20])


@pytest.fixture
def fresh_kernel(monkeypatch):
    """`_kernel` looked up again under the test's environment, and again after it."""

    class Env:
        """monkeypatch's setenv/delenv, with the settings read again after each change."""

        def setenv(self, name: str, value: str) -> None:
            monkeypatch.setenv(name, value)
            settings.forget()

        def delenv(self, name: str) -> None:
            monkeypatch.delenv(name)
            settings.forget()

    cpu_native._kernel.cache_clear()
    yield Env()
    monkeypatch.undo()
    settings.forget()
    cpu_native._kernel.cache_clear()


@pytest.mark.parametrize(
    ("hq", "hkv", "head_dim", "block_size", "window", "dtype"),
    [
        (4, 2, 32, 16, None, torch.float32),  # the embedded model's heads
        (8, 2, 64, 5, 9, torch.float32),
        (32, 8, 128, 16, None, torch.bfloat16),  # Llama-3-8B's heads, a bfloat16 model
        (6, 6, 24, 3, 4, torch.float32),  # a head_dim without its own compiled loop
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_kernel_matches_reference(hq, hkv, head_dim, block_size, window, dtype, threads):
    assert cpu_native.available()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kv, meta = random_batch(*DECODES, hq, hkv, head_dim, block_size, dtype, "cpu", seed=hq)
        tables = meta.block_tables.long()
        lengths = torch.from_numpy(meta.seq_lens_cpu).long()
        out = cpu_native.decode_attention(q, kv, tables, lengths, 0.3, window)
    finally:
        torch.set_num_threads(before)
    ref = paged_attention_ref(q, kv, meta, 0.3, window)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, **tol)


def test_backend_sends_decode_rows_through_the_kernel(monkeypatch):
    calls = []
    real = cpu_native.decode_attention

    def counted(query, *args):
        calls.append(query.shape[0])
        return real(query, *args)

    monkeypatch.setattr(cpu_native, "decode_attention", counted)
    q, kv, meta = random_batch(*MIXED, 8, 2, 32, 4, torch.float32, "cpu", seed=3)
    out = cpu_paged_attention(q, kv, meta, 0.3, 7)
    # the three decode rows, scattered among the prefill chunks; then the rows of 6 and 3
    # queries (at most MAX_SHORT_QUERIES), one decode row per query padded to 6; 20 go to SDPA
    assert calls == [3, 12]
    torch.testing.assert_close(out, paged_attention_ref(q, kv, meta, 0.3, 7), atol=1e-5, rtol=1e-5)
    fp8 = kv.to(torch.float8_e4m3fn)  # a cache the kernel does not read: the torch path
    ref = paged_attention_ref(q, fp8, meta, 0.3, 7, k_scale=0.5, v_scale=2.0)
    got = cpu_paged_attention(q, fp8, meta, 0.3, 7, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert calls == [3, 12]


def test_failed_build_or_setting_leaves_torch_serving(fresh_kernel, tmp_path, caplog):
    fresh_kernel.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    fresh_kernel.setenv("CXX", "false")  # a compiler that fails every build
    q, kv, meta = random_batch(*DECODES, 4, 2, 32, 16, torch.float32, "cpu")
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert not cpu_native.available()
    assert "staying on torch" in caplog.text and "false" in caplog.text
    ref = paged_attention_ref(q, kv, meta, 0.3)
    torch.testing.assert_close(cpu_paged_attention(q, kv, meta, 0.3), ref, atol=1e-5, rtol=1e-5)

    cpu_native._kernel.cache_clear()
    fresh_kernel.delenv("CXX")
    fresh_kernel.setenv("PAGEDSERVE_CPU_KERNELS", "torch")
    assert not cpu_native.available()
    fresh_kernel.setenv("PAGEDSERVE_CPU_KERNELS", "fast")
    cpu_native._kernel.cache_clear()
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_KERNELS='fast'"):
        cpu_native.available()


def test_build_goes_to_the_cache_once(fresh_kernel, tmp_path):
    fresh_kernel.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert cpu_native.available()
    # Loading it leaves the process's floating point alone (a library linked with -ffast-math
    # turns on flush-to-zero for everyone: subnormals would become 0).
    assert float(sys.float_info.min) / 2.0 > 0.0
    assert torch.tensor(1e-40, dtype=torch.float32).item() * 1.0 > 0.0
    built = list((tmp_path / "cpu_kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no partial file left behind
    mtime = built[0].stat().st_mtime_ns
    cpu_native._kernel.cache_clear()
    assert cpu_native.available()  # a second process loads it
    assert built[0].stat().st_mtime_ns == mtime
