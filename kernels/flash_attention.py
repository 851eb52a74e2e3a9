"""Paged attention through FlashAttention 4 (`flash_attn.cute.flash_attn_varlen_func`, the
`flash-attn-4` package: CuTe DSL kernels compiled at run time, SM90 and SM100).

Chosen with `--attention-backend flash` (or by `auto`, see kernels/backend.py). Our cache layout
`[num_blocks, 2, block_size, Hkv, D]` is FA4's paged layout as it is: `kv_cache[:, 0]` and
`kv_cache[:, 1]` are `(num_pages, page_size, Hkv, D)` views whose strides FA4 accepts without a
copy, the block table is its `page_table` (int32, rows contiguous), `seq_lens` its `seqused_k`
and `query_start_loc` its `cu_seqlens_q`. Its causal mask aligns each row's queries to the end of
the row's keys, which is `paged_attention_ref`'s "new tokens sit at the end of the context" rule.

Block sizes: every size works. On an H100 (hdim 128) FA4 tiles keys 128 at a time; a page of
exactly 128 tokens loads by TMA, any other size through its cp.async page gather (slower per key:
`--block-size 128` is the fast layout for this backend). A sliding window becomes
`window_size=(window - 1, 0)`; soft-capping is FA4's `softcap`; FP8 caches are refused (FA4 reads
FP8 on SM100 only). Scales of a bf16/fp16 cache fold into the softmax scale and the output.
Key splits (flash-decoding) are FA4's own choice for decode steps, from the host bounds
(`max_seqlen_k`: in a CUDA graph the longest context, so a captured graph keeps one choice); steps
with prompts never split (their query tiles fill the GPU, and one choice keeps one variant).

Compiled kernels: FA4 compiles each kernel variant (a key of dtype, head dims, GQA packing, tile,
split, varlen flags) on first use, seconds each. They are kept on disk, in
`$PAGEDSERVE_FLASH_CACHE_DIR` (default `flash_attn` under disk_cache.py's root), so a second start
loads them instead of compiling: this module turns on FA4's persistent cache before importing it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from pagedserve.disk_cache import cache_root
from pagedserve.kernels.attention import AttentionMetadata

CACHE_DIR_ENV = "PAGEDSERVE_FLASH_CACHE_DIR"


def flash_cache_dir() -> str:
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(cache_root(), "flash_attn")


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


def flash_attn_importable() -> bool:
    """Whether FA4 can be imported here."""
    return cute_dsl_importable("flash_attn.cute")


def prepare_cute_dsl() -> None:
    """Before the first import of FA4 or quack (FA4 imports quack): `cutlass` on sys.path and
    both libraries' compiled kernels kept on disk under disk_cache.py's root."""
    _add_cutlass_path()
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", flash_cache_dir())
    os.environ.setdefault("QUACK_CACHE_DIR", os.path.join(cache_root(), "quack"))


@functools.cache
def _varlen_func():
    prepare_cute_dsl()
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def flash_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    *,
    num_splits: int | None = None,  # None: FA4's heuristic (0) for decodes past SM 9.x, else 1
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hq, D]
    """`paged_attention_ref`'s contract through FA4 (device tensors and host ints only)."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        raise ValueError("the flash attention backend does not read an FP8 KV cache; use triton")
    if query.shape[0] == 0 or meta.seq_lens.shape[0] == 0:
        return torch.empty_like(query)
    if num_splits is None:  # a prompt's query tiles fill the GPU: one variant for them all
        # FA4 4.0.0b36 refuses split-KV on SM 9.0 ("SplitKV not supported on SM 9.0")
        split_ok = torch.cuda.get_device_capability(query.device)[0] >= 10
        num_splits = 0 if meta.max_query_len <= 1 and split_ok else 1
    window = (None, None) if sliding_window is None else (sliding_window - 1, 0)
    result = _varlen_func()(
        query,
        kv_cache[:, 0],  # [num_blocks, block_size, Hkv, D], strided: no copy
        kv_cache[:, 1],
        cu_seqlens_q=meta.query_start_loc,
        max_seqlen_q=max(meta.max_query_len, 1),
        max_seqlen_k=max(meta.max_seq_len, 1),
        seqused_k=meta.seq_lens,
        page_table=meta.block_tables,
        softmax_scale=scale * k_scale,
        causal=True,
        window_size=window,
        softcap=logit_softcap or 0.0,
        num_splits=num_splits,
    )
    out = result[0] if isinstance(result, tuple) else result
    return out if v_scale == 1.0 else out * v_scale
