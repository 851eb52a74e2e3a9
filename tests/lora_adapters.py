"""Random PEFT LoRA adapters for tiny models, and transformers + peft as the oracle.

`make_adapter(base_dir, path, rank, targets, seed, ...)` writes a real PEFT checkpoint
(`adapter_config.json` + `adapter_model.safetensors`, saved by peft itself) with A and B drawn
from `seed`, large enough that every adapter changes the greedy tokens. `peft_greedy` runs
transformers' `generate` with the adapter applied by peft.
"""

from __future__ import annotations

import json
import os

import pytest
import torch


def make_adapter(
    base_dir: str,
    path: str,
    rank: int,
    targets: list[str],
    seed: int,
    alpha: float | None = None,
    rslora: bool = False,
    std: float = 0.3,
) -> str:
    pytest.importorskip("peft")  # the test extra has it; a bare GPU image may not
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        return path
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
        lora_dropout=0.0, use_rslora=rslora, init_lora_weights=False,
    )  # fmt: skip
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(path, safe_serialization=True)
    return path


def peft_greedy(
    base_dir: str, adapter_dir: str | None, prompts: list[list[int]], n: int
) -> list[list[int]]:
    """Greedy tokens of transformers, with the adapter through peft (None: the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        seq = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
            min_new_tokens=n, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        out.append(seq[0, len(prompt) :].tolist())
    return out


def edit_config(path: str, **changes: object) -> None:
    """Rewrite keys of an adapter's adapter_config.json (for refusal tests)."""
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)
