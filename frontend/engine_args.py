"""vLLM-style engine keyword arguments -> `EngineConfig` (shared by `LLM(...)` and the CLI).

Every argument has its default in `ENGINE_ARGS`; a name not there raises TypeError (a typo or a
vLLM argument we lack must not be silently dropped). The model and tokenizer may be hub ids
(`frontend/hub.py`): they are resolved to local directories here, once, so the processes started
later only ever see directories; the served name stays what the user typed.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.frontend.hub import resolve_model
from pagedserve.lora_checkpoint import read_adapter
from pagedserve.lora_config import LoRAConfig
from pagedserve.parallel_config import ParallelConfig
from pagedserve.speculative_config import SpeculativeConfig

ENGINE_ARGS: dict[str, Any] = {
    # model and tokenizer
    "tokenizer": None, "revision": None, "download_dir": None, "served_model_name": None,
    "trust_remote_code": False, "generation_config": "auto", "dtype": "auto",
    "max_model_len": None, "load_format": "auto", "seed": 0, "enforce_eager": False,
    "quantization": None, "attention_backend": "auto",
    "runner": "auto", "convert": "auto", "pooler_config": None,
    # KV cache
    "block_size": 16, "enable_prefix_caching": True, "gpu_memory_utilization": 0.9,
    "kv_cache_memory": None, "num_gpu_blocks_override": None, "kv_cache_dtype": "auto",
    "kv_offloading_size": None, "swap_space": None, "preemption_mode": None,
    # scheduler
    "max_num_seqs": None, "max_num_batched_tokens": None, "scheduling_policy": "fcfs",
    "max_waiting": None, "step_timeout": None, "async_scheduling": True,
    "enable_chunked_prefill": None, "max_grammar_compile_seconds": 10.0,
    # parallelism
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "device": "auto", "nnodes": 1,
    "node_rank": 0, "master_addr": "127.0.0.1", "master_port": None, "pp_layer_partition": None,
    "data_parallel_size": 1, "disable_custom_all_reduce": False,
    # LoRA adapters
    "enable_lora": False, "max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None,
    "lora_dtype": "auto", "lora_modules": None, "allow_runtime_lora_updating": False,
    "lora_allowed_dirs": None,
    # speculative decoding: a dict (or JSON text) of vLLM's keys (speculative_config.py)
    "speculative_config": None,
}  # fmt: skip


MAX_NUM_BATCHED_TOKENS = 8192  # tokens per step unless set
# ... and for a served engine of pipeline stages (`launch --pp P`, P > 1). A micro-batch's step
# passes every stage before its next can start, so a step that carries a whole prompt (hundreds
# of tokens beside the decodes) holds its micro-batch back by that prompt's time on each stage,
# while the stages idle waiting for it: a bubble every decoding request feels in its TPOT. With
# 512 tokens a step a prompt is cut into chunks spread over the micro-batches. Measured on four
# H200s (70B shape, `launch --tp 2 --pp 2` under `bench serve` at 8 req/s, docs/parallelism.md):
# TPOT p50 / p99 42.3 / 51.5 ms at 8192, 42.1 / 51.2 at 2048, 36.3 / 41.5 and 36.3 / 41.3 at 512;
# offline (`bench throughput`, every prompt at once) 512 costs 7% (10.86 req/s against 11.68), so
# `LLM` and the benchmarks keep 8192.
SERVE_PIPELINE_MAX_NUM_BATCHED_TOKENS = 512


def check_engine_kwargs(kw: dict[str, Any], caller: str = "LLM()") -> None:
    unknown = sorted(set(kw) - set(ENGINE_ARGS))
    if unknown:
        raise TypeError(f"{caller} got an unexpected keyword argument {unknown[0]!r}")


def build_engine_config(model: str, *, serving: bool = False, **kw: Any) -> EngineConfig:
    """An EngineConfig from vLLM-style keyword arguments (see `ENGINE_ARGS`); `serving`: for
    `launch` (the defaults of an online server where they differ from offline use, as vLLM's
    usage context sets them)."""
    check_engine_kwargs(kw)
    a = {**ENGINE_ARGS, **kw}
    batched = MAX_NUM_BATCHED_TOKENS
    if serving and a["pipeline_parallel_size"] > 1:
        batched = SERVE_PIPELINE_MAX_NUM_BATCHED_TOKENS
    if a["enable_chunked_prefill"] is False:
        raise ValueError(
            "chunked prefill cannot be turned off: the scheduler always splits long prompts "
            "over steps (one token budget per step)"
        )
    path = resolve_model(model, a["revision"], a["download_dir"])
    tokenizer = a["tokenizer"]
    if tokenizer is not None:
        tokenizer = resolve_model(tokenizer, None, a["download_dir"], flag="--tokenizer")
    config = EngineConfig(
        model=ModelConfig(
            model=path,
            dtype=a["dtype"],
            max_model_len=a["max_model_len"],
            load_format=a["load_format"],
            seed=a["seed"],
            tokenizer=tokenizer,
            served_model_name=a["served_model_name"] or model,
            enforce_eager=a["enforce_eager"],
            generation_config=a["generation_config"],
            trust_remote_code=a["trust_remote_code"],
            quantization=a["quantization"],
            attention_backend=a["attention_backend"] or "auto",
            runner=a["runner"],
            convert=a["convert"],
            pooler_config=_json_dict(a["pooler_config"], "--pooler-config"),
        ),
        cache=CacheConfig(
            block_size=a["block_size"],
            enable_prefix_caching=a["enable_prefix_caching"],
            gpu_memory_utilization=a["gpu_memory_utilization"],
            kv_cache_memory=a["kv_cache_memory"],
            num_blocks_override=a["num_gpu_blocks_override"],
            kv_cache_dtype=a["kv_cache_dtype"] or "auto",
            kv_offloading_size=offloading_size(a),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=a["max_num_seqs"] or 256,
            max_num_batched_tokens=a["max_num_batched_tokens"] or batched,
            policy=a["scheduling_policy"],
            max_waiting=a["max_waiting"],
            step_timeout=a["step_timeout"] or 600.0,
            async_scheduling=a["async_scheduling"],
            max_grammar_compile_seconds=a["max_grammar_compile_seconds"],
            preemption_mode=a["preemption_mode"],
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=a["tensor_parallel_size"],
            pipeline_parallel_size=a["pipeline_parallel_size"],
            device=a["device"],
            nnodes=a["nnodes"],
            node_rank=a["node_rank"],
            master_addr=a["master_addr"],
            master_port=a["master_port"],
            pp_layer_partition=a["pp_layer_partition"],
            data_parallel_size=a["data_parallel_size"],
            disable_custom_all_reduce=a["disable_custom_all_reduce"],
        ),
        lora=lora_config(a),
        speculative=SpeculativeConfig.from_value(a["speculative_config"]),
    )
    if config.lora is not None:
        for name, path, _ in config.lora.lora_modules:
            read_adapter(name, path, config.model.hf, config.lora.max_lora_rank)
    return config


def offloading_size(a: dict[str, Any]) -> float | None:
    """GiB of host KV tier per worker: `kv_offloading_size`, or `swap_space` (vLLM's older name,
    whose 0 meant off); a swap preemption mode needs one."""
    size, swap = a["kv_offloading_size"], a["swap_space"]
    if size is not None and swap is not None and size != swap:
        raise ValueError("--kv-offloading-size and --swap-space name one size: give one")
    size = size if size is not None else (swap or None)
    if a["preemption_mode"] == "swap" and size is None:
        raise ValueError("--preemption-mode swap needs a host KV tier: --kv-offloading-size GiB")
    return size


def lora_config(a: dict[str, Any]) -> LoRAConfig | None:
    """The LoRA section (None without enable_lora); static adapters are checked against the
    model here, so a bad one stops the start with its name."""
    if not a["enable_lora"]:
        if a["lora_modules"]:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    modules = tuple(_lora_module(m) for m in a["lora_modules"] or ())
    return LoRAConfig(
        max_loras=a["max_loras"] or 1,
        max_lora_rank=a["max_lora_rank"] or 16,
        max_cpu_loras=a["max_cpu_loras"],
        lora_dtype=a["lora_dtype"] or "auto",
        lora_modules=modules,
        allow_runtime_lora_updating=bool(a["allow_runtime_lora_updating"]),
        lora_allowed_dirs=tuple(a["lora_allowed_dirs"] or ()),
    )


def _lora_module(item: Any) -> tuple[str, str, str | None]:
    """`name=path`, `(name, path)` or vLLM's JSON form `{"name", "path", "base_model_name"}`."""
    if isinstance(item, str):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object")
        return name, path, None
    if isinstance(item, dict):
        unknown = sorted(set(item) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules: unknown key {unknown[0]!r}")
        if not item.get("name") or not item.get("path"):
            raise ValueError(f"--lora-modules {item!r}: needs name and path")
        return str(item["name"]), str(item["path"]), item.get("base_model_name")
    name, path = item
    return str(name), str(path), None


def _json_dict(value: Any, flag: str) -> dict[str, Any] | None:
    """A dict, or its JSON text (a CLI flag's value)."""
    if value is None or isinstance(value, dict):
        return value
    try:
        value = json.loads(value)
    except (TypeError, json.JSONDecodeError):
        raise ValueError(f"{flag}: {value!r} is not a JSON object") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: {value!r} is not a JSON object")
    return value
