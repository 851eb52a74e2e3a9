"""Every attention backend, by name: its capabilities and where its implementation lives.

The one list of backends. Config validation (`ModelConfig.attention_backend`), the CLI's
`--attention-backend` choices, the start-up choice (kernels/attention/selection.py) and the
model runner's step features (worker/step_features.py) all read it. A new backend is one entry
here and one module beside this file.

Pure Python: implementations are imported on first use (`BackendEntry.load`), so the API server
and the core, which validate the config, never import torch.

`PAGEDSERVE_ATTENTION_BACKEND=torch|sdpa|triton|flash` forces a backend over
`--attention-backend` (and, for `torch`, the reference KV-cache write too), read once per process.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve import settings
from pagedserve.kernels.attention.interface import BackendCaps

if TYPE_CHECKING:
    from pagedserve.kernels.attention.interface import PagedAttention

AUTO = "auto"  # per step kind, the measured faster of AUTO_CANDIDATES (CPU: sdpa)
AUTO_CANDIDATES = ("triton", "flash")


@dataclass(frozen=True)
class BackendEntry:
    name: str
    caps: BackendCaps
    impl: str  # "module:attribute" of its `PagedAttention`, imported on first use
    cuda_only: bool  # refused on other devices
    requestable: bool  # a `--attention-backend` value (else only the environment names it)
    available: str | None = None  # "module:function" saying whether it imports here
    missing: str = ""  # what it needs, said when `available` says no

    def load(self) -> PagedAttention:
        return _resolve(self.impl)

    def is_available(self) -> bool:
        return self.available is None or bool(_resolve(self.available)())


def _resolve(target: str):
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


_ANYWHERE = dict(fp8_cache=True, soft_cap=True, sinks=True, multi_token_queries=True)
BACKENDS: dict[str, BackendEntry] = {
    entry.name: entry
    for entry in (
        BackendEntry(  # the oracle: a Python loop over rows
            "torch",
            BackendCaps(cuda_graphs=False, cascade=False, float32=True, **_ANYWHERE),
            "pagedserve.kernels.attention.reference:paged_attention_ref",
            cuda_only=False,
            requestable=False,
        ),
        BackendEntry(  # CPUs: batched SDPA, decode rows in C++ (soft-capping, sinks: the reference)
            "sdpa",
            BackendCaps(cuda_graphs=False, cascade=False, float32=True, **_ANYWHERE),
            "pagedserve.kernels.attention.cpu:cpu_paged_attention",
            cuda_only=False,
            requestable=False,
        ),
        BackendEntry(
            "triton",
            BackendCaps(cuda_graphs=True, cascade=True, float32=True, **_ANYWHERE),
            "pagedserve.kernels.attention.triton:triton_paged_attention",
            cuda_only=True,
            requestable=True,
            available="pagedserve.kernels.backend:triton_available",
            missing="needs the triton package",
        ),
        BackendEntry(
            "flash",
            BackendCaps(
                cuda_graphs=True,
                cascade=False,
                fp8_cache=False,
                soft_cap=True,
                sinks=False,
                multi_token_queries=True,
                float32=False,
            ),  # fmt: skip
            "pagedserve.kernels.attention.flash:flash_paged_attention",
            cuda_only=True,
            requestable=True,
            available="pagedserve.kernels.attention.flash:flash_attn_available",
            missing="needs FlashAttention 4 (`pip install --pre flash-attn-4`, or "
            "tests/gpu/fa4_wheels.sh for a machine without network): flash_attn.cute does not "
            "import",
        ),
    )
}
ATTENTION_BACKENDS = tuple(BACKENDS)  # what PAGEDSERVE_ATTENTION_BACKEND may name
REQUESTABLE_BACKENDS = (AUTO, *(n for n, e in BACKENDS.items() if e.requestable))  # the CLI's


def get_backend(name: str) -> BackendEntry:
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}: choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    return BACKENDS[name]


def check_requested(name: str) -> None:
    """Refuse a `--attention-backend` value that is not a requestable backend or `auto`."""
    if name not in REQUESTABLE_BACKENDS:
        raise ValueError(
            f"--attention-backend {name!r}: choose one of {', '.join(REQUESTABLE_BACKENDS)}"
        )


def backend_caps(name: str) -> tuple[BackendCaps, ...]:
    """The capabilities of what `name` may run: one backend, or for `auto` each candidate (a
    step kind runs one of them)."""
    names = AUTO_CANDIDATES if name == AUTO else (name,)
    return tuple(get_backend(n).caps for n in names)


def forced_attention_backend() -> str | None:
    """The backend `PAGEDSERVE_ATTENTION_BACKEND` forces (settings.py), or None."""
    return settings.current().attention_backend
