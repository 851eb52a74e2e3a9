"""`--num-loras N` of `pagedserve bench throughput|latency`: N random PEFT adapters of rank
`--lora-rank` on all seven projections, written once for the model's shapes, with the requests
spread over them uniformly (request i runs adapter i mod N): the issue's multi-LoRA workload, to
set beside the same run without adapters. vLLM takes the same directories (`--enable-lora
--lora-modules`), so its number can stand beside ours.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from typing import Any

from pagedserve.config import ModelConfig
from pagedserve.ipc.messages import LoRARequest
from pagedserve.lora_checkpoint import CONFIG_FILE, WEIGHTS_FILE, module_shapes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-loras", type=int, default=0, help="random adapters to spread the "
                   "requests over (0: the base model alone)")  # fmt: skip
    p.add_argument("--lora-rank", type=int, default=16)


def lora_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if not args.num_loras:
        return {}
    return {"enable_lora": True, "max_loras": args.num_loras, "max_lora_rank": args.lora_rank}


def lora_requests(args: argparse.Namespace, count: int) -> list[LoRARequest | None] | None:
    """One adapter per request, round robin over `--num-loras` (None: no adapters)."""
    if not args.num_loras:
        return None
    hf = ModelConfig(args.model).hf
    key = hashlib.sha1(json.dumps([hf, args.lora_rank], sort_keys=True).encode()).hexdigest()[:12]
    root = os.path.join(tempfile.gettempdir(), f"pagedserve-bench-loras-{key}")
    loras = [
        LoRARequest(f"bench-{i}", i + 1, write_random_adapter(hf, args.lora_rank, root, i))
        for i in range(args.num_loras)
    ]
    return [loras[i % len(loras)] for i in range(count)]


def write_random_adapter(hf: dict[str, Any], rank: int, root: str, seed: int) -> str:
    """A PEFT checkpoint with A, B ~ N(0, 0.01) on every layer's seven projections (bf16)."""
    import torch
    from safetensors.torch import save_file

    path = os.path.join(root, f"adapter-{seed}")
    if os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        return path
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(hf)
    tensors = {}
    for layer in range(int(hf["num_hidden_layers"])):
        for module in TARGETS:
            out, inp = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, inp, generator=gen) * 0.01).to(
                torch.bfloat16
            )
            tensors[f"{name}.lora_B.weight"] = (torch.randn(out, rank, generator=gen) * 0.01).to(
                torch.bfloat16
            )
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": TARGETS,
              "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f)
    return path
