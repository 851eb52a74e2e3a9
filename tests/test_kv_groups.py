"""KV cache groups: how layers split into groups, and the core's block accounts per group.

Pure Python (no model, no torch): Gemma-like configs mix sliding-window and global layers; the
windowed groups keep a window's worth of blocks however long a conversation grows, the global
group keeps every block, and prefix hits stay correct. The hypothesis state machine in
test_scheduler.py checks the pool invariants with mixed groups; the engine test in
test_model_families.py checks Gemma token for token against transformers."""

from __future__ import annotations

import pytest
from test_scheduler import EOS, add, make, step

from pagedserve.core.block_pool import SKIPPED_BLOCK
from pagedserve.core.kv_cache_manager import cdiv
from pagedserve.hf_config import kv_cache_groups, layer_kv_slot


def gemma3(num_layers: int, window: int = 32) -> dict:
    return {
        "model_type": "gemma3_text",
        "num_hidden_layers": num_layers,
        "sliding_window": window,
        "sliding_window_pattern": 6,
    }


def test_groups_split_each_kind_into_groups_of_the_smallest_kinds_size():
    groups = kv_cache_groups(gemma3(12))  # layers 5 and 11 global, ten local
    assert [(g.window, g.layer_ids) for g in groups] == [
        (None, (5, 11)),
        *[(32, ids) for ids in [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]],
    ]
    assert layer_kv_slot(gemma3(12), 11) == (0, 1) and layer_kv_slot(gemma3(12), 6) == (3, 1)
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 16}
    assert [(g.window, g.layer_ids) for g in kv_cache_groups(gemma2)] == [
        (None, (1, 3)),
        (16, (0, 2)),
    ]
    llama = {"model_type": "llama", "num_hidden_layers": 3, "sliding_window": 16}
    assert [(g.window, g.layer_ids) for g in kv_cache_groups(llama)] == [(None, (0, 1, 2))]
    mistral = {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 16}
    assert [g.window for g in kv_cache_groups(mistral)] == [16]


def test_a_long_conversation_holds_a_window_of_blocks_in_windowed_groups():
    """Five chat turns with Gemma-3-like groups (window 10, 4-token blocks): each turn resends the
    conversation, hits the prefix cache, prefills in chunks and decodes. The global group holds a
    block per 4 tokens; each windowed group never more than ceil(10 / 4) + 1 while decoding."""
    windows = [g.window for g in kv_cache_groups(gemma3(6, window=10))]
    assert windows == [None, 10, 10, 10, 10, 10]
    s = make(num_blocks=160, block_size=4, budget=12, max_model_len=256, windows=windows)
    bound = cdiv(10, 4) + 1
    conversation, num_computed = list(range(10, 40)), 0
    for turn in range(5):
        rid = f"turn{turn}"
        add(s, rid, conversation, max_tokens=16, ignore_eos=True)
        plan, _ = step(s)
        req = s.requests[rid]
        hit = plan.new_requests[0].num_computed_tokens
        # Every full block the last turn computed, in the global group and each window's.
        assert hit == min(num_computed // 4, (len(conversation) - 1) // 4) * 4, (turn, hit)
        assert all(n == max(hit - 10 + 1, 0) // 4 for n in req.num_skipped_blocks[1:])
        peak = 0
        while rid in s.requests:
            held = [len([b for b in blocks if b is not SKIPPED_BLOCK]) for blocks in req.blocks]
            assert held[0] == req.num_blocks, "the global group keeps every block"
            if req.num_computed_tokens > len(conversation):  # decoding
                assert max(held[1:]) <= bound, held
            peak = max(peak, sum(held))
            step(s)
        num_computed = req.num_computed_tokens
        conversation = req.all_token_ids + [EOS] + list(range(50, 60))  # the user's next turn
        # One token's window per windowed group, a chunk beyond: far below 6 x the global count.
        assert peak <= cdiv(len(conversation), 4) + 5 * cdiv(10 + 12 + 2, 4), peak
    assert s.kv.num_free_blocks == 160


def test_a_windowed_hit_needs_only_the_blocks_its_window_reads():
    """A hit of k blocks needs the global group's blocks 0..k-1 and, in the windowed group, only
    those the token at k * block_size reads: with that group's block 7 gone the hit drops to 7
    blocks, whose window (positions 21..27) is still cached."""
    s = make(num_blocks=64, block_size=4, windows=[None, 8])
    add(s, "a", range(10, 43), max_tokens=1)  # 33 tokens: 8 full blocks
    a = s.requests["a"]
    while s.has_unfinished_requests():
        step(s)
    hashes = s.kv.block_hashes(a, 8)
    gone = s.kv.pool.lookup(s.kv._key(hashes[7], 1))
    assert gone is not None and gone.ref_cnt == 0
    s.kv.pool._evict(gone)  # as if reused for other content
    add(s, "b", range(10, 43), max_tokens=2)
    plan, _ = step(s)
    assert plan.new_requests[0].num_computed_tokens == 28
    b = s.requests["b"]
    assert b.num_skipped_blocks == [0, 5] and b.blocks[1][5] is not SKIPPED_BLOCK
    assert plan.new_requests[0].group_block_ids[0][:5] == [0] * 5


def test_too_small_a_cache_for_the_groups_is_refused():
    with pytest.raises(ValueError, match="over 2 KV cache groups"):
        make(num_blocks=16, block_size=4, budget=16, max_model_len=64, windows=[None, 8])
    make(num_blocks=16 + 7, block_size=4, budget=16, max_model_len=64, windows=[None, 8])


def test_every_groups_hits_are_taken_before_any_group_pops_new_blocks():
    """A full pool of cached blocks, the global group's first (LRU order): the new block the
    global group pops must not be one the windowed group is about to hit (found by the state
    machine; the invariants catch a block in two groups)."""
    s = make(num_blocks=12, block_size=4, max_model_len=24, windows=[None, 8])
    add(s, "a", range(10, 27), max_tokens=1)  # 17 tokens: 5 blocks per group, then freed
    step(s)
    add(s, "c", range(100, 107), max_tokens=5)  # takes the 4 uncached blocks
    step(s)
    add(s, "b", [*range(10, 27), 50, 51, 52])  # hits 4 blocks: [0-3] and [skip, skip, 2, 3]
    plan, _ = step(s)
    assert plan.new_requests[0].num_computed_tokens == 16 and s.kv.num_free_blocks == 0
