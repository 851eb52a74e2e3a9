"""The gate/up GEMM with SwiGLU in its epilogue (kernels/swiglu_gemm.py): where it runs, and on a
Hopper GPU with quack installed, its result against cuBLAS + silu_and_mul, in a Llama MLP with
tp-stacked weights and inside a CUDA graph (the GPU part skips elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pagedserve import settings
from pagedserve.kernels import backend, swiglu_gemm
from pagedserve.kernels.activation import silu_and_mul_ref
from pagedserve.kernels.swiglu_gemm import SWIGLU_GEMM_MIN_ROWS, swiglu_gemm_applies, swiglu_linear
from pagedserve.worker.layers import linear as layers

HAS_QUACK_HOPPER = (
    torch.cuda.is_available()
    and torch.cuda.get_device_capability()[0] == 9
    and swiglu_gemm.quack_available()
)
needs_quack = pytest.mark.skipif(not HAS_QUACK_HOPPER, reason="needs an SM 9.x GPU and quack")


def _without_fusions(monkeypatch, names: str) -> None:
    monkeypatch.setenv("PAGEDSERVE_DISABLE_FUSIONS", names)
    settings.forget()


@pytest.fixture(autouse=True)
def _fresh_fusion_setting():
    settings.forget()
    yield
    settings.forget()


def test_cpu_keeps_the_two_kernel_path():
    mlp = layers.MergedColumnParallelLinear(64, [96, 96])
    x = torch.randn(SWIGLU_GEMM_MIN_ROWS, 64)
    assert not swiglu_gemm_applies(x, torch.randn(192, 64))
    assert mlp.swiglu(x) is None


def test_fusion_name_is_known(monkeypatch):
    _without_fusions(monkeypatch, "swiglu-gemm")
    assert not backend.fusion_enabled("swiglu-gemm")
    assert backend.fusion_enabled("gemv")


@pytest.mark.gpu
@needs_quack
@pytest.mark.parametrize("rows", [SWIGLU_GEMM_MIN_ROWS, 1500, 8192])
def test_swiglu_linear_matches_gemm_then_silu(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 768, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    got = swiglu_linear(x, w).float()
    want = silu_and_mul_ref(x.float() @ w.float().t())
    assert got.shape == (rows, 768)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_quack
def test_llama_mlp_takes_it_for_prompts_only(monkeypatch):
    torch.manual_seed(0)
    mlp = layers.MergedColumnParallelLinear(256, [512, 512]).cuda().to(torch.bfloat16)
    with torch.no_grad():
        mlp.weight.normal_(0, 0.05)
    big = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
    small = big[: SWIGLU_GEMM_MIN_ROWS - 1].contiguous()
    assert mlp.swiglu(small) is None
    fused = mlp.swiglu(big)
    assert fused is not None
    want = silu_and_mul_ref(mlp(big).float())
    torch.testing.assert_close(fused.float(), want, atol=2e-2, rtol=2e-2)
    _without_fusions(monkeypatch, "swiglu-gemm")
    assert mlp.swiglu(big) is None


@pytest.mark.gpu
@needs_quack
def test_cuda_graph_replays_with_new_inputs():
    torch.manual_seed(1)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    swiglu_linear(x, w)  # compiled outside the capture, as the start-up profile does
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = swiglu_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, swiglu_linear(x, w), atol=0, rtol=0)
