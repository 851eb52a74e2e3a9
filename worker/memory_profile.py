"""The step the memory profile runs: the worst one the scheduler can plan.

The KV cache gets what the profiled step leaves, so that step must peak at least as high as any
real one. The worst step is not one long prompt: it is the whole token budget spread over
`max_num_seqs` requests that all sample, because the LM head then makes `[max_num_seqs, vocab]`
float32 logits and the sampler several more tensors of that shape (a clone, penalty counts,
probabilities, noise, sort buffers for top-p, log-softmax for logprobs): over 1 GB at
256 x 128k. So the profile runs every row as a prompt chunk that ends this step, then samples
each with penalties, temperature, min-p, top-k, top-p and the most logprobs a request may ask.
"""

from __future__ import annotations

import numpy as np

from pagedserve.ipc.messages import MAX_LOGPROBS, SamplingParams
from pagedserve.worker.input_batch import StepInputs
from pagedserve.worker.sampler import SamplingRow

# Every sampler stage on (random, penalties, filters, logprobs): the costliest row there is.
WORST_SAMPLING = SamplingParams(
    temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, presence_penalty=0.5,
    frequency_penalty=0.5, repetition_penalty=1.1, logprobs=MAX_LOGPROBS,
)  # fmt: skip


def worst_step_inputs(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> tuple[StepInputs, int]:
    """The inputs of the worst step and how many KV blocks it writes to.

    min(max_num_seqs, budget) rows share the budget as evenly as possible (no row longer than
    max_model_len); each row is a prompt chunk at positions [0, len) over its own blocks, and
    each ends its prompt here, so every row samples."""
    num_rows = max(1, min(max_num_seqs, max_num_batched_tokens))
    num_tokens = min(max_num_batched_tokens, num_rows * max_model_len)
    base, extra = divmod(num_tokens, num_rows)
    lens = np.array([base + (1 if i < extra else 0) for i in range(num_rows)], dtype=np.int32)
    lens = lens[lens > 0]
    num_rows = len(lens)
    blocks_per_row = -(-int(lens.max()) // block_size)
    block_tables = np.arange(num_rows * blocks_per_row, dtype=np.int32).reshape(num_rows, -1)
    query_start_loc = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
    rows = np.repeat(np.arange(num_rows), lens)
    slot_mapping = block_tables[rows, positions // block_size] * block_size + positions % block_size
    inputs = StepInputs(
        input_ids=np.zeros(len(positions), dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping.astype(np.int64),
        query_start_loc=query_start_loc,
        seq_lens=lens,
        block_tables=block_tables,
        logits_indices=(query_start_loc[1:] - 1).astype(np.int64),
        sample_rows=list(range(num_rows)),
    )
    return inputs, num_rows * blocks_per_row


def worst_sampling_rows(inputs: StepInputs, vocab_size: int) -> list[SamplingRow]:
    """One costliest sampling row per sampled row, its prompt as long as its chunk (penalties
    count prompt tokens)."""
    rows = []
    for n in inputs.seq_lens:
        prompt = np.arange(int(n), dtype=np.int64) % vocab_size
        rows.append(SamplingRow(WORST_SAMPLING, prompt, []))
    return rows
