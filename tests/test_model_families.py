"""The further model families (MoE, Gemma 2/3, Phi-3, YaRN/longrope) against transformers.

Per family, on a tiny random model (tests/tiny_models.py `FAMILY_KINDS`): logits through the paged
KV cache with chunked prefill and decodes in one batch (fp32, CPU, 8-token blocks); then the
engine at tp=2 with 4-token blocks, a 16-token step budget, prefix-cache hits and a KV cache of 16
blocks (Mixtral's window frees blocks behind it, which others then reuse; Gemma's windowed KV cache
group does the same while its global group keeps every block, and its prefix hits skip the
windowed blocks behind the window; the other families preempt), greedy token for token against
transformers' `generate` (so tp=2 equals tp=1, which equals transformers)."""

from __future__ import annotations

import pytest
import torch
from test_llm import hf_greedy
from test_models import BLOCK_SIZE, PagedRunner, check, hf_logits, random_seqs

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig
from pagedserve.worker.models import build_model

from tiny_models import FAMILY_KINDS, make_tiny_model

NUM_NEW = 8
# One engine run per model code path (MoE + window, Gemma 2 and 3 with their two KV cache groups,
# Phi-3): each costs an engine start. Qwen3-MoE differs from Mixtral in what the logits test checks.
ENGINE_KINDS = ["mixtral", "gemma2", "gemma3", "phi3"]
# Gemma's two KV cache groups (windowed, global) share each KV tensor: a block is half the bytes,
# and one request may hold a window's worth of blocks more.
NUM_BLOCKS = {"gemma2": 24, "gemma3": 24}


@pytest.fixture(scope="module", params=FAMILY_KINDS)
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(request.param, str(tmp_path_factory.getbasetemp() / request.param))
    ours = build_model(ModelConfig(model=path), torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return path, ours, theirs


def test_chunked_prefill_and_decode_logits(family):
    """Lengths stay within 32 positions: transformers switches Phi-3's longrope factors for the
    whole sequence when run at once, which the incremental engine test below covers instead."""
    _, ours, theirs = family
    seqs = random_seqs([30, 21, 9], seed=5)
    steps = [{0: 11, 2: 9}, {0: 13, 1: 7, 2: 0}, {0: 6, 1: 14}]
    check(PagedRunner(ours, seqs), theirs, steps)


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_engine_tp2_prefix_cache_equals_transformers(kind, tmp_path_factory):
    path = make_tiny_model(kind, str(tmp_path_factory.getbasetemp() / kind))
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 500, (16,), generator=gen).tolist()
    # At most 31 positions: see test_longrope_switch_matches_incremental_transformers.
    prompts = [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 7, 5)]
    want, _ = hf_greedy(path, prompts, NUM_NEW)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(
        path, device="cpu", dtype="float32", tensor_parallel_size=2, block_size=4,
        max_num_batched_tokens=16, num_gpu_blocks_override=NUM_BLOCKS.get(kind, 16),
        max_model_len=64,
    ) as llm:  # fmt: skip
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    assert all(o.num_cached_tokens == 16 for o in rest)
    assert [o.outputs[0].token_ids for o in first + rest] == want


def test_window_never_weighs_blocks_behind_it(tmp_path_factory):
    """The core frees Mixtral's blocks behind its 8-token window while the workers' tables keep
    their ids, and another request may write there: scribbling over those blocks after every
    step changes no logit."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("mixtral", str(tmp_path_factory.getbasetemp() / "mixtral"))
    ours = build_model(ModelConfig(model=path), torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = random_seqs([26], seed=8)
    runner = PagedRunner(ours, seqs)
    got = [runner.step({0: 11})[0]]
    while runner.computed[0] < 26:
        behind = (runner.computed[0] - 8 + 1) // BLOCK_SIZE  # blocks no next query reads
        for block in runner.tables[0][:behind]:
            for kv in runner.kv_caches:
                kv[block].normal_(0, 100)
        got.append(runner.step({0: 1})[0])
    torch.testing.assert_close(torch.cat(got), hf_logits(theirs, seqs[0]), atol=1e-4, rtol=0)


def test_longrope_switch_matches_incremental_transformers(tmp_path_factory):
    """Past its original context (32) Phi-3's longrope switches to the long factors. Decoding one
    token at a time over the paged cache equals transformers' own incremental forward (which
    rotates each new token by the factors of the length so far). Its `generate` rotates the step
    that crosses differently, so the engine test above stays below 32 positions."""
    from transformers import AutoModelForCausalLM, DynamicCache

    path = make_tiny_model("phi3", str(tmp_path_factory.getbasetemp() / "phi3"))
    ours = build_model(ModelConfig(model=path), torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = random_seqs([36], seed=6)[0]
    runner = PagedRunner(ours, [seq])
    got = [runner.step({0: 28})[0][-1]] + [runner.step({0: 1})[0][0] for _ in range(8)]
    cache = DynamicCache(config=theirs.config)
    with torch.no_grad():
        want = [theirs(torch.tensor([seq[:28]]), past_key_values=cache).logits[0, -1]]
        for token in seq[28:]:
            want.append(theirs(torch.tensor([[token]]), past_key_values=cache).logits[0, -1])
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-4, rtol=0)
    prefilled = PagedRunner(ours, [seq]).step({0: 36})[0][32:]  # long factors from position 32 on
    torch.testing.assert_close(prefilled, torch.stack(got[5:]), atol=1e-4, rtol=0)


def test_sharded_moe_checkpoint_and_clear_errors(tmp_path):
    """Per-expert tensors across several safetensors files (an index) load into the stacked
    parameters; a missing expert tensor, a missing shard file and an unknown architecture are
    refused by name."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    src = make_tiny_model("mixtral", str(tmp_path / "src"))
    whole = build_model(ModelConfig(model=src), torch.float32, "cpu")
    theirs = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    theirs.save_pretrained(sharded, max_shard_size="200KB")
    with open(sharded / "model.safetensors.index.json") as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    assert len(files) > 2
    reloaded = dict(
        build_model(ModelConfig(model=str(sharded)), torch.float32, "cpu").named_parameters()
    )
    for name, param in whole.named_parameters():
        assert torch.equal(reloaded[name], param), name
    missing = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    victim = next(f for f in files if missing in load_file(sharded / f))
    weights = load_file(sharded / victim)
    del weights[missing]
    save_file(weights, sharded / victim, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"lacks model.layers.1.block_sparse_moe.experts.3.w3.weight"
    ):
        build_model(ModelConfig(model=str(sharded)), torch.float32, "cpu")
    os.remove(sharded / victim)
    with pytest.raises(ValueError, match=f"names missing files: {victim}"):
        build_model(ModelConfig(model=str(sharded)), torch.float32, "cpu")
    odd = tmp_path / "odd"
    shutil.copytree(src, odd)
    with open(odd / "config.json") as f:
        config = json.load(f)
    config["architectures"] = ["JambaForCausalLM"]
    with open(odd / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"\['JambaForCausalLM'\] is not supported"):
        build_model(ModelConfig(model=str(odd)), torch.float32, "cpu")


def test_gemma_groups_share_kv_tensors_so_a_block_costs_one_slot(tmp_path_factory):
    """Gemma's windowed and global layers are two KV cache groups of one layer each: both layers
    use one KV tensor (a block id belongs to one group at a time), so a block costs one layer's
    bytes and the same memory holds twice the blocks of a model whose layers share one table."""
    from pagedserve.frontend.llm import build_engine_config
    from pagedserve.parallel.groups import rank_info
    from pagedserve.worker.model_runner import ModelRunner

    path = make_tiny_model("gemma3", str(tmp_path_factory.getbasetemp() / "gemma3"))
    memory = 1 << 20
    config = build_engine_config(
        path, device="cpu", dtype="float32", block_size=4, kv_cache_memory=memory
    )
    assert config.model.kv_group_windows == [None, 8]
    runner = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    per_layer = 2 * 4 * runner.model.num_kv_heads_per_rank * runner.model.head_dim * 4
    assert runner.profile_num_blocks() == memory // per_layer
    runner.init_cache(8)
    assert runner.kv_caches[0] is runner.kv_caches[1] and runner.kv_caches[0].shape[0] == 8
    assert runner.batch.block_tables.shape[0] == 2 and not runner.features.cuda_graphs
