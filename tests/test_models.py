"""Our Llama-family models against transformers: same logits (fp32, CPU) for batched prefill,
chunked prefill, and mixed decode + prefill steps through the paged KV cache."""

from __future__ import annotations

import io
import os
import random
import shutil
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.config import ModelConfig
from pagedserve.kernels.attention.metadata import build_attention_metadata
from pagedserve.tests.tiny_models import TINY_KINDS, VOCAB_SIZE, tiny_model_dir
from pagedserve.worker.loader import iter_checkpoint, safetensors_files
from pagedserve.worker.models import build_model

BLOCK_SIZE = 8
NUM_BLOCKS = 64
TOL = 1e-4


class PagedRunner:
    """A test-side stand-in for the model runner: owns block tables and KV caches and runs steps
    given as {seq index: number of new tokens}, returning each row's logits."""

    def __init__(self, model: torch.nn.Module, seqs: list[list[int]], dtype=torch.float32):
        self.model, self.seqs = model, seqs
        free = list(range(1, NUM_BLOCKS))
        random.Random(0).shuffle(free)  # scattered, non-monotonic block ids
        self.free = free
        self.tables: list[list[int]] = [[] for _ in seqs]
        self.computed = [0] * len(seqs)
        shape = (NUM_BLOCKS, 2, BLOCK_SIZE, model.num_kv_heads_per_rank, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
        self.has_state = hasattr(model, "allocate_states")  # linear attention: seq i in slot i
        if self.has_state:
            model.allocate_states(len(seqs), dtype, torch.device("cpu"))

    def step(self, plan: dict[int, int]) -> dict[int, torch.Tensor]:
        ids = list(plan)
        for i in ids:
            while len(self.tables[i]) * BLOCK_SIZE < self.computed[i] + plan[i]:
                self.tables[i].append(self.free.pop())
        meta, positions = build_attention_metadata(
            [self.computed[i] for i in ids],
            [plan[i] for i in ids],
            [self.tables[i] for i in ids],
            BLOCK_SIZE,
        )
        if self.has_state:
            meta.state_slots_cpu = np.asarray(ids, dtype=np.int64)
        tokens = [
            t for i in ids for t in self.seqs[i][self.computed[i] : self.computed[i] + plan[i]]
        ]
        with torch.no_grad():
            hidden = self.model(torch.tensor(tokens), positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for i in ids:
            out[i] = logits[start : start + plan[i]]
            start += plan[i]
            self.computed[i] += plan[i]
        return out


@pytest.fixture(scope="module", params=TINY_KINDS)
def models(request, tmp_path_factory):
    path = tiny_model_dir(request.param, tmp_path_factory.getbasetemp())
    ours = build_model(ModelConfig(model=path), torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return ours, theirs


def hf_logits(model, tokens: list[int]) -> torch.Tensor:  # [L, V]
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def random_seqs(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in lengths]


def check(runner: PagedRunner, theirs, steps: list[dict[int, int]]) -> None:
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(runner.seqs))}
    for plan in steps:
        for i, logits in runner.step(plan).items():
            got[i].append(logits)
    for i, parts in got.items():
        ours = torch.cat(parts)
        ref = hf_logits(theirs, runner.seqs[i])[: len(ours)]
        assert (ours - ref).abs().max().item() < TOL, f"seq {i}"


def test_batched_prefill(models):
    ours, theirs = models
    seqs = random_seqs([5, 17, 33, 1, 8])
    check(PagedRunner(ours, seqs), theirs, [{i: len(s) for i, s in enumerate(seqs)}])


def test_layers_share_one_rotary_table(models):
    """Start-up builds the cos/sin table once per model, not once per layer (issue 34)."""
    ours, _ = models
    tables = {
        m.cos_sin_cache.data_ptr()
        for m in ours.modules()
        if isinstance(getattr(m, "cos_sin_cache", None), torch.Tensor)
    }
    per_type = 2 if "gemma" in type(ours).__name__.lower() else 1  # Gemma 3: local and global
    assert 1 <= len(tables) <= per_type


def test_chunked_prefill(models):
    ours, theirs = models
    seqs = random_seqs([40, 21], seed=1)
    check(PagedRunner(ours, seqs), theirs, [{0: 23, 1: 5}, {0: 17, 1: 16}])


def test_mixed_decode_and_prefill(models):
    ours, theirs = models
    seqs = random_seqs([20, 30], seed=2)
    steps = [{0: 12}] + [{0: 1, 1: 6} for _ in range(5)] + [{0: 1}] * 3
    check(PagedRunner(ours, seqs), theirs, steps)


def test_prefix_block_written_in_same_step(models):
    """Row 1 reuses row 0's first block, which row 0 writes in this very step."""
    ours, theirs = models
    seqs = random_seqs([13, 6], seed=3)
    seqs[1] = seqs[0][:BLOCK_SIZE] + seqs[1]
    runner = PagedRunner(ours, seqs)
    runner.tables[0] = [runner.free.pop(), runner.free.pop()]
    runner.tables[1] = [runner.tables[0][0]]
    runner.computed[1] = BLOCK_SIZE  # a prefix-cache hit on the block being computed
    out = runner.step({0: 13, 1: 6})
    ref = hf_logits(theirs, seqs[1])[BLOCK_SIZE:]
    assert (out[1] - ref).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bf16_runs(kind, tmp_path_factory):
    path = tiny_model_dir(kind, tmp_path_factory.getbasetemp())
    model = build_model(ModelConfig(model=path), torch.bfloat16, torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.bfloat16
    seqs = random_seqs([9, 4])
    runner = PagedRunner(model, seqs, dtype=torch.bfloat16)
    logits = runner.step({0: 9, 1: 4})
    assert logits[0].dtype == torch.float32 and torch.isfinite(logits[0]).all()
    runner.seqs = [s + [3] for s in seqs]
    assert torch.isfinite(runner.step({0: 1, 1: 1})[1]).all()


def test_dummy_load_reads_no_weights(tmp_path_factory, tmp_path):
    src = tiny_model_dir("qwen3", tmp_path_factory.getbasetemp())
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")  # no weights
    config = ModelConfig(model=str(tmp_path), load_format="dummy", seed=7)
    a = build_model(config, torch.float32, torch.device("cpu"))
    b = build_model(config, torch.float32, torch.device("cpu"))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    runner = PagedRunner(a, random_seqs([5]))
    assert torch.isfinite(runner.step({0: 5})[0]).all()
    with pytest.raises(ValueError, match="safetensors"):
        build_model(ModelConfig(model=str(tmp_path)), torch.float32, torch.device("cpu"))


def test_pipeline_stages_compose(tmp_path_factory):
    """Stage [0, 1) hands (hidden, residual) to stage [1, 2); the result equals the full model."""
    path = tiny_model_dir("llama-tied", tmp_path_factory.getbasetemp())
    config = ModelConfig(model=path)
    cpu = torch.device("cpu")
    full = build_model(config, torch.float32, cpu)
    first = build_model(config, torch.float32, cpu, layer_range=(0, 1))
    last = build_model(config, torch.float32, cpu, layer_range=(1, 2))
    assert not hasattr(first, "lm_head") and not hasattr(last.model, "embed_tokens")
    seqs = random_seqs([7, 3], seed=4)
    want = PagedRunner(full, seqs).step({0: 7, 1: 3})
    a, b = PagedRunner(first, seqs), PagedRunner(last, seqs)
    meta, positions = build_attention_metadata([0, 0], [7, 3], [[1], [2]], BLOCK_SIZE)
    tokens = torch.tensor(seqs[0] + seqs[1])
    with torch.no_grad():
        inter = first(tokens, positions, a.kv_caches, meta)
        hidden = last(None, positions, b.kv_caches, meta, intermediate=inter)
        logits = last.compute_logits(hidden)
    torch.testing.assert_close(logits, torch.cat([want[0], want[1]]))


def test_sharded_checkpoint_and_missing_weight(models, tmp_path):
    from safetensors.torch import load_file, save_file

    ours, theirs = models
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    reloaded = build_model(ModelConfig(model=str(tmp_path / "sharded")), torch.float32, "cpu")
    for name, param in ours.named_parameters():
        torch.testing.assert_close(dict(reloaded.named_parameters())[name], param)
    theirs.save_pretrained(tmp_path / "broken")
    weights = load_file(tmp_path / "broken" / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "broken" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks model.layers.1.self_attn.k_proj.weight \(for .*"
                       r"qkv_proj.weight \(shard k\)\)"):  # fmt: skip
        build_model(ModelConfig(model=str(tmp_path / "broken")), torch.float32, "cpu")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:  # tqdm draws only on a terminal
        return True


def test_shard_progress_bar(models, tmp_path, monkeypatch):
    """Loading draws one bar step per shard file, on a terminal only and only when asked."""
    models[1].save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    num_files = len(safetensors_files(str(tmp_path / "sharded")))
    assert num_files > 1
    for tty, show in [(True, True), (False, True), (True, False)]:
        err = _Terminal() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        names = [name for name, _ in iter_checkpoint(str(tmp_path / "sharded"), show)]
        assert names
        drawn = err.getvalue()
        want = f"{num_files}/{num_files}"
        assert ("checkpoint shards" in drawn and want in drawn) if tty and show else drawn == ""
