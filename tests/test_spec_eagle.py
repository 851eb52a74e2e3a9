"""EAGLE heads (issue 38, `method: eagle`): a head in vLLM's HF format (config.json +
safetensors, `fc` over [embedding ; target hidden], one Llama layer without its input norm, the
target's embedding and LM head) built for the tiny Llama target; greedy output with it is token
for token the output without speculation (a prompt in chunks, a stop string, preemption), drafts
are accepted and rejected and counted, and a bad head is refused at start-up by name."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM
from pagedserve.config import ModelConfig
from pagedserve.ipc.messages import SamplingParams
from pagedserve.speculative_config import SpeculativeConfig
from pagedserve.worker.eagle import build_eagle_head

from tiny_models import tiny_model_dir


def write_head(target: str, path: str, mix: float = 0.002, quiet: bool = True) -> str:
    """An EAGLE-1 head that drafts much like the target: `fc` passes the token's embedding plus
    a little of the target's hidden state (random); layer 0 (no input norm, as vLLM's) adds
    nothing (zero o_proj and down_proj); layers 1 and 2 are the target's; its own LM head is
    the target's times the final norm's weights (a head has no final norm). It still misses the
    target's first token and its hidden-state input, so some drafts are rejected. (`mix`: the
    hidden state's weight in `fc`; `quiet=False`: layer 0 keeps its own o_proj and down_proj,
    and `fc` has a bias.)"""
    weights = load_file(os.path.join(target, "model.safetensors"))
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    fc = torch.cat([torch.eye(hidden), mix * torch.randn(hidden, hidden, generator=gen)], 1)
    head = {
        "fc.weight": fc,
        "lm_head.weight": weights["lm_head.weight"] * weights["model.norm.weight"],
    }
    if not quiet:  # and an fc bias, as the original EAGLE checkpoints have
        head["fc.bias"] = 0.05 * torch.randn(hidden, generator=gen)
    for name, tensor in weights.items():
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            zero = quiet and ("o_proj" in name or "down_proj" in name)
            head[name[6:]] = torch.zeros_like(tensor) if zero else tensor
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            head[name[6:].replace(f"layers.{i}.", f"layers.{i + 1}.", 1)] = tensor
    os.makedirs(path, exist_ok=True)
    save_file({n: t.clone() for n, t in head.items()}, os.path.join(path, "model.safetensors"))
    config.update(num_hidden_layers=3, architectures=["LlamaForCausalLM"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = str(tmp_path_factory.getbasetemp())
    target = tiny_model_dir("llama", base)
    return target, write_head(target, os.path.join(base, "eagle-head"))


def eagle(head: str, k: int = 3) -> dict:
    return {"method": "eagle", "model": head, "num_speculative_tokens": k}


def generate(target, spec, prompts, params, **kwargs):
    with LLM(target, device="cpu", dtype="float32", block_size=4, speculative_config=spec,
             max_num_batched_tokens=32, max_model_len=128, **kwargs) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0] for o in outs], llm.last_stats


PROMPTS = [list(range(40, 110)), [7, 8, 9] * 5, [5, 6], list(range(200, 230))]


def test_greedy_output_is_speculation_off(dirs):
    """Greedy rows (one prompt of 70 tokens in chunks of 32, one with a stop string, logprobs)
    give the same tokens with the head on as off; drafts both accepted and rejected, counted.
    A KV cache of 40 blocks of 4 makes the batch preempt and recompute. At --tp 2 (gloo): the
    head is sharded like the target and every rank drafts alike."""
    target, head = dirs
    params = [SamplingParams(temperature=0, max_tokens=30, logprobs=2)] + [
        SamplingParams(temperature=0, max_tokens=30)
    ] * 3
    off, _ = generate(target, None, PROMPTS, params)
    text = off[1].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params[1] = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
    on, stats = generate(
        target, eagle(head), PROMPTS, params, num_gpu_blocks_override=40, tensor_parallel_size=2
    )
    assert on[1].finish_reason == "stop" and on[1].text == text[: text.index(stop)]
    for i in (0, 2, 3):
        assert on[i].token_ids == off[i].token_ids, i
    for x, y in zip(on[0].logprobs, off[0].logprobs, strict=True):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert stats.num_preemptions > 0


def test_bad_heads_are_refused_by_name(dirs, tmp_path):
    """A head of another hidden size or vocabulary, or another architecture, is refused by the
    config; one whose tensor has the wrong shape or with no weights, when the engine starts."""
    target, head = dirs
    mc = ModelConfig(target)

    def variant(name: str, **changes) -> str:
        path = shutil.copytree(head, tmp_path / name)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        return str(path)

    cases = [
        (variant("wide", hidden_size=128, head_dim=16), "hidden_size \\(128\\) is not the target"),
        (variant("vocab", vocab_size=1024), "vocabulary \\(1024\\) is not the target's"),
        (variant("gemma", architectures=["Gemma2ForCausalLM"], model_type="gemma2"),
         "only Llama EAGLE heads"),
        (variant("hass", add_para_norm=True), "'add_para_norm'"),
    ]  # fmt: skip
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_value(eagle(path)).check_engine(mc, 1, 1)
    SpeculativeConfig.from_value(eagle(head)).check_engine(mc, 1, 1)
    with pytest.raises(ValueError, match="'eagle' needs 'model'"):
        SpeculativeConfig.from_value({"method": "eagle", "num_speculative_tokens": 2})

    shaped = variant("shape")
    weights = load_file(os.path.join(shaped, "model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"][:, :64].contiguous()
    save_file(weights, os.path.join(shaped, "model.safetensors"))
    with pytest.raises(Exception, match="checkpoint tensor 'fc.weight'"):  # from the worker
        generate(target, eagle(shaped), PROMPTS[:1], SamplingParams(max_tokens=2))
    empty = variant("empty")
    os.remove(os.path.join(empty, "model.safetensors"))
    spec = SpeculativeConfig.from_value(eagle(empty))
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        build_eagle_head(spec.draft_model_config(mc), None, torch.float32, "cpu")


def test_head_matches_a_transformers_reference(dirs):
    """The head's forward over a prompt's pairs (token p + 1, the target's hidden state at p
    after its final norm) is vLLM's EAGLE-1 computed with transformers' Llama layers: fc over
    [embedding ; hidden], layer 0 without its input norm, hidden + residual, the LM head."""
    from transformers import LlamaForCausalLM

    from pagedserve.worker.input_batch import StepInputs
    from pagedserve.worker.models import build_model
    from pagedserve.worker.step_metadata import attention_metadata

    target_dir = dirs[0]
    head_dir = write_head(target_dir, os.path.join(os.path.dirname(dirs[1]), "loud"), 0.05, False)
    ids = torch.tensor(PROMPTS[3])  # [L + 1]
    ref = LlamaForCausalLM.from_pretrained(target_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        hidden = ref(ids[None], output_hidden_states=True).hidden_states[-1][0, :-1]  # [L, H]
    mc = ModelConfig(target_dir, dtype="float32")
    target = build_model(mc, torch.float32, torch.device("cpu"))
    spec = SpeculativeConfig.from_value(eagle(head_dir))
    head = build_eagle_head(spec.draft_model_config(mc), target, torch.float32, "cpu")
    n, block = len(ids) - 1, 4
    inputs = StepInputs(
        input_ids=ids[1:].numpy(), positions=np.arange(n), slot_mapping=np.arange(n),
        query_start_loc=np.array([0, n], dtype=np.int32), seq_lens=np.array([n], dtype=np.int32),
        block_tables=np.arange(-(-n // block), dtype=np.int32)[None],
        logits_indices=np.array([n - 1]), sample_rows=[0],
    )  # fmt: skip
    shape = (-(-n // block), 2, block, head.num_kv_heads_per_rank, head.head_dim)
    caches = [torch.zeros(shape) for _ in head.layers]
    meta = attention_metadata(inputs, block, torch.device("cpu"))
    with torch.no_grad():
        ours = head(ids[1:], hidden, torch.arange(n), caches, meta)  # [L, H]
        expected = _reference_head(ref, head_dir, ids[1:], hidden)
        assert torch.allclose(ours, expected, atol=1e-4), (ours - expected).abs().max()
        logits = head.compute_logits(ours)
    weights = load_file(os.path.join(head_dir, "model.safetensors"))
    assert torch.allclose(logits, expected @ weights["lm_head.weight"].T, atol=1e-3)


def _reference_head(ref, head_dir: str, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    with open(os.path.join(head_dir, "config.json")) as f:
        num_layers = json.load(f)["num_hidden_layers"]
    weights = load_file(os.path.join(head_dir, "model.safetensors"))
    config = ref.config
    layers = [LlamaDecoderLayer(config, i).eval() for i in range(num_layers)]
    for i, layer in enumerate(layers):
        own = {
            n[len(f"layers.{i}.") :]: t for n, t in weights.items() if n.startswith(f"layers.{i}.")
        }
        if i == 0:
            layer.input_layernorm = torch.nn.Identity()
        layer.load_state_dict(own, strict=True)
    x = torch.cat([ref.model.embed_tokens(ids), hidden], -1) @ weights["fc.weight"].T  # [L, H]
    x = x + weights.get("fc.bias", 0)
    positions = torch.arange(len(ids))[None]
    rotary = LlamaRotaryEmbedding(config)(x[None], positions)
    h = x[None]  # transformers' layers return hidden + residual, as the head's last does
    for layer in layers:
        out = layer(h, position_embeddings=rotary, position_ids=positions, attention_mask=None)
        h = out[0] if isinstance(out, tuple) else out
    return h[0]


def test_memory_profile_holds_the_kept_hidden_states(dirs):
    """The profiled step runs with a step's worth of kept target hidden states alive ([T, H] in
    the head's rows, as `after_target` leaves them), so the CUDA profile's peak counts them; the
    profile drops them after."""
    from pagedserve.frontend.llm import build_engine_config
    from pagedserve.parallel.groups import rank_info
    from pagedserve.worker.model_runner import ModelRunner

    target, head = dirs
    config = build_engine_config(
        target, device="cpu", dtype="float32", max_num_seqs=4, speculative_config=eagle(head),
        max_num_batched_tokens=48,
    )  # fmt: skip
    runner = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    kept, forward = [], runner.model.forward

    def spy(*args, **kwargs):
        rows = runner.drafter.rows.values()
        kept.append((sum(len(r.hidden) for r in rows), {tuple(r.hidden.shape[1:]) for r in rows}))
        return forward(*args, **kwargs)

    runner.model.forward = spy
    runner._dummy_forward()
    hidden = config.model.hf["hidden_size"]
    assert kept == [(48, {(hidden,)})] and not runner.drafter.rows
