"""Weight loading: safetensors checkpoints (sharded or not) or GGUF files into our parameters, or
dummy weights.

Each safetensors tensor is opened as a lazy slice and handed to its parameter's `weight_loader`,
which reads only this rank's shard; a rank never materializes a full tensor parallel weight.
GGUF tensors are dequantized whole (quantization blocks run along rows, llama.cpp permutes q and
k rows), one at a time, to float32 and then to the parameter's dtype; worker/gguf_weights.py
caches the result, so this runs once per file and dtype.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.kernels.cpu_linear import settle_layouts
from pagedserve.worker.layers.linear import FusedShards, load_full

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: those named by the sharded index, else every `*.safetensors`."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        absent = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
        if absent:
            raise ValueError(f"{model_dir}: {INDEX_FILE} names missing files: {', '.join(absent)}")
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights (use --load-format dummy to test)")
    return files


def iter_checkpoint(model_dir: str, show_progress: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield (name, lazy slice) for every tensor of the checkpoint; nothing is read yet.
    `show_progress`: a bar per shard file on stderr (only when stderr is a terminal)."""
    files = safetensors_files(model_dir)
    for path in progress(files, "Loading safetensors checkpoint shards", show_progress):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                yield name, f.get_slice(name)


def progress(items: list[str], desc: str, enabled: bool) -> Any:
    """`items`, through a tqdm bar when enabled and stderr is a terminal (tqdm's disable=None)."""
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="file", disable=None)


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
        read_field,
    )

    reader = GGUFReader(gguf_file)
    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = _gguf_names(hf_model, processor)
    for tensor in reader.tensors:
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type),
                                   name=tensor.name)  # fmt: skip
        if result.name in names:  # else derived (rope_freqs): a weight left out is caught below
            yield names[result.name], torch.from_numpy(result.weights.copy())


def _gguf_names(hf_model: nn.Module, processor: Any) -> dict[str, str]:
    """transformers' GGUF -> HF name map. It rebuilds gguf's name table (a function of the
    architecture and layer count only) for every submodule it visits: 17 s of a first start for
    SmolLM2 on 2 cores, 0.07 s with the table memoized during the call."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build)
    try:
        return get_gguf_hf_weights_map(hf_model, processor)
    finally:
        gguf.get_tensor_name_map = build


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]], source: str) -> None:
    """Copy (name, tensor or lazy slice) pairs of the checkpoint `source` into `model`, which
    provides `checkpoint_name_wanted(name)` and `checkpoint_to_param(name) -> (param name,
    shard id)`. Raises on missing or unknown weights, and on a tensor whose shape is not the one
    the config gives (each weight loader checks the whole tensor before taking its shard)."""
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
        try:
            with torch.no_grad():
                loader(param, tensor, shard_id)
        except ValueError as e:  # a shape that is not the config's, a bad scale: name the tensor
            raise ValueError(f"{source}: checkpoint tensor {name!r}: {e}") from None
        parts = shard_id.ids if isinstance(shard_id, FusedShards) else (shard_id,)
        loaded.update((param_name, part) for part in parts)
    missing = [
        _describe(model, n, s)
        for n, p in params.items()
        for s in getattr(p, "shard_ids", (None,))
        if (n, s) not in loaded and not getattr(p, "optional", False)
    ]
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {', '.join(missing)}")


def _describe(model: nn.Module, param_name: str, shard_id: Any) -> str:
    """The checkpoint tensor a parameter (shard) expects, and our parameter it fills."""
    ours = param_name if shard_id is None else f"{param_name} (shard {shard_id})"
    name_of = getattr(model, "checkpoint_name", None)
    theirs = name_of(param_name, shard_id) if name_of is not None else None
    return ours if theirs is None or theirs == param_name else f"{theirs} (for {ours})"


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights without reading files: normal(0, 0.02), norms at 1, seeded. Drawn on the
    parameter's own device, in place: an 8B model drawn on the CPU in float32 and copied over
    took most of a minute of start-up."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or getattr(param, "optional", False):
                param.fill_(1.0)
                continue
            if name.endswith("weight_scale"):  # FP8 weights below are N(0, 1): 0.02 each
                param.fill_(0.02)
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            if param.dtype == torch.uint8:  # packed codes (MXFP4 blocks): uniform random bytes
                param.random_(0, 256, generator=generators[param.device])
                continue
            if param.dtype == torch.float8_e4m3fn:  # stacked experts: one at a time
                for part in param.data.unbind(0) if param.dim() == 3 else (param.data,):
                    drawn = torch.empty(part.shape, device=param.device, dtype=torch.bfloat16)
                    part.copy_(drawn.normal_(0.0, 1.0, generator=generators[param.device]))
                continue
            param.normal_(0.0, 0.02, generator=generators[param.device])


def after_loading(model: nn.Module) -> None:
    """Each module's post-load step (`after_loading()`): load-time FP8 quantization of linear
    weights, KV-cache scales read into floats; then the CPU linears' layouts, by model size."""
    for module in model.modules():
        hook = getattr(module, "after_loading", None)
        if hook is not None:
            hook()
    settle_layouts(model)
