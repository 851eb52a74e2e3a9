"""core/ is pure Python: importing every module of pagedserve.core pulls in no torch, zmq or
numpy (the EngineCore process must start fast and its tests must run anywhere)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pagedserve.core

FORBIDDEN = ("torch", "zmq", "numpy")

SCRIPT = f"""
import importlib, pkgutil, sys
import pagedserve.core
names = [m.name for m in pkgutil.iter_modules(pagedserve.core.__path__, "pagedserve.core.")]
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in {FORBIDDEN!r})
print(len(names), bad)
"""


def test_core_modules_import_no_heavy_dependencies():
    expected = sum(1 for _ in pkgutil.iter_modules(pagedserve.core.__path__))
    assert expected >= 5  # block_pool, kv_cache_manager, policy, request, scheduler, ...
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split(maxsplit=1)
    assert int(out[0]) == expected
    assert out[1].strip() == "[]", f"core imported {out[1].strip()}"
