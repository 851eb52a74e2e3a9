"""`cache_salt` in the core (pure Python, no server): the salt is hashed into the parent of a
request's first block, so requests with different salts (or one salted, one not) never share a
KV block, whatever their tokens, and requests with the same salt share as before. The HTTP side
(`cache_salt`, `--cache-salt-by`, cached_tokens) is in tests/test_hardening_server.py."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import add, make, step

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.ipc.messages import MAX_CACHE_SALT, AddRequest, ClientMessage, SamplingParams

BLOCK = 4
SALTS = st.sampled_from([None, "alice", "bob", "alice\x00", "b"])


def request(req_id: str, tokens: list[int], salt: str | None) -> Request:
    return Request(req_id, tokens, SamplingParams(cache_salt=salt))


def run_alone(kv: KVCacheManager, req: Request) -> int:
    """Allocate `req` as the scheduler would at its first step; the prefix-cache hit, in tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    req.num_computed_tokens = req.num_tokens
    return num_hit


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=14), SALTS), max_size=8))
def test_blocks_are_shared_only_within_a_salt(reqs: list[tuple[list[int], str | None]]) -> None:
    """Requests run together (all holding their blocks): two with different salts hold no block
    in common and no hash in common; two with the same salt share exactly their common full
    leading blocks (the last token of each always computes)."""
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK)
    running = [request(str(i), tokens, salt) for i, (tokens, salt) in enumerate(reqs)]
    for req in running:
        run_alone(kv, req)
    for a in running:
        for b in running:
            if a is b:
                continue
            shared = {id(x) for x in a.blocks[0]} & {id(x) for x in b.blocks[0]}
            if a.sampling.cache_salt != b.sampling.cache_salt:
                assert not shared, (a, b)
                assert not set(a.block_hashes) & set(b.block_hashes)
            else:
                common = 0  # leading full blocks with equal tokens
                while (
                    common < min(len(a.block_hashes), len(b.block_hashes))
                    and a.all_token_ids[common * BLOCK : (common + 1) * BLOCK]
                    == b.all_token_ids[common * BLOCK : (common + 1) * BLOCK]
                ):
                    common += 1
                assert a.block_hashes[:common] == b.block_hashes[:common]


def test_a_guess_with_another_salt_gets_no_cached_tokens() -> None:
    """Through the scheduler: a finished request's prompt is cached for its own salt only."""
    s = make(block_size=BLOCK)
    secret = list(range(20, 33))  # 3 full blocks + 1 token
    add(s, "victim", secret, max_tokens=1, cache_salt="tenant-a")
    step(s)
    hits = {}
    for rid, salt in [("other-salt", "tenant-b"), ("no-salt", None), ("same-salt", "tenant-a")]:
        add(s, rid, secret, max_tokens=1, cache_salt=salt)
        _, out = step(s)
        hits[rid] = out[0][1].num_cached_tokens
        assert not s.has_unfinished_requests()
    assert hits == {"other-salt": 0, "no-salt": 0, "same-salt": 12}


def test_unsalted_cache_is_not_hit_by_salted_requests() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    tokens = list(range(9))
    run_alone(kv, request("plain", tokens, None))
    assert run_alone(kv, request("salted", tokens, "s")) == 0
    assert run_alone(kv, request("plain-again", tokens, None)) == 8
    assert run_alone(kv, request("salted-again", tokens, "s")) == 8


@pytest.mark.parametrize("salt", ["", "\ud800", "x" * (MAX_CACHE_SALT + 1), 7])
def test_bad_salts_are_refused_where_they_arrive(salt: object) -> None:
    """The core's gate: SamplingParams refuses a bad salt, built here or decoded from ipc."""
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=salt)  # type: ignore[arg-type]
    if isinstance(salt, str) and salt and "\ud800" not in salt:
        raw = msgspec.msgpack.encode({"cache_salt": salt})
        with pytest.raises(msgspec.ValidationError, match="cache_salt"):
            msgspec.msgpack.decode(raw, type=SamplingParams)


def test_salt_crosses_ipc() -> None:
    msg = AddRequest("r", [1, 2, 3], SamplingParams(cache_salt="tenant-é"))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=ClientMessage)
    assert decoded.sampling.cache_salt == "tenant-é"
    plain = msgspec.msgpack.encode(AddRequest("r", [1], SamplingParams()))
    assert b"cache_salt" not in plain  # omitted when unset: no cost to unsalted requests
