"""The model runner in one process: a step started before the one before it has finished (what
the worker does under async scheduling) feeds that step's sampled tokens in on the device and
gives exactly the tokens of running every step start to finish."""

from __future__ import annotations

import pytest
import torch

from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import CachedDelta, NewRequest, SamplingParams, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.model_runner import ModelRunner

from tiny_models import tiny_model_dir

PROMPTS = [list(range(20, 27)), list(range(40, 53))]
STEPS = 10
BLOCK = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tiny_model_dir("llama", str(tmp_path_factory.getbasetemp()))
    config = build_engine_config(path, device="cpu", dtype="float32", block_size=BLOCK,
                                 num_gpu_blocks_override=64)  # fmt: skip
    r = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    r.init_cache(64)
    return r


def prefill(step_id: int, params: list[SamplingParams]) -> StepPlan:
    news = [
        NewRequest(f"r{i}", p, list(range(i * 16, (i + 1) * 16)), params[i], 0)
        for i, p in enumerate(PROMPTS)
    ]
    return StepPlan(step_id, [n.req_id for n in news], [len(p) for p in PROMPTS], new_requests=news)


def decode(step_id: int, k: int, tokens: list[list[int]] | None) -> StepPlan:
    """Decode step k after the prefill; `tokens`: what the core tells (None: nothing yet)."""
    cached = [
        CachedDelta(f"r{i}", [] if tokens is None else tokens[i], [], len(p) + k)
        for i, p in enumerate(PROMPTS)
    ]
    return StepPlan(step_id, [c.req_id for c in cached], [1, 1], cached=cached)


def finish_all(runner: ModelRunner, step_id: int) -> None:
    runner.execute(StepPlan(step_id, [], [], finished_ids=[f"r{i}" for i in range(len(PROMPTS))]))


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0, max_tokens=64)] * 2,
        [SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.2, max_tokens=64),
         SamplingParams(temperature=1.0, frequency_penalty=0.7, max_tokens=64)],
    ],
)  # fmt: skip
def test_step_started_before_the_last_finished_equals_step_by_step(runner, params):
    # Step by step: every step finishes before the next starts; the core tells each token.
    runner.sampler = type(runner.sampler)(seed=0)
    res = runner.execute(prefill(0, params))
    got = [[t[0]] for t in res.sampled_token_ids]
    for k in range(STEPS):
        res = runner.execute(decode(k + 1, k, [[g[-1]] for g in got]))
        for g, t in zip(got, res.sampled_token_ids, strict=True):
            g.extend(t)
    finish_all(runner, 100)

    # Lookahead: each decode starts while the step before is unfinished, so its input token
    # is only on the device; the core tells nothing.
    runner.sampler = type(runner.sampler)(seed=0)
    pending = runner.sample(runner.start(prefill(200, params), None))
    ahead = [[] for _ in PROMPTS]
    for k in range(STEPS):
        started = runner.start(decode(201 + k, k, None), pending)
        assert len(started.inputs.unknown) == len(PROMPTS), "inputs came from the device"
        res = runner.finish(pending)
        for a, t in zip(ahead, res.sampled_token_ids, strict=True):
            a.extend(t)
        pending = runner.sample(started)
    res = runner.finish(pending)
    for a, t in zip(ahead, res.sampled_token_ids, strict=True):
        a.extend(t)
    finish_all(runner, 300)
    assert ahead == got


# ---------------------------------------------------------------- mixed-step graph padding
@pytest.mark.parametrize("max_model_len", [1, 5, 16, 40, 100, 1000])
def test_mixed_graph_padding_stays_inside_its_block_table(max_model_len):
    """With max_model_len below a bucket gap, the padding row's length used to exceed its
    block table (reads past the staging buffer): now a step uses a bucket only if the padding
    fits, else it runs eagerly; the laid-out metadata is consistent either way."""
    import numpy as np

    from pagedserve.worker.cuda_graphs import MIXED_TOKEN_SIZES, lay_out_mixed, mixed_bucket
    from pagedserve.worker.input_batch import StepInputs

    block_size, max_seqs = 16, 4
    max_blocks = -(-max_model_len // block_size)
    capacity, slots = max_blocks * block_size, max_seqs + 1
    sizes = list(MIXED_TOKEN_SIZES)
    used = 0
    for num_tokens in range(1, 1100, 7):
        lens = [min(num_tokens, max_model_len)] * -(-num_tokens // max_model_len)
        lens[-1] = num_tokens - sum(lens[:-1])
        if len(lens) > max_seqs:
            continue
        size = mixed_bucket(sizes, slots, capacity, num_tokens, len(lens))
        if size is None:
            continue
        used += 1
        assert num_tokens <= size <= num_tokens + capacity
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        zeros = np.zeros(num_tokens, dtype=np.int64)
        tables = np.arange(len(lens) * max_blocks, dtype=np.int32).reshape(-1, max_blocks) + 1
        inputs = StepInputs(zeros, zeros, zeros, qsl, np.array(lens, np.int32), tables, zeros, [])
        a64 = np.zeros((3, sizes[0]), np.int64)
        a32 = np.full(2 * slots + 1 + slots * max_blocks, 0, np.int32)
        end = lay_out_mixed(a64, a32, inputs, size, slots, max_blocks)
        q, seq = a32[: slots + 1], a32[slots + 1 : 2 * slots + 1]
        assert q[-1] == size and (np.diff(q) >= 0).all() and (np.diff(q) <= seq).all()
        assert seq[-1] == size - num_tokens <= capacity  # the padding row fits its table
        assert (a64[2, num_tokens:size] == -1).all()
        assert end == 2 * slots + 1 + len(lens) * max_blocks  # the padding row stays block 0
    assert used > 0 if max_model_len >= 64 else True
    if max_model_len < 64:  # smaller than every gap: a 1-token step cannot pad to 64
        assert mixed_bucket(sizes, slots, capacity, 1, 1) is None


# ---------------------------------------------------------------- the memory profile's step
@pytest.mark.parametrize(
    "budget,seqs,max_len,rows,tokens",
    [(8192, 256, 4096, 256, 8192), (100, 256, 4096, 100, 100), (8192, 2, 1000, 2, 2000),
     (8191, 3, 8192, 3, 8191)],
)  # fmt: skip
def test_profiled_step_is_the_worst_step(budget, seqs, max_len, rows, tokens):
    """The whole budget over max_num_seqs rows (not one request of min(budget, max_len)
    tokens), every row sampled, each row within max_model_len over its own blocks."""
    import numpy as np

    from pagedserve.worker.memory_profile import WORST_SAMPLING, worst_step_inputs

    inputs, num_blocks = worst_step_inputs(budget, seqs, max_len, BLOCK)
    assert len(inputs.seq_lens) == rows and len(inputs.input_ids) == tokens
    assert inputs.seq_lens.max() <= max_len and inputs.seq_lens.max() - inputs.seq_lens.min() <= 1
    assert (np.diff(inputs.query_start_loc) == inputs.seq_lens).all()
    assert inputs.sample_rows == list(range(rows))
    assert (inputs.logits_indices == inputs.query_start_loc[1:] - 1).all()
    slots = inputs.slot_mapping
    assert (
        len(set(slots.tolist())) == tokens and slots.min() >= 0 and slots.max() < num_blocks * BLOCK
    )
    p = WORST_SAMPLING
    assert p.top_p < 1 and p.top_k > 0 and p.logprobs and p.repetition_penalty != 1 and not p.greedy


def test_profile_samples_max_num_seqs_rows_over_the_vocabulary(runner, monkeypatch):
    """The profile's forward ends in the sampler over [max_num_seqs, vocab] logits, with
    penalties and top-p (CPU: the same code path the GPU profile measures)."""
    seen = []
    sample_ids = runner.sampler.sample_ids
    monkeypatch.setattr(
        runner.sampler,
        "sample_ids",
        lambda logits, rows: seen.append((logits.shape, rows)) or sample_ids(logits, rows),
    )
    runner._dummy_forward()
    sched = runner.config.scheduler
    ((shape, rows),) = seen
    want = min(sched.max_num_seqs, sched.max_num_batched_tokens)
    assert tuple(shape) == (want, runner.config.model.vocab_size)
    assert all(r.params.top_p < 1 and r.params.presence_penalty for r in rows)


@pytest.mark.parametrize(
    ("cores", "ranks", "weights", "expected"),
    [(2, 1, 1 << 20, 1), (2, 1, 200 << 20, 2), (8, 2, 1 << 20, 3), (8, 2, 200 << 20, 4)],
)
def test_cpu_threads_leave_a_core_to_the_host_only_for_small_models(
    runner, monkeypatch, cores, ranks, weights, expected
):
    from pagedserve.worker.device import set_cpu_threads, weight_bytes

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(ranks, weights) == expected == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    plain = sum(p.numel() * 4 for p in runner.model.parameters())
    packed = sum(m.packed.numel() * 4 for m in runner.model.modules() if _packed(m))
    assert weight_bytes(runner.model) == plain + packed


def _packed(module) -> bool:
    return getattr(module, "packed", None) is not None


def test_profile_scores_a_chunk_of_prompt_logprobs(runner, monkeypatch):
    """The profile's peak counts prompt logprobs: one CHUNK of positions through the LM head,
    with the largest top-N (worker/prompt_logprobs.py)."""
    from pagedserve.ipc.messages import MAX_LOGPROBS
    from pagedserve.worker import model_runner
    from pagedserve.worker.prompt_logprobs import CHUNK

    seen, real = [], model_runner.score_positions
    monkeypatch.setattr(
        model_runner,
        "score_positions",
        lambda f, hidden, idx, tgt, n: seen.append((len(idx), n)) or real(f, hidden, idx, tgt, n),
    )
    runner._dummy_forward()
    sched, vocab = runner.config.scheduler, runner.config.model.vocab_size
    assert seen == [(min(CHUNK, sched.max_num_batched_tokens), min(MAX_LOGPROBS, vocab))]
