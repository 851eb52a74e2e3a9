"""A speculative verification's attention on a CPU (kernels/attention/cpu.py): a row of k + 1
queries runs on the C++ decode kernel, one decode row per query, so each query's output is bit
for bit what the decode step at its position computes (the greedy tokens of speculation on and
off then agree by construction, not by tolerance), and a mixed step still matches the reference.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.benchmarks.kernels.bench_kernels import random_batch
from pagedserve.kernels import cpu_native
from pagedserve.kernels.attention.cpu import MAX_SHORT_QUERIES, cpu_paged_attention
from pagedserve.kernels.attention.metadata import build_attention_metadata
from pagedserve.kernels.attention.reference import paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C++ CPU kernels here")


@pytest.mark.parametrize(("window", "dtype"), [(None, torch.float32), (20, torch.bfloat16)])
def test_verification_rows_equal_decode_rows_bit_for_bit(window, dtype):
    # row 0 verifies 8 drafts after 37 tokens, row 1 decodes, row 2 verifies 3 after 50
    computed, new, block_size = [37, 12, 50], [9, 1, 4], 8
    q, kv, meta = random_batch(computed, new, 6, 2, 64, block_size, dtype, "cpu", seed=3)
    out = cpu_paged_attention(q, kv, meta, 0.125, window)
    # the same queries, each a decode row of its own over its row's blocks
    tables = meta.block_tables.tolist()
    rows = zip(computed, new, tables, strict=True)
    per_query = [(c + j, t) for c, n, t in rows for j in range(n)]
    decode_meta, _ = build_attention_metadata(
        [p for p, _ in per_query], [1] * len(per_query), [t for _, t in per_query], block_size
    )
    assert torch.equal(out, cpu_paged_attention(q, kv, decode_meta, 0.125, window))
    ref = paged_attention_ref(q, kv, meta, 0.125, window)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize(
    ("computed", "new"),
    [
        ([30, 0, 9, 5, 0], [1, MAX_SHORT_QUERIES + 4, 5, MAX_SHORT_QUERIES, 2]),  # three groups
        ([3, 7], [9, 9]),  # one short group, no padding: its output is the step's, in order
        ([0, 5, 9], [20, 20, 20]),  # the same for a prefill group
    ],
)
def test_short_rows_beside_other_rows_match_the_reference(computed, new):
    """Decode, short (verification) and prefill rows in one step, scattered back or dense."""
    q, kv, meta = random_batch(computed, new, 8, 2, 32, 16, torch.float32, "cpu", seed=5)
    ref = paged_attention_ref(q, kv, meta, 0.2, 11)
    torch.testing.assert_close(cpu_paged_attention(q, kv, meta, 0.2, 11), ref, atol=1e-5, rtol=1e-5)
