"""Weight loading: safetensors checkpoints (sharded or not) into our parameters, or dummy weights.

Each tensor is opened as a lazy safetensors slice and handed to its parameter's `weight_loader`,
which reads only this rank's shard; a rank never materializes a full tensor parallel weight.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
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


def load_weights(model: nn.Module, model_dir: str, show_progress: bool = False) -> None:
    """Copy the checkpoint into `model`, which provides `checkpoint_name_wanted(name)` and
    `checkpoint_to_param(name) -> (param name, shard id)`. Raises on missing or unknown weights.
    `show_progress`: one rank per model shows the shard bar (the others would print it again)."""
    params = dict(model.named_parameters())
    loaded: set[tuple[str, Any]] = set()
    for name, tensor in iter_checkpoint(model_dir, show_progress):
        if not model.checkpoint_name_wanted(name):
            continue
        param_name, shard_id = model.checkpoint_to_param(name)
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"{model_dir}: checkpoint weight {name!r} has no place in the model")
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
        raise ValueError(f"{model_dir}: checkpoint lacks weights for {', '.join(missing)}")


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
