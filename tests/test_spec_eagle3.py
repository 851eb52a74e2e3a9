"""EAGLE-3 heads (issue 38, `method: eagle3`): a random head in vLLM's HF format for the tiny
Llama target (fc over three target layers' hidden states, `midlayer.*` whose attention reads
[embedding ; hidden], a final norm, its own LM head over a draft vocabulary with `d2t`): its
forward equals one written out with transformers' attention, greedy output with it is the
output without speculation, and the config refuses what it cannot serve by name."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM
from pagedserve.config import ModelConfig
from pagedserve.ipc.messages import SamplingParams
from pagedserve.speculative_config import SpeculativeConfig

from tiny_models import tiny_model_dir

AUX = [0, 1, 1]  # the target's layers whose input feeds the head (the tiny target has 2)
DRAFT_VOCAB = 256


def write_head3(target: str, path: str) -> str:
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    h, heads, kv, inter = 64, 4, 2, 128
    gen = torch.Generator().manual_seed(3)

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=gen)

    d = 16  # head_dim
    head = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.hidden_norm.weight": 1 + rand(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(DRAFT_VOCAB, h, scale=1.0),
    }
    targets = torch.sort(torch.randperm(config["vocab_size"], generator=gen)[:DRAFT_VOCAB])[0]
    head["d2t"] = targets - torch.arange(DRAFT_VOCAB)
    head["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool).index_fill(0, targets, True)
    os.makedirs(path, exist_ok=True)
    save_file(head, os.path.join(path, "model.safetensors"))
    config.update(
        num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], head_dim=d,
        draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=AUX,
    )  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = str(tmp_path_factory.getbasetemp())
    target = tiny_model_dir("llama", base)
    return target, write_head3(target, os.path.join(base, "eagle3-head"))


def eagle3(head: str) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": 2}


def test_config_refuses_what_it_cannot_serve(dirs):
    target, head = dirs
    spec = SpeculativeConfig.from_value(eagle3(head))
    with pytest.raises(ValueError, match="'eagle3' needs --enforce-eager"):
        spec.check_engine(ModelConfig(target), 1, 1)
    spec.check_engine(ModelConfig(target, enforce_eager=True), 1, 1)


def test_head_matches_a_reference(dirs):
    """Our head over a prompt's pairs (token p + 1; the target's three hidden states at p) and
    its logits over the target's vocabulary (-inf outside the draft's), against the formula
    written out with transformers' Llama attention (2H wide in, H out)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from pagedserve.worker.eagle import build_eagle_head
    from pagedserve.worker.eagle3 import Eagle3Head
    from pagedserve.worker.input_batch import StepInputs
    from pagedserve.worker.models import build_model
    from pagedserve.worker.step_metadata import attention_metadata

    target_dir, head_dir = dirs
    ids = torch.arange(200, 230)
    ref = LlamaForCausalLM.from_pretrained(target_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        states = ref(ids[None], output_hidden_states=True).hidden_states  # entering each layer
    hidden = torch.cat([states[i][0, :-1] for i in AUX], -1)  # [L, 3H]
    mc = ModelConfig(target_dir, dtype="float32", enforce_eager=True)
    target = build_model(mc, torch.float32, torch.device("cpu"))
    hmc = SpeculativeConfig.from_value(eagle3(head_dir)).draft_model_config(mc)
    head = build_eagle_head(hmc, target, torch.float32, "cpu", Eagle3Head)
    n, block = len(ids) - 1, 4
    inputs = StepInputs(
        input_ids=ids[1:].numpy(), positions=np.arange(n), slot_mapping=np.arange(n),
        query_start_loc=np.array([0, n], dtype=np.int32), seq_lens=np.array([n], dtype=np.int32),
        block_tables=np.arange(-(-n // block), dtype=np.int32)[None],
        logits_indices=np.array([n - 1]), sample_rows=[0],
    )  # fmt: skip
    caches = [torch.zeros(-(-n // block), 2, block, 2, 16)]
    w = load_file(os.path.join(head_dir, "model.safetensors"))
    with torch.no_grad():
        meta = attention_metadata(inputs, block, torch.device("cpu"))
        ours = head(ids[1:], hidden, torch.arange(n), caches, meta)  # [L, H]
        logits = head.compute_logits(ours)

        def rms(x: torch.Tensor, name: str) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[name]

        wide = LlamaConfig(**{**ref.config.to_dict(), "hidden_size": 128, "head_dim": 16})
        wide._attn_implementation = "sdpa"  # causal without a mask
        attn = LlamaAttention(wide, 0).eval()
        attn.o_proj = torch.nn.Linear(64, 64, bias=False)
        p = "midlayer.self_attn."
        attn.load_state_dict({k[len(p) :]: v for k, v in w.items() if k.startswith(p)})
        x = hidden @ w["fc.weight"].T  # [L, H]
        a = torch.cat([rms(ref.model.embed_tokens(ids[1:]), "midlayer.input_layernorm.weight"),
                       rms(x, "midlayer.hidden_norm.weight")], -1)[None]  # fmt: skip
        rotary = LlamaRotaryEmbedding(wide)(a, torch.arange(n)[None])
        r = attn(a, position_embeddings=rotary, attention_mask=None)[0][0] + x
        m = rms(r, "midlayer.post_attention_layernorm.weight")
        m = m @ w["midlayer.mlp.gate_proj.weight"].T
        u = rms(r, "midlayer.post_attention_layernorm.weight") @ w["midlayer.mlp.up_proj.weight"].T
        expected = (torch.nn.functional.silu(m) * u) @ w["midlayer.mlp.down_proj.weight"].T + r
        assert torch.allclose(ours, expected, atol=1e-4), (ours - expected).abs().max()
        draft = rms(expected, "norm.weight") @ w["lm_head.weight"].T  # [L, Vd]
    columns = torch.arange(DRAFT_VOCAB) + w["d2t"]
    assert torch.allclose(logits[:, columns], draft, atol=1e-3)
    assert torch.isinf(logits).sum() == n * (logits.shape[1] - DRAFT_VOCAB)


def test_greedy_output_is_transformers(dirs):
    """A prompt in chunks and a short one: with the head (eager target) the greedy tokens are
    transformers' own, and the head's drafts were verified and counted."""
    from transformers import LlamaForCausalLM

    target, head = dirs
    prompts = [list(range(40, 110)), [5, 6]]
    ref = LlamaForCausalLM.from_pretrained(target).eval()
    expected = [
        ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    kwargs = dict(device="cpu", dtype="float32", block_size=4, enforce_eager=True,
                  max_num_batched_tokens=32, max_model_len=128)  # fmt: skip
    with LLM(target, speculative_config=eagle3(head), **kwargs) as llm:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.last_stats
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.spec_num_draft_tokens > 0
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
