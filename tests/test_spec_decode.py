"""Speculative decoding (issue 38): the config refuses what we lack by name, the proposers draft
what they should, the scheduler budgets and frees exactly with drafts in flight, verification
keeps the target distribution (chi-square), and through the real engine the output is token for
token the same with speculation on and off (greedy and seeded sampling, logprobs, stop strings,
max_tokens)."""

from __future__ import annotations

import random
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedserve import LLM
from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.spec_decode.decoder import SpecDecoder, token_proposer
from pagedserve.core.spec_decode.ngram import NgramProposer
from pagedserve.core.spec_decode.suffix import SuffixProposer
from pagedserve.ipc.messages import AddRequest, SamplingParams, StepPlan, StepResult
from pagedserve.speculative_config import SpeculativeConfig
from pagedserve.worker.sampler import Sampler, SamplingRow, apply_penalties, filtered_probs
from pagedserve.worker.sampler_drafts import SamplerDrafts
from pagedserve.worker.spec_verify import verify

from tiny_models import tiny_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5}


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"method": "mtp", "num_speculative_tokens": 3, "model": "x"}, "'mtp' is not implemented"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' needs 'model'"),
        ({"model": "some/draft", "num_speculative_tokens": 3}, "'method' is required"),
        ({"method": "medusa2", "num_speculative_tokens": 3}, "unknown method 'medusa2'"),
        ({**NGRAM, "acceptance_method": "typical"}, "unknown key 'acceptance_method'"),
        ({**NGRAM, "suffix_decoding_max_tree_depth": 8}, "does not apply to 'ngram'"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 4}, "prompt_lookup_min <= prompt_lookup_max"),
        ({**NGRAM, "draft_tensor_parallel_size": 1}, "'draft_tensor_parallel_size'"),
        ("{not json", "not JSON"),
    ],
)
def test_config_refuses_by_name(value, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.from_value(value)


def test_every_method_refuses_a_linear_attention_target():
    hybrid = SimpleNamespace(hf={"layer_types": ["linear_attention", "full_attention"]})
    for value in (NGRAM, {"method": "suffix", "num_speculative_tokens": 3}):
        with pytest.raises(ValueError, match="linear-attention layers"):
            SpeculativeConfig.from_value(value).check_engine(hybrid, 1, 1)


def test_config_defaults_like_vllm():
    c = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2,
                                      "prompt_lookup_max": 3})  # fmt: skip
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)


# ---------------------------------------------------------------- proposers
def test_ngram_longest_recent_match():
    p = NgramProposer(1, 3)
    # tail (7, 8, 9) occurred at 1..3 followed by 10 11; (8, 9) alone also at 6..7 followed by 4
    tokens = [0, 7, 8, 9, 10, 11, 8, 9, 4, 5, 7, 8, 9]
    assert p.propose(tokens, 2) == [10, 11]
    tokens += [1]  # tail 1: never seen before; (9, 1), (8, 9, 1) neither
    assert p.propose(tokens, 3) == []
    tokens += [5]  # tail (1, 5) no; 5 alone: most recent earlier 5 at 9, followed by 7 8 9
    assert p.propose(tokens, 3) == [7, 8, 9]


def test_suffix_longest_match_any_length():
    p = SuffixProposer(max_depth=64, max_spec_factor=1.0)
    file = [random.Random(0).randrange(100) for _ in range(40)]
    tokens = file + [200, 201] + file[:10]  # a reply copying the file after a change
    assert p.propose(tokens, 5) == file[10:15]
    assert p.propose([*tokens, 999], 5) == []
    short = SuffixProposer(max_depth=64, max_spec_factor=0.5)
    assert short.propose([1, 2, 3, 4, 9, 3, 4], 5) == [9]  # match of 2 -> at most 1 token


# ---------------------------------------------------------------- scheduler
def target_next(seq: list[int]) -> int:
    """A deterministic 'model' with repetitive output, so prompt lookup has something to find."""
    return 3 + (seq[-1] * 7 + seq[-2]) % 11 if len(seq) % 23 else 2  # 2: EOS sometimes


class FakeWorkers:
    """Runs plans in order like the workers: keeps each request's tokens, drafts where the plan
    leaves it to them (ngram after sampling: from where the row really is), verifies drafts
    greedily against `target_next` (accepted drafts, then the target's token)."""

    def __init__(self, spec: SpeculativeConfig | None = None) -> None:
        self.seqs: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}  # block tables, kept as the workers keep them
        self.drafter = SamplerDrafts(partial(token_proposer, spec))

    def run(self, plan: StepPlan) -> StepResult:
        self.drafter.forget(plan.finished_ids)
        for new in plan.new_requests:
            self.seqs[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.tables[new.req_id] = list(new.block_ids)
        for delta in plan.cached:  # worker/input_batch.py's rule
            table = self.tables[delta.req_id]
            start = len(table) if delta.num_blocks_before is None else delta.num_blocks_before
            table[start:] = delta.new_block_ids
        computed = {d.req_id: d.num_computed_tokens for d in plan.cached}
        computed |= {n.req_id: n.num_computed_tokens for n in plan.new_requests}
        sampled, num_drafts = [], []
        for req_id, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens, strict=True):
            seq, drafts = self.seqs[req_id], plan.draft_token_ids.get(req_id, [])
            k = plan.num_sampler_drafts.get(req_id)
            if k is not None:  # planned as if its drafts in flight were all accepted
                assert computed[req_id] >= len(seq) - 1 and n == 1 + k
                drafts = self.drafter.propose(req_id, np.array(seq), k)
                computed[req_id], n = len(seq) - 1, 1 + len(drafts)
            num_drafts.append(len(drafts))
            assert computed[req_id] + n <= len(seq) + len(drafts)
            if computed[req_id] + n < len(seq) + len(drafts):
                sampled.append([])
                continue
            new = []
            for d in drafts:
                if d != target_next(seq + new):
                    break
                new.append(d)
            new.append(target_next(seq + new))
            seq += new
            sampled.append(new)
        result = StepResult(plan.step_id, sampled)
        if plan.num_sampler_drafts:
            result.num_drafts = num_drafts
        return result


def run_scheduler(spec: SpeculativeConfig | None, num_blocks: int, async_scheduling: bool):
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24),
        CacheConfig(block_size=4),
        max_model_len=96,
        num_blocks=num_blocks,
        debug=True,  # full invariant checks after every call
        async_scheduling=async_scheduling,
        workers_keep_samples=True,
        speculative=spec,
    )
    rng = random.Random(1)
    for i in range(6):
        prompt = [rng.randrange(3, 14) for _ in range(rng.randrange(3, 30))]
        sampling = {"temperature": 0, "max_tokens": rng.randrange(5, 60)}
        s.add_request(
            AddRequest(f"r{i}", prompt, sampling=SamplingParams(**sampling), eos_token_ids=[2])
        )
    workers, inflight, outputs = FakeWorkers(spec), [], {}
    while s.has_unfinished_requests() or inflight:
        while len(inflight) < 2 and s.has_unfinished_requests():
            plan = s.schedule()
            if not plan.scheduled_ids:
                break
            assert sum(plan.num_scheduled_tokens) <= 24
            for req_id, drafts in plan.draft_token_ids.items():
                req = s.requests[req_id]
                assert req.num_blocks * 4 >= req.num_computed_tokens  # drafts' slots allocated
                assert len(drafts) <= spec.num_speculative_tokens
            inflight.append((plan, workers.run(plan)))
            for req_id in plan.scheduled_ids:  # the workers index the core's blocks
                req = s.requests[req_id]
                assert workers.tables[req_id][: req.num_blocks] == req.block_ids[0]
        plan, result = inflight.pop(0)
        assert s.check_result(plan, result, vocab_size=16) is None
        for _, delta in s.update_from_output(plan, result):
            outputs.setdefault(delta.req_id, []).extend(delta.new_token_ids)
            req = s.requests.get(delta.req_id)
            if req is not None and req.num_placeholders == 0:  # none in flight: exact count
                assert req.num_computed_tokens == req.num_tokens - 1
                # no block held only for rejected drafts
                assert req.num_blocks == -(-req.num_computed_tokens // 4)
    assert s.kv.pool.num_free == num_blocks  # everything freed
    return outputs, s


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_blocks", [64, 24])  # 24: preemptions with drafts in flight
def test_scheduler_with_drafts_gives_the_same_tokens(async_scheduling, num_blocks):
    off, _ = run_scheduler(None, num_blocks, async_scheduling)
    for value in (NGRAM, SUFFIX):
        spec = SpeculativeConfig.from_value(value)
        on, s = run_scheduler(spec, num_blocks, async_scheduling)
        assert on == off
        stats = s.get_stats()
        assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_drafts > 0
        assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
        assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
        if num_blocks == 24:
            assert s.num_preemptions > 0


def test_disable_by_batch_size_turns_speculation_off():
    spec = SpeculativeConfig.from_value({**NGRAM, "disable_by_batch_size": 2})
    on, s = run_scheduler(spec, 64, True)
    assert on == run_scheduler(None, 64, True)[0]
    # 6 requests, max 4 running: speculation only once at most one is left
    assert 0 < s.get_stats().spec_num_drafts < 30


def test_a_row_waits_for_its_token_only_with_a_draft_in_sight():
    """With its last token in flight, a row whose known tokens draft nothing decodes ahead of
    its result (a plain step, []); one whose known tokens repeat waits for it (None), to draft
    from it."""
    decoder = SpecDecoder(SpeculativeConfig.from_value(NGRAM), max_model_len=96)

    def decoding(prompt: list[int]) -> Request:
        req = Request("r", prompt, SamplingParams(temperature=0, max_tokens=20))
        req.num_computed_tokens, req.num_placeholders = len(prompt), 1  # one token in flight
        return req

    assert decoder.drafts_for(decoding([3, 4, 5, 6, 7]), budget=24, busy=False) == []
    assert decoder.drafts_for(decoding([3, 4, 5, 3, 4]), budget=24, busy=False) is None


# ---------------------------------------------------------------- verification
def test_verification_keeps_the_target_distribution():
    """Rows with drafts at two positions, thousands of draws: the first new token follows p0
    (processed logits: penalties, temperature, top-k, top-p), and after an accepted draft the
    second follows p1 (penalties counting the draft). Chi-square, p > 1e-3."""
    vocab, n = 8, 6000
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=1.0, top_k=6, top_p=0.95, repetition_penalty=1.3,
                            presence_penalty=0.4)  # fmt: skip
    draft = int(base[0].argmax())  # a likely draft, so many are accepted
    rows = [SamplingRow(params, [1, 2], [3]) for _ in range(n)]
    logits = base.repeat(n, 1)  # [2n, V]: row i's positions 0 and 1
    v = verify(Sampler(seed=1), logits, rows, [[draft]] * n, logprobs=False)
    firsts = torch.tensor([a[0] for a in v.accepted])
    seconds = torch.tensor([a[1] for a in v.accepted if len(a) == 2])
    for observed, position, outputs in [(firsts, 0, [3]), (seconds, 1, [3, draft])]:
        row = SamplingRow(params, [1, 2], outputs)
        lg = base[position : position + 1].clone()
        apply_penalties(lg, [row])
        p = filtered_probs(lg, [row])[0]
        counts = torch.bincount(observed, minlength=vocab).double()
        keep = p > 0
        assert counts[~keep].sum() == 0  # nothing outside top-k / top-p
        expected = p[keep].double() / p[keep].double().sum() * len(observed)
        assert chisquare(counts[keep], expected).pvalue > 1e-3
    assert 0.2 * n < len(seconds) < n  # drafts were accepted and rejected


# ---------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir("llama", str(tmp_path_factory.getbasetemp()))


def generate(model_dir, spec, prompts, params):
    with LLM(model_dir, device="cpu", dtype="float32", block_size=4,
             speculative_config=spec) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return outs, llm.last_stats


def test_engine_same_tokens_on_and_off(model_dir):
    """Greedy and seeded rows, logprobs, a stop string and max_tokens: the same outputs with
    ngram and suffix speculation as without, and drafts were accepted."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(30)] * 2, list(range(40, 80)), [7, 8, 9] * 9]
    params = [
        SamplingParams(temperature=0, max_tokens=48, logprobs=2),
        SamplingParams(temperature=1.0, seed=11, max_tokens=40, top_p=0.9),
        SamplingParams(temperature=0.7, seed=5, max_tokens=33, repetition_penalty=1.2),
    ]
    off, _ = generate(model_dir, None, prompts, params)
    text = off[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params.append(SamplingParams(temperature=0, max_tokens=48, stop=[stop]))
    prompts.append(prompts[0])
    for spec in (NGRAM, SUFFIX):
        on, stats = generate(model_dir, spec, prompts, params)
        stopped = on.pop()
        assert stopped.outputs[0].finish_reason == "stop"
        assert stopped.outputs[0].text == text[: text.index(stop)]
        for a, b in zip(on, off, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].text == b.outputs[0].text
            assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        for x, y in zip(on[0].outputs[0].logprobs, off[0].outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        assert stats.spec_num_accepted_tokens > 0, spec


def test_metrics_under_vllm_names(monkeypatch):
    """/metrics: vLLM's spec_decode_* counters (and per-position acceptance) once the engine
    speculates; none before."""
    from pagedserve.frontend.openai.metrics import Metrics
    from pagedserve.ipc.messages import SchedulerStats

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = Metrics("m")
    metrics.on_stats(0, SchedulerStats())
    assert b"spec_decode" not in metrics.render()[0]
    stats = SchedulerStats(spec_num_drafts=5, spec_num_draft_tokens=20, spec_num_accepted_tokens=9,
                           spec_accepted_per_pos=[5, 3, 1, 0])  # fmt: skip
    metrics.on_stats(0, stats)
    text = metrics.render()[0].decode()
    for prefix in ("pagedserve:", "vllm:"):
        labels = '{engine="0",model_name="m"}'
        assert f"{prefix}spec_decode_num_drafts_total{labels} 5.0" in text
        assert f"{prefix}spec_decode_num_draft_tokens_total{labels} 20.0" in text
        assert f"{prefix}spec_decode_num_accepted_tokens_total{labels} 9.0" in text
        per_pos = f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"
        assert per_pos + '{engine="0",model_name="m",position="1"} 3.0' in text


def test_stats_log_line_like_vllm(caplog):
    from pagedserve.core.stats_log import StatsLog
    from pagedserve.ipc.messages import SchedulerStats

    log = StatsLog(1.0, now=0.0)
    stats = SchedulerStats(num_running=1, spec_num_drafts=4, spec_num_draft_tokens=12,
                           spec_num_accepted_tokens=6, spec_accepted_per_pos=[4, 2, 0])  # fmt: skip
    with caplog.at_level("INFO", logger="pagedserve.engine"):
        log.maybe_log(2.0, stats, 0)
    assert (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 tokens/s, "
        "Drafted throughput: 6.00 tokens/s, Accepted: 6 tokens, Drafted: 12 tokens, "
        "Per-position acceptance rate: 1.000, 0.500, 0.000, Avg Draft acceptance rate: 50.0%"
    ) in caplog.text
