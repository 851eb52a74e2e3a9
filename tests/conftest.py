"""Shared test set-up: tests/ on sys.path (for helper modules), GPU tests skip without a GPU,
and helpers to inspect the process table."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# One intra-op thread for this process and the servers it starts (before torch is imported): the
# test models are tiny, and on a 2-core machine running a test process, an engine core, API
# servers and workers, a second OpenMP thread makes each op wait at a barrier for a thread that
# is not scheduled (10-100x slower ops under load). Workers pick the same for themselves there.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Servers and runners in tests stay eager: a compiled CPU forward (worker/cpu_compile.py) would
# start a compiling child per model shape; tests/test_cpu_compile.py turns it on for itself.
os.environ.setdefault("PAGEDSERVE_CPU_COMPILE", "off")


def _interpret_triton_without_a_gpu() -> None:
    """Triton kernel tests run on a CPU under Triton's interpreter, which Triton reads when it
    first decorates a kernel: set it here, before any test module imports triton."""
    import importlib.util

    import torch  # does not import triton

    triton_pending = importlib.util.find_spec("triton") and "triton" not in sys.modules
    if triton_pending and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
