"""The attention backend choice (`--attention-backend`, per step kind) on CPU, and FlashAttention 4
against the torch reference on a GPU (skipped without CUDA or without `flash_attn.cute`)."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch

from pagedserve import settings
from pagedserve.config import ModelConfig
from pagedserve.kernels.attention import flash, selection
from pagedserve.kernels.attention.dispatch import STEP_KINDS, per_step_kind, step_kind
from pagedserve.kernels.attention.flash import flash_attn_importable
from pagedserve.kernels.attention.metadata import build_attention_metadata
from pagedserve.kernels.attention.reference import paged_attention_ref

HAS_FLASH = torch.cuda.is_available() and flash_attn_importable()
needs_flash = pytest.mark.skipif(not HAS_FLASH, reason="needs CUDA and flash_attn.cute (FA4)")


def _meta(computed: list[int], new: list[int]):
    tables = [list(range(-(-(c + n) // 16))) for c, n in zip(computed, new, strict=True)]
    return build_attention_metadata(computed, new, tables, 16)[0]


def test_step_kind_and_dispatch():
    assert step_kind(_meta([5, 9], [1, 1])) == "decode"
    assert step_kind(_meta([0, 3], [7, 4])) == "prefill"
    assert step_kind(_meta([0, 3], [7, 1])) == "mixed"
    graph_meta = _meta([0, 3], [7, 4])
    graph_meta.query_start_loc_cpu = np.zeros(3, dtype=np.int32)  # a mixed graph's placeholder
    assert step_kind(graph_meta) == "mixed"
    calls = []

    def fake(name):
        return lambda q, kv, meta, scale, window=None, **kw: calls.append((name, window, kw))

    attend = per_step_kind({k: fake(k) for k in STEP_KINDS})
    attend(None, None, _meta([5], [1]), 1.0, None, k_scale=2.0)
    attend(None, None, _meta([0, 3], [7, 1]), 1.0, 4096, logit_softcap=30.0)
    assert calls == [("decode", None, {"k_scale": 2.0}), ("mixed", 4096, {"logit_softcap": 30.0})]


def test_backend_names_refused_where_unusable(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND", raising=False)
    settings.forget()
    assert selection.attention_backend_name("cpu") == "sdpa"
    with pytest.raises(ValueError, match="choose one of"):
        selection.attention_backend_name("cpu", "flash2")
    for name in ("flash", "triton"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            selection.attention_backend_name("cpu", name)
    monkeypatch.setattr(flash, "flash_attn_available", lambda: False)
    with pytest.raises(ValueError, match="flash_attn.cute does not import"):
        selection.attention_backend_name("cuda", "flash")
    monkeypatch.setattr(flash, "flash_attn_available", lambda: True)
    with pytest.raises(ValueError, match="FP8 KV cache"):
        selection.attention_backend_name("cuda", "flash", kv_fp8=True)
    with pytest.raises(ValueError, match="float16/bfloat16 models only, not float32"):
        selection.attention_backend_name("cuda", "flash", dtype=torch.float32)
    assert selection.attention_backend_name("cuda", "flash", dtype=torch.bfloat16) == "flash"


def test_flash_importable_needs_cutlass_cute(tmp_path, monkeypatch):
    """The partial install of nvidia-cutlass-dsl >= 4.6 without libs-core: `cutlass` holds only
    `_mlir`, so `import flash_attn.cute` would fail; found out without importing anything."""
    if importlib.util.find_spec("flash_attn") or importlib.util.find_spec("cutlass"):
        pytest.skip("a real FA4 or cutlass is installed here")
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    (tmp_path / "cutlass" / "_mlir").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.cute", "cutlass"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not flash_attn_importable()
    (tmp_path / "cutlass" / "cute").mkdir()
    assert flash_attn_importable()


def test_config_refuses_unknown_backend(tmp_path):
    hf = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1}
    hf.update(num_attention_heads=2, vocab_size=16)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert ModelConfig(str(tmp_path)).attention_backend == "auto"
    with pytest.raises(ValueError, match="--attention-backend 'fa3'"):
        ModelConfig(str(tmp_path), attention_backend="fa3")


def test_auto_reads_measured_choice(tmp_path, monkeypatch):
    path = tmp_path / "choice.json"
    measured = {"GPU X": {"prefill": "flash", "decode": "triton", "mixed": "bogus"}}
    path.write_text(json.dumps(measured))
    monkeypatch.setattr(selection, "CHOICE_FILE", str(path))
    monkeypatch.setattr(flash, "flash_attn_available", lambda: True)
    want = {"prefill": "flash", "decode": "triton", "mixed": "triton"}
    assert selection.auto_choices("GPU X") == want
    assert set(selection.auto_choices("GPU Y").values()) == {"triton"}  # not measured there
    assert set(selection.auto_choices("GPU X", kv_fp8=True).values()) == {"triton"}
    assert selection.auto_choices("GPU X", dtype=torch.bfloat16) == want
    # FA4 reads fp16/bf16 only: a float32 model (the GPU equivalence tests') stays on Triton
    assert set(selection.auto_choices("GPU X", dtype=torch.float32).values()) == {"triton"}
    monkeypatch.setattr(flash, "flash_attn_available", lambda: False)
    assert set(selection.auto_choices("GPU X").values()) == {"triton"}


# ------------------------------------------------------------------ GPU: FA4 against the reference
CASES = {
    "prefill": ([0, 0, 0], [300, 17, 128]),
    "chunked prefill": ([256, 1000], [256, 77]),
    "decode": ([0, 15, 16, 4095, 700], [1, 1, 1, 1, 1]),
    "mixed": ([1024, 33, 0, 500], [1, 1, 200, 64]),
}


def _check(computed, new, hq, hkv, block_size, **kw):
    from pagedserve.benchmarks.kernels.bench_kernels import random_batch, relative_error
    from pagedserve.kernels.attention.flash import flash_paged_attention

    q, kv, meta = random_batch(computed, new, hq, hkv, 128, block_size, torch.bfloat16, "cuda")
    out = flash_paged_attention(q, kv, meta, 128**-0.5, **kw)
    ref = paged_attention_ref(q, kv, meta, 128**-0.5, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert relative_error(out, ref) < 1e-2


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("case", list(CASES))
def test_flash_matches_reference(case):
    _check(*CASES[case], 32, 8, 16)


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("heads", [(8, 8), (28, 4)])  # MHA, GQA 7 (Qwen-like); 32/8 above
def test_flash_head_layouts(heads):
    _check(*CASES["mixed"], *heads, 16)


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128, 256])
def test_flash_block_sizes(block_size):
    _check(*CASES["mixed"], 32, 8, block_size)


@pytest.mark.gpu
@needs_flash
def test_flash_window_and_softcap():
    _check(*CASES["mixed"], 32, 8, 16, sliding_window=100)
    _check(*CASES["prefill"], 32, 8, 16, logit_softcap=30.0)


@pytest.mark.gpu
@needs_flash
def test_flash_in_cuda_graph():
    """A captured call replays over new metadata of the same shapes (the runner's graphs)."""
    from pagedserve.benchmarks.kernels.bench_kernels import random_batch, relative_error
    from pagedserve.kernels.attention.flash import flash_paged_attention

    q, kv, meta = random_batch([100, 2000], [1, 1], 32, 8, 128, 16, torch.bfloat16, "cuda")
    meta.max_seq_len = meta.block_tables.shape[1] * 16  # an upper bound, as the graphs pass
    flash_paged_attention(q, kv, meta, 0.1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_paged_attention(q, kv, meta, 0.1)
    meta.seq_lens.copy_(torch.tensor([2001, 50], dtype=torch.int32))
    meta.seq_lens_cpu = np.array([2001, 50], dtype=np.int32)
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, paged_attention_ref(q, kv, meta, 0.1)) < 1e-2


def test_warm_up_runs_each_layer_configuration_once():
    from pagedserve.worker.layers.attention import Attention
    from pagedserve.worker.warm_up import warm_up_attention

    calls = []

    def backend(q, kv, meta, scale, window=None, **kw):
        calls.append((q.shape, meta.max_query_len, window, kw.get("logit_softcap")))
        return paged_attention_ref(q, kv, meta, scale, window, kw.get("logit_softcap"))

    layers = [
        Attention(4, 2, 8, 0.3, None, backend),
        Attention(4, 2, 8, 0.3, None, backend),
        Attention(4, 2, 8, 0.3, 16, backend),
        Attention(4, 2, 8, 0.3, None, backend, logit_softcap=50.0),
    ]
    kv = torch.zeros(16, 2, 16, 2, 8)
    assert warm_up_attention(layers, kv, torch.float32) == 3
    prefill, mixed = ((128, 4, 8), 64), ((65, 4, 8), 64)
    assert calls == [
        (*prefill, None, None), (*mixed, None, None), (*prefill, 16, None), (*mixed, 16, None),
        (*prefill, None, 50.0), (*mixed, None, 50.0),
    ]  # fmt: skip
    assert warm_up_attention(layers, torch.zeros(8, 2, 16, 2, 8), torch.float32) == 0  # too small


@pytest.mark.parametrize(
    "computed,new",
    [([5, 0, 40, 17], [1, 9, 1, 6]), ([30, 31, 0, 3], [1, 1, 12, 5])],  # interleaved, consecutive
)
def test_mixed_step_runs_as_decode_and_prompt_parts(computed, new):
    from pagedserve.benchmarks.kernels.bench_kernels import random_batch

    q, kv, meta = random_batch(computed, new, 4, 2, 8, 16, torch.float32, "cpu")
    seen = []

    def recording(kind):
        def run(q, kv, meta, scale, window=None, **kw):
            seen.append((kind, meta.max_query_len, meta.seq_lens.tolist(), q.shape[0]))
            return paged_attention_ref(q, kv, meta, scale, window, **kw)

        return run

    attend = per_step_kind({k: recording(k) for k in STEP_KINDS}, min_split_tokens=1)
    out = attend(q, kv, meta, 0.3, None)
    torch.testing.assert_close(out, paged_attention_ref(q, kv, meta, 0.3))
    lens = [c + n for c, n in zip(computed, new, strict=True)]
    decodes = [s for s, n in zip(lens, new, strict=True) if n == 1]
    prompts = [s for s, n in zip(lens, new, strict=True) if n > 1]
    assert seen == [("decode", 1, decodes, 2), ("prefill", max(new), prompts, sum(new) - 2)]
    assert "split_rows" in meta.scratch  # built once per step, shared by every layer
