"""The few-row CPU linear (kernels/cpu_small_linear.cpp via kernels/cpu_linear.py) against
`x @ w.T + b`: built as each instruction-set variant explicitly (AVX2 everywhere on x86, AVX-512
where the CPU has it, the machine's own); the rows, weight rows and columns that its vector loops
do not divide; and which layout a loaded model's linears take: plain (this kernel up to `SMALL_M`
rows, oneDNN above) for a model too large for the caches, oneDNN's blocked one for a small one
or with `PAGEDSERVE_CPU_LINEAR=packed`."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from pagedserve import settings
from pagedserve.kernels import cpu_linear, cpu_native
from pagedserve.worker.layers import linear as layers
from pagedserve.worker.loader import after_loading

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or cpu_native._compiler() is None,
    reason="the C++ CPU kernels need an x86 CPU and a C++ compiler",
)


@pytest.fixture
def env(monkeypatch, tmp_path_factory):
    """Sets an environment variable for the kernels' and settings' next lookup; restores all."""

    def use(name: str, value: str) -> None:
        monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))
        monkeypatch.setenv(name, value)
        settings.forget()
        cpu_native._kernel.cache_clear()

    yield use
    monkeypatch.undo()
    settings.forget()
    cpu_native._kernel.cache_clear()


@pytest.mark.parametrize("variant", ["native", "avx2", "avx512"])
def test_small_linear_matches_matmul(variant, env):
    if missing := cpu_native.missing_flags(variant):
        pytest.skip(f"this CPU lacks {missing}")
    env("PAGEDSERVE_CPU_KERNELS", variant)
    assert cpu_native.available()
    torch.manual_seed(0)
    # 37 weight rows: rows left over after groups of 4 (one row) or 5; 131 columns: a lane tail
    weight, bias = torch.randn(37, 131), torch.randn(37)
    for rows in (0, 1, 2, 3, 4, 5, 7, 32):
        x = torch.randn(rows, 131)
        for b in (bias, None):
            want = x @ weight.T + (0 if b is None else b)
            got = cpu_native.small_linear(x, weight, b)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    x = torch.randn(5, 262)[:, ::2]  # a strided input is made contiguous
    torch.testing.assert_close(cpu_native.small_linear(x, weight, None), x @ weight.T)


def _model(hidden: int, vocab: int) -> torch.nn.Module:
    """A column-parallel linear big enough to prepare ([2 * hidden, hidden]) and a tied head."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.proj = layers.ColumnParallelLinear(hidden, 2 * hidden, bias=True)
    model.embed = layers.VocabParallelEmbedding(vocab, hidden)
    model.head = layers.ParallelLMHead(vocab, hidden)
    model.head.tie(model.embed)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    return model


def test_streamed_model_keeps_plain_weights_and_matches_f_linear(env, monkeypatch):
    """Over `STREAMED_MODEL_BYTES`: the weights stay plain (no copy: the tied head shares the
    embedding's), rows up to SMALL_M run the C++ kernel and more run oneDNN, each as F.linear."""
    env("PAGEDSERVE_CPU_LINEAR", "onednn")
    monkeypatch.setattr(cpu_linear, "STREAMED_MODEL_BYTES", 0)
    model = _model(1024, 512)
    weight, bias = model.proj.weight.data.clone(), model.proj.bias.data.clone()
    after_loading(model)
    assert model.proj.weight is None and model.proj.packed.layout == torch.strided
    assert model.head.packed.data_ptr() == model.embed.weight.data_ptr()
    calls = []
    small_linear = cpu_native.small_linear
    monkeypatch.setattr(cpu_native, "small_linear", lambda *a: calls.append(1) or small_linear(*a))
    for rows, kernel in ((1, True), (7, True), (cpu_linear.SMALL_M, True), (33, False)):
        calls.clear()
        x = torch.randn(rows, 1024)
        torch.testing.assert_close(model.proj(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
        assert bool(calls) == kernel
    x = torch.randn(3, 1024)
    head = model.head(x)
    torch.testing.assert_close(head, x @ model.embed.weight.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("setting", "streamed"), [("onednn", False), ("packed", True)])
def test_small_model_or_packed_setting_takes_onednn_layout(setting, streamed, env, monkeypatch):
    """Under `STREAMED_MODEL_BYTES` (weights in cache: compute-bound) or with the `packed`
    setting, every prepared weight ends in oneDNN's layout, as before this kernel."""
    env("PAGEDSERVE_CPU_LINEAR", setting)
    if streamed:
        monkeypatch.setattr(cpu_linear, "STREAMED_MODEL_BYTES", 0)
    model = _model(1024, 512)
    weight = model.proj.weight.data.clone()
    after_loading(model)
    assert model.proj.packed.layout == model.head.packed.layout == torch._mkldnn
    assert model.head.weight is model.embed.weight  # the head packed a copy
    x = torch.randn(2, 1024)
    torch.testing.assert_close(model.proj(x) - model.proj.bias, x @ weight.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("streamed", [True, False])
def test_streamed_model_runs_its_small_weights_on_the_kernel(streamed, env, monkeypatch):
    """A weight under `MIN_PACKED_ELEMENTS` (SmolLM2's o_proj) of a streamed model runs the C++
    kernel at decode sizes too (plain, no copy), as F.linear; a small model keeps it on
    F.linear (its compiled forward needs unpacked layers)."""
    env("PAGEDSERVE_CPU_LINEAR", "onednn")
    if streamed:
        monkeypatch.setattr(cpu_linear, "STREAMED_MODEL_BYTES", 0)
    model = _model(1024, 512)
    model.small = layers.RowParallelLinear(256, 256, bias=False)
    model.small.weight.data.normal_()  # (the layer allocates it uninitialized: a NaN now and then)
    weight = model.small.weight.data.clone()
    after_loading(model)
    assert (model.small.packed is not None) == streamed and (model.small.weight is None) == streamed
    calls = []
    small_linear = cpu_native.small_linear
    monkeypatch.setattr(cpu_native, "small_linear", lambda *a: calls.append(1) or small_linear(*a))
    x = torch.randn(9, 256)
    torch.testing.assert_close(model.small(x), x @ weight.T, atol=1e-4, rtol=1e-4)
    assert bool(calls) == streamed
