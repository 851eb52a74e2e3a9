"""The LoRA adapters an API server (or `LLM`) serves, by the name requests put in `model`.

Adapters from `--lora-modules` get ids 1..n in their order, the same in every API server
process. Adapters loaded at run time (`/v1/load_lora_adapter`, only with
`--allow-runtime-lora-updating` or VLLM_ALLOW_RUNTIME_LORA_UPDATING) get an id from a hash of
their name and path, so one load names one adapter everywhere in the engine (the prefix cache
and the workers' slots key on the id) and a reload from another path is another adapter. Loads
are checked against the model here (lora_checkpoint.py), so a bad adapter is refused by name and
never reaches a worker. Unloading only forgets the name: requests already running keep their
adapter (core/lora_gate.py keeps it in the workers' host pools while any request uses it).

Each API server keeps its own registry: with `--api-servers N`, runtime loads reach only the
server that took them (as in vLLM); `--lora-modules` reach all.
"""

from __future__ import annotations

import hashlib
import os

from pagedserve.ipc.messages import LoRARequest
from pagedserve.lora_checkpoint import read_adapter
from pagedserve.lora_config import LoRAConfig

RUNTIME_ID_BASE = 1 << 20  # runtime ids sit above any --lora-modules count


class LoRANotFoundError(LookupError):
    """No adapter of that name is loaded."""


class LoRARegistry:
    def __init__(self, config: LoRAConfig, hf: dict, base_name: str) -> None:
        self.config, self.hf, self.base_name = config, hf, base_name
        self.adapters: dict[str, LoRARequest] = {}
        for i, (name, path, base) in enumerate(config.lora_modules, 1):
            self.adapters[name] = LoRARequest(name, i, os.path.abspath(path), base)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def check_path(self, path: str) -> str:
        """`path` made absolute; ValueError unless it lies under `--lora-allowed-dirs`."""
        real = os.path.realpath(path)
        allowed = [os.path.realpath(d) for d in self.config.lora_allowed_dirs]
        if allowed and not any(real == d or real.startswith(d + os.sep) for d in allowed):
            raise PermissionError(f"lora_path {path!r} is outside --lora-allowed-dirs")
        return real

    def load(self, name: str, path: str, reserved: list[str]) -> LoRARequest:
        """Check and register an adapter (blocking file reads: run it off the event loop).
        `reserved`: names of the base model, which an adapter may not take."""
        if not name:
            raise ValueError("lora_name is empty")
        if name in reserved:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        real = self.check_path(path)
        read_adapter(name, real, self.hf, self.config.max_lora_rank)
        digest = hashlib.blake2b(f"{name}\0{real}".encode(), digest_size=8).digest()
        lora_id = RUNTIME_ID_BASE + int.from_bytes(digest, "big") % ((1 << 31) - RUNTIME_ID_BASE)
        lora = LoRARequest(name, lora_id, real, None)
        self.adapters[name] = lora
        return lora

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")

    def cards(self) -> list[dict[str, str]]:
        """(id, root, parent) of each adapter for /v1/models."""
        return [
            {"id": a.lora_name, "root": a.lora_path, "parent": a.base_model_name or self.base_name}
            for a in self.adapters.values()
        ]
