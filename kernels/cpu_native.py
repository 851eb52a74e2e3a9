"""CPU kernels in C++, built on this machine with its C++ compiler and called through ctypes.

`small_linear` (kernels/cpu_small_linear.cpp) is a linear layer for the few rows of a decode
step on a plain float32 weight (kernels/cpu_linear.py says when it serves).

`decode_attention` (kernels/cpu_decode_attention.cpp) is decode attention over the paged cache,
read in place: 2-5x faster than inductor's fused loops or gather + SDPA at 1-32 rows, because it
fetches each next block by hand (a row's blocks are anywhere in the cache, one page each, and
the hardware prefetcher stops at pages) and reads every key and value row once for all heads.

The source has no torch headers, so it builds in about a second: the first CPU worker on a
machine builds it (`-O3` plus the variant's flags, OpenMP from the runtime torch already loaded)
into the cache directory under a key of the source, the flags, the compiler and the CPU's feature
flags; later starts load it in milliseconds. No compiler, a failed build or
`PAGEDSERVE_CPU_KERNELS=torch` leaves the torch paths in use (kernels/attention/cpu.py), with a
warning for a failure.

Variants (`PAGEDSERVE_CPU_KERNELS`, VARIANTS below): `native` (the default, `-march=native`: on an
AVX2-only CPU this is the AVX2 code, on an AVX-512 one with 512-bit vectors preferred), `avx2`
(`-mavx2 -mfma`, runs on any x86 CPU since Haswell / Zen) and `avx512` (512-bit vectors). The
explicit ones are for tests and comparisons: they are built on any machine, and a variant this
CPU cannot run is refused with a warning (torch serves) instead of dying on an illegal instruction.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess

import torch

from pagedserve import settings

logger = logging.getLogger(__name__)

# One library of both sources: decode attention, and the few-row linear (kernels/cpu_linear.py).
SOURCES = [
    os.path.join(os.path.dirname(__file__), name)
    for name in ("cpu_decode_attention.cpp", "cpu_small_linear.cpp")
]
# Compiled with -ffast-math (vectorized reductions and expf) but linked without it: linking with
# it adds crtfastmath.o, which sets flush-to-zero for the whole process when the library loads.
COMPILE = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
LINK = ["-shared", "-fopenmp", "-lmvec"]  # libmvec: glibc's vector expf
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
# variant -> (its compile flags, the /proc/cpuinfo flags a CPU needs to run it)
VARIANTS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "native": (["-march=native"], ()),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
    "avx512": (
        ["-mavx2", "-mfma", "-mf16c", *(f"-m{f}" for f in AVX512), "-mprefer-vector-width=512"],
        ("avx2", "fma", "f16c", *AVX512),
    ),
}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, ctypes.c_int, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I]
_LINEAR_ARGTYPES = [_P, _P, _P, _P, _I, _I, _I]
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def kernels_setting() -> str:
    return settings.current().cpu_kernels


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CXX"), "c++", "g++") if c and shutil.which(c)), None)


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return torch.backends.cpu.get_cpu_capability()


def missing_flags(variant: str) -> list[str]:
    """The CPU features `variant` needs that this CPU lacks (none: it can run here)."""
    have = set(_cpu_flags().split())
    return [f for f in VARIANTS[variant][1] if f not in have]


def variant_flags(variant: str) -> list[str]:
    """The compile flags of `variant`. `native` on an AVX-512 CPU adds 512-bit vectors, which GCC's
    -march=native leaves at 256 bits: measured 15-25% faster per layer at 1-32 rows with 8B heads
    on a 16-core Xeon (docs/cpu_avx.md), equal with the embedded model's."""
    flags = VARIANTS[variant][0]
    if variant == "native" and not missing_flags("avx512"):
        flags = [*flags, "-mprefer-vector-width=512"]
    return flags


def register_counts(path: str) -> dict[str, int] | None:
    """How many instructions of the built library name an xmm, ymm or zmm register (its vector
    width, as `objdump -d | grep -c ymm` counts it); None without objdump."""
    if shutil.which("objdump") is None:
        return None
    text = subprocess.run(["objdump", "-d", path], capture_output=True, text=True).stdout
    lines = text.splitlines()
    return {reg: sum(reg in line for line in lines) for reg in ("xmm", "ymm", "zmm")}


def library_path(compiler: str, variant: str = "native") -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for source in SOURCES:
        with open(source, "rb") as f:
            digest.update(f.read())
    flags = COMPILE + variant_flags(variant) + LINK
    for part in (" ".join(flags), version, _cpu_flags()):
        digest.update(part.encode())
    name = f"cpu_kernels-{variant}-{digest.hexdigest()[:24]}.so"
    return os.path.join(settings.current().cache_dir, "cpu_kernels", name)


def build(compiler: str, path: str, variant: str = "native") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path.removesuffix('.so')}.{os.getpid()}.partial"
    objects = [f"{partial}.{i}.o" for i in range(len(SOURCES))]
    flags = [*COMPILE, *variant_flags(variant)]
    compiles = [[compiler, *flags, "-o", o, src] for o, src in zip(objects, SOURCES, strict=True)]
    for cmd in (*compiles, [compiler, *objects, *LINK, "-o", f"{partial}.so"]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
    for o in objects:
        os.remove(o)
    os.replace(f"{partial}.so", path)  # whole or absent, for another process building the same


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    """The built and loaded library, or None where it does not apply (see the module's doc)."""
    variant = kernels_setting()
    if variant == "torch":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler (c++, g++ or $CXX): CPU decode attention stays on torch")
        return None
    if missing := missing_flags(variant):
        logger.warning(
            "this CPU lacks %s for the %s CPU kernels: decode attention stays on torch",
            ", ".join(missing), variant,
        )  # fmt: skip
        return None
    try:
        path = library_path(compiler, variant)
        if not os.path.exists(path):
            build(compiler, path, variant)
        library = ctypes.CDLL(path)
    except (OSError, RuntimeError) as e:
        logger.warning("CPU decode attention kernel unavailable, staying on torch: %s", e)
        return None
    for function, argtypes in (
        (library.pagedserve_decode_attention, _ARGTYPES),
        (library.pagedserve_small_linear, _LINEAR_ARGTYPES),
    ):
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return library


def available() -> bool:
    """Builds or loads the kernel (a CPU worker calls this at start-up, off the serving path)."""
    return _kernel() is not None


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D], float32 or bfloat16
    block_tables: torch.Tensor,  # [B, nb] int64
    seq_lens: torch.Tensor,  # [B] int64: each query's position + 1
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [B, Hq, D], query's dtype
    """One query per row over its paged context (query head h reads KV head h // (Hq / Hkv)).
    Call only when `available()`; computes in float32."""
    library = _kernel()
    assert library is not None, "decode_attention called without the kernel available"
    rows, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if kv_cache.dtype not in CACHE_DTYPES or not kv_cache.is_contiguous():
        raise ValueError(f"the kernel reads contiguous {CACHE_DTYPES} caches, not {kv_cache.dtype}")
    q = query.to(torch.float32).contiguous()
    tables, lengths = block_tables.contiguous(), seq_lens.contiguous()
    if tables.dtype != torch.int64 or lengths.dtype != torch.int64:
        raise ValueError("block_tables and seq_lens must be int64")
    out = torch.empty(q.shape, dtype=torch.float32)
    library.pagedserve_decode_attention(
        q.data_ptr(), kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16),
        tables.data_ptr(), lengths.data_ptr(), out.data_ptr(), rows, num_kv_heads,
        num_heads // num_kv_heads, head_dim, block_size, tables.shape[1], scale,
        sliding_window or 0,
    )  # fmt: skip
    return out.to(query.dtype)


def small_linear(
    x: torch.Tensor,  # [M, K] float32
    weight: torch.Tensor,  # [N, K] float32, contiguous
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    """`x @ weight.T + bias` for a few rows (kernels/cpu_small_linear.cpp: bound by reading the
    weight once, in its plain layout). Call only when `available()`."""
    library = _kernel()
    assert library is not None, "small_linear called without the kernel available"
    x = x.contiguous()
    rows, (cols, inner) = x.shape[0], weight.shape
    assert x.dtype == weight.dtype == torch.float32 and weight.is_contiguous(), (x, weight)
    assert x.shape[1] == inner and (bias is None or bias.shape == (cols,)), (x.shape, weight.shape)
    out = torch.empty(rows, cols, dtype=torch.float32)
    bias = None if bias is None else bias.to(torch.float32).contiguous()  # held through the call
    bias_ptr = None if bias is None else bias.data_ptr()
    library.pagedserve_small_linear(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(),
                                    rows, cols, inner)  # fmt: skip
    return out
