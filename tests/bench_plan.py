"""Worker-side host cost of one decode plan for 256 running requests: msgpack encode + decode and
the persistent batch's `apply`, with each request's sampled token sent back in the plan (what
pipeline stages need) and without (one stage: every rank keeps its own samples).

    python tests/bench_plan.py
"""

from __future__ import annotations

import timeit

import msgspec

from pagedserve.ipc.messages import CachedDelta, CoreToWorker, NewRequest, SamplingParams, StepPlan
from pagedserve.worker.input_batch import InputBatch

B, PROMPT, MAX_LEN, BLOCK = 256, 1000, 4096, 16


def decode_plan(num_computed: int, with_tokens: bool) -> StepPlan:
    cached = [CachedDelta(f"r{i}", [7] if with_tokens else [], [], num_computed) for i in range(B)]
    return StepPlan(1, [f"r{i}" for i in range(B)], [1] * B, cached=cached)


def main() -> None:
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreToWorker)
    blocks = -(-MAX_LEN // BLOCK)
    for with_tokens in (True, False):
        batch = InputBatch(B, MAX_LEN, BLOCK)
        news = [
            NewRequest(f"r{i}", list(range(PROMPT)), list(range(i * blocks, (i + 1) * blocks)),
                       SamplingParams(), PROMPT)
            for i in range(B)
        ]  # fmt: skip
        batch.apply(StepPlan(0, [], [], new_requests=news))
        step = [PROMPT]

        def one(batch=batch, step=step, with_tokens=with_tokens) -> None:
            batch.apply(dec.decode(enc.encode(decode_plan(step[0], with_tokens))))
            step[0] += 1

        seconds = min(timeit.repeat(one, number=200, repeat=5)) / 200
        size = len(enc.encode(decode_plan(PROMPT, with_tokens)))
        print(f"tokens in the plan: {with_tokens!s:<5}  {1e6 * seconds:5.0f} us per plan, "
              f"{size} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
