"""Weight loading: safetensors checkpoints (sharded or not) or GGUF files into our parameters, or
dummy weights.

Each safetensors tensor is opened as a lazy slice and handed to its parameter's `weight_loader`,
which reads only this rank's shard; a rank never materializes a full tensor parallel weight.
GGUF tensors are dequantized whole (quantization blocks run along rows, llama.cpp permutes q and
k rows), one at a time, to float32 and then to the parameter's dtype.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.parallel.layers import load_full

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: those named by the sharded index, else every `*.safetensors`."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights (use --load-format dummy to test)")
    return files


def iter_checkpoint(model_dir: str) -> Iterator[tuple[str, Any]]:
    """Yield (name, lazy slice) for every tensor of the checkpoint; nothing is read yet."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                yield name, f.get_slice(name)


def iter_gguf(gguf_file: str, hf_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF checkpoint name, float32 tensor) for every tensor of a GGUF file, dequantized by
    the `gguf` package; names and llama.cpp's q/k row permutation undone as transformers does
    (its GGUF tensor processors, and its name map built from the HF model class on the meta
    device). `hf_dir` holds the file's converted config.json (`gguf_checkpoint.py`)."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    reader = GGUFReader(gguf_file)
    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(hf_model, processor)
    for tensor in reader.tensors:
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type),
                                   name=tensor.name)  # fmt: skip
        if result.name in names:  # else derived (rope_freqs): a weight left out is caught below
            yield names[result.name], torch.from_numpy(result.weights.copy())


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]], source: str) -> None:
    """Copy (name, tensor or lazy slice) pairs of the checkpoint `source` into `model`, which
    provides `checkpoint_name_wanted(name)` and `checkpoint_to_param(name) -> (param name,
    shard id)`. Raises on missing or unknown weights."""
    params = dict(model.named_parameters())
    loaded: set[tuple[str, Any]] = set()
    for name, tensor in weights:
        if not model.checkpoint_name_wanted(name):
            continue
        param_name, shard_id = model.checkpoint_to_param(name)
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"{source}: checkpoint weight {name!r} has no place in the model")
        loader = getattr(param, "weight_loader", load_full)
        with torch.no_grad():
            loader(param, tensor, shard_id)
        loaded.add((param_name, shard_id))
    missing = [
        f"{n} (shard {s})" if s is not None else n
        for n, p in params.items()
        for s in getattr(p, "shard_ids", (None,))
        if (n, s) not in loaded
    ]
    if missing:
        raise ValueError(f"{source}: checkpoint lacks weights for {', '.join(missing)}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights without reading files: normal(0, 0.02), norms at 1, seeded. Drawn on the
    parameter's own device, in place: an 8B model drawn on the CPU in float32 and copied over
    took most of a minute of start-up."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=generators[param.device])
