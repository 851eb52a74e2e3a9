"""Hybrid models (Qwen3-Next, Qwen3.5 dense and MoE): Gated DeltaNet layers with recurrent state
in state slots, gated full attention, against transformers on tiny random models
(tests/tiny_models.py `HYBRID_KINDS`, fp32, CPU).

- Logits through the paged KV cache and the state slots, prompts cut into chunks that cut the
  delta rule's own 64-token chunks, decodes mixed in.
- The engine, greedy token for token against transformers' `generate`: a 16-token step budget
  (every prompt in chunks), 4-token blocks and a KV cache too small for all requests at once, so
  requests are preempted and resume by recomputing their state; Qwen3-Next at tp=2 and over two
  pipeline stages, seeded sampling equal between the two.
- A decode CUDA graph's layout (state slots on the device only, padding in a scratch slot)
  against the eager one; the Triton recurrent step against its reference; the multimodal
  checkpoint's vision tower and an MTP head are skipped by name.
"""

from __future__ import annotations

import pytest
import torch
from test_llm import hf_greedy
from test_models import PagedRunner, hf_logits, random_seqs
from triton_env import needs_triton, tiny

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig, kv_cache_groups
from pagedserve.worker.models import build_model

from tiny_models import HYBRID_KINDS, make_tiny_model

NUM_NEW = 8


@pytest.fixture(scope="module", params=HYBRID_KINDS)
def hybrid(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(request.param, str(tmp_path_factory.getbasetemp() / request.param))
    ours = build_model(ModelConfig(model=path), torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return path, ours, theirs


def test_chunked_prefill_and_decode_logits(hybrid):
    """Seq 0 (100 tokens) runs 30 + 50 + 19 + 1: its chunks cross the delta rule's 64-token
    chunk; seq 1 decodes one token at a time (the recurrent step) beside others' prefills."""
    _, ours, theirs = hybrid
    seqs = random_seqs([100, 21, 9], seed=5)
    steps = [{0: 30, 2: 9}, {0: 50, 1: 7}, {0: 19, 1: 12}, {0: 1, 1: 1}, {1: 1}]
    runner = PagedRunner(ours, seqs)
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    for plan in steps:
        for i, logits in runner.step(plan).items():
            got[i].append(logits)
    for i, parts in got.items():
        ours_logits = torch.cat(parts)
        want = hf_logits(theirs, seqs[i])[: len(ours_logits)]
        # Other chunk boundaries than transformers' sum the state in another order: ~1e-4.
        torch.testing.assert_close(ours_logits, want, atol=1e-3, rtol=0, msg=f"seq {i}")


def test_only_full_attention_layers_have_kv_cache(hybrid):
    path, ours, _ = hybrid
    config = ModelConfig(model=path)
    assert [g.layer_ids for g in kv_cache_groups(config.hf)] == [(1, 3)]
    assert ours.state_bytes_per_slot(torch.float32) == 2 * 4 * (
        (2 * 32 + 32) * 3 + 4 * 16 * 8
    )  # two linear layers: conv state [96, 3] and delta state [4, 16, 8] per slot


SEEDED: dict[tuple[int, int], list[list[int]]] = {}  # (tp, pp) -> seeded samples


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_engine_chunked_preempted_equals_transformers(tp, pp, tmp_path_factory):
    """Qwen3-Next (MoE layers, a dense one). Three prompts of 70-90 tokens need 18-23 blocks of
    4 each, 64 with their outputs; the cache holds 40, so the scheduler must preempt (and the
    request recompute its state) before the first one finishes. Seeded sampling gives the same
    tokens at tp=2 and at tp=1 (over two pipeline stages). The same prompts again hit no prefix
    cache: it is off for models with recurrent state."""
    path = make_tiny_model("qwen3-next", str(tmp_path_factory.getbasetemp() / "qwen3-next"))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (90, 70, 83)]
    want, _ = hf_greedy(path, prompts, NUM_NEW)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(
        path, device="cpu", dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
        block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=40, max_model_len=128,
    ) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        sampled = llm.generate([{"prompt_token_ids": p} for p in prompts], seeded)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens == 0 for o in sampled), "prefix caching is off for them"
    SEEDED[tp, pp] = [o.outputs[0].token_ids for o in sampled]
    assert len(set(map(str, SEEDED.values()))) == 1, SEEDED


def test_decode_graph_layout_matches_the_eager_one(tmp_path_factory):
    """A decode CUDA graph knows its rows' state slots only on the device and pads its batch
    with rows in a scratch slot: a linear layer gives the same outputs and states as with the
    step's host layout, and leaves every other slot as it was."""
    import numpy as np

    from pagedserve.kernels.attention.metadata import AttentionMetadata

    path = make_tiny_model("qwen3.5", str(tmp_path_factory.getbasetemp() / "qwen3.5"))
    model = build_model(ModelConfig(model=path), torch.float32, torch.device("cpu"))
    layer = model.linear_layers[0]
    gen = torch.Generator().manual_seed(9)
    layer.allocate_states(6, torch.float32, torch.device("cpu"))  # 5 slots + the scratch one
    layer.conv_state.normal_(generator=gen)
    layer.ssm_state.normal_(generator=gen)
    slots, scratch = [4, 0, 2], 5
    x = torch.randn(4, 64, generator=gen)  # 3 decode rows, then a padding row

    def meta(rows: int) -> AttentionMetadata:
        qsl = np.arange(rows + 1, dtype=np.int32)
        none = torch.zeros(0)
        return AttentionMetadata(none, none, none, none, qsl, np.full(rows, 9, np.int32), 1, 9, 4)

    states = layer.conv_state.clone(), layer.ssm_state.clone()
    eager = meta(3)
    eager.state_slots_cpu = np.array(slots)
    eager.state_slots = torch.tensor(slots)
    want = layer(x[:3], eager)
    want_states = layer.conv_state.clone(), layer.ssm_state.clone()
    layer.conv_state.copy_(states[0])
    layer.ssm_state.copy_(states[1])
    graph = meta(4)  # as DecodeGraphs lays it out: slots on the device only
    graph.state_slots = torch.tensor([*slots, scratch])
    got = layer(x, graph)
    torch.testing.assert_close(got[:3], want)
    for mine, theirs in zip((layer.conv_state, layer.ssm_state), want_states, strict=True):
        torch.testing.assert_close(mine[:scratch], theirs[:scratch])


@needs_triton
@tiny
def test_triton_recurrent_step_matches_reference():
    """Decode rows in scattered slots of a larger pool, two value heads per key head, a value
    width that is no power of two: outputs and the slots' new states equal the reference; the
    other slots are untouched."""
    from pagedserve.kernels.gated_delta import recurrent_step
    from pagedserve.kernels.triton_gated_delta import triton_recurrent_step

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    rows, hk, hv, dk, dv = 3, 2, 4, 16, 12

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q, k, v = rand(rows, hk, dk), rand(rows, hk, dk), rand(rows, hv, dv)
    g, beta = -rand(rows, hv).abs(), rand(rows, hv).sigmoid()
    pool = rand(6, hv, dk, dv)
    slots = torch.tensor([4, 0, 2], device=device)
    before = pool.clone()
    got = triton_recurrent_step(q, k, v, g, beta, pool, slots)
    qs, ks = q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1)
    want, state = recurrent_step(qs, ks, v, g, beta, before[slots])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], state, atol=1e-5, rtol=1e-5)
    others = [1, 3, 5]
    assert torch.equal(pool[others], before[others])


def test_vision_tower_and_mtp_head_are_skipped_by_name(tmp_path, tmp_path_factory, caplog):
    """The multimodal checkpoint's `model.visual.*` and an MTP head (`mtp.*`, as Qwen3.5 and
    Qwen3-Next publish it) load into nothing, with one log line for the MTP head; any other
    stray tensor is still refused by name."""
    import json
    import logging
    import shutil

    from safetensors.torch import load_file, save_file

    src = make_tiny_model("qwen3.5-vl", str(tmp_path_factory.getbasetemp() / "qwen3.5-vl"))
    dst = tmp_path / "mtp"
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    assert any(name.startswith("model.visual.") for name in weights)
    weights["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    with open(dst / "config.json") as f:
        config = json.load(f)
    config["text_config"]["mtp_num_hidden_layers"] = 1
    with open(dst / "config.json", "w") as f:
        json.dump(config, f)
    with caplog.at_level(logging.INFO):
        build_model(ModelConfig(model=str(dst)), torch.float32, torch.device("cpu"))
    assert "MTP head (mtp.*) is not loaded" in caplog.text
    weights["model.language_model.extra.weight"] = torch.zeros(2)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.language_model.extra.weight' has no place"):
        build_model(ModelConfig(model=str(dst)), torch.float32, torch.device("cpu"))


@needs_triton
@tiny
def test_triton_chunk_rule_matches_reference():
    """Three rows in scattered slots: 70 tokens from zeros (a 64-token chunk and a cut one), 5
    and 64 tokens continuing from a state; two value heads per key head, a value width that is
    no power of two. Outputs and the slots' final states equal the reference's chunked form."""
    from pagedserve.kernels.gated_delta import chunk_rule
    from pagedserve.kernels.triton_chunk_gated_delta import triton_chunk_rule

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(4)
    lens, hk, hv, dk, dv = [70, 5, 64], 1, 2, 16, 12
    total = sum(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q, k, v = rand(total, hk, dk), rand(total, hk, dk), rand(total, hv, dv)
    g, beta = -rand(total, hv).abs() * 0.3, rand(total, hv).sigmoid()
    pool = rand(5, hv, dk, dv)
    before = pool.clone()
    slots, fresh = [3, 0, 4], [1, 0, 0]
    starts = [0, 70, 75]
    ends = [s + n for s, n in zip(starts, lens, strict=True)]

    def dev(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    got = triton_chunk_rule(
        q, k, v, g, beta, pool, dev(slots), dev(starts), dev(ends), dev(fresh).to(torch.int32)
    )
    qs, ks = q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1)
    for slot, lo, hi, new in zip(slots, starts, ends, fresh, strict=True):
        init = None if new else before[slot]
        want, state = chunk_rule(qs[lo:hi], ks[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], init)
        torch.testing.assert_close(got[lo:hi], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool[slot], state, atol=1e-4, rtol=1e-4)
    assert torch.equal(pool[[1, 2]], before[[1, 2]])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3-next"])
def test_gpu_engine_equals_transformers(kind, tmp_path_factory):
    """On a GPU (float32): the Triton paths (the chunked kernel for prompts and
    chunks, the recurrent step for decodes), chunked and preempted as on the CPU above."""
    path = make_tiny_model(kind, str(tmp_path_factory.getbasetemp() / kind))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (90, 70, 83)]
    want, _ = hf_greedy(path, prompts, NUM_NEW)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(
        path, device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=48,
        num_gpu_blocks_override=12, max_model_len=128,
    ) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_refusals_name_the_flag(tmp_path_factory):
    """State slots that would take more than half the memory, a --tp that does not divide the
    linear-attention heads, and FP8 weights are refused at start-up by name."""
    from pagedserve.frontend.llm import build_engine_config
    from pagedserve.parallel.groups import rank_info
    from pagedserve.worker.model_runner import ModelRunner

    path = make_tiny_model("qwen3.5", str(tmp_path_factory.getbasetemp() / "qwen3.5"))
    per_slot = 2 * 4 * ((2 * 32 + 32) * 3 + 4 * 16 * 8)  # bytes, see the test above
    config = build_engine_config(
        path, device="cpu", dtype="float32", max_num_seqs=64, kv_cache_memory=64 * per_slot
    )
    runner = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    with pytest.raises(ValueError, match="recurrent state for --max-num-seqs 64"):
        runner.profile_num_blocks()
    with pytest.raises(ValueError, match=r"--tp 4 does not divide .* linear-attention key heads"):
        build_engine_config(path, device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="hybrid linear-attention .* block-FP8 checkpoints only"):
        build_engine_config(path, device="cpu", quantization="fp8")


def test_configs_without_layer_types_get_transformers_defaults(tmp_path, tmp_path_factory):
    """Hub configs that give `full_attention_interval` instead of `layer_types`, and no
    `partial_rotary_factor`, read as transformers reads them."""
    import json
    import shutil

    src = make_tiny_model("qwen3.5", str(tmp_path_factory.getbasetemp() / "qwen3.5"))
    shutil.copytree(src, tmp_path / "m")
    with open(tmp_path / "m" / "config.json") as f:
        config = json.load(f)
    del config["layer_types"]
    config["full_attention_interval"] = 2
    config["rope_parameters"].pop("partial_rotary_factor")
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(config, f)
    hf = ModelConfig(model=str(tmp_path / "m")).hf
    assert hf["layer_types"][:2] == ["linear_attention", "full_attention"]
    assert [g.layer_ids for g in kv_cache_groups(hf)] == [(1, 3)]
    assert hf["partial_rotary_factor"] == 0.25
