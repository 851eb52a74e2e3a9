"""FP8 weights and KV cache on the CPU reference path: schemes parsed from published configs,
tiny FP8 checkpoints in each published layout loaded and run, load-time quantization, scales
sharded with their weights under TP, the FP8 cache's writes and reads, and the clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.kernels import fp8
from pagedserve.kernels.attention.metadata import build_attention_metadata
from pagedserve.kernels.attention.reference import paged_attention_ref, write_kv_cache_ref
from pagedserve.quant_config import quant_scheme
from pagedserve.tests.fp8_checkpoints import make_fp8_checkpoint
from pagedserve.tests.tiny_models import VOCAB_SIZE, tiny_model_dir
from pagedserve.worker.layers import linear as layers
from pagedserve.worker.layers import quant_linear
from pagedserve.worker.models import build_model

TOKENS = torch.randint(3, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def prefill_logits(model: torch.nn.Module, tokens: list[int], kv_dtype=torch.float32):
    """One prefill of `tokens` through a fresh paged cache: logits [T, V]."""
    block = 8
    blocks = -(-len(tokens) // block)
    meta, positions = build_attention_metadata([0], [len(tokens)], [list(range(blocks))], block)
    shape = (blocks, 2, block, model.num_kv_heads_per_rank, model.head_dim)
    caches = [torch.zeros(shape, dtype=kv_dtype) for _ in range(model.num_layers)]
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(tokens), positions, caches, meta))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def build(path: str, **kw) -> torch.nn.Module:
    kv_fp8 = kw.pop("kv_fp8", False)
    return build_model(ModelConfig(model=path, **kw), torch.float32, "cpu", kv_fp8=kv_fp8)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return tiny_model_dir("llama", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def checkpoints(plain, tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    return {
        fmt: make_fp8_checkpoint(plain, str(base / fmt), fmt, kv_scales=fmt == "channel")
        for fmt in ("block", "channel", "tensor")
    }


def test_schemes_from_published_configs(checkpoints):
    block = ModelConfig(model=checkpoints["block"]).quant
    assert (block.serialized, block.strategy, block.block, block.act_group) == (
        True, "block", (128, 128), 128,
    )  # fmt: skip
    assert ModelConfig(model=checkpoints["channel"]).quant.strategy == "channel"
    assert ModelConfig(model=checkpoints["tensor"]).quant.strategy == "tensor"
    load_time = quant_scheme({}, "fp8")
    assert (load_time.serialized, load_time.strategy, load_time.act_group) == (
        False, "channel", None,
    )  # fmt: skip
    assert quant_scheme({}, None) is None


@pytest.mark.parametrize(
    "hf, flag, match",
    [
        ({}, "awq", "--quantization 'awq' is not supported"),
        ({"quantization_config": {"quant_method": "gptq"}}, None, "'gptq' is not supported"),
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, None,
         "activation_scheme 'static'"),
        ({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["mlp"]}},
         None, "leaves layers unquantized"),
        ({"quantization_config": {"quant_method": "compressed-tensors", "format":
          "pack-quantized"}}, None, "format 'pack-quantized'"),
    ],
)  # fmt: skip
def test_unsupported_schemes_are_refused_by_name(hf, flag, match):
    with pytest.raises(ValueError, match=match):
        quant_scheme(hf, flag)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_fp8_moe_is_refused_by_name(tmp_path, model_type):
    """FP8 expert weights are not implemented: the flag and an FP8 checkpoint are refused when the
    config is read (before any process starts), naming the model type."""
    hf = {"model_type": model_type, "num_hidden_layers": 2, "max_position_embeddings": 64}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match=f"--quantization fp8: .* MoE models \\({model_type}\\)"):
        ModelConfig(model=str(tmp_path), quantization="fp8")
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match="an FP8 checkpoint: FP8 weights are not supported"):
        ModelConfig(model=str(tmp_path))


def test_kv_cache_dtype_is_checked():
    assert CacheConfig(kv_cache_dtype="fp8").kv_fp8 and not CacheConfig().kv_fp8
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int8'"):
        CacheConfig(kv_cache_dtype="int8")


def test_quantize_and_reference_linear():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 300, generator=gen), torch.randn(50, 300, generator=gen)
    for group in (None, 128):
        q, scale = fp8.quantize_rows(x, group)
        assert q.dtype == fp8.FP8 and scale.shape == (7, 1 if group is None else 3)
        assert rel(fp8.dequantize(q, scale, group), x) < 0.04  # e4m3: 3 mantissa bits
        wq, ws = fp8.quantize_rows(w, group)
        out = fp8.fp8_linear_ref(x, wq, ws, None, group)
        assert rel(out, x @ w.t()) < 0.05
    zero = fp8.quantize_rows(torch.zeros(2, 8))[0]
    assert zero.float().abs().sum() == 0  # no NaN from a zero row


@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
def test_fp8_checkpoint_loads_and_matches_its_dequantized_weights(checkpoints, fmt):
    """Weights load bit-exact from the checkpoint; the FP8 model's logits differ from a plain
    model with the same (dequantized) weights only by activation quantization."""
    model = build(checkpoints[fmt])
    qkv = model.model.layers["0"].self_attn.qkv_proj
    assert qkv.weight.dtype == fp8.FP8 and qkv.weight_scale.dtype == torch.float32
    assert qkv.weight_scale.shape == (qkv.weight.shape[0], 1)  # K = 64: one 128-column block
    deq = build(checkpoints[fmt] + "-dequant")
    torch.testing.assert_close(
        fp8.dequantize(qkv.weight, qkv.weight_scale, None),
        deq.model.layers["0"].self_attn.qkv_proj.weight,
    )
    got, want = prefill_logits(model, TOKENS), prefill_logits(deq, TOKENS)
    assert rel(got, want) < 0.15
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_load_time_quantization(plain):
    model, ref = build(plain, quantization="fp8"), build(plain)
    for layer in model.model.layers.values():
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert lin.weight.dtype == fp8.FP8 and lin.weight_scale.shape[1] == 1
    assert model.lm_head.weight.dtype == torch.float32  # the LM head stays in the model dtype
    got, want = prefill_logits(model, TOKENS), prefill_logits(ref, TOKENS)
    assert rel(got, want) < 0.15
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.85


def test_attention_takes_rows_the_norm_quantized(plain):
    """On a GPU the RMSNorm before an FP8 qkv projection may hand it `Fp8Rows` (fusion
    norm-quant): the attention layer then gives what it gives for the model-dtype rows (the
    per-token path quantizes them the same way), with nothing on the way expecting a tensor."""
    layer = build(plain, quantization="fp8").model.layers["0"].self_attn
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, layer.qkv_proj.weight.shape[1], generator=gen)
    meta, positions = build_attention_metadata([0], [5], [[0]], 8)
    shape = (1, 2, 8, layer.attn.num_kv_heads, layer.head_dim)
    kv_a, kv_b = torch.zeros(shape), torch.zeros(shape)
    with torch.no_grad():
        want = layer(positions, hidden, kv_a, meta)
        got = layer(positions, fp8.Fp8Rows(*fp8.quantize_rows(hidden), hidden.dtype), kv_b, meta)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(kv_b, kv_a)


def _wide_llama(path: str) -> str:
    """A llama with 128-multiple widths, so block scales can split across 2 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        LlamaForCausalLM(cfg).save_pretrained(path)  # fmt: skip
    return path


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_tp_shards_scales_with_their_weights(tmp_path_factory, monkeypatch, fmt):
    """Each rank of tp=2 holds exactly its slice of the tp=1 model's fp8 weights and scales."""
    base = tmp_path_factory.mktemp(f"tp-{fmt}")
    path = make_fp8_checkpoint(_wide_llama(str(base / "plain")), str(base / "q"), fmt)
    full = build(path).model.layers["0"]
    for rank in (0, 1):
        for module in (layers, quant_linear):
            monkeypatch.setattr(module, "tp_size", lambda: 2)
        monkeypatch.setattr(layers, "tp_rank", lambda r=rank: r)
        part = build(path).model.layers["0"]
        for name, dim in (("self_attn.qkv_proj", 0), ("mlp.gate_up_proj", 0),
                          ("self_attn.o_proj", 1), ("mlp.down_proj", 1)):  # fmt: skip
            ours, whole = part.get_submodule(name), full.get_submodule(name)
            want = fp8.dequantize(whole.weight, whole.weight_scale, whole.quant.act_group)
            got = fp8.dequantize(ours.weight, ours.weight_scale, ours.quant.act_group)
            if name.endswith("qkv_proj"):  # q, k, v parts each split by heads
                q, kv = 256, 128
                parts = zip(want.split([q, kv, kv]), [q // 2, kv // 2, kv // 2], strict=True)
                want = torch.cat([p.narrow(0, rank * s, s) for p, s in parts])
            elif name.endswith("gate_up_proj"):
                want = torch.cat([p.narrow(0, rank * 256, 256) for p in want.split(512)])
            else:
                size = got.shape[dim]
                want = want.narrow(dim, rank * size, size)
            assert torch.equal(got, want), (fmt, rank, name)


def test_block_scales_that_do_not_align_to_the_shard_are_refused(checkpoints, monkeypatch):
    for module in (layers, quant_linear):
        monkeypatch.setattr(module, "tp_size", lambda: 2)
    with pytest.raises(ValueError, match="not a multiple of the 128-column block"):
        build(checkpoints["block"])  # o_proj: 32 input columns per rank


def test_fp8_cache_write_and_read_reference():
    gen = torch.Generator().manual_seed(0)
    meta, _ = build_attention_metadata([0, 5], [9, 3], [[3, 1], [0, 2]], 8)
    key, value = torch.randn(12, 2, 16, generator=gen), torch.randn(12, 2, 16, generator=gen)
    query = torch.randn(12, 4, 16, generator=gen)
    ref_cache = torch.zeros(4, 2, 8, 2, 16)
    cache = torch.zeros(4, 2, 8, 2, 16, dtype=fp8.FP8)
    prefix = torch.randn(5, 2, 16, generator=gen)  # row 1's 5 cached tokens
    pre_slots = torch.tensor([0, 1, 2, 3, 4])
    for c, ks, vs in ((ref_cache, 1.0, 1.0), (cache, 2.0, 0.5)):
        write_kv_cache_ref(prefix, prefix, c, pre_slots, ks, vs)
        write_kv_cache_ref(key, value, c, meta.slot_mapping, ks, vs)
    stored = cache[3, 0, 0].float() * 2.0  # row 0's first key, dequantized
    assert rel(stored, key[0]) < 0.04
    got = paged_attention_ref(query, cache, meta, 0.25, k_scale=2.0, v_scale=0.5)
    want = paged_attention_ref(query, ref_cache, meta, 0.25)
    assert rel(got, want) < 0.05


def test_fp8_kv_model_and_checkpoint_scales(checkpoints, plain):
    model = build(checkpoints["channel"], kv_fp8=True)
    scales = [layer.self_attn.attn.kv_scales for layer in model.model.layers.values()]
    assert scales == [(0.5, 0.25), (1.5, 0.25)]  # from the checkpoint's k_scale / v_scale
    assert build(plain, kv_fp8=True).model.layers["0"].self_attn.attn.kv_scales == (1.0, 1.0)
    both = prefill_logits(build(plain, quantization="fp8", kv_fp8=True), TOKENS, fp8.FP8)
    want = prefill_logits(build(plain), TOKENS)
    assert rel(both, want) < 0.15
    assert (both.argmax(-1) == want.argmax(-1)).float().mean() > 0.65  # flat random logits


def test_fp8_on_an_old_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="compute capability 8.9.*A100 is 8.0"):
        fp8.require_fp8_device("cuda", "--kv-cache-dtype fp8")
    fp8.require_fp8_device("cpu", "--kv-cache-dtype fp8")  # the reference runs anywhere


def test_engine_generates_with_fp8_weights_and_cache(checkpoints):
    """The engine end to end (processes, scheduler, cache sizing) on a block-FP8 checkpoint with
    an FP8 cache: its KV memory holds blocks of 1-byte elements, and its greedy tokens are the
    in-process model's (same weights, same FP8 cache)."""
    from pagedserve import LLM, SamplingParams

    path, memory = checkpoints["block"], 1 << 20
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [TOKENS[:n] for n in (5, 17)]
    with LLM(path, device="cpu", dtype="float32", kv_cache_dtype="fp8",
             kv_cache_memory=memory) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        num_blocks = llm._cores.clients[0].ready.num_blocks
    model = build(path, kv_fp8=True)
    block_bytes = 2 * 16 * model.num_kv_heads_per_rank * model.head_dim * model.num_layers
    assert num_blocks == memory // block_bytes  # 1 byte per element (float32 would be 4)
    for prompt, out in zip(prompts, outs, strict=True):
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(prefill_logits(model, seq, fp8.FP8)[-1].argmax()))
        assert out.outputs[0].token_ids == seq[len(prompt) :]


def test_config_json_round_trip_keeps_quantization(checkpoints):
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=ModelConfig(model=checkpoints["tensor"]))
    assert EngineConfig.from_json(cfg.to_json()).model.quant == cfg.model.quant
    with open(os.path.join(checkpoints["tensor"], "config.json")) as f:
        assert json.load(f)["quantization_config"]["ignore"] == ["lm_head"]


def test_accuracy_command_on_the_embedded_model():
    """The FP8 accuracy table (docs/performance.md) comes from this command; on one short window
    FP8 still agrees on most tokens and costs more KL than bf16 does."""
    from pagedserve.benchmarks.fp8_accuracy import run
    from pagedserve.frontend.hub import default_model_dir

    results = run(default_model_dir(), context=64, num_windows=1)
    assert set(results) == {"bf16", "fp8 weights", "fp8 KV cache", "fp8 weights + KV"}
    assert results["fp8 weights + KV"]["top1_agreement"] > 0.8
    assert 0 <= results["bf16"]["mean_kl"] < results["fp8 weights + KV"]["mean_kl"] < 0.1


def test_metrics_count_cache_blocks_and_tokens(monkeypatch):
    from pagedserve.frontend.openai.metrics import Metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = Metrics("m")
    metrics.set_cache(1000, 16, "fp8_e4m3")
    text = metrics.render()[0].decode()
    assert 'pagedserve:kv_cache_num_blocks{engine="0",model_name="m"} 1000.0' in text
    assert 'pagedserve:kv_cache_capacity_tokens{engine="0",model_name="m"} 16000.0' in text
    assert 'cache_dtype="fp8_e4m3"' in text


def test_flags_reach_the_engine_config(plain):
    import argparse

    from pagedserve.benchmarks.cli import add_bench_parser
    from pagedserve.benchmarks.common import engine_kwargs
    from pagedserve.frontend.llm import build_engine_config

    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    add_bench_parser(sub)
    args = sub.choices["bench"].parse_args(
        ["latency", "--model", plain, "--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    )
    config = build_engine_config(plain, **engine_kwargs(args))
    assert config.model.quant is not None and not config.model.quant.serialized
    assert config.cache.kv_fp8
