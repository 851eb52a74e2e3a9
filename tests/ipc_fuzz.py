"""Hypothesis strategies for hostile frames on each of the EngineCore's sockets (ipc/messages.py).

Frames are built as the msgpack the core decodes (tagged arrays for the array_like messages, a map
for SamplingParams), not through the Structs, so values their constructors would refuse and values
of the wrong type travel too. Each frame is sent whole, truncated, with a byte flipped, or replaced
by random bytes. Left out on purpose: ShutdownEngine (a client may stop the engine) and a
WorkerError from a rank that exists (a worker reporting its own failure must stop the engine);
step ids are far from those in flight (a well-formed result for the step in flight is a worker's
word, as on a real link; results that do not fit their plan are unit-tested in test_scheduler).
"""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st

EDGES = [0, 1, -1, 255, 256, 511, 512, 4095, 4096, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1]
ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(EDGES))
small = st.one_of(st.integers(0, 600), st.sampled_from(EDGES))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=12))
anything = st.recursive(
    scalars | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=10,
)
token_lists = st.lists(small, min_size=0, max_size=12) | st.lists(ints, max_size=4)
sampling = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 3) | st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**64 - 1]),
     "temperature": st.sampled_from([0.0, 0.7])},
    optional={
        "n": small, "seed": ints, "logprobs": small, "top_k": ints, "top_p": st.floats(),
        "min_tokens": small, "stop_token_ids": token_lists,
        "logit_bias": st.dictionaries(ints, st.floats(), max_size=3), "presence_penalty": scalars,
        "repetition_penalty": st.floats(), "prompt_logprobs": scalars, "stop": anything,
    },
)  # fmt: skip
clients = st.sampled_from([0, 1, 99]) | ints  # 0: the API server that is being served


def add_request() -> st.SearchStrategy[list]:
    return st.tuples(
        st.just("AddRequest"), st.text(max_size=300), token_lists, sampling | anything,
        token_lists, st.floats(), ints, clients,
    ).map(list)  # fmt: skip


def client_hello(ipc_dir: str) -> st.SearchStrategy[list]:
    addresses = st.text(max_size=40) | st.sampled_from(
        [f"ipc://{ipc_dir}/fuzz", f"ipc://{ipc_dir}/" + "x" * 300, f"ipc://{ipc_dir}/../x",
         "tcp://127.0.0.1:1", "inproc://x", "ipc://", ""]
    )  # fmt: skip
    return st.tuples(st.just("ClientHello"), clients, addresses).map(list)


def client_message(ipc_dir: str) -> st.SearchStrategy[list]:
    return st.one_of(
        add_request(),
        client_hello(ipc_dir),
        st.tuples(st.just("AbortRequests"), st.lists(st.text(max_size=8))).map(list),
        st.just(["ResetPrefixCache"]),
        st.tuples(st.sampled_from(["AddRequest", "Nope", "ShutdownEngine2"]), anything).map(list),
    )


far_steps = st.integers(-(2**63), -1) | st.integers(10**9, 2**64 - 1)


def worker_message(world_size: int) -> st.SearchStrategy[list]:
    entry = st.tuples(token_lists, st.lists(st.floats()), token_lists).map(list)
    logprobs = st.none() | st.lists(st.none() | st.lists(entry))
    return st.one_of(
        st.tuples(
            st.just("StepResult"), far_steps, st.lists(token_lists, max_size=6), logprobs
        ).map(list),
        st.tuples(st.just("WorkerReady"), ints, ints, st.text(max_size=12)).map(list),
        st.tuples(
            st.just("WorkerError"),
            ints.filter(lambda r: not 0 <= r < world_size),
            st.text(max_size=40),
        ).map(list),  # fmt: skip
        st.tuples(st.sampled_from(["StepResult", "WorkerReady", "InitCache"]), anything).map(list),
    )


def frames(messages: st.SearchStrategy[list]) -> st.SearchStrategy[bytes]:
    """An encoded message, whole, cut short or with one byte flipped; or random bytes."""

    @st.composite
    def mangle(draw) -> bytes:
        data = msgspec.msgpack.encode(draw(messages))
        how = draw(st.sampled_from(["whole", "cut", "flip"]))
        if how == "cut" and data:
            return data[: draw(st.integers(0, len(data) - 1))]
        if how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
        return data

    return st.one_of(mangle(), st.binary(max_size=64))
