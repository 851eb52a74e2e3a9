"""Adapter loads off the step path (core/lora_gate.py, worker/lora/manager.py): through a real
`pagedserve launch`, a large adapter (rank 2048 on all seven projections of a 1024-wide model,
bf16 on disk: about a second to read) loads while a base-model request streams, and the stream's
worst gap stays well below the load; a load that fails answers its request with a 400 naming the
adapter, and the server keeps serving. Then the gate's pool decisions, in pure Python."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
import torch
from test_server import Launched, assert_error

from pagedserve.core.lora_gate import LoRAGate
from pagedserve.ipc.messages import (
    AbortRequests,
    AddRequest,
    LoRALoaded,
    LoRARequest,
    SamplingParams,
)

from tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, make_tokenizer

HIDDEN, INTERMEDIATE, LAYERS, RANK = 1024, 2816, 2, 2048
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
MODULES = {
    "self_attn": {m: (HIDDEN, HIDDEN) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    "mlp": {"gate_proj": (INTERMEDIATE, HIDDEN), "up_proj": (INTERMEDIATE, HIDDEN),
            "down_proj": (HIDDEN, INTERMEDIATE)},
}  # fmt: skip


def _random(shapes: dict[tuple[int, int], torch.Tensor], shape: tuple[int, int], dtype):
    """A random tensor of `shape` (one draw per shape, copied: what the values are does not
    matter here, and drawing 100M normals would cost seconds)."""
    if shape not in shapes:
        gen = torch.Generator().manual_seed(len(shapes))
        shapes[shape] = torch.randn(shape, generator=gen).mul_(0.02).to(dtype)
    return shapes[shape].clone()


def _wide_model(path: str) -> str:
    """A Llama 1024 wide with a 512-token vocabulary, written tensor by tensor."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=8,
        max_position_embeddings=4096, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)  # fmt: skip
    make_tokenizer().save_pretrained(path)
    shapes: dict = {}
    tensors = {
        "model.embed_tokens.weight": _random(shapes, (VOCAB_SIZE, HIDDEN), torch.float32),
        "lm_head.weight": _random(shapes, (VOCAB_SIZE, HIDDEN), torch.float32),
        "model.norm.weight": torch.ones(HIDDEN),
    }
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = torch.ones(HIDDEN)
        for block, modules in MODULES.items():
            for module, shape in modules.items():
                tensors[f"{prefix}.{block}.{module}.weight"] = _random(shapes, shape, torch.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _large_adapter(path: str, rank: int) -> str:
    """A PEFT checkpoint with A and B on every projection, bf16 (as PEFT saves bf16 models)."""
    from safetensors.torch import save_file

    shapes: dict = {}
    tensors = {}
    for layer in range(LAYERS):
        for block, modules in MODULES.items():
            for module, (out, inp) in modules.items():
                name = f"base_model.model.model.layers.{layer}.{block}.{module}"
                for which, shape in (("A", (rank, inp)), ("B", (out, rank))):
                    w = _random(shapes, shape, torch.bfloat16)
                    tensors[f"{name}.lora_{which}.weight"] = w
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
              "target_modules": [m for ms in MODULES.values() for m in ms]}  # fmt: skip
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("lora-loading"))
    model = _wide_model(os.path.join(base, "wide"))
    big = _large_adapter(os.path.join(base, "big"), RANK)
    gone = _large_adapter(os.path.join(base, "gone"), 8)
    args = [
        "--model", model, "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
        "--dtype", "float32", "--kv-cache-memory", "64M", "--served-model-name", "wide",
        "--enable-lora", "--max-loras", "1", "--max-lora-rank", str(RANK),
        "--lora-modules", f"big={big}", f"gone={gone}",
    ]  # fmt: skip
    proc = Launched(args, os.path.join(base, "launch.log"))
    url = proc.wait_ready()
    with httpx.Client(base_url=url, timeout=120) as http:
        yield http, gone
    assert proc.stop() == 0, proc.output()


def _complete(http: httpx.Client, model: str) -> httpx.Response:
    """One token after a one-token prompt: the adapter's first step is its slot copy and a
    GEMV (a CPU's GEMM on a few rows of a rank-2048 adapter costs as much as reading it)."""
    body = {"model": model, "prompt": [5], "max_tokens": 1, "temperature": 0}
    return http.post("/v1/completions", json=body)


def test_a_large_adapter_loads_while_the_base_model_streams(server):
    http, _ = server
    arrivals: list[float] = []  # when each chunk of the base-model stream came
    done = threading.Event()

    def stream() -> None:
        body = {"model": "wide", "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        with (
            httpx.Client(base_url=http.base_url, timeout=120) as own,
            own.stream("POST", "/v1/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                if done.is_set():
                    return  # closing the stream aborts the request

    thread = threading.Thread(target=stream)
    thread.start()
    while len(arrivals) < 5:
        assert thread.is_alive()
        time.sleep(0.01)
    start = time.monotonic()
    response = _complete(http, "big")  # the first request of `big`: the workers read it now
    end = time.monotonic()
    time.sleep(0.2)
    done.set()
    thread.join(timeout=60)
    assert response.status_code == 200, response.text
    load = end - start
    inside = [t for t in arrivals if start <= t <= end]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b > start and a < end]
    print(f"adapter's first request {load:.2f} s; stream: {len(inside)} chunks, worst gap "
          f"{max(gaps):.3f} s")  # fmt: skip
    assert load > 0.5, "the adapter read too fast to tell a stalled stream from a live one"
    # On the step path the stream stopped for the read and the adapter's first step: the worst
    # gap was nearly all of `load`. Off it, only for that step (mostly the slot copy).
    assert max(gaps) < load / 3, (max(gaps), load)


def test_a_failed_load_is_a_400_and_the_server_keeps_serving(server):
    http, gone = server
    os.remove(os.path.join(gone, "adapter_model.safetensors"))  # checked at start, gone since
    error = assert_error(_complete(http, "gone"), 400)
    assert "'gone'" in error["message"] and "not found" in error["message"], error
    assert _complete(http, "wide").status_code == 200
    assert _complete(http, "big").status_code == 200


# ---------------------------------------------------------------------- the gate, pure Python
def _req(req_id: str, lora: LoRARequest) -> AddRequest:
    return AddRequest(req_id, [1, 2], SamplingParams(max_tokens=1), lora=lora)


def test_gate_keeps_adapters_in_use_and_drops_the_least_recent():
    a, b, c = (LoRARequest(n, i, f"/adapters/{n}") for i, n in enumerate("abc", 1))
    users = {"a"}  # the scheduler's unfinished requests use `a`
    gate = LoRAGate(ranks=[0, 1], capacity=2, in_use=lambda lora: lora.lora_name in users)
    for i, lora in enumerate((a, b)):
        go_on, order = gate.admit(_req(f"r{i}", lora))
        assert not go_on and order.lora == lora and order.drop_ids == []
        assert gate.loaded(LoRALoaded(0, lora.lora_int_id)) == ([], None)  # one rank of two
        assert gate.loaded(LoRALoaded(7, lora.lora_int_id)) == ([], None)  # not a rank: ignored
        released, error = gate.loaded(LoRALoaded(1, lora.lora_int_id))
        assert [r.req_id for r in released] == [f"r{i}"] and error is None
    assert gate.admit(_req("again", a)) == (True, None)  # held: on at once (a is most recent)
    _, order = gate.admit(_req("r2", c))
    assert order.drop_ids == [2]  # b: least recent of those unused
    assert gate.held_ids == [1] and gate.num_waiting == 1
    assert [r.req_id for r in gate.abort(["r2", "other"])] == ["r2"]
    other_a = LoRARequest("a2", 1, "/adapters/elsewhere")
    with pytest.raises(ValueError, match="lora_int_id 1 names adapter 'a'"):
        gate.admit(_req("clash", other_a))  # while `a` runs, id 1 stays `a`
    released, error = gate.loaded(LoRALoaded(0, 3, error="LoRA adapter 'c': gone"))
    assert released == [] and error is None  # rank 1 has not answered
    _, error = gate.loaded(LoRALoaded(1, 3))
    assert error == "LoRA adapter 'c': gone" and 3 not in gate.held_ids
    _, order = gate.admit(_req("r3", b))
    assert order.drop_ids == [3]  # rank 1 read c: its copy leaves with the next order


class _Transport:
    """Just enough of the core's transport: what it broadcast, one client."""

    def __init__(self) -> None:
        self.sent: list = []
        self.outputs: list = []

    def broadcast(self, msg) -> None:
        self.sent.append(msg)

    def send_outputs(self, client_index: int, outputs) -> None:
        self.outputs += outputs.outputs

    def client_indices(self) -> list[int]:
        return [0]


def test_neither_gate_drops_what_a_request_waiting_in_the_other_needs(tmp_path_factory):
    from pagedserve.config import EngineConfig, ModelConfig
    from pagedserve.core.engine_core import EngineCore
    from pagedserve.ipc.messages import GrammarCompiled, LoadLoRA, StructuredOutputs
    from pagedserve.lora_config import LoRAConfig

    from tiny_models import tiny_model_dir

    model = ModelConfig(tiny_model_dir("llama", tmp_path_factory.getbasetemp()))
    config = EngineConfig(model, lora=LoRAConfig(max_loras=1, max_cpu_loras=1))
    transport = _Transport()
    core = EngineCore(config, transport, num_blocks=64)
    a, b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
    spec = StructuredOutputs(regex="[a-z]+")
    add = lambda req_id, lora, grammar=None: core._handle_client_message(  # noqa: E731
        AddRequest(req_id, [5, 6], SamplingParams(structured_outputs=grammar), lora=lora)
    )
    assert add("plain-a", a) == []  # waits for `a`
    core._handle_worker_message(LoRALoaded(0, 1))
    assert [d.req_id for d in transport.outputs] == ["plain-a"]  # admitted
    assert add("json-a", a, spec) == []  # waits for its grammar; `a` is held
    core._handle_client_message(AbortRequests(["plain-a"]))  # no scheduled request uses `a`
    assert add("plain-b", b) == []
    load_b = transport.sent[-1]
    assert isinstance(load_b, LoadLoRA) and load_b.lora == b
    assert load_b.drop_ids == []  # `a` stays: json-a waits for its grammar with it
    core._handle_worker_message(LoRALoaded(0, 2))
    core._handle_worker_message(GrammarCompiled(0, spec.key))
    admitted = [d.req_id for d in transport.outputs if d.finish_reason is None]
    assert admitted == ["plain-a", "plain-b", "json-a"]  # json-a needed no second load of `a`
    assert sum(isinstance(m, LoadLoRA) for m in transport.sent) == 2
