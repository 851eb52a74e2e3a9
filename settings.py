"""Every `PAGEDSERVE_*` environment variable, read in this one module into typed settings.

Why one module: a switch read where it is used (ten modules did, one at import time, one inside
the core) configures the engine behind the config's back (STYLE 6), is checked only when the path
that reads it runs, and differs between processes when their environments differ. Here each
variable is read and validated once, when `launch` or `LLM` builds its `EngineConfig`
(`Settings.from_env()`, a clear error before any process starts), and the result travels in the
config (`EngineConfig.settings`) to the core and every worker, which install it with `activate()`
at start-up. Code that runs outside an engine (a test calling a kernel) reads the environment the
same way, once, on first use.

Secrets stay out of the config, which crosses process boundaries on command lines: the API key
and the CURVE key are read here too (`api_key_from_env`, `curve_key_from_env`) but handed only to
the process that needs them.

| variable | setting | values (default first) |
| --- | --- | --- |
| PAGEDSERVE_ATTENTION_BACKEND | attention_backend | unset, torch, sdpa, triton, flash: force one |
| PAGEDSERVE_DISABLE_TRITON | disable_triton | 0, 1: every op on its torch reference |
| PAGEDSERVE_DISABLE_FUSIONS | disabled_fusions | comma list of FUSIONS, or all |
| PAGEDSERVE_MIXED_SPLIT_TOKENS | mixed_split_tokens | 1024; 0: never split eager mixed steps |
| PAGEDSERVE_CPU_LINEAR | cpu_linear | onednn, packed, torch |
| PAGEDSERVE_CPU_KERNELS | cpu_kernels | native, avx2, avx512, torch |
| PAGEDSERVE_CPU_COMPILE | cpu_compile | auto, off |
| PAGEDSERVE_CACHE | cache_dir | $XDG_CACHE_HOME/pagedserve or ~/.cache/pagedserve |
| PAGEDSERVE_FLASH_CACHE_DIR | flash_cache_dir | flash_attn under cache_dir |
| PAGEDSERVE_MEMORY_REPORT | memory_report | a file: each GPU rank's profiled peak |
| PAGEDSERVE_STEP_TRACE | step_trace | a file prefix: one line per step, core and workers |
| PAGEDSERVE_MXFP4_EXPERTS | mxfp4_experts | dequantize, packed: gpt-oss's experts in MXFP4 (CUDA) |
| PAGEDSERVE_DRAFT_CUDA_GRAPHS | draft_cuda_graphs | 1 (default), 0: the drafter's own CUDA graphs |
| PAGEDSERVE_API_KEY | (secret) | the API key (else VLLM_API_KEY) |
| PAGEDSERVE_CURVE_KEY, PAGEDSERVE_CURVE_KEY_FILE | (secret) | multi-node CURVE key |
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

ATTENTION_OVERRIDES = ("torch", "sdpa", "triton", "flash")
CPU_KERNELS = ("native", "avx2", "avx512", "torch")  # kernels/cpu_native.py's variants, or none
FUSIONS = (
    "gemv", "gated-gemv", "rope-cache", "graph-head", "cascade", "fp8-fast-accum", "norm-quant",
    "l2-prefetch", "qkv-rope", "swiglu-gemm", "lora-gemv",
    "lora-swiglu",
    "moe-gemv",
    "mla-decode",
)  # fmt: skip
API_KEY_ENV = "PAGEDSERVE_API_KEY"
CURVE_KEY_ENV = "PAGEDSERVE_CURVE_KEY"
CURVE_KEY_FILE_ENV = "PAGEDSERVE_CURVE_KEY_FILE"


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = env.get(name) or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


def _fusions(env: Mapping[str, str]) -> tuple[str, ...]:
    raw = env.get("PAGEDSERVE_DISABLE_FUSIONS") or ""
    names = {name.strip() for name in raw.split(",") if name.strip()}
    unknown = names - {*FUSIONS, "all"}
    if unknown:
        raise ValueError(
            f"PAGEDSERVE_DISABLE_FUSIONS names {', '.join(sorted(unknown))}: not one of "
            f"{', '.join(FUSIONS)}, all"
        )
    return tuple(f for f in FUSIONS if f in names or "all" in names)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name) or str(default)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value


def default_cache_dir(env: Mapping[str, str]) -> str:
    base = env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "pagedserve")


@dataclass(frozen=True)
class Settings:
    """The engine's environment switches, validated; `None` means unset."""

    attention_backend: str | None = None
    disable_triton: bool = False
    disabled_fusions: tuple[str, ...] = ()
    mixed_split_tokens: int = 1024
    cpu_linear: str = "onednn"
    cpu_kernels: str = "native"
    cpu_compile: str = "auto"
    cache_dir: str = ""
    flash_cache_dir: str = ""
    memory_report: str | None = None
    step_trace: str | None = None
    mxfp4_experts: str = "dequantize"
    draft_cuda_graphs: bool = True
    launch_t0: float | None = None  # set by `launch` (not the environment): start-up timings

    def __post_init__(self) -> None:
        if self.attention_backend not in (None, *ATTENTION_OVERRIDES):
            raise ValueError(
                f"PAGEDSERVE_ATTENTION_BACKEND={self.attention_backend!r} is not one of "
                f"{', '.join(ATTENTION_OVERRIDES)}"
            )
        unknown = set(self.disabled_fusions) - set(FUSIONS)
        assert not unknown, unknown

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        cache_dir = env.get("PAGEDSERVE_CACHE") or default_cache_dir(env)
        return cls(
            attention_backend=env.get("PAGEDSERVE_ATTENTION_BACKEND") or None,
            disable_triton=env.get("PAGEDSERVE_DISABLE_TRITON", "0") not in ("", "0"),
            disabled_fusions=_fusions(env),
            mixed_split_tokens=_int(env, "PAGEDSERVE_MIXED_SPLIT_TOKENS", 1024),
            cpu_linear=_choice(env, "PAGEDSERVE_CPU_LINEAR", ("onednn", "packed", "torch")),
            cpu_kernels=_choice(env, "PAGEDSERVE_CPU_KERNELS", CPU_KERNELS),
            cpu_compile=_choice(env, "PAGEDSERVE_CPU_COMPILE", ("auto", "off")),
            cache_dir=cache_dir,
            flash_cache_dir=env.get("PAGEDSERVE_FLASH_CACHE_DIR")
            or os.path.join(cache_dir, "flash_attn"),
            memory_report=env.get("PAGEDSERVE_MEMORY_REPORT") or None,
            step_trace=env.get("PAGEDSERVE_STEP_TRACE") or None,
            mxfp4_experts=_choice(env, "PAGEDSERVE_MXFP4_EXPERTS", ("dequantize", "packed")),
            draft_cuda_graphs=_choice(env, "PAGEDSERVE_DRAFT_CUDA_GRAPHS", ("1", "0")) == "1",
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> Settings:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - fields
        assert not unknown, unknown
        args = dict(values)
        args["disabled_fusions"] = tuple(args.get("disabled_fusions", ()))
        return cls(**args)

    def fusion_enabled(self, name: str) -> bool:
        """Whether the fusion or fast path `name` (one of FUSIONS) is on (the default)."""
        assert name in FUSIONS, name
        return name not in self.disabled_fusions


_active: Settings | None = None


def activate(settings: Settings) -> None:
    """Install the config's settings in this process: a process main calls it once at start-up,
    right after decoding its config (which may already have looked up the cache directory in
    the same environment). From then on the config's settings are the process's."""
    global _active
    _active = settings


def forget() -> None:
    """Tests that change the environment: read it again on the next `current()`."""
    global _active
    _active = None


def current() -> Settings:
    """This process's settings: the config's once `activate` ran, else read from the
    environment on first use (code run outside an engine: tests, benchmarks, `python -m`)."""
    global _active
    if _active is None:
        _active = Settings.from_env()
    return _active


def api_key_from_env(env: Mapping[str, str] | None = None, vllm_too: bool = True) -> str | None:
    """The API key: PAGEDSERVE_API_KEY, else (for `launch`'s default) vLLM's VLLM_API_KEY. An API
    server reads only the first: `launch` hands it the key it settled on."""
    env = os.environ if env is None else env
    return env.get(API_KEY_ENV) or (env.get("VLLM_API_KEY") if vllm_too else None) or None


def curve_key_from_env(env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(the key's 64 hex digits, a file holding them): whichever the environment gives."""
    env = os.environ if env is None else env
    return env.get(CURVE_KEY_ENV) or None, env.get(CURVE_KEY_FILE_ENV) or None


def runtime_lora_updating_from_env(env: Mapping[str, str] | None = None) -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (1 or true): the default of `launch`'s
    --allow-runtime-lora-updating."""
    env = os.environ if env is None else env
    return env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
