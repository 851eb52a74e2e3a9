"""vLLM-style engine keyword arguments -> `EngineConfig` (shared by `LLM(...)` and the CLI).

Every argument has its default in `ENGINE_ARGS`; a name not there raises TypeError (a typo or a
vLLM argument we lack must not be silently dropped). The model and tokenizer may be hub ids
(`frontend/hub.py`): they are resolved to local directories here, once, so the processes started
later only ever see directories; the served name stays what the user typed.
"""

from __future__ import annotations

from typing import Any

from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedserve.frontend.hub import resolve_model
from pagedserve.speculative_config import SpeculativeConfig

ENGINE_ARGS: dict[str, Any] = {
    # model and tokenizer
    "tokenizer": None, "revision": None, "download_dir": None, "served_model_name": None,
    "trust_remote_code": False, "generation_config": "auto", "dtype": "auto",
    "max_model_len": None, "load_format": "auto", "seed": 0, "enforce_eager": False,
    "quantization": None, "attention_backend": "auto",
    # KV cache
    "block_size": 16, "enable_prefix_caching": True, "gpu_memory_utilization": 0.9,
    "kv_cache_memory": None, "num_gpu_blocks_override": None, "kv_cache_dtype": "auto",
    # scheduler
    "max_num_seqs": None, "max_num_batched_tokens": None, "scheduling_policy": "fcfs",
    "max_waiting": None, "step_timeout": None, "async_scheduling": True,
    "enable_chunked_prefill": None, "max_grammar_compile_seconds": 10.0,
    # parallelism
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "device": "auto", "nnodes": 1,
    "node_rank": 0, "master_addr": "127.0.0.1", "master_port": None, "pp_layer_partition": None,
    # speculative decoding: a dict (or JSON text) of vLLM's keys (speculative_config.py)
    "speculative_config": None,
}  # fmt: skip


def check_engine_kwargs(kw: dict[str, Any], caller: str = "LLM()") -> None:
    unknown = sorted(set(kw) - set(ENGINE_ARGS))
    if unknown:
        raise TypeError(f"{caller} got an unexpected keyword argument {unknown[0]!r}")


def build_engine_config(model: str, **kw: Any) -> EngineConfig:
    """An EngineConfig from vLLM-style keyword arguments (see `ENGINE_ARGS`)."""
    check_engine_kwargs(kw)
    a = {**ENGINE_ARGS, **kw}
    if a["enable_chunked_prefill"] is False:
        raise ValueError(
            "chunked prefill cannot be turned off: the scheduler always splits long prompts "
            "over steps (one token budget per step)"
        )
    path = resolve_model(model, a["revision"], a["download_dir"])
    tokenizer = a["tokenizer"]
    if tokenizer is not None:
        tokenizer = resolve_model(tokenizer, None, a["download_dir"], flag="--tokenizer")
    return EngineConfig(
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
        ),
        cache=CacheConfig(
            block_size=a["block_size"],
            enable_prefix_caching=a["enable_prefix_caching"],
            gpu_memory_utilization=a["gpu_memory_utilization"],
            kv_cache_memory=a["kv_cache_memory"],
            num_blocks_override=a["num_gpu_blocks_override"],
            kv_cache_dtype=a["kv_cache_dtype"] or "auto",
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=a["max_num_seqs"] or 256,
            max_num_batched_tokens=a["max_num_batched_tokens"] or 8192,
            policy=a["scheduling_policy"],
            max_waiting=a["max_waiting"],
            step_timeout=a["step_timeout"] or 600.0,
            async_scheduling=a["async_scheduling"],
            max_grammar_compile_seconds=a["max_grammar_compile_seconds"],
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
        ),
        speculative=SpeculativeConfig.from_value(a["speculative_config"]),
    )
