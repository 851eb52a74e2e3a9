"""pagedserve: an LLM serving engine with a paged KV cache and continuous batching.

The names below load lazily so that `import pagedserve.core` stays pure Python (no torch, no zmq).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "LLM", "SamplingParams", "StructuredOutputs", "StructuredOutputsParams", "RequestOutput",
    "CompletionOutput", "AsyncEngine", "LoRARequest", "PoolingParams",
]  # fmt: skip

_LAZY = {
    "LLM": "pagedserve.frontend.llm",
    "AsyncEngine": "pagedserve.frontend.async_engine",
    "RequestOutput": "pagedserve.frontend.outputs",
    "CompletionOutput": "pagedserve.frontend.outputs",
    "SamplingParams": "pagedserve.ipc.messages",
    "StructuredOutputs": "pagedserve.ipc.messages",
    "LoRARequest": "pagedserve.ipc.messages",
    "PoolingParams": "pagedserve.ipc.messages",
}


def __getattr__(name: str) -> Any:
    if name == "StructuredOutputsParams":  # vLLM's name
        name = "StructuredOutputs"
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
