"""Cascade (shared-prefix) attention: the host's common-prefix rule (numpy) and the Triton kernel's
prefix pass + per-row pass + merge against `paged_attention_ref`.

Without a GPU the kernel runs under the Triton interpreter (tests/conftest.py) at tiny sizes in
float32; with one, the same tests run compiled and the `gpu` ones add Llama-3-8B heads in bf16, a
CUDA graph replayed with different prefixes, and the W6 decode shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_env import HAS_CUDA, HAS_TRITON, needs_triton, tiny

from pagedserve.kernels.attention.cascade import cascade_len, common_prefix_len

if HAS_TRITON:
    from pagedserve.benchmarks.kernels.bench_kernels import random_batch, relative_error
    from pagedserve.kernels.attention.reference import paged_attention_ref
    from pagedserve.kernels.attention.triton import triton_paged_attention

DEV = "cuda" if HAS_CUDA else "cpu"


def kernel_test(fn):
    """A kernel test: needs triton, runs compiled on a GPU or interpreted on a CPU."""
    return needs_triton(tiny(fn))


TOL = dict(atol=2e-2, rtol=2e-2) if HAS_CUDA else dict(atol=1e-4, rtol=1e-4)
FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------- host: the common prefix
def _prefix(tables, seq_lens, q_lens, block_size=16):
    return common_prefix_len(
        np.asarray(tables, dtype=np.int32), np.asarray(seq_lens), np.asarray(q_lens), block_size
    )


def test_common_prefix_stops_at_the_first_differing_block():
    tables = [[7, 3, 9, 1, 0], [7, 3, 9, 2, 5], [7, 3, 4, 6, 8]]
    assert _prefix(tables, [70, 75, 80], [1, 1, 1]) == 2 * 16  # block 2 differs in row 2
    assert _prefix([t[:] for t in tables[:2]], [70, 75], [1, 1]) == 3 * 16


def test_common_prefix_never_covers_new_tokens():
    tables = [[7, 3, 9, 1], [7, 3, 9, 1]]  # identical tables: the cap decides
    assert _prefix(tables, [64, 64], [1, 1]) == 48  # 63 cached: 3 whole blocks
    assert _prefix(tables, [64, 64], [1, 17]) == 32  # a prefill row: 47 cached -> 2 blocks
    assert _prefix(tables, [48, 60], [1, 1]) == 32  # the whole context of row 0 is 47 tokens
    assert _prefix(tables, [49, 60], [1, 1]) == 48  # row 0's context is exactly the prefix
    assert _prefix(tables, [15, 60], [1, 1]) == 0  # less than a block cached
    assert _prefix(tables, [64, 64], [64, 64]) == 0  # nothing cached (prompts from scratch)


def test_common_prefix_edge_cases():
    assert _prefix([[3, 4]], [30], [1]) == 0  # one row: nothing to share
    assert _prefix(np.zeros((0, 1)), [], []) == 0
    assert _prefix([[3, 4], [5, 4]], [30, 30], [1, 1]) == 0  # the first block differs
    assert _prefix([[3], [3]], [300, 300], [1, 1], block_size=16) == 16  # past the table width
    assert _prefix([[3, 4], [3, 4]], [40, 40], [1, 1], block_size=32) == 32  # other block sizes


def test_cascade_len_thresholds():
    rows, width = 40, 20
    tables = np.tile(np.arange(width, dtype=np.int32), (rows, 1))
    seq_lens, q_lens = np.full(rows, 300), np.ones(rows)
    assert cascade_len(tables, seq_lens, q_lens, 16) == 288
    assert cascade_len(tables[:31], seq_lens[:31], q_lens[:31], 16) == 0  # too few rows
    assert cascade_len(tables, seq_lens, q_lens, 16, min_rows=2) == 288
    short = np.full(rows, 200)  # 192 shared tokens: under CASCADE_MIN_TOKENS
    assert cascade_len(tables, short, q_lens, 16) == 0
    assert cascade_len(tables, short, q_lens, 16, min_tokens=64) == 192
    mixed = np.where(np.arange(rows) < 8, 20, 1)  # 8 prompt chunks: 32 decode rows remain
    assert cascade_len(tables, seq_lens, mixed, 16) == 272  # the chunks' cap: 280 cached
    assert cascade_len(tables, seq_lens, np.where(np.arange(rows) < 9, 20, 1), 16) == 0


# ---------------------------------------------------------------- kernel
def _case(computed, new, shared_blocks, hq=4, hkv=2, block_size=16, seed=0):
    q, kv, meta = random_batch(
        computed, new, hq, hkv, 16, block_size, torch.float32, DEV, seed, shared_blocks
    )
    tables = meta.block_tables.cpu().numpy()
    q_lens = np.diff(meta.query_start_loc_cpu)
    length = common_prefix_len(tables, meta.seq_lens_cpu, q_lens, block_size)
    return q, kv, meta, length


def _cascade(meta, length: int, bound: int | None = None):
    """`meta` with the cascade on: `length` on the device, `bound` (a graph's upper bound) or
    `length` on the host."""
    meta.cascade_len = bound or length
    meta.cascade_len_dev = torch.tensor([length], dtype=torch.int32, device=DEV)
    return meta


# (cached, new) per row: decodes sharing 3 blocks of 16, one row whose context is the prefix.
DECODES = ([60, 50, 48, 70, 100], [1, 1, 1, 1, 1])
MIXED = ([60, 48, 70, 50, 49], [1, 9, 1, 20, 1])  # prompt chunks after the shared prefix


@kernel_test
@pytest.mark.parametrize(
    ("rows", "hq", "block_size", "num_splits", "prefix_splits", "prefix_block_m", "softcap"),
    [
        (DECODES, 4, 16, None, 2, 16, None),  # several query tiles and prefix splits
        (DECODES, 4, 16, 2, 1, 128, 0.5),  # split per-row pass, soft-capped scores
        (DECODES, 6, 16, None, 3, 16, None),  # GQA group 3 (padded to 4 rows per token)
        (DECODES, 2, 32, None, None, 128, None),  # other block size, chosen splits
        (DECODES, 4, 8, 3, 2, 32, None),
    ],
)
def test_cascade_matches_reference(
    rows, hq, block_size, num_splits, prefix_splits, prefix_block_m, softcap
):
    q, kv, meta, length = _case(*rows, 48 // block_size, hq, block_size=block_size, seed=hq)
    assert length == (48 if block_size < 32 else 32)
    ref = paged_attention_ref(q, kv, meta, 0.25, None, softcap)
    out = triton_paged_attention(
        q, kv, _cascade(meta, length), 0.25, None, softcap, num_splits=num_splits,
        prefix_splits=prefix_splits, prefix_block_m=prefix_block_m,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, **TOL)


def _spy_prefix_passes(monkeypatch) -> list[int]:
    """Record each launch of the cascade's prefix pass (its number of query tokens)."""
    from pagedserve.kernels.attention import triton as triton_attention

    calls: list[int] = []
    launch = triton_attention._launch

    def spy(query, *args):
        if args[-1]:  # `prefix`
            calls.append(query.shape[0])
        return launch(query, *args)

    monkeypatch.setattr(triton_attention, "_launch", spy)
    return calls


@kernel_test
def test_mixed_step_cascades_its_decode_part(monkeypatch):
    """A mixed step run as one call takes the plain path (prompt rows gain nothing); run as its
    decode and prompt parts, the decode part cascades. Both are the reference."""
    from pagedserve.kernels.attention.dispatch import per_step_kind

    calls = _spy_prefix_passes(monkeypatch)
    q, kv, meta, length = _case(*MIXED, 3, seed=4)
    assert length == 48
    ref = paged_attention_ref(q, kv, meta, 0.25)
    torch.testing.assert_close(triton_paged_attention(q, kv, _cascade(meta, 48), 0.25), ref, **TOL)
    assert calls == []
    split = per_step_kind(dict.fromkeys(("decode", "prefill", "mixed"), triton_paged_attention), 1)
    torch.testing.assert_close(split(q, kv, meta, 0.25), ref, **TOL)
    assert calls == [3]  # the three decode rows


@kernel_test
def test_cascade_device_value_below_the_host_bound(monkeypatch):
    """A CUDA graph's replays: the host holds an upper bound, the device the step's prefix (0,
    a block, or all of it); each is the reference."""
    calls = _spy_prefix_passes(monkeypatch)
    q, kv, meta, length = _case(*DECODES, 3, seed=5)
    ref = paged_attention_ref(q, kv, meta, 0.25)
    for device_len in (0, 16, length):
        out = triton_paged_attention(q, kv, _cascade(meta, device_len, bound=4096), 0.25)
        torch.testing.assert_close(out, ref, **TOL)
    assert calls == [5, 5, 5]


def test_cascade_graph_buckets():
    """Decode buckets with a cascade variant: multiples of 64, and the largest (from 32 rows)."""
    from pagedserve.worker.cuda_graphs import capture_sizes, cascade_sizes

    assert cascade_sizes(capture_sizes(256)) == [256, 192, 128, 64]
    assert cascade_sizes(capture_sizes(100)) == [100, 64]
    assert cascade_sizes(capture_sizes(40)) == [40]
    assert cascade_sizes(capture_sizes(16)) == []


@kernel_test
def test_no_cascade_runs_as_before(monkeypatch):
    """cascade_len 0 (and a windowed layer, which refuses the cascade) take the plain path."""
    calls = _spy_prefix_passes(monkeypatch)
    q, kv, meta, length = _case(*DECODES, 3, seed=6)
    plain = triton_paged_attention(q, kv, meta, 0.25)
    cleared = _cascade(meta, length)
    cleared.cascade_len = 0
    assert torch.equal(triton_paged_attention(q, kv, cleared, 0.25), plain)
    ref = paged_attention_ref(q, kv, meta, 0.25, 9)
    out = triton_paged_attention(q, kv, _cascade(meta, length), 0.25, 9)
    torch.testing.assert_close(out, ref, **TOL)
    assert calls == []


@kernel_test
def test_cascade_reads_fp8_cache():
    q, kv, meta, length = _case(*DECODES, 3, seed=7)
    kv8 = kv.to(FP8)
    ref = paged_attention_ref(q, kv8, meta, 0.25, k_scale=0.7, v_scale=1.3)
    out = triton_paged_attention(
        q, kv8, _cascade(meta, length), 0.25, k_scale=0.7, v_scale=1.3, prefix_block_m=16
    )
    torch.testing.assert_close(out, ref, atol=2e-2 if HAS_CUDA else 1e-4, rtol=2e-2)


# ---------------------------------------------------------------- GPU: Llama-3-8B heads
def _w6_batch(rows: int, own: int, seed: int = 0):
    """`rows` decodes sharing a 2,048-token prefix (128 blocks of 16), `own` tokens each after."""
    computed = [2048 + own - 1 - (i % 7) for i in range(rows)]
    q, kv, meta = random_batch(
        computed, [1] * rows, 32, 8, 128, 16, torch.bfloat16, "cuda", seed, 128
    )
    return q, kv, meta


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("rows", [64, 256])
def test_gpu_cascade_w6_decode(rows):
    q, kv, meta = _w6_batch(rows, 128)
    ref = paged_attention_ref(q, kv, meta, 128**-0.5)
    out = triton_paged_attention(q, kv, _cascade(meta, 2048), 128**-0.5)
    assert relative_error(out, ref) < 1e-2
    kv8 = kv.to(FP8)
    ref = paged_attention_ref(q, kv8, meta, 128**-0.5, k_scale=0.5, v_scale=2.0)
    out = triton_paged_attention(q, kv8, meta, 128**-0.5, k_scale=0.5, v_scale=2.0)
    assert relative_error(out, ref) < 1e-2


@pytest.mark.gpu
@needs_triton
def test_gpu_cascade_cuda_graph_replays_other_prefixes():
    """Captured once with the cascade on (the host bound 4096), replayed with the device prefix
    at 2048, 1024 and 0 tokens: each is the reference."""
    q, kv, meta = _w6_batch(64, 128, seed=1)
    _cascade(meta, 2048, bound=4096)
    triton_paged_attention(q, kv, meta, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_paged_attention(q, kv, meta, 0.1)
    ref = paged_attention_ref(q, kv, meta, 0.1)
    for length in (2048, 1024, 0):
        meta.cascade_len_dev.fill_(length)
        out.zero_()
        graph.replay()
        assert relative_error(out, ref) < 1e-2, length
