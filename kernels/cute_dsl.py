"""Libraries over NVIDIA's CuTe DSL (FlashAttention 4's `flash_attn.cute`, quack's GEMMs):
whether they import here, and the set-up before their first import.

Compiled kernels: FA4 compiles each kernel variant (a key of dtype, head dims, GQA packing, tile,
split, varlen flags) on first use, seconds each. They are kept on disk, in
`$PAGEDSERVE_FLASH_CACHE_DIR` (default `flash_attn` under the cache directory, settings.py), so a
second start loads them instead of compiling: `prepare_cute_dsl` turns on FA4's (and quack's)
persistent cache before importing them.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from pagedserve import settings


def flash_cache_dir() -> str:
    return settings.current().flash_cache_dir


def _add_cutlass_path() -> None:
    """`nvidia-cutlass-dsl` puts its `cutlass` package on sys.path through a .pth file, which an
    install with `pip --target` (the GPU machine's) never runs: do what it does."""
    if importlib.util.find_spec("cutlass") is not None:
        return
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "dsl_packages")
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)


def cute_dsl_importable(package: str) -> bool:
    """Whether `package`, a library over the CuTe DSL (`flash_attn.cute`, `quack`), can be
    imported here (no CUDA needed to answer, nothing imported): also that `cutlass` has its `cute`
    package, which since nvidia-cutlass-dsl 4.6 comes in nvidia-cutlass-dsl-libs-core; without it
    `cutlass` is a namespace package of `_mlir` only."""
    if importlib.util.find_spec(package.split(".")[0]) is None:
        return False
    _add_cutlass_path()
    cutlass = importlib.util.find_spec("cutlass")
    roots = (cutlass.submodule_search_locations or []) if cutlass else []
    if not any(os.path.isdir(os.path.join(root, "cute")) for root in roots):
        return False
    return importlib.util.find_spec(package) is not None


def prepare_cute_dsl() -> None:
    """Before the first import of FA4 or quack (FA4 imports quack): `cutlass` on sys.path and
    both libraries' compiled kernels kept on disk under the cache directory (settings.py)."""
    _add_cutlass_path()
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", flash_cache_dir())
    os.environ.setdefault("QUACK_CACHE_DIR", os.path.join(settings.current().cache_dir, "quack"))
