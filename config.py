"""Engine configuration: one frozen dataclass per area, combined into `EngineConfig`.

Pure Python (json only), so the core can use it. Every value a user can set is checked in
`__post_init__` with a message that names the flag. Configs travel to child processes as JSON
(`EngineConfig.to_json`); derived fields are recomputed on the other side.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from pagedserve.gguf_checkpoint import find_gguf_file, gguf_metadata_dir
from pagedserve.hf_config import (
    GENERATION_SAMPLING_KEYS,
    MLA_MODEL_TYPES,
    check_fp8_model,
    has_recurrent_state,
    kv_cache_groups,
    read_generation_config,
    read_hf_config,
    text_config,
)
from pagedserve.kernels.attention.registry import check_requested
from pagedserve.lora_config import LoRAConfig
from pagedserve.parallel_config import ParallelConfig
from pagedserve.pooling_config import PoolingConfig, position_offset, resolve_pooling
from pagedserve.quant_config import Fp8Scheme, kv_cache_is_fp8, quant_scheme
from pagedserve.settings import Settings
from pagedserve.speculative_config import SpeculativeConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"  # "auto" (safetensors or GGUF, as found) | "dummy" (random weights)
    seed: int = 0
    tokenizer: str | None = None
    served_model_name: str | list[str] | None = None  # the first is the name in responses
    enforce_eager: bool = False  # no CUDA graphs, no compiled CPU forward
    # "auto": sampling defaults from the model's generation_config.json; "vllm": the engine's
    # own; else a directory whose generation_config.json is read instead (EOS ids included).
    generation_config: str = "auto"
    trust_remote_code: bool = False  # the tokenizer may run the checkpoint's own Python code
    quantization: str | None = None  # "fp8": quantize a plain checkpoint's weights at load time
    attention_backend: str = "auto"  # REQUESTABLE_BACKENDS (kernels/attention/registry.py)
    # pooling models (pooling_config.py): vLLM's --runner, --convert and --pooler-config
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict[str, Any] | None = None
    # Derived from config.json in __post_init__:
    # Derived in __post_init__: the GGUF file `model` names (None: an HF directory), the directory
    # holding config.json and the tokenizer (`model`, or the GGUF file's converted metadata), and
    # its config.json.
    gguf_file: str | None = field(init=False, repr=False, compare=False)
    hf_dir: str = field(init=False, repr=False, compare=False)
    hf: dict[str, Any] = field(init=False, repr=False, compare=False)
    quant: Fp8Scheme | None = field(init=False, repr=False, compare=False)
    pooling: PoolingConfig | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        gguf_file = find_gguf_file(self.model)
        object.__setattr__(self, "gguf_file", gguf_file)
        hf_dir = gguf_metadata_dir(gguf_file) if gguf_file else self.model
        object.__setattr__(self, "hf_dir", hf_dir)
        object.__setattr__(self, "hf", text_config(read_hf_config(self.hf_dir)))
        dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if dtype not in _DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose one of {', '.join(_DTYPES)}")
        object.__setattr__(self, "dtype", dtype)
        check_requested(self.attention_backend)  # one of kernels/attention/registry.py's
        object.__setattr__(self, "quant", quant_scheme(self.hf, self.quantization))
        pooling = resolve_pooling(hf_dir, self.hf, self.runner, self.convert, self.pooler_config)
        object.__setattr__(self, "pooling", pooling)
        if self.quant is not None:
            check_fp8_model(self.hf, self.quant, self.quantization)
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"--load-format {self.load_format!r}: choose auto or dummy")
        if self.load_format == "gguf" and gguf_file is None:
            raise ValueError(f"--load-format gguf: --model {self.model!r} is no GGUF file")
        if self.load_format == "safetensors" and gguf_file is not None:
            raise ValueError(f"--load-format safetensors: --model {self.model!r} is a GGUF file")
        limit = (self.hf.get("max_position_embeddings") or 2048) - position_offset(self.hf)
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", int(limit))
        elif self.max_model_len < 1:
            raise ValueError("--max-model-len must be at least 1")
        elif self.max_model_len > limit:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in self.hf:
                raise ValueError(f"{self.hf_dir}/config.json lacks {key!r}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(self.generation_config, "generation_config.json")
        ):
            raise ValueError(
                f"--generation-config {self.generation_config!r}: choose auto, vllm or a "
                "directory holding a generation_config.json"
            )
        if isinstance(self.served_model_name, list) and not self.served_model_name:
            raise ValueError("--served-model-name needs at least one name")

    @property
    def names(self) -> list[str]:
        """Every name clients may use for the model; the first is the one responses carry."""
        names = self.served_model_name or self.model
        return [names] if isinstance(names, str) else list(names)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.hf_dir

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        raw = self.hf.get("torch_dtype") or self.hf.get("dtype") or "float32"
        return raw if raw in _DTYPES else "float32"

    @property
    def num_layers(self) -> int:
        return int(self.hf["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.hf["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.hf.get("head_dim") or self.hf["hidden_size"] // self.num_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.hf["vocab_size"])

    @property
    def generation_values(self) -> dict[str, Any]:
        """The generation_config.json in effect (the model's, or --generation-config DIR's)."""
        if self.generation_config in ("auto", "vllm"):
            return read_generation_config(self.hf_dir)
        return read_generation_config(self.generation_config)

    @property
    def default_sampling(self) -> dict[str, Any]:
        """SamplingParams keyword arguments generation_config sets ({} with "vllm"): what a
        request that leaves them unset gets, as in vLLM."""
        if self.generation_config == "vllm":
            return {}
        values = self.generation_values
        out = {k: values[k] for k in GENERATION_SAMPLING_KEYS if values.get(k) is not None}
        if "max_new_tokens" in out:
            out["max_tokens"] = out.pop("max_new_tokens")
        return out

    @property
    def kv_group_windows(self) -> list[int | None]:
        """Each KV cache group's window (None: global), what the core keeps block accounts by."""
        return [group.window for group in kv_cache_groups(self.hf)]

    @property
    def eos_token_ids(self) -> list[int]:
        """Every EOS id of generation_config.json (preferred) or config.json (Llama-3 Instruct
        lists three: a chat turn ends with the last)."""
        eos = self.generation_values.get("eos_token_id")
        if eos is None:
            eos = self.hf.get("eos_token_id")
        if eos is None:
            return []
        return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; required meaning on CPU, an override on GPU
    num_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "fp8" (e4m3, per-tensor scales)
    kv_offloading_size: float | None = None  # GiB of host KV tier per worker (None: off)

    def __post_init__(self) -> None:
        kv_cache_is_fp8(self.kv_cache_dtype)  # validates the name
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size {self.block_size}: must be a power of two")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("--kv-cache-memory must be positive")
        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ValueError("--kv-offloading-size must be a positive number of GiB")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError("num_blocks_override must be at least 1")

    @property
    def kv_fp8(self) -> bool:
        return kv_cache_is_fp8(self.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    policy: str = "fcfs"  # "fcfs" | "priority"
    max_waiting: int | None = None  # None: unbounded; else AddRequests beyond it are refused
    step_timeout: float = 600.0  # seconds a step may take before the engine is declared dead
    async_scheduling: bool = True  # plan step N+1 while step N runs (single pipeline stage)
    # a grammar whose compile runs longer is refused (a 400 naming the limit); others go on
    max_grammar_compile_seconds: float = 10.0
    preemption_mode: str | None = None  # "swap" | "recompute" (None: by cost, with a host tier)

    def __post_init__(self) -> None:
        if self.preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"--preemption-mode {self.preemption_mode!r}: swap or recompute")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError("--max-waiting must be >= 0")
        if not self.max_grammar_compile_seconds > 0:
            raise ValueError("--max-grammar-compile-seconds must be positive")
        if not self.step_timeout > 0:
            raise ValueError("--step-timeout must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be at least 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy {self.policy!r}: choose fcfs or priority")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # every PAGEDSERVE_* switch, read once where the config is built (settings.py says why)
    settings: Settings = field(default_factory=Settings.from_env)
    lora: LoRAConfig | None = None  # None: no LoRA adapters (--enable-lora turns it on)
    speculative: SpeculativeConfig | None = None  # --speculative-config (speculative_config.py)

    def __post_init__(self) -> None:
        mc, tp = self.model, self.parallel.tensor_parallel_size
        if self.lora is not None and mc.quant is not None:
            raise ValueError("--enable-lora: LoRA on FP8 weights is not supported yet")
        if self.lora is not None and mc.hf.get("model_type") in MLA_MODEL_TYPES:
            raise ValueError("--enable-lora: LoRA on DeepseekV3 (MLA) models is not supported yet")
        sizes = {
            "attention heads": mc.num_heads,
            "intermediate size": int(mc.hf.get("intermediate_size", tp)),
            "vocabulary size": mc.vocab_size,
        }
        if has_recurrent_state(mc.hf):
            sizes["linear-attention key heads"] = int(mc.hf["linear_num_key_heads"])
            sizes["linear-attention value heads"] = int(mc.hf["linear_num_value_heads"])
        for what, size in sizes.items():
            if size % tp:
                raise ValueError(f"--tp {tp} does not divide the model's {what} ({size})")
        kv = mc.num_kv_heads
        if kv % tp and tp % kv:
            raise ValueError(f"--tp {tp} and the model's {kv} KV heads: one must divide the other")
        pp = self.parallel.pipeline_parallel_size
        if pp > mc.num_layers:
            raise ValueError(f"--pp {pp} exceeds the model's {mc.num_layers} layers")
        if self.speculative is not None:
            self.speculative.check_engine(mc, tp, pp)

    @property
    def max_model_len(self) -> int:
        assert self.model.max_model_len is not None
        return self.model.max_model_len

    @property
    def pipelined_async(self) -> bool:
        """Async scheduling with several pipeline stages: while fewer requests run than there are
        stages, a plan may decode a token still in flight; the last stage sends each step's
        sampled ids to the first on the device (worker/stage_tokens.py). Not with speculative
        decoding or pooling models (their rows' tokens are not one sample per step)."""
        return (
            self.scheduler.async_scheduling
            and self.parallel.pipeline_parallel_size > 1
            and self.speculative is None
            and self.model.pooling is None
        )

    def core_configs(self) -> list[EngineConfig]:
        """One config per data parallel core: its `parallel.data_parallel_rank`, and with several
        cores, per-core files for the step trace and memory report (`FILE.dp1.worker0`)."""
        size = self.parallel.data_parallel_size
        if size == 1:
            return [self]
        out = []
        for i in range(size):
            s = self.settings
            files = {
                name: f"{path}.dp{i}"
                for name in ("step_trace", "memory_report")
                if (path := getattr(s, name)) is not None
            }
            settings = dataclasses.replace(s, **files)
            out.append(dataclasses.replace(self, parallel=self.parallel.core(i), settings=settings))
        return out

    @property
    def num_state_slots(self) -> int | None:
        """Recurrent-state slots of a model with linear attention (None: it keeps none): one per
        request `max_num_seqs` lets run; the workers' memory profile reserves them before KV."""
        return self.scheduler.max_num_seqs if has_recurrent_state(self.model.hf) else None

    def to_json(self) -> str:
        def init_fields(obj: Any) -> dict[str, Any] | None:
            if obj is None:  # an area that is off (lora)
                return None
            return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}

        return json.dumps(
            {
                f.name: None
                if getattr(self, f.name) is None
                else init_fields(getattr(self, f.name))
                for f in dataclasses.fields(self)
            }
        )

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        raw = json.loads(text)
        return cls(
            model=ModelConfig(**raw["model"]),
            cache=CacheConfig(**raw["cache"]),
            scheduler=SchedulerConfig(**raw["scheduler"]),
            parallel=ParallelConfig(**raw["parallel"]),
            settings=Settings.from_dict(raw["settings"]),
            lora=LoRAConfig(**raw["lora"]) if raw.get("lora") else None,
            speculative=SpeculativeConfig(**raw["speculative"]) if raw.get("speculative") else None,
        )
