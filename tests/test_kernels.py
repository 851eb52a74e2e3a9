"""Torch reference kernels against dense references and transformers; TP layer shard math."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.kernels.activation import silu_and_mul
from pagedserve.kernels.attention.metadata import build_attention_metadata
from pagedserve.kernels.rotary import attention_factor, cos_sin_cache, inv_frequencies, rope_config
from pagedserve.worker.layers import linear as layers
from pagedserve.worker.layers.attention import Attention
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding


def dense_attention(q, k, v, scale, window=None):  # q [L, Hq, D], k/v [S, Hkv, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    L, S = q.shape[0], k.shape[0]
    q_pos = torch.arange(S - L, S)[:, None]
    k_pos = torch.arange(S)[None, :]
    mask = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)  # [L, Hq, D]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense(seed, window):
    rng = random.Random(seed)
    hq, hkv, d, bs, num_blocks = 8, 2, 16, 4, 96
    attn = Attention(hq, hkv, d, scale=d**-0.5, sliding_window=window)
    num_seqs = rng.randint(1, 5)
    computed = [rng.choice([0, rng.randint(1, 30)]) for _ in range(num_seqs)]
    new = [rng.choice([1, rng.randint(1, 12)]) for _ in range(num_seqs)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [
        [free.pop() for _ in range(-(-(c + n) // bs))] for c, n in zip(computed, new, strict=True)
    ]
    kv_cache = torch.randn(num_blocks, 2, bs, hkv, d)  # garbage outside written slots
    full_k = [torch.randn(c + n, hkv, d) for c, n in zip(computed, new, strict=True)]
    full_v = [torch.randn(c + n, hkv, d) for c, n in zip(computed, new, strict=True)]
    # Earlier context goes in the cache first, as previous steps would have written it.
    prior, _ = build_attention_metadata([0] * num_seqs, computed, tables, bs)
    for_k = torch.cat([k[:c] for k, c in zip(full_k, computed, strict=True)])
    for_v = torch.cat([v[:c] for v, c in zip(full_v, computed, strict=True)])
    attn.forward(
        torch.zeros(len(for_k), hq * d), for_k.flatten(1), for_v.flatten(1), kv_cache, prior
    )
    meta, positions = build_attention_metadata(computed, new, tables, bs)
    q = torch.randn(sum(new), hq, d)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, computed, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, computed, strict=True)])
    out = attn(q.flatten(1), new_k.flatten(1), new_v.flatten(1), kv_cache, meta)
    out = out.view(-1, hq, d)
    start = 0
    for i, n in enumerate(new):
        ref = dense_attention(q[start : start + n], full_k[i], full_v[i], d**-0.5, window)
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-5, rtol=1e-5)
        start += n
    assert positions.tolist() == [
        p for c, n in zip(computed, new, strict=True) for p in range(c, c + n)
    ]


def test_rope_config_reads_both_spellings():
    new = {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    }
    old = {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **new["rope_parameters"]}}
    del old["rope_scaling"]["rope_type"]
    assert rope_config(new).rope_type == rope_config(old).rope_type == "llama3"
    assert rope_config(new).theta == rope_config(old).theta == 5e5
    assert rope_config({}).rope_type == "default" and rope_config({}).theta == 10000.0
    with pytest.raises(ValueError, match="su"):
        rope_config({"rope_scaling": {"rope_type": "su", "factor": 4.0}})
    gemma3 = {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"factor": 8.0}}
    assert rope_config(gemma3, "sliding_attention").theta == 1e4
    assert rope_config(gemma3, "full_attention").scaling["factor"] == 8.0


ORIG32, ORIG64 = ({"original_max_position_embeddings": n} for n in (32, 64))


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, **ORIG64},
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, **ORIG32,
         "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False},
        {"rope_type": "longrope", "rope_theta": 1e4, **ORIG32,
         "short_factor": [1.0 + i / 64 for i in range(64)],
         "long_factor": [2.0 + i / 8 for i in range(64)]},
    ],
)  # fmt: skip
def test_inv_freq_matches_transformers(rope):
    """Frequencies and the cos/sin scale of each type equal transformers' rope init functions;
    longrope switches to its long factors where transformers does (sequence longer than the
    original context)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=2048, num_attention_heads=16, max_position_embeddings=128,
        rope_parameters=dict(rope),
    )  # fmt: skip
    init = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    expected, scale = init(config, "cpu")
    cfg = rope_config(config.to_dict())
    torch.testing.assert_close(inv_frequencies(128, cfg), expected)
    assert attention_factor(cfg) == pytest.approx(scale)
    cache = cos_sin_cache(128, 128, cfg)  # [P, 128]
    for pos in (5, 31, 32, 100):
        inv, _ = init(config, "cpu", seq_len=pos + 1)
        want = torch.cat([(pos * inv).cos(), (pos * inv).sin()]) * scale
        torch.testing.assert_close(cache[pos], want)


def test_rotary_matches_rotate_half_and_partial_passthrough():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = rope_config({"rope_theta": 100.0})
    rope = RotaryEmbedding(16, 64, cfg)
    pos = torch.tensor([0, 3, 17, 63])
    q, k = torch.randn(4, 4 * 16), torch.randn(4, 2 * 16)
    q2, k2 = rope(pos, q, k)
    inv = inv_frequencies(16, cfg)
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, dim=-1)  # [T, D]
    ref_q, ref_k = apply_rotary_pos_emb(q.view(4, 4, 16), k.view(4, 2, 16), emb.cos(), emb.sin())
    torch.testing.assert_close(q2.view(4, 4, 16), ref_q)
    torch.testing.assert_close(k2.view(4, 2, 16), ref_k)
    half = RotaryEmbedding(16, 64, rope_config({"partial_rotary_factor": 0.5}))
    q3, _ = half(pos, q, k)
    torch.testing.assert_close(q3.view(4, 4, 16)[..., 8:], q.view(4, 4, 16)[..., 8:])


def test_rmsnorm_and_residual_path():
    norm = RMSNorm(32, eps=1e-5)
    norm.weight.data = torch.randn(32)
    x, res = torch.randn(5, 32), torch.randn(5, 32)
    ref = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), ref)
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, norm(x + res))
    bf = norm.to(torch.bfloat16)(x.bfloat16())
    assert bf.dtype == torch.bfloat16


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


def _as_rank(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(layers, "tp_rank", lambda: rank)
    monkeypatch.setattr(layers, "tp_size", lambda: size)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_reassemble_full_weights(tp, monkeypatch, tmp_path):
    """Load every rank's shards from safetensors slices; the shards put together (and the kv
    heads replicated when tp > num_kv_heads) equal the full q/k/v, gate/up and o weights."""
    hidden, d, hq, hkv, inter = 16, 4, 4, 2, 8
    full = {
        "q": torch.randn(hq * d, hidden),
        "k": torch.randn(hkv * d, hidden),
        "v": torch.randn(hkv * d, hidden),
        "gate": torch.randn(inter, hidden),
        "up": torch.randn(inter, hidden),
        "o": torch.randn(hidden, hq * d),
    }
    save_file(full, tmp_path / "w.safetensors")
    kv_reps = max(1, tp // hkv)
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        parts = []
        for rank in range(tp):
            _as_rank(monkeypatch, rank, tp)
            qkv = layers.QKVParallelLinear(hidden, d, hq, hkv)
            mlp = layers.MergedColumnParallelLinear(hidden, [inter, inter])
            o = layers.RowParallelLinear(hq * d, hidden)
            for sid in "qkv":
                qkv.weight.weight_loader(qkv.weight, f.get_slice(sid), sid)
            mlp.weight.weight_loader(mlp.weight, f.get_slice("gate"), 0)
            mlp.weight.weight_loader(mlp.weight, f.get_slice("up"), 1)
            o.weight.weight_loader(o.weight, f.get_slice("o"))
            parts.append((qkv.split(qkv.weight.T), mlp.weight.chunk(2), o.weight))
    torch.testing.assert_close(torch.cat([p[0][0].T for p in parts]), full["q"])
    for j, name in ((1, "k"), (2, "v")):
        unique = torch.cat([p[0][j].T for p in parts][::kv_reps])
        torch.testing.assert_close(unique, full[name])
    torch.testing.assert_close(torch.cat([p[1][0] for p in parts]), full["gate"])
    torch.testing.assert_close(torch.cat([p[1][1] for p in parts]), full["up"])
    torch.testing.assert_close(torch.cat([p[2] for p in parts], dim=1), full["o"])


def test_tp_divisibility_errors(monkeypatch):
    _as_rank(monkeypatch, 0, 3)
    with pytest.raises(ValueError, match="attention heads"):
        layers.QKVParallelLinear(16, 4, 4, 2)
    with pytest.raises(ValueError, match="vocab size"):
        layers.VocabParallelEmbedding(512, 8)
    with pytest.raises(ValueError, match="intermediate size"):
        layers.MergedColumnParallelLinear(16, [8, 8])


CPU_BATCHES = {  # (cached tokens, new tokens) per row
    "prefill": ([0, 0, 0], [7, 1, 13]),
    "decode": ([5, 0, 17, 40, 3], [1, 1, 1, 1, 1]),
    "mixed": ([9, 0, 30, 2, 0, 11], [1, 6, 1, 1, 3, 20]),
    "chunked": ([25, 4], [9, 1]),
}


@pytest.mark.parametrize(
    ("hq", "hkv", "block_size", "window", "dtype"),
    [
        (4, 4, 16, None, torch.float32),
        (8, 2, 3, None, torch.float32),
        (6, 3, 5, 4, torch.float32),
        (8, 2, 16, 7, torch.bfloat16),
    ],
)
def test_cpu_batched_attention_matches_reference(hq, hkv, block_size, window, dtype):
    from pagedserve.benchmarks.kernels.bench_kernels import random_batch
    from pagedserve.kernels.attention.cpu import cpu_paged_attention
    from pagedserve.kernels.attention.reference import paged_attention_ref

    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for computed, new in CPU_BATCHES.values():
        q, kv, meta = random_batch(computed, new, hq, hkv, 16, block_size, dtype, "cpu", seed=hq)
        ref = paged_attention_ref(q, kv, meta, 0.25, window)
        out = cpu_paged_attention(q, kv, meta, 0.25, window)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        torch.testing.assert_close(out, ref, **tol)
        # the layout is cached on the step's metadata: a second layer reuses it
        torch.testing.assert_close(cpu_paged_attention(q, kv, meta, 0.25, window), out)
        # an FP8 cache's scales, and soft-capping (Gemma 2), keep the reference's contract
        for extra in ({"k_scale": 0.5, "v_scale": 2.0}, {"logit_softcap": 3.0}):
            ref = paged_attention_ref(q, kv, meta, 0.25, window, **extra)
            torch.testing.assert_close(cpu_paged_attention(q, kv, meta, 0.25, window, **extra),
                                       ref, **tol)  # fmt: skip


@pytest.mark.parametrize("padded", [False, True])
def test_cpu_cache_write_matches_reference(padded):
    """The CPU backend's cache write (rows worked out once per step) stores what
    `write_kv_cache_ref` stores, padding slots (< 0) skipped, FP8 scales applied."""
    from pagedserve.kernels.attention.cpu import cpu_paged_attention
    from pagedserve.kernels.attention.metadata import AttentionMetadata
    from pagedserve.kernels.attention.reference import write_kv_cache_ref

    torch.manual_seed(1)
    slots = torch.tensor([5, 17, 18, 3, 40] + ([-1, -1] if padded else []))
    meta = AttentionMetadata(slots, None, None, None, None, None, 1, 1, block_size=8)
    write = Attention(4, 2, 16, 0.25, backend=cpu_paged_attention).write_cache
    assert write is not None
    for dtype, scales in ((torch.float32, (1.0, 1.0)), (torch.float8_e4m3fn, (0.5, 2.0))):
        key, value = torch.randn(len(slots), 2, 16), torch.randn(len(slots), 2, 16)
        ref = torch.zeros(6, 2, 8, 2, 16, dtype=dtype)
        ours = ref.clone()
        write_kv_cache_ref(key, value, ref, slots, *scales)
        for _ in range(2):  # the second layer reuses the rows cached on the metadata
            write(key, value, ours, meta, *scales)
        assert torch.equal(ours.float(), ref.float())


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can pack a `dtype` weight for oneDNN, asked of torch
    directly (not through pack_weight, which the test checks): bf16 needs AVX-512 (bw, vl, dq)
    or AVX-NE-CONVERT, so an AVX2-only CPU packs float32 and keeps bf16 on F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(1024, 512, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_packed_linear_matches_f_linear(dtype):
    """After loading, a CPU linear runs on its oneDNN-packed weight (the plain one is freed) where
    this CPU can pack `dtype` (bfloat16 where it cannot: packed as float32), and on its plain
    weight where it cannot; either way it gives F.linear's result in `dtype`. A tied LM head packs
    a copy and keeps the shared weight."""
    from pagedserve.kernels.cpu_linear import pack_weight

    as_float32 = dtype == torch.bfloat16 and not _onednn_packs(dtype)
    packs = _onednn_packs(dtype) or (as_float32 and _onednn_packs(torch.float32))
    assert pack_weight(torch.zeros(64, 96)) is None  # too small: oneDNN's call overhead
    torch.manual_seed(0)
    lin = layers.ColumnParallelLinear(1024, 512, bias=True).to(dtype)
    lin.weight.data.normal_(0, 0.1)
    lin.bias.data.normal_(0, 0.1)
    weight, bias = lin.weight.data.clone(), lin.bias.data.clone()
    lin.after_loading()
    assert (lin.packed is not None, lin.weight is None) == (packs, packs)
    if packs:
        assert lin.packed.dtype == (torch.float32 if as_float32 else dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (0, 1, 7, 33):
        x = torch.randn(rows, 1024, dtype=dtype)
        torch.testing.assert_close(lin(x), F.linear(x, weight, bias), atol=tol, rtol=tol)
    embed = layers.VocabParallelEmbedding(4096, 128)
    embed.weight.data.normal_(0, 0.1)
    head = layers.ParallelLMHead(4096, 128)
    head.tie(embed)
    head.after_loading()
    assert (head.packed is not None) == _onednn_packs(torch.float32)
    assert head.weight is embed.weight
    x = torch.randn(3, 128)
    torch.testing.assert_close(head(x), x @ embed.weight.T, atol=1e-5, rtol=1e-5)
