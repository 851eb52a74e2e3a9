"""Grammars must not stall or starve other clients (issue 33, findings 2 and 3): nothing compiles
on the step path, the core and the workers agree on which grammars are held, a slow grammar
compiles beside the others within a time budget (over it: a 400 naming the limit), and requests
waiting for a grammar count in `--max-waiting`.

The compiler's pool and the gate's holdings are tested in-process on the embedded tokenizer; the
stalls on real `pagedserve launch` processes (CPU), measured as the worst wait of a well-behaved
client polling while the bad one runs (the old code stalled it for seconds or minutes).
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from test_hardening_frontend import Prober
from test_server import Launched, assert_error

from pagedserve.core.grammar_gate import GrammarGate
from pagedserve.frontend.hub import default_model_dir
from pagedserve.ipc.messages import AddRequest, GrammarCompiled, SamplingParams, StructuredOutputs
from pagedserve.worker.grammar import GrammarCompiler

BASE = ["--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--max-model-len", "256",
        "--max-num-seqs", "32"]  # fmt: skip
STALL_S = 1.5  # the old code held a polling client for a whole compile: seconds to minutes
LIMIT_S = 2.0  # --max-grammar-compile-seconds of the `strict` server


def optional_properties(count: int, prefix: str = "p") -> dict:
    """A schema of `count` optional string properties: xgrammar's compile grows fast with them
    (on the embedded tokenizer, one core: 600 take ~1 s, 1,000 ~5 s, 3,000 minutes)."""
    return {
        "type": "object",
        "properties": {f"{prefix}{i}": {"type": "string"} for i in range(count)},
    }


def json_spec(schema: dict) -> StructuredOutputs:
    return StructuredOutputs(json=json.dumps(schema))


# ---------------------------------------------------------------------- in-process
def test_a_compile_that_ended_late_is_late_whenever_it_is_polled():
    """The answer must not depend on when the caller polls: a compile that took longer than its
    budget is refused even if no poll saw it running over (a poller held off, say by the GIL)."""
    compiler = GrammarCompiler(default_model_dir(), 4096, budget_s=0.01, num_threads=1)
    try:
        compiler.hold(StructuredOutputs(choice=["warm"]))  # loads the tokenizer (no budget)
        slow = json_spec(optional_properties(300))
        compiler.submit(slow.key, slow)
        deadline = time.monotonic() + 60
        while not compiler._jobs[slow.key].done and time.monotonic() < deadline:
            time.sleep(0.01)  # no poll meanwhile
        [(key, error)] = compiler.poll()
        assert key == slow.key and "--max-grammar-compile-seconds" in (error or ""), error
        assert slow.key not in compiler.held_keys
    finally:
        compiler.close()


def test_a_slow_grammar_compiles_beside_the_others_within_its_budget():
    compiler = GrammarCompiler(default_model_dir(), 4096, budget_s=0.5, num_threads=2)
    try:
        compiler.hold(StructuredOutputs(choice=["warm"]))  # loads the tokenizer (no budget)
        slow, fast = json_spec(optional_properties(1000)), StructuredOutputs(regex="[0-9]{3}")
        start = time.monotonic()
        compiler.submit(slow.key, slow)
        time.sleep(0.05)
        compiler.submit(fast.key, fast)
        answers = {}
        while slow.key not in answers and time.monotonic() - start < 30:
            answers.update({k: (e, time.monotonic() - start) for k, e in compiler.poll()})
            time.sleep(1e-3)
        assert answers[fast.key][0] is None and answers[fast.key][1] < 0.5, answers  # not behind
        error, took = answers[slow.key]
        assert "--max-grammar-compile-seconds" in error and 0.5 < took < 3, answers
        compiler.submit(slow.key, slow)  # asked again: refused at once, no second compile
        assert compiler.poll() == [(slow.key, error)]
        other = StructuredOutputs(regex="[a-z]{2}")  # the pool still has two threads
        compiler.submit(other.key, other)
        time.sleep(0.3)
        assert compiler.poll() == [(other.key, None)]
        assert compiler.held_keys == {StructuredOutputs(choice=["warm"]).key, fast.key, other.key}
    finally:
        compiler.close()


def admitted(gate: GrammarGate, compiler: GrammarCompiler, spec: StructuredOutputs) -> bool:
    """Send a request of `spec` through the gate as the core does, the compile order to the
    workers' compiler, its answer back; whether the request could be scheduled at once."""
    ok, order = gate.admit(AddRequest(f"r{time.monotonic_ns()}", [1], SamplingParams(
        structured_outputs=spec)))  # fmt: skip
    if order is not None:
        compiler.submit(order.key, order.spec, order.drop_keys)
        while not (answers := compiler.poll()):
            time.sleep(1e-3)
        assert answers == [(spec.key, None)]
        released, error = gate.compiled(GrammarCompiled(0, spec.key))
        assert len(released) == 1 and error is None
    assert set(gate.held_keys) == compiler.held_keys  # they agree, order by order
    return ok


def test_the_workers_hold_exactly_what_the_core_holds():
    """More grammars than the capacity, then the first again: the gate had dropped it, so it
    waits for a recompile off the step path; the step path (`get`) never compiles."""
    users: set[str] = set()
    gate = GrammarGate(sampling_ranks=[0], capacity=4, in_use=users.__contains__)
    compiler = GrammarCompiler(default_model_dir(), 4096)
    try:
        specs = [StructuredOutputs(choice=[f"w{i}"]) for i in range(6)]
        users.add(specs[1].key)  # a request of grammar 1 is still running
        assert not any(admitted(gate, compiler, spec) for spec in specs)
        assert admitted(gate, compiler, specs[1])  # in use: kept
        with pytest.raises(RuntimeError, match="not held"):
            compiler.get(specs[0])  # dropped: a plan could not bring it, and it never compiles
        compiles = compiler.num_compiles
        assert not admitted(gate, compiler, specs[0])  # the first again: compiled again
        assert compiler.num_compiles == compiles + 1 and compiler.get(specs[0]) is not None
    finally:
        compiler.close()


# ---------------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """`roomy`: grammars may take two minutes to compile; `strict`: 2 s, and at most two
    requests waiting (in the queue or for their grammar)."""
    tmp = tmp_path_factory.mktemp("grammar")
    both = {
        "roomy": Launched([*BASE, "--max-grammar-compile-seconds", "120"], str(tmp / "roomy.log")),
        "strict": Launched(
            [*BASE, "--max-grammar-compile-seconds", str(LIMIT_S), "--max-waiting", "2"],
            str(tmp / "strict.log"),
        ),
    }
    try:
        urls = {name: p.wait_ready() for name, p in both.items()}
        # xgrammar loads on the first grammar (API server, worker): on both servers at once
        with ThreadPoolExecutor(len(urls)) as pool:
            assert list(pool.map(warm_up, urls.values())) == [200] * len(urls)
        yield SimpleNamespace(urls=urls)
    finally:
        for name, launched in both.items():
            assert launched.stop() == 0, f"{name}:\n{launched.output()}"


def warm_up(url: str) -> int:
    with httpx.Client(base_url=url, timeout=300) as client:
        return complete(client, {"choice": ["warm"]}, max_tokens=1).status_code


def complete(client: httpx.Client, grammar: dict, **body) -> httpx.Response:
    body = {"prompt": "Answer:", "max_tokens": 4, "structured_outputs": grammar, **body}
    return client.post("/v1/completions", json=body)


def test_an_evicted_grammar_is_compiled_again_off_the_step_path(servers):
    """A slow grammar, then 512 others (the workers used to keep 512, the core 4,096), then the
    slow one again: it used to compile inside a step, stalling every request."""
    slow = {"json": optional_properties(1000)}
    with httpx.Client(base_url=servers.urls["roomy"], timeout=300) as client:
        start = time.monotonic()
        assert complete(client, slow).status_code == 200
        took = time.monotonic() - start
        assert took > 2 * STALL_S, f"the slow grammar compiled in {took:.1f} s: make it slower"

        def others(k: int) -> None:
            with httpx.Client(base_url=servers.urls["roomy"], timeout=120) as own:
                for i in range(k, 512, 8):
                    assert complete(own, {"choice": [f"w{i}"]}, max_tokens=1).status_code == 200

        threads = [threading.Thread(target=others, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        others_took = time.monotonic() - start - took
        with Prober(servers.urls["roomy"]) as prober:
            time.sleep(0.3)
            assert complete(client, slow).status_code == 200
        bound = max(STALL_S, took / 2)  # a compile on the step path stalls the prober ~`took`
        assert prober.count > 2 and prober.worst < bound, (prober.worst, took, others_took)


def test_a_slow_grammar_does_not_hold_another_clients_regex(servers):
    """While a 3,000-property schema compiles (minutes), another client's `[0-9]{3}` is answered
    at once; the schema is refused after the limit with a 400 naming it."""
    url, slow = servers.urls["strict"], {}

    def send_slow() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            start = time.monotonic()
            slow["response"] = complete(client, {"json": optional_properties(3000)})
            slow["took"] = time.monotonic() - start

    thread = threading.Thread(target=send_slow)
    thread.start()
    time.sleep(0.5)
    with httpx.Client(base_url=url, timeout=60) as client:
        start = time.monotonic()
        response = complete(client, {"regex": "[0-9]{3}"}, max_tokens=8)
        took = time.monotonic() - start
    assert response.status_code == 200 and took < STALL_S, (took, response.text)
    assert re.fullmatch("[0-9]{3}", response.json()["choices"][0]["text"])
    thread.join()
    message = assert_error(slow["response"], 400)["message"]
    assert "--max-grammar-compile-seconds" in message and f"{LIMIT_S:g} s" in message, message
    assert LIMIT_S < slow["took"] < LIMIT_S + 8


def test_requests_waiting_for_their_grammar_count_in_max_waiting(servers):
    """`--max-waiting 2`: two choices waiting for their grammar fill the queue (a third request
    is a 503); they were not counted."""
    url, slow = servers.urls["strict"], {}

    def send_slow() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            slow["response"] = complete(client, {"json": optional_properties(1100, "q")}, n=2)

    thread = threading.Thread(target=send_slow)
    thread.start()
    time.sleep(0.7)
    with httpx.Client(base_url=url, timeout=60) as client:
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert_error(response, 503)
    thread.join()
    assert_error(slow["response"], 400)
