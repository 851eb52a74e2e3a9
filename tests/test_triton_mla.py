"""MLA's Triton decode kernel (kernels/triton_mla.py) against the torch latent attention
(kernels/mla.py `mla_decode_ref`): rows of several lengths over shuffled paged blocks, tiles that
span blocks, one split and several (some left empty by short rows), and an empty padding row.
Under the Triton interpreter without a GPU (tiny shapes, float32 and float16: the interpreter's
bfloat16 dots are wrong); with one, the `gpu` tests add DeepSeek-V3's head shapes in bf16 (128
heads, R = 512, P = 64), rows of several tokens (causal) and a CUDA-graph replay with other
lengths. The model through the kernel (decode and mixed-step graphs) is test_deepseek_v3.py's
GPU test.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import HAS_CUDA, needs_triton, tiny

pytestmark = needs_triton

from pagedserve.benchmarks.kernels.bench_mla import latent_batch  # noqa: E402
from pagedserve.kernels.mla import mla_decode_ref  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
SMALL = {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}  # a tile spans 2 blocks


def _check(lens, dtype, num_splits, heads=4, rank=32, rope=16, config=SMALL, tol=None):
    from pagedserve.kernels.triton_mla import triton_mla_decode

    q_lat, q_pe, cache, tables, seq_lens = latent_batch(lens, heads, rank, rope, 16, dtype, DEV)
    scale, max_len = (rank + rope) ** -0.5, max(lens)
    got = triton_mla_decode(
        q_lat, q_pe, cache, tables, seq_lens, max_len, scale, num_splits, config
    )
    want = mla_decode_ref(q_lat, q_pe, cache, tables, seq_lens, max_len, scale)
    live = seq_lens > 0
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got[live].float(), want[live].float(), **tol)
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))  # an empty row: zeros, no NaN
    return got


@tiny
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_mla_decode_equals_torch(dtype):
    """Lengths 1 (one token), 0 (an empty padding row), a block's edge, several tiles; unsplit,
    3 splits (the short rows leave some empty) and the split count the kernel chooses."""
    lens = [1, 40, 0, 16, 97]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    if HAS_CUDA and dtype == torch.float32:
        tol = dict(atol=1e-3, rtol=1e-3)
    one = _check(lens, dtype, 1, tol=tol)
    split = _check(lens, dtype, 3, tol=tol)
    torch.testing.assert_close(split, one, **tol)
    # heads past one group, R not a power of two, P under a dot's 16 (the tiny model's 8), the
    # chosen splits
    _check(lens, dtype, None, heads=20, rank=24, rope=8, tol=tol)


@tiny
def test_triton_mla_causal_rows_equal_the_model_path():
    """A mixed step on the device layout alone (`causal`: the path of DeepSeek's mixed CUDA
    graphs) equals kernels/mla.py's host path (decode rows absorbed, prompt rows expanded): a
    fresh 5-token prompt, decodes, a 17-token chunk across blocks after 16 cached tokens, and
    empty rows (one between, one last, as a mixed graph's slots); unsplit and in 3 splits."""
    from pagedserve.kernels.attention.metadata import build_attention_metadata
    from pagedserve.kernels.mla import mla_attention, mla_decode
    from pagedserve.kernels.triton_mla import triton_mla_decode

    heads, nope, rank, rope, v_dim, bs = 4, 16, 24, 8, 16, 16
    computed, new = [0, 20, 0, 16, 3, 0], [5, 1, 0, 17, 1, 0]
    gen = torch.Generator().manual_seed(3)
    order = (torch.randperm(12, generator=gen) + 1).tolist()
    tables = [
        [order.pop() for _ in range(-(-(c + n) // bs))] for c, n in zip(computed, new, strict=True)
    ]
    meta, _ = build_attention_metadata(computed, new, tables, bs, DEV)
    cache = torch.randn(13, 1, bs, 1, rank + rope, generator=gen).to(DEV)
    q_nope, q_pe = (torch.randn(sum(new), heads, d, generator=gen).to(DEV) for d in (nope, rope))
    w_uk = (torch.randn(heads, nope, rank, generator=gen) / rank**0.5).to(DEV)
    w_uv = (torch.randn(heads, v_dim, rank, generator=gen) / rank**0.5).to(DEV)
    scale = (nope + rope) ** -0.5
    want = mla_attention(q_nope, q_pe, cache, meta, w_uk, w_uv, scale)  # host path on the CPU
    got = mla_decode(q_nope, q_pe, cache, meta, None, w_uk, w_uv, scale, causal=True)
    tol = dict(atol=1e-3, rtol=1e-3) if HAS_CUDA else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    layout = (meta.block_tables, meta.seq_lens, meta.max_seq_len, scale)
    split = triton_mla_decode(q_lat, q_pe, cache, *layout, 3, SMALL, meta.query_start_loc)
    torch.testing.assert_close(torch.einsum("thr,hvr->thv", split, w_uv), want, **tol)


@tiny
def test_triton_mla_decode_refuses_bad_inputs():
    from pagedserve.kernels.triton_mla import triton_mla_decode

    q_lat, q_pe, cache, tables, lens = latent_batch([5, 9], 4, 32, 16, 16, torch.float32, DEV)
    with pytest.raises(ValueError, match="R \\+ P"):
        triton_mla_decode(q_lat[..., :16], q_pe, cache, tables, lens, 9, 0.1)
    with pytest.raises(ValueError, match="differ from cache"):
        triton_mla_decode(q_lat.half(), q_pe.half(), cache, tables, lens, 9, 0.1)
    with pytest.raises(ValueError, match="int32"):
        triton_mla_decode(q_lat, q_pe, cache, tables.long(), lens, 9, 0.1)


V3 = dict(heads=128, rank=512, rope=64)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("lens", [[1], [200], [3000, 1, 0, 517, 64, 2048, 33, 128]])
def test_gpu_triton_mla_decode_v3_shapes(lens):
    """DeepSeek-V3's head shapes in bf16 with the chosen launch (config and splits)."""
    tol = dict(atol=2e-2, rtol=2e-2)
    _check(lens, torch.bfloat16, None, config=None, tol=tol, **V3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_gpu_triton_mla_decode_graph_replays_other_lengths():
    """Captured in a CUDA graph with a host bound of 4096 (the split count fixed then), replayed
    with other lengths written on the device: equal to the torch reference each time."""
    from pagedserve.kernels.triton_mla import triton_mla_decode

    q_lat, q_pe, cache, tables, lens = latent_batch([4000, 7, 1, 0], 128, 512, 64, 16,
                                                    torch.bfloat16, DEV)  # fmt: skip
    scale = 576**-0.5
    run = lambda: triton_mla_decode(q_lat, q_pe, cache, tables, lens, 4096, scale)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for new in ([1, 4000, 300, 2], [129, 3, 4001, 5]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        want = mla_decode_ref(q_lat, q_pe, cache, tables, lens, 4096, scale)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_gpu_triton_mla_causal_v3_shapes():
    """Rows of 37, 1, 0 and 200 new tokens after 100, 900, 0 and 0 cached ones at V3's head
    shapes in bf16: each token equals a one-token row over the keys up to it."""
    from pagedserve.kernels.triton_mla import triton_mla_decode

    seq_lens, q_lens = [137, 901, 0, 200], [37, 1, 0, 200]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(q_lens))  # [T]
    seen = [n - q + j + 1 for n, q in zip(seq_lens, q_lens, strict=True) for j in range(q)]
    _, _, cache, tables, lens = latent_batch(seq_lens, 1, 512, 64, 16, torch.bfloat16, DEV)
    gen = torch.Generator(device=DEV).manual_seed(1)
    q_lat = torch.randn(len(seen), 128, 512, generator=gen, device=DEV) / 512**0.25
    q_pe = torch.randn(len(seen), 128, 64, generator=gen, device=DEV)
    q_lat, q_pe = q_lat.bfloat16(), q_pe.bfloat16()
    got = triton_mla_decode(q_lat, q_pe, cache, tables, lens, 901, 0.05,
                            query_start_loc=qsl.to(DEV))  # fmt: skip
    per_token = torch.tensor(seen, dtype=torch.int32, device=DEV)
    want = mla_decode_ref(q_lat, q_pe, cache, tables[rows.to(DEV)], per_token, 901, 0.05)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
