"""The flags of `pagedserve serve MODEL` / `pagedserve launch --model MODEL`, named as vLLM names
them so users' scripts and Helm charts carry over. Each flag has real behaviour; where it names
something pagedserve lacks (`--no-enable-chunked-prefill`) the config refuses it in one line.

`engine_kwargs(args)` turns the parsed flags into `build_engine_config`'s keyword arguments;
`LaunchOptions` (entrypoints/launcher.py) takes the rest, which concern the HTTP servers.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from pagedserve import settings
from pagedserve.kernels.attention.registry import REQUESTABLE_BACKENDS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `512M`, `2G`, `1.5GiB` (binary multiples)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (like 512M or 2G)")
    number, unit = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    return int(float(number) * 1024**power)


def _bounded(kind: type, ok: Any, what: str) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} must be {what}")
        return value

    return parse


_positive_int = _bounded(int, lambda v: v >= 1, "at least 1")
_non_negative_int = _bounded(int, lambda v: v >= 0, ">= 0")
_non_negative_float = _bounded(float, lambda v: v >= 0, ">= 0")
_positive_float = _bounded(float, lambda v: v > 0, "> 0")


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _str_list(text: str) -> list[str]:
    """vLLM's JSON list (`'["https://a.example"]'`) or a comma-separated list."""
    if text.strip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"{text!r} is not a list of strings")
        return items
    return [item.strip() for item in text.split(",") if item.strip()]


def add_model_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--served-model-name", nargs="+", help="names clients use; the first is the one responses "
      "carry (default: the model as given)")  # fmt: skip
    a("--tokenizer", help="tokenizer directory or hub id (default: the model's)")
    a("--revision", help="hub branch, tag or commit of the model (default: main)")
    a("--download-dir", help="hub cache directory (default: huggingface_hub's, under HF_HOME)")
    a("--trust-remote-code", action="store_true", help="let the tokenizer run the model's code")
    a("--generation-config", default="auto", help="auto: sampling defaults from the model's "
      "generation_config.json; vllm: none; or a directory holding one")  # fmt: skip
    a("--max-model-len", type=int)
    a("--dtype", default="auto")
    a("--load-format", default="auto")
    a("--quantization", "-q", help="fp8: quantize a plain checkpoint's weights at load time "
      "(FP8 checkpoints are detected from their config)")  # fmt: skip
    a("--kv-cache-dtype", default="auto", help="auto (model dtype) or fp8 (e4m3)")
    a("--seed", type=int, default=0, help="seed of requests that bring none")
    a("--runner", default="auto", help="auto, generate or pooling (embeddings, classification, "
      "scores: docs/pooling.md); auto: pooling for sentence-transformers and "
      "*ForSequenceClassification checkpoints")  # fmt: skip
    a("--convert", default="auto", help="pooling task: embed or classify (auto: from the model)")
    a("--pooler-config", help="JSON: pooling_type (LAST, MEAN, CLS), normalize, "
      "classifier_from_token, is_matryoshka")  # fmt: skip


def add_engine_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    a("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1)
    a("-dp", "--data-parallel-size", dest="dp", type=_positive_int, default=1,
      help="engine cores on this host, each with its own tp x pp GPUs (core i: GPUs "
      "[i*tp*pp, (i+1)*tp*pp)); requests go to the core holding their prefix")  # fmt: skip
    a("--disable-custom-all-reduce", action="store_true", help="NCCL for every tensor-parallel "
      "all-reduce (default: small ones one-shot over NVLink)")  # fmt: skip
    a("--pp-layer-partition", type=int_list, help="layers per pipeline stage, e.g. 20,12")
    a("--nnodes", type=_positive_int, default=1, help="machines in one TP x PP group")
    a("--node-rank", type=_non_negative_int, default=0, help="0 runs the engine and API servers")
    a("--master-addr", default="127.0.0.1", help="address of node 0 (multi-node)")
    a("--master-port", type=_positive_int, help="node 0's rendezvous port (multi-node; it also "
      "uses the next two ports for the step plans and results)")  # fmt: skip
    a("--max-num-seqs", type=int, help="requests running at once (256)")
    a("--max-num-batched-tokens", type=int,
      help="tokens per step (8192; 512 for a served engine with --pp > 1)")  # fmt: skip
    a("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
      help="always on (long prompts are split over steps); --no-... is refused")  # fmt: skip
    a("--block-size", type=int, default=16)
    a("--gpu-memory-utilization", type=float, default=0.9)
    a("--kv-cache-memory", type=parse_size, help="KV cache size in bytes (512M, 2G)")
    a(
        "--kv-offloading-size",
        type=float,
        help="GiB of host memory per worker for a second KV "
        "tier: swap on preemption, evicted prefix blocks (off by default; docs/kv-offloading.md)",
    )
    a("--swap-space", type=float, help="vLLM's older name of --kv-offloading-size")
    a("--preemption-mode", choices=["swap", "recompute"],
      help="with a host KV tier: force one (default: chosen by measured cost)")  # fmt: skip
    a("--device", default="auto")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    a("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    a("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
      help="plan step N+1 while step N runs (one pipeline stage only)")  # fmt: skip
    a("--enforce-eager", action="store_true", help="no CUDA graphs, no compiled CPU forward")
    a(
        "--speculative-config",
        help="speculative decoding, vLLM's JSON keys, e.g. '{\"method\": "
        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (methods: ngram, '
        "suffix, draft_model, eagle, eagle3)",
    )
    a("--attention-backend", default="auto", choices=list(REQUESTABLE_BACKENDS),
      help="flash: FlashAttention 4 (flash-attn-4); auto: triton, or per step kind the backend "
      "measured faster on this GPU (kernels/attention/attention_choice.json)")  # fmt: skip
    a(
        "--max-waiting",
        type=_non_negative_int,
        help="refuse requests (503 + Retry-After) while this many wait (default: no bound)",
    )
    a(
        "--step-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds one engine step may take before the engine is declared dead (stuck worker)",
    )
    a(
        "--max-grammar-compile-seconds",
        type=_positive_float,
        default=10.0,
        help="a structured-output grammar (JSON schema, regex, ...) that takes longer to compile "
        "is refused with a 400; other grammars compile meanwhile",
    )


def add_server_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--host", default="0.0.0.0")
    a("--port", type=int, default=8000, help="0 picks a free port")
    a("--api-servers", type=_positive_int, default=1, help="API server processes on one port")
    a(
        "--api-key",
        default=settings.api_key_from_env(),
        help="or PAGEDSERVE_API_KEY (else VLLM_API_KEY)",
    )
    a("--chat-template", help="the chat template: a file, or the template itself")
    a("--trust-request-chat-template", action="store_true",
      help="let requests bring their own chat_template (rendered under a time limit)")  # fmt: skip
    a("--log-level", default="info", choices=LOG_LEVELS)
    a("--uvicorn-log-level", choices=[*LOG_LEVELS, "trace"], help="default: --log-level")
    a("--disable-log-requests", dest="log_requests", action="store_false",
      help="no log line per request (default: method, path, status, tokens, latency)")  # fmt: skip
    a("--log-prompts", "--log-requests", "--enable-log-requests", dest="log_prompts",
      action="store_true", help="put each request's prompt text in its log line")  # fmt: skip
    a("--log-stats-interval", type=_positive_float, default=10.0,
      help="seconds between the engine's stats lines (throughput, queues, KV cache)")  # fmt: skip
    a("--disable-log-stats", action="store_true", help="no engine stats lines")
    a("--allowed-origins", type=_str_list, help="CORS: origins browsers may call from, as a JSON "
      "list or comma-separated ('*': any); default: no CORS headers")  # fmt: skip
    a("--ssl-keyfile", help="serve HTTPS with this key (and --ssl-certfile)")
    a("--ssl-certfile")
    a("--root-path", default="", help="the path prefix a proxy serves the API under")
    a("--enable-auto-tool-choice", action="store_true",
      help="tool_choice auto: parse tool calls (needs --tool-call-parser)")  # fmt: skip
    a("--tool-call-parser",
      choices=["hermes", "llama3_json", "mistral", "qwen3_coder", "qwen3_xml", "openai"],
      help="the model's tool-call format (hermes: Qwen2.5/Qwen3/Qwen3-Next; qwen3_coder: "
      "Qwen3-Coder/Qwen3.5; openai: gpt-oss's harmony)")  # fmt: skip
    a("--reasoning-parser", choices=["qwen3", "deepseek_r1", "openai_gptoss"],
      help="move <think>...</think> into reasoning_content")  # fmt: skip
    a(
        "--drain-timeout",
        type=_non_negative_float,
        default=30.0,
        help="on SIGTERM, seconds running requests may take to finish before they are aborted",
    )
    a("--max-request-bytes", type=parse_size, default=4 << 20,
      help="largest request body (4M); bigger bodies get 413")  # fmt: skip
    add_guard_args(p)


def add_guard_args(p: argparse.ArgumentParser) -> None:
    """Flags of `launch` that its API servers take as they are (`guard_argv`): connections
    (frontend/openai/connections.py), what one client may learn of another's requests, and the
    Responses API's store."""
    a = p.add_argument
    a("--timeout-header", type=_positive_float, default=30.0,
      help="seconds a client may take to send a request's headers (from connecting, or from the "
      "request's first byte); then the connection is closed (408)")  # fmt: skip
    a("--timeout-body", type=_positive_float, default=60.0,
      help="seconds a client may take to send a request's body after its headers "
      "(then 408)")  # fmt: skip
    a("--max-connections", type=_positive_int, default=4096,
      help="client connections per API server (lowered to fit `ulimit -n`); beyond it the oldest "
      "idle connection is closed, or new requests get 503 (/health never does)")  # fmt: skip
    a("--enable-prompt-tokens-details", action="store_true",
      help="report usage.prompt_tokens_details.cached_tokens (off: cache hits would tell a "
      "client what other clients' prompts hold)")  # fmt: skip
    a("--cache-salt-by", choices=["none", "user", "api-key"], default="none",
      help="salt each request's prefix cache by its `user` field or the API key it sent, so "
      "only that tenant's requests share cached blocks (none: only their own "
      "cache_salt)")  # fmt: skip
    a("--metrics-public", action="store_true",
      help="serve /metrics without the API key (default: it needs the key when one "
      "is set)")  # fmt: skip
    a("--responses-store-size", type=_non_negative_int, default=1024,
      help="Responses API: responses kept for GET and previous_response_id, per API server "
      "(least recently used leave first; 0: none)")  # fmt: skip
    a("--responses-store-max-age", type=_positive_float, default=3600.0,
      help="Responses API: seconds a stored response is kept after its last use")  # fmt: skip


def guard_argv(args: argparse.Namespace) -> list[str]:
    """The `add_guard_args` flags of `args`, as an API server's command line."""
    argv = [
        "--timeout-header", str(args.timeout_header),
        "--timeout-body", str(args.timeout_body),
        "--max-connections", str(args.max_connections),
        "--cache-salt-by", args.cache_salt_by,
        "--responses-store-size", str(args.responses_store_size),
        "--responses-store-max-age", str(args.responses_store_max_age),
    ]  # fmt: skip
    for flag in ("enable_prompt_tokens_details", "metrics_public"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    return argv


def _lora_module(text: str) -> str | dict[str, Any]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if not text.strip().startswith("{"):
        return text
    try:
        item = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object") from None
    if not isinstance(item, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return item


def add_lora_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--enable-lora", action="store_true", help="serve LoRA adapters of the base model")
    a("--lora-modules", nargs="+", type=_lora_module, help="adapters served from the start: "
      "name=path, or JSON {\"name\", \"path\", \"base_model_name\"}")  # fmt: skip
    a("--max-loras", type=_positive_int, default=1, help="adapters in one batch (GPU slots)")
    a("--max-lora-rank", type=_positive_int, default=16, help="largest adapter rank")
    a("--max-cpu-loras", type=_positive_int, help="adapters kept in host memory (>= max-loras)")
    a("--lora-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    a("--allow-runtime-lora-updating", action="store_true",
      default=settings.runtime_lora_updating_from_env(),
      help="open /v1/load_lora_adapter and /v1/unload_lora_adapter (or "
      "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")  # fmt: skip
    a("--lora-allowed-dirs", nargs="+", help="runtime loads only from under these directories")


def add_launch_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_engine_args(p)
    add_lora_args(p)
    add_server_args(p)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`build_engine_config` keyword arguments from the parsed flags."""
    return dict(
        tokenizer=args.tokenizer,
        revision=args.revision,
        download_dir=args.download_dir,
        served_model_name=args.served_model_name,
        trust_remote_code=args.trust_remote_code,
        generation_config=args.generation_config,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        load_format=args.load_format,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        runner=args.runner,
        convert=args.convert,
        pooler_config=args.pooler_config,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        pp_layer_partition=args.pp_layer_partition,
        data_parallel_size=args.dp,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        kv_offloading_size=args.kv_offloading_size,
        swap_space=args.swap_space,
        preemption_mode=args.preemption_mode,
        device=args.device,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        max_waiting=args.max_waiting,
        step_timeout=args.step_timeout,
        max_grammar_compile_seconds=args.max_grammar_compile_seconds,
        async_scheduling=args.async_scheduling,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        enable_lora=args.enable_lora,
        lora_modules=args.lora_modules,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_dtype=args.lora_dtype,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_allowed_dirs=args.lora_allowed_dirs,
        speculative_config=args.speculative_config,
    )
