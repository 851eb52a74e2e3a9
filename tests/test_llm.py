"""The engine end to end through `LLM` (real EngineCore and worker processes), token for token
against transformers' own `generate` on tiny random-weight models of every supported family."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.errors import EngineDeadError
from pagedserve.ipc.messages import MAX_LOGPROBS, AbortRequests, AddRequest, ClientHello

from proctools import descendants, wait_gone
from tiny_models import TINY_KINDS, make_tiny_model

NUM_NEW = 12
CPU = dict(device="cpu", dtype="float32")


def make_prompts(vocab: int, count: int = 8, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 17, 30, 5, 41, 12, 23][:count]
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model_dir: str, prompts: list[list[int]], n: int) -> tuple[list, list]:
    """transformers' greedy tokens and the raw-logit logprob of each chosen token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        new = out.sequences[0, len(prompt) :].tolist()
        lps = [
            torch.log_softmax(lg[0].float(), -1)[t].item()
            for lg, t in zip(out.logits, new, strict=False)
        ]
        tokens.append(new)
        logprobs.append(lps)
    return tokens, logprobs


@pytest.fixture(scope="module", params=TINY_KINDS)
def family(request, tmp_path_factory):
    path = make_tiny_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = make_prompts(vocab)
    tokens, logprobs = hf_greedy(path, prompts, NUM_NEW)
    return path, prompts, tokens, logprobs


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, **kw)


def run(path: str, prompts: list[list[int]], params: SamplingParams, **kw) -> list:
    with LLM(path, **CPU, **kw) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.fixture(scope="module")
def engine(family):
    """The family's engine of the default configuration, shared by the tests that use it."""
    with LLM(family[0], **CPU) as llm:
        yield llm


def test_greedy_equals_transformers_with_logprobs(family, engine):
    _, prompts, want, want_lps = family
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], greedy(logprobs=2))
    assert [o.outputs[0].token_ids for o in outs] == want
    for out, lps in zip(outs, want_lps, strict=False):
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        assert got == pytest.approx(lps, abs=1e-4)
        assert all(len(d) in (2, 3) for d in out.outputs[0].logprobs)  # sampled + top-2
        assert out.outputs[0].finish_reason == "length"


def test_chunked_prefill_and_preemption_equal_transformers(family):
    path, prompts, want, _ = family
    # 16-token budget forces chunks; 20 blocks of 4 tokens cannot hold 8 running requests.
    outs = run(
        path, prompts, greedy(), max_num_batched_tokens=16, block_size=4,
        num_gpu_blocks_override=20, max_model_len=80,
    )  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == want


def test_prefix_cache_hits_and_same_outputs_without_it(family, engine):
    path, prompts, _, _ = family
    # two full 16-token blocks shared by every prompt, that no earlier request of `engine` had
    shared = prompts[5][::-1][:32]
    batch = [shared + p for p in prompts]
    first = engine.generate([{"prompt_token_ids": batch[0]}], greedy())
    rest = engine.generate([{"prompt_token_ids": p} for p in batch[1:]], greedy())
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 32 for o in rest)
    # Without the cache: transformers on the same batch (the engine equals it, test above), not
    # a second engine (CI time)
    off, _ = hf_greedy(path, batch, NUM_NEW)
    assert [o.outputs[0].token_ids for o in first + rest] == off


def test_async_scheduling_changes_no_output(tmp_path_factory):
    """Async scheduling feeds each sampled token back in before the core has seen it: seeded
    sampling, penalties, min_tokens, stop tokens and logprobs must come out exactly as with it
    off, also under chunked prefill and preemption."""
    path = make_tiny_model("llama", str(tmp_path_factory.mktemp("llama-async")))
    prompts = make_prompts(256)
    params = [
        SamplingParams(temperature=0.8, seed=3, max_tokens=14, logprobs=1),
        SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.4),
        SamplingParams(temperature=1.0, seed=11, top_k=20, top_p=0.9, min_tokens=5, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[17, 23, 99]),
    ] * 2  # fmt: skip
    batch = [{"prompt_token_ids": p} for p in prompts]
    tight = dict(max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=24)
    results = []
    for async_scheduling in (True, False):
        with LLM(path, **CPU, **tight, max_model_len=80, async_scheduling=async_scheduling) as llm:
            outs = llm.generate(batch, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                         o.outputs[0].logprobs) for o in outs])  # fmt: skip
    for on, off in zip(*results, strict=True):
        assert on[:2] == off[:2]  # tokens and finish reasons
        if on[2] is not None:  # batches differ, so fp32 logits may differ in the last bits
            for a, b in zip(on[2], off[2], strict=True):
                assert list(a) == list(b)
                assert [x.logprob for x in a.values()] == pytest.approx(
                    [x.logprob for x in b.values()], abs=1e-4
                )


@pytest.fixture(scope="module")
def llama_llm(tmp_path_factory):
    path = make_tiny_model("llama", str(tmp_path_factory.mktemp("llama-shared")))
    with LLM(path, **CPU) as llm:
        yield llm


def test_strings_chat_and_stop_strings(llama_llm):
    out = llama_llm.generate("the quick brown fox", greedy())[0]
    assert out.prompt_token_ids and len(out.outputs[0].token_ids) == NUM_NEW
    text = out.outputs[0].text
    assert text == llama_llm.get_tokenizer().decode(
        out.outputs[0].token_ids, skip_special_tokens=True
    )
    cut = text.strip()[:3]
    if cut:
        stopped = llama_llm.generate("the quick brown fox", greedy(stop=[cut]))[0].outputs[0]
        assert stopped.finish_reason == "stop" and stopped.stop_reason == cut
        assert stopped.text == text[: text.index(cut)]
    chat = llama_llm.chat([{"role": "user", "content": "hello"}], greedy())[0]
    assert len(chat.outputs[0].token_ids) == NUM_NEW


def test_sampling_n_seed_and_stop_tokens(llama_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10)
    a = llama_llm.generate({"prompt_token_ids": list(range(5, 40))}, params)[0]
    b = llama_llm.generate({"prompt_token_ids": list(range(5, 40))}, params)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    first = a.outputs[0].token_ids[3]
    stop = SamplingParams(temperature=1.0, seed=7, max_tokens=10, stop_token_ids=[first])
    out = llama_llm.generate({"prompt_token_ids": list(range(5, 40))}, stop)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == first
    assert out.token_ids[-1] == first and len(out.token_ids) <= 4


def test_bad_prompts_are_refused(llama_llm):
    with pytest.raises(ValueError, match="empty"):
        llama_llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="max_model_len"):
        llama_llm.generate({"prompt_token_ids": [5] * 10_000})
    with pytest.raises(ValueError, match="token ids"):
        llama_llm.generate({"prompt_token_ids": [10**7]})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_start_close_twice_leaves_no_process(tmp_path_factory):
    path = make_tiny_model("llama", str(tmp_path_factory.mktemp("hygiene")))
    before = set(descendants(os.getpid()))  # other tests' module-scoped engines
    for _ in range(2):
        llm = LLM(path, **CPU)
        core_pid = llm._cores.clients[0].core.pid
        family_pids = [core_pid, *descendants(core_pid)]
        assert len(family_pids) >= 2  # the core and its worker
        llm.close()
        assert wait_gone(family_pids, timeout=10) == []
    assert set(descendants(os.getpid())) - before == set()


def test_killed_worker_raises_quickly(tmp_path_factory):
    path = make_tiny_model("llama", str(tmp_path_factory.mktemp("kill")))
    llm = LLM(path, **CPU)
    core_pid = llm._cores.clients[0].core.pid
    (worker_pid,) = descendants(core_pid)
    os.kill(worker_pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker 0"):
        llm.generate("hello", SamplingParams(max_tokens=500, ignore_eos=True))
    assert time.monotonic() - start < 10
    llm.close()
    assert wait_gone([core_pid, worker_pid], timeout=10) == []


# ---------------------------------------------------------------------- the core is the gate
def refusal(llm: LLM, msg: AddRequest) -> str | None:
    """Send `msg` straight to the core (as any process on its input socket could); the core's
    answer: its reason for refusing it, or None when it admitted it."""
    llm._cores.clients[0].send(msg)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = llm._cores.clients[0].outputs.get(timeout=0.5)
        for delta in getattr(out, "outputs", []):
            if delta.req_id == msg.req_id:
                if delta.finish_reason is None:
                    llm._cores.clients[0].send(AbortRequests([msg.req_id]))
                return delta.error
        llm._cores.clients[0].check_alive()
    raise AssertionError(f"no answer to {msg.req_id}")


def assert_serves(llm: LLM) -> None:
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=2)
    )[0]
    assert len(out.outputs[0].token_ids) == 2


def test_too_many_logprobs_is_refused_not_fatal(llama_llm):
    """Crash 1: logprobs beyond the vocabulary (and beyond the cap) made the worker's topk raise."""
    vocab = llama_llm.config.model.vocab_size
    for logprobs in (vocab + 88, MAX_LOGPROBS + 1):
        with pytest.raises(ValueError, match="logprobs must be at most"):
            llama_llm.generate({"prompt_token_ids": [5, 6]}, greedy(logprobs=logprobs))
    assert_serves(llama_llm)


def test_bad_client_hello_is_dropped(llama_llm):
    """Crash 2: a ClientHello whose output address is no ZeroMQ endpoint raised in the loop."""
    inside = f"ipc://{llama_llm._cores.clients[0].directory}/"
    for index, address in [(7, "not an endpoint"), (8, inside + "x" * 300), (-1, inside + "y"),
                           (9, "tcp://127.0.0.1:1"), (10, inside + "../escape")]:  # fmt: skip
        llama_llm._cores.clients[0].send(ClientHello(index, address))
    # a request naming a client that never said hello is dropped too (nobody to answer)
    llama_llm._cores.clients[0].send(AddRequest("orphan", [5, 6], greedy(), client_index=7))
    assert_serves(llama_llm)


@pytest.mark.parametrize(
    "ids,field",
    [([5, 2**63 + 5], "prompt token ids"), ([-1], "prompt token ids"),
     ([5, 10**6], "prompt token ids"), ([5] * 10_000, "max_model_len")],
    ids=["overflow", "negative", "out-of-vocab", "too-long"],
)  # fmt: skip
def test_bad_token_ids_are_refused_by_the_core(llama_llm, ids, field):
    """Crash 3: ids the core never range-checked (2**63+5 raised OverflowError in hash_block;
    negative or >= vocab ones reached the embedding). The sender gets the reason."""
    msg = AddRequest(
        f"bad-{ids[-1]}", ids, greedy(), client_index=llama_llm._cores.clients[0].client_index
    )
    assert field in (refusal(llama_llm, msg) or "")
    assert_serves(llama_llm)


def test_other_values_the_model_cannot_take(llama_llm):
    vocab = llama_llm.config.model.vocab_size
    index = llama_llm._cores.clients[0].client_index
    cases = {
        "stop_token_ids": greedy(stop_token_ids=[vocab]),
        "logit_bias": greedy(logit_bias={vocab + 3: 1.0}),
    }
    for field, params in cases.items():
        assert field in refusal(llama_llm, AddRequest(f"v-{field}", [5], params, [], 0.0, 0, index))
    eos = AddRequest("v-eos", [5], greedy(), eos_token_ids=[vocab], client_index=index)
    assert "eos_token_ids" in refusal(llama_llm, eos)
    assert refusal(llama_llm, AddRequest("v-ok", [5], greedy(), client_index=index)) is None
    assert_serves(llama_llm)


def test_seed_plus_n_overflow_is_a_value_error(llama_llm):
    """Crash 4: seed + i overflowed 64 bits for choice i (a 500 at the API server)."""
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(n=2, seed=2**63 - 1)
    top = SamplingParams(n=2, seed=2**63 - 2, temperature=1.0, max_tokens=2)
    out = llama_llm.generate({"prompt_token_ids": [5, 6]}, top)[0]
    assert [len(c.token_ids) for c in out.outputs] == [2, 2]


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, so tqdm draws (tqdm's disable=None checks isatty)."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_on_a_terminal_only(llama_llm, monkeypatch, tty):
    """generate/chat draw vLLM's bar by default on a terminal; none when piped or disabled."""
    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    llama_llm.generate(["one", "two"], greedy())
    llama_llm.chat([[{"role": "user", "content": "hi"}]] * 3, greedy())
    drawn = err.getvalue()
    assert (("Processed prompts" in drawn and "2/2" in drawn and "3/3" in drawn) if tty
            else drawn == "")  # fmt: skip
    err.seek(0), err.truncate()
    llama_llm.generate(["one"], greedy(), use_tqdm=False)
    llama_llm.chat([{"role": "user", "content": "hi"}], greedy(), use_tqdm=False)
    assert err.getvalue() == ""
