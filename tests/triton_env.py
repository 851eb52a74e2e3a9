"""What the Triton test modules share: whether Triton and a GPU are here, and the `tiny` mark.

Without a GPU the kernels run under Triton's interpreter: tests/conftest.py sets
`TRITON_INTERPRET=1` before any test module imports triton (Triton reads it when it first
decorates a kernel). `tiny` skips only if triton was imported uninterpreted before conftest ran.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
RUNNABLE = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
tiny = pytest.mark.skipif(not RUNNABLE, reason="triton was imported without the interpreter")
