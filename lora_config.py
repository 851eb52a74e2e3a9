"""Multi-LoRA serving's config (`--enable-lora`); pure Python, like config.py, whose
`EngineConfig` holds it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (`--enable-lora`): present only when it is on.

    `lora_modules`: adapters served from the start, (name, path, base_model_name or None);
    `max_loras` adapters run in one step (the device slots), `max_cpu_loras` stay loaded in host
    memory; `allow_runtime_lora_updating` opens /v1/load_lora_adapter and
    /v1/unload_lora_adapter, for paths under `lora_allowed_dirs` (empty: any)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dtype: str = "auto"  # "auto" (the model's) | float16 | bfloat16 | float32
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()
    allow_runtime_lora_updating: bool = False
    lora_allowed_dirs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        modules = tuple((str(n), str(p), b) for n, p, b in self.lora_modules)
        object.__setattr__(self, "lora_modules", modules)
        object.__setattr__(self, "lora_allowed_dirs", tuple(self.lora_allowed_dirs))
        if self.max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        if self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be at least 1")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )
        if self.lora_dtype not in ("auto", "float16", "bfloat16", "float32"):
            raise ValueError(
                f"--lora-dtype {self.lora_dtype!r}: choose auto, float16, bfloat16 or float32"
            )
        names = [n for n, _, _ in modules]
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules: each adapter needs its own name")
