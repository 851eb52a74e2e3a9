"""Multi-LoRA: adapters refused by name, the batched kernels against a per-row loop, the core's
adapter rules (slots per step, prefix-cache keys), and the engine through `LLM` token for token
against transformers + peft on a tiny Llama and a tiny Qwen3 (with tp=2), one batch mixing the
base model and three adapters of ranks 8 and 16 on different target modules."""

from __future__ import annotations

import argparse
import os
import shutil

import numpy as np
import pytest
import torch
from lora_adapters import edit_config, make_adapter, peft_greedy
from test_scheduler import make, sched, step
from triton_env import HAS_CUDA, needs_triton, tiny

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.kernels.lora import SlotRows, group_layout, lora_expand_ref, lora_shrink_ref
from pagedserve.lora_checkpoint import LoRAAdapterError, read_adapter

from tiny_models import make_tiny_model

NUM_NEW = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, rank, targets, extra LoraConfig arguments)
ADAPTERS = [
    ("attn-r8", 8, ["q_proj", "v_proj"], {}),
    ("mlp-r16", 16, ["o_proj", "gate_proj", "up_proj", "down_proj"], {}),
    ("all-r8-rslora", 8, ALL, {"rslora": True, "alpha": 4.0}),
]
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
    [40, 41, 42],
    [300, 301, 7, 9, 11, 200, 100, 50, 25, 12, 6, 3, 99, 98, 97, 96, 95, 94, 93],
]


def _family(kind: str, base_dir: str) -> dict:
    model = make_tiny_model(kind, os.path.join(base_dir, kind))
    loras, want = [None], {None: peft_greedy(model, None, PROMPTS, NUM_NEW)}
    for i, (name, rank, targets, extra) in enumerate(ADAPTERS, 1):
        path = make_adapter(
            model, os.path.join(base_dir, f"{kind}-{name}"), rank, targets, i, **extra
        )
        loras.append(LoRARequest(name, i, path))
        want[name] = peft_greedy(model, path, PROMPTS, NUM_NEW)
    return {"model": model, "loras": loras, "want": want}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict:
    return _family("llama", str(tmp_path_factory.mktemp("lora")))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> dict:
    return _family("qwen3", str(tmp_path_factory.mktemp("lora")))


def _mixed(family: dict, rotate: int = 0) -> tuple[list, list, list]:
    """Every prompt with every adapter and the base model, in one batch (adapters rotated)."""
    prompts, loras, want = [], [], []
    adapters = family["loras"][rotate:] + family["loras"][:rotate]
    for lora in adapters:
        for i, p in enumerate(PROMPTS):
            prompts.append({"prompt_token_ids": p})
            loras.append(lora)
            want.append(family["want"][None if lora is None else lora.lora_name][i])
    return prompts, loras, want


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)


# ---------------------------------------------------------------- the engine against peft
def test_mixed_batch_equals_peft_llama(llama):
    """Three adapters and the base model in one batch (max_loras=3); then again with the
    adapters swapped over the prompts, so a prefix-cache hit across adapters would show."""
    assert len({tuple(v[0]) for v in llama["want"].values()}) == 4, "adapters change the tokens"
    with LLM(llama["model"], device="cpu", dtype="float32", enable_lora=True, max_loras=3,
             max_lora_rank=16) as llm:  # fmt: skip
        for rotate in (0, 1):
            prompts, loras, want = _mixed(llama, rotate)
            outs = llm.generate(prompts, GREEDY, lora_request=loras)
            assert [o.outputs[0].token_ids for o in outs] == want


def test_more_adapters_than_slots_tp2_qwen3(qwen3):
    """Tensor parallel over two ranks (A and B sharded as their layers: q/k/v and gate/up by
    output rows, o/down by input columns), three adapters over two device slots and a host pool
    of two: the scheduler runs at most two adapters per step, slots and the host pool evict and
    reload, and tokens stay exact."""
    with LLM(qwen3["model"], device="cpu", dtype="float32", enable_lora=True, max_loras=2,
             max_cpu_loras=2, max_lora_rank=16, tensor_parallel_size=2) as llm:  # fmt: skip
        prompts, loras, want = _mixed(qwen3)
        outs = llm.generate(prompts, GREEDY, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == want
        with pytest.raises(LoRAAdapterError, match="'nope'"):
            llm.generate(prompts[:1], GREEDY, lora_request=LoRARequest("nope", 9, "/no/such"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_fused_decode_paths_add_the_adapter_on_gpu(llama):
    """bf16 on CUDA, where decode batches take the fused qkv-rope GEMV and prompts the SwiGLU
    GEMM: each row's logprobs of its own tokens match peft's, which an adapter skipped on a
    fused path would break by far more than bf16 rounding."""
    from transformers import AutoModelForCausalLM

    prompts, loras, _ = _mixed(llama)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=0)
    with LLM(llama["model"], device="cuda", dtype="bfloat16", enable_lora=True, max_loras=3,
             gpu_memory_utilization=0.3) as llm:  # fmt: skip
        outs = llm.generate(prompts, params, lora_request=loras)
    from peft import PeftModel

    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        model = AutoModelForCausalLM.from_pretrained(llama["model"], dtype=torch.bfloat16)
        if lora is not None:
            model = PeftModel.from_pretrained(model, lora.lora_path)
        model = model.cuda().eval()
        ids = prompt["prompt_token_ids"] + out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
        n = len(prompt["prompt_token_ids"])
        want = torch.log_softmax(logits[n - 1 : -1], -1)
        want = want.gather(1, torch.tensor(ids[n:], device="cuda")[:, None])[:, 0].tolist()
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        assert got == pytest.approx(want, abs=0.15)


# ---------------------------------------------------------------- adapters refused by name
def test_bad_adapters_are_refused_by_name(llama, qwen3, tmp_path):
    hf = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "num_hidden_layers": 2}  # fmt: skip
    good = llama["loras"][1].lora_path
    assert read_adapter("ok", good, hf, 16).rank == 8

    def variant(name: str, **changes) -> str:
        path = str(tmp_path / name)
        shutil.copytree(good, path)
        edit_config(path, **changes)
        return path

    cases = [
        (variant("dora", use_dora=True), 16, "use_dora"),
        (variant("embed", target_modules=["q_proj", "embed_tokens"]), 16, "'embed_tokens'"),
        (variant("head", target_modules=["lm_head"]), 16, "'lm_head'"),
        (variant("saved", modules_to_save=["lm_head"]), 16, "modules_to_save"),
        (variant("bias", bias="all"), 16, "bias"),
        (good, 4, "rank 8 exceeds --max-lora-rank 4"),
        (qwen3["loras"][1].lora_path, 16, "shape"),  # head_dim 32: q_proj's B is 128 rows
        (str(tmp_path / "missing"), 16, "not found"),
    ]
    for path, max_rank, why in cases:
        with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'bad'.*{why}"):
            read_adapter("bad", path, hf, max_rank)
    os.remove(os.path.join(variant("nofile"), "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="'bad'.*adapter_model.safetensors not found"):
        read_adapter("bad", str(tmp_path / "nofile"), hf, 16)


# ---------------------------------------------------------------- kernels
def _loop_reference(x, a, b, starts, slots):
    """Row by row: y[t] = B_s A_s x[t] for the row's slot s (the oracle of the batched ops)."""
    y = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32)
    for i, slot in enumerate(slots):
        for t in range(starts[i], starts[i + 1]):
            if slot >= 0:
                y[t] = b[slot].float() @ (a[slot].float() @ x[t].float())
    return y


def _case(dtype=torch.float32):
    """Requests of slots 1, base, 0, 1, 2: slot 1's group is 71 rows (two 64-row blocks), and
    K = 512 takes two K splits."""
    gen = torch.Generator().manual_seed(0)
    starts, slots = [0, 70, 71, 91, 92, 100], [1, -1, 0, 1, 2]
    x = torch.randn(100, 512, generator=gen).to(dtype)
    a = (torch.randn(3, 16, 512, generator=gen) / 8).to(dtype)
    b = torch.randn(3, 40, 16, generator=gen).to(dtype)
    return x, a, b, starts, slots


def test_shrink_expand_reference_equals_row_loop():
    x, a, b, starts, slots = _case()
    rows = SlotRows.from_segments(starts, slots, x.device)
    assert rows.order.tolist() == [*range(71, 91), *range(70), 91, *range(92, 100)]
    y = lora_expand_ref(torch.zeros(100, 40), lora_shrink_ref(x, a, rows), b, rows)
    torch.testing.assert_close(y, _loop_reference(x, a, b, starts, slots), rtol=1e-4, atol=1e-3)
    assert y[70].abs().sum() == 0  # the base-model row


@needs_triton
@tiny
def test_triton_shrink_expand_equal_reference():
    from pagedserve.kernels.activation import silu_and_mul_ref
    from pagedserve.kernels.triton_lora import num_splits, triton_lora_expand, triton_lora_shrink

    device = "cuda" if HAS_CUDA else "cpu"
    x, a, b, starts, slots = (t.to(device) if torch.is_tensor(t) else t for t in _case())
    rows = SlotRows.from_segments(starts, slots, x.device)
    assert num_splits(rows, 512) == 2
    h = triton_lora_shrink(x, a, rows)  # [2, T, R] partial sums, adapter rows only
    order = rows.order.long()
    torch.testing.assert_close(
        h.sum(0)[order], lora_shrink_ref(x, a, rows)[order], rtol=1e-3, atol=1e-2
    )
    y = triton_lora_expand(torch.ones(100, 40, device=device), h, b, rows)
    want = 1 + _loop_reference(x.cpu(), a.cpu(), b.cpu(), starts, slots)
    torch.testing.assert_close(y.cpu(), want, rtol=1e-3, atol=5e-2)
    # gated: x is gate | up, activated in the shrink's loads
    gate_up = torch.cat([x, x.flip(0)], dim=1)
    y = triton_lora_expand(
        torch.zeros(100, 40, device=device), triton_lora_shrink(gate_up, a, rows, True), b, rows
    )
    want = _loop_reference(silu_and_mul_ref(gate_up).cpu(), a.cpu(), b.cpu(), starts, slots)
    torch.testing.assert_close(y.cpu(), want, rtol=1e-3, atol=5e-2)
    # a CUDA graph's rows: a static buffer of 16 rows and 4 groups, 8 decode rows in it
    starts1, slots1 = list(range(9)), [2, -1, 0, 0, 1, -1, -1, -1]
    host, num_rows, num_groups = group_layout(starts1, slots1, 16, 4)
    static = SlotRows(torch.from_numpy(host).to(device), num_rows, num_groups, 8)
    assert static.group_slots.tolist() == [0, 1, 2, -1]
    h = triton_lora_shrink(x[:8], a, static)
    y = triton_lora_expand(torch.zeros(8, 40, device=device), h, b, static)
    want = _loop_reference(x[:8].cpu(), a.cpu(), b.cpu(), starts1, slots1)
    torch.testing.assert_close(y.cpu(), want, rtol=1e-3, atol=5e-2)


@needs_triton
@tiny
@pytest.mark.parametrize("gated", [False, True])
def test_decode_lora_linear_equals_reference(gated):
    """The decode-size path: the shrink over every slot's A inside the base GEMV, one expand by
    each row's slot (3 slots of 48 columns: A's rows no whole GEMV tile), over a graph-sized
    buffer of 16 rows holding 5 tokens: slots 2, base, 0, 0, 1."""
    from pagedserve.kernels.activation import silu_and_mul_ref
    from pagedserve.kernels.triton_lora import triton_lora_linear

    device = "cuda" if HAS_CUDA else "cpu"
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 1024 if gated else 512, generator=gen)
    w = torch.randn(40, 512, generator=gen) / 16
    a = torch.randn(3, 48, 512, generator=gen) / 16
    b = torch.randn(3, 40, 48, generator=gen) / 4
    starts, slots = list(range(6)), [2, -1, 0, 0, 1]
    host, num_rows, num_groups = group_layout(starts, slots, 16, 3)
    rows = SlotRows(torch.from_numpy(host).to(device), num_rows, num_groups, 5)
    assert rows.token_slots.tolist() == [2, -1, 0, 0, 1, *[-1] * 11]
    dev = [t.to(device, dtype) for t in (x, w, a, b)]
    y = triton_lora_linear(*dev[:2], None, *dev[2:], rows.token_slots, gated).float().cpu()
    x = silu_and_mul_ref(x) if gated else x
    want = x @ w.t() + _loop_reference(x, a, b, starts, slots)
    tol = 5e-2 if HAS_CUDA else 1e-3
    torch.testing.assert_close(y, want, rtol=tol, atol=tol)
    assert (y[1] - x[1] @ w.t()).abs().max() < tol  # the base-model row: no delta


@needs_triton
@tiny
def test_dense_lora_equals_reference():
    """Above GEMV sizes: one GEMM over every slot's A, the expand over 64-row tiles by each
    token's slot (`_case`: a 71-row group across two tiles, a base row between), and gate/up's
    deltas inside the activation."""
    from pagedserve.kernels.activation import silu_and_mul_ref
    from pagedserve.kernels.triton_lora import triton_lora_dense, triton_lora_swiglu

    device = "cuda" if HAS_CUDA else "cpu"
    x, a, b, starts, slots = _case(torch.bfloat16 if HAS_CUDA else torch.float32)
    rows = SlotRows.from_segments(starts, slots, device)
    assert rows.token_slots.shape == (100,)
    y = triton_lora_dense(torch.ones(100, 40, device=device, dtype=x.dtype), x.to(device),
                          a.to(device), b.to(device), rows.token_slots)  # fmt: skip
    want = 1 + _loop_reference(x, a, b, starts, slots)
    tol = 1e-1 if HAS_CUDA else 5e-2  # (bf16: 0.063 off at 2 of 4,000 on an H100)
    torch.testing.assert_close(y.float().cpu(), want, rtol=2e-2, atol=tol)
    assert (y[70] == 1).all()  # the base-model row
    # a prompt's gate/up: the deltas added inside silu-and-mul (B's rows: 20 gate, 20 up)
    gate_up = torch.randn(100, 40, generator=torch.Generator().manual_seed(2)).to(x.dtype)
    out = triton_lora_swiglu(gate_up.to(device), x.to(device), a.to(device), b.to(device),
                             rows.token_slots)  # fmt: skip
    want = silu_and_mul_ref(gate_up.float() + _loop_reference(x, a, b, starts, slots))
    torch.testing.assert_close(out.float().cpu(), want, rtol=2e-2, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_triton_graph_rows_staged_without_waiting_for_the_gpu():
    """A graph step's LoRA rows reach the graphs' buffer without the host waiting for the GPU's
    queue (a copy from pageable memory waits: the next step could not be queued behind)."""
    import numpy as np

    from pagedserve.lora_config import LoRAConfig
    from pagedserve.worker.lora.manager import LoRAManager

    config, dev = LoRAConfig(max_loras=2), torch.device("cuda", 0)
    manager = LoRAManager(config, torch.nn.Module(), {}, dev, torch.bfloat16, 64)
    segments = (np.array([0, 1, 2, 3]), [1, -1, 0])
    manager.batch.set(segments=segments)
    manager.stage_graph()  # the first one pins its buffers
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # ~0.3 s of GPU time queued ahead of the copy
    done = torch.cuda.Event()
    done.record()
    manager.stage_graph()
    assert not done.query(), "staging the rows waited for the GPU"
    torch.cuda.synchronize()
    want, _, _ = group_layout(*segments, 64, 2)
    assert manager.graph_buf.cpu().tolist() == want.tolist()


@pytest.mark.parametrize(
    "seg_starts, seg_slots, capacity",
    [([0, 5, 6, 9], [1, -1, 0], None), ([0, 3, 8, 9, 11], [2, 0, -1, 1], None),
     ([0, 1, 2, 3], [1, -1, 0], (13, 3))],
)  # fmt: skip
def test_rows_sections_start_16_byte_aligned(seg_starts, seg_slots, capacity):
    """Every section of a step's rows starts at a multiple of 16 bytes whatever the step's row
    count (Triton compiles a kernel again for each alignment of a pointer: offsets that moved
    with the rows compiled kernels on the step path), and holds what it held before."""
    if capacity is None:
        rows = SlotRows.from_segments(seg_starts, seg_slots, torch.device("cpu"))
    else:
        host, num_rows, num_groups = group_layout(seg_starts, seg_slots, *capacity)
        rows = SlotRows(torch.from_numpy(host), num_rows, num_groups, 1)
    for view in (rows.order, rows.group_starts, rows.group_slots, rows.token_slots):
        assert view.storage_offset() % 4 == 0  # int32: 4 elements = 16 bytes
    token_slots = [
        s for i, s in enumerate(seg_slots) for _ in range(seg_starts[i + 1] - seg_starts[i])
    ]
    assert rows.token_slots.tolist()[: len(token_slots)] == token_slots
    assert set(rows.token_slots.tolist()[len(token_slots) :]) <= {-1}
    used = sorted({s for s in seg_slots if s >= 0})
    assert rows.group_slots.tolist()[: len(used)] == used
    counts = [token_slots.count(s) for s in used]
    ends = rows.group_starts.tolist()[1 : len(used) + 1]
    assert rows.group_starts[0] == 0 and ends == list(np.cumsum(counts))
    order = rows.order.tolist()[: sum(counts)]
    assert [token_slots[t] for t in order] == sorted(token_slots[t] for t in order)


def _num_compiled(kernel) -> int:
    """Variants of a Triton kernel compiled so far (its per-device caches)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(cache) for cache in kernel.cache.values())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_eager_steps_reuse_one_compiled_kernel():
    """Steps of 64, 37 and 101 tokens (rows of 3 adapters and the base model) run the dense
    LoRA kernels compiled once: no variant per row count or pointer alignment (one compiled on
    the step path stalled W1 ~1.3 s, twice a run)."""
    from pagedserve.kernels import triton_lora as tl_lora

    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(3, 16, 256, generator=gen) / 8).to("cuda", torch.bfloat16)
    b = torch.randn(3, 80, 16, generator=gen).to("cuda", torch.bfloat16)
    seen = []
    for tokens in (64, 37, 101):
        cut = [0, tokens // 3, tokens // 3 + 1, 2 * tokens // 3, tokens]
        rows = SlotRows.from_segments(cut, [2, -1, 0, 1], torch.device("cuda"))
        x = torch.randn(tokens, 256, generator=gen).to("cuda", torch.bfloat16)
        tl_lora.triton_lora_dense(torch.zeros(tokens, 80, device="cuda", dtype=x.dtype), x, a, b,
                                  rows.token_slots)  # fmt: skip
        tl_lora.triton_lora_swiglu(torch.zeros(tokens, 80, device="cuda", dtype=x.dtype), x, a,
                                   b, rows.token_slots)  # fmt: skip
        seen.append((_num_compiled(tl_lora._slot_expand_rows_kernel),
                     _num_compiled(tl_lora._slot_silu_kernel)))  # fmt: skip
    assert seen[1:] == seen[:1] * 2, seen


# ---------------------------------------------------------------- the core's adapter rules
def _add(s, req_id: str, prompt: list[int], lora: LoRARequest | None) -> None:
    from pagedserve.ipc.messages import AddRequest

    params = SamplingParams(max_tokens=4)
    s.add_request(AddRequest(req_id, prompt, params, [2], lora=lora))


def test_scheduler_runs_at_most_max_loras_adapters_per_step():
    s = make()
    s.max_loras = 2
    adapters = [LoRARequest(f"a{i}", i, f"/x/{i}") for i in (1, 2, 3)]
    for i, lora in enumerate([adapters[0], None, adapters[1], adapters[2], adapters[0]]):
        _add(s, f"r{i}", [10 + i, 11, 12], lora)
    plan, _ = step(s)
    assert list(sched(plan)) == ["r0", "r1", "r2", "r4"]  # r3's adapter would be a third
    assert {n.req_id: n.lora for n in plan.new_requests}["r2"] == adapters[1]
    stats = s.get_stats()
    assert stats.running_lora_adapters == {"a1": 2, "a2": 1}
    assert stats.waiting_lora_adapters == {"a3": 1}
    assert [r.req_id for r in s.policy] == ["r3"]  # passed over, still waiting
    _add(s, "r5", [9, 9, 9], adapters[2])
    for _ in range(20):  # once a slot frees, r3 runs before r5
        plan, _ = step(s)
        assert "r5" not in sched(plan) or "r3" in sched(plan)
        if "r3" in sched(plan):
            break
    assert "r3" in sched(plan)


def test_core_refuses_an_adapter_without_enable_lora():
    from pagedserve.core.admission import ModelLimits, check_request
    from pagedserve.ipc.messages import AddRequest

    msg = AddRequest("r", [5, 6], SamplingParams(), lora=LoRARequest("a", 1, "/x"))
    with pytest.raises(ValueError, match="--enable-lora"):
        check_request(msg, ModelLimits(512, 64))
    check_request(msg, ModelLimits(512, 64, lora=True))


def test_prefix_cache_keys_include_the_adapter():
    s = make()
    s.max_loras = 2
    prompt = list(range(20, 33))  # three full blocks of 4
    _add(s, "base", prompt, None)
    while s.has_unfinished_requests():
        step(s)
    a1 = LoRARequest("a1", 1, "/x/1")
    _add(s, "lora", prompt, a1)
    plan, _ = step(s)
    assert plan.new_requests[0].num_computed_tokens == 0  # the base model's blocks are not its
    while s.has_unfinished_requests():
        step(s)
    _add(s, "again", prompt, a1)
    plan, _ = step(s)
    assert plan.new_requests[0].num_computed_tokens == 12  # the same adapter's are


def test_runtime_updating_follows_vllms_variable():
    from pagedserve.entrypoints.args import add_launch_args
    from pagedserve.settings import runtime_lora_updating_from_env

    assert runtime_lora_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_lora_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert not runtime_lora_updating_from_env({})
    parser = argparse.ArgumentParser()
    add_launch_args(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", '
                              '"path": "/y", "base_model_name": "m"}'])  # fmt: skip
    assert args.lora_modules == ["a=/x", {"name": "b", "path": "/y", "base_model_name": "m"}]
