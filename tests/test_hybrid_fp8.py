"""Hybrid models from block-FP8 checkpoints (Qwen3-Next-80B-A3B-*-FP8, Qwen3.5-MoE / Qwen3.5
FP8), on tiny random models (tests/tiny_models.py, fp32, CPU) quantized here as Qwen publishes
them: every decoder projection fp8 with a `weight_scale_inv` per 16 x 16 block (128 in the real
ones: the tiny widths need smaller blocks to hold several), routed experts included; the routers,
the shared expert's gate and the b/a projections in the model dtype and listed in
`modules_to_not_convert`.

- Greedy tokens equal transformers' on the same effective weights (the fp8 weights times their
  block scales), through a prefill cut in two chunks and a decode, once the FP8 layers keep
  their activations unquantized: activation rounding is tests/test_fp8.py's concern, and with it
  the routing of this tiny random model flips against an unquantized oracle.
- The engine (`LLM`, a worker process, activations quantized as served) gives the same greedy
  tokens as the model run here with the same kernels.
- FP8 schemes without block scales, and load-time `--quantization fp8`, are refused by name.
- On a GPU: the experts stay fp8 and steps of <= 16 rows (every FP8 linear weight-only) give
  transformers' greedy tokens.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_llm import hf_greedy
from test_models import PagedRunner, hf_logits, random_seqs
from tiny_deepseek import _block_quantize

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig
from pagedserve.kernels.activation import silu_and_mul_ref
from pagedserve.kernels.fp8 import fp8_weight_only_ref
from pagedserve.worker.layers import quant_linear
from pagedserve.worker.models import build_model

from tiny_models import make_tiny_model

BLOCK = 16
PLAIN = (".in_proj_ba.", ".in_proj_a.", ".in_proj_b.")  # fewer rows than a block: left plain
NUM_NEW = 6


def make_fp8_hybrid(src: str, dst: str) -> tuple[str, str]:
    """`src` as a block-FP8 checkpoint in `dst`, and `dst + "-dequant"`: the same model with
    each fp8 weight times its block scales (transformers' oracle)."""
    weights = load_file(os.path.join(src, "model.safetensors"))
    fp8, dequant, plain = {}, {}, ["lm_head", "model.embed_tokens"]
    for name, w in weights.items():
        module, _, leaf = name.rpartition(".")
        linear = name.startswith("model.layers.") and "_proj" in module[-12:] and leaf == "weight"
        if linear and w.dim() == 2 and not any(p in name for p in PLAIN):
            q, scale = _block_quantize(w, BLOCK)
            full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequant[name] = q.float() * full[: w.shape[0], : w.shape[1]]
            continue
        fp8[name] = dequant[name] = w
        if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) or any(
            p in name for p in PLAIN
        ):
            plain.append(name.removesuffix(".weight"))
    for out, tensors in ((dst, fp8), (dst + "-dequant", dequant)):
        shutil.copytree(src, out, dirs_exist_ok=True)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": plain,
    }  # fmt: skip
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst, dst + "-dequant"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (fp8 dir, dequantized dir), built once per kind."""
    base, made = tmp_path_factory.getbasetemp(), {}

    def get(kind: str) -> tuple[str, str]:
        if kind not in made:
            src = make_tiny_model(kind, str(base / kind))
            made[kind] = make_fp8_hybrid(src, str(base / f"{kind}-fp8"))
        return made[kind]

    return get


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Our greedy tokens (prefill in two chunks, then one-token decodes) and the prefill's
    logits."""
    runner = PagedRunner(model, [list(prompt)])
    cut = len(prompt) * 2 // 3
    prefill = torch.cat([runner.step({0: cut})[0], runner.step({0: len(prompt) - cut})[0]])
    logits, tokens = prefill[-1], []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        if len(tokens) < n:
            runner.seqs[0].append(tokens[-1])
            logits = runner.step({0: 1})[0][-1]
    return tokens, prefill


@pytest.mark.parametrize("kind", ["qwen3-next", "qwen3.5-moe", "qwen3.5"])
def test_fp8_checkpoint_greedy_equals_transformers(kind, checkpoints, monkeypatch):
    from transformers import AutoModelForCausalLM

    fp8, dequant = checkpoints(kind)
    ours = build_model(ModelConfig(model=fp8), torch.float32, torch.device("cpu"))
    layer = ours.model.layers["0"]
    if kind != "qwen3.5":  # the experts: fp8 times their block scales, exactly
        stored = load_file(os.path.join(dequant, "model.safetensors"))
        want = stored["model.layers.0.mlp.experts.2.down_proj.weight"]
        assert torch.equal(layer.mlp.experts.w2_weight[2], want)
        assert layer.mlp.shared_expert.down_proj.weight.dtype == torch.float8_e4m3fn
    deltanet = layer.linear_attn
    assert deltanet.out_proj.weight.dtype == torch.float8_e4m3fn
    monkeypatch.setattr(quant_linear, "fp8_linear", fp8_weight_only_ref)
    monkeypatch.setattr(
        quant_linear, "fp8_silu_mul_linear",
        lambda x, *args: fp8_weight_only_ref(silu_and_mul_ref(x), *args),
    )  # fmt: skip
    prompt = random_seqs([21], seed=4)[0]
    tokens, prefill = greedy(ours, prompt, NUM_NEW)
    want_tokens, _ = hf_greedy(dequant, [prompt], NUM_NEW)
    assert tokens == want_tokens[0]
    theirs = AutoModelForCausalLM.from_pretrained(dequant, dtype=torch.float32).eval()
    torch.testing.assert_close(prefill, hf_logits(theirs, prompt), atol=1e-3, rtol=0)


def test_engine_serves_the_fp8_checkpoint(checkpoints):
    """Qwen3-Next FP8 through `LLM` (activations quantized per token and block, as served):
    the same greedy tokens as the model run here with the same kernels."""
    fp8, _ = checkpoints("qwen3-next")
    ours = build_model(ModelConfig(model=fp8), torch.float32, torch.device("cpu"))
    prompts = random_seqs([21, 9], seed=6)
    want = [greedy(ours, p, NUM_NEW)[0] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(fp8, device="cpu", dtype="float32", max_model_len=64, enforce_eager=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_fp8_without_block_scales_is_refused(checkpoints, tmp_path):
    """Per-tensor FP8 and load-time `--quantization fp8` on a hybrid: refused by name."""
    fp8, dequant = checkpoints("qwen3-next")
    with pytest.raises(ValueError, match="block-FP8 checkpoints only"):
        ModelConfig(model=dequant, quantization="fp8")
    shutil.copytree(fp8, tmp_path / "m")
    with open(tmp_path / "m" / "config.json") as f:
        config = json.load(f)
    del config["quantization_config"]["weight_block_size"]
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="an FP8 checkpoint: .* block-FP8 checkpoints only"):
        ModelConfig(model=str(tmp_path / "m"))


@pytest.mark.gpu
def test_gpu_fp8_experts_stay_fp8_and_match_transformers(checkpoints):
    """On a GPU (float32): the routed experts stay fp8 (the grouped Triton kernel scales each
    tile by its block) and steps of at most 16 rows keep every FP8 linear weight-only, so greedy
    tokens equal transformers' on the dequantized weights."""
    fp8, dequant = checkpoints("qwen3-next")
    prompts = random_seqs([16, 11], seed=8)
    want, _ = hf_greedy(dequant, prompts, NUM_NEW)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(
        fp8, device="cuda", dtype="float32", max_num_batched_tokens=16, max_num_seqs=1,
        max_model_len=64,
    ) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == want
    ours = build_model(ModelConfig(model=fp8), torch.float32, torch.device("cuda"))
    experts = ours.model.layers["0"].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w13_scale is not None
