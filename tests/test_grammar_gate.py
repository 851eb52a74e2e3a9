"""The core's grammar gate: a constrained request reaches the scheduler only once every sampling
rank has compiled its grammar; one compile order per grammar; aborts and failures end held ones."""

from __future__ import annotations

from pagedserve.core.grammar_gate import GrammarGate
from pagedserve.ipc.messages import AddRequest, GrammarCompiled, SamplingParams, StructuredOutputs

SPEC = StructuredOutputs(regex="[a-z]+")


def add(req_id: str, spec: StructuredOutputs | None = SPEC) -> AddRequest:
    return AddRequest(req_id, [1, 2, 3], SamplingParams(structured_outputs=spec))


def test_requests_wait_for_every_sampling_rank():
    gate = GrammarGate(sampling_ranks=[2, 3])  # tp=2, pp=2: the last stage's ranks
    assert gate.admit(add("plain", None)) == (True, None)
    ok, order = gate.admit(add("a"))
    assert not ok and order is not None and order.key == SPEC.key and gate.pending
    assert gate.admit(add("b")) == (False, None)  # the same grammar: no second compile
    assert gate.compiled(GrammarCompiled(2, SPEC.key)) == ([], None)
    assert gate.compiled(GrammarCompiled(2, SPEC.key)) == ([], None)  # a rank counts once
    assert gate.compiled(GrammarCompiled(0, SPEC.key)) == ([], None)  # not a sampling rank
    assert gate.compiled(GrammarCompiled(99, SPEC.key)) == ([], None)  # no such rank
    released, error = gate.compiled(GrammarCompiled(3, SPEC.key))
    assert [r.req_id for r in released] == ["a", "b"] and error is None and not gate.pending
    assert gate.admit(add("c")) == (True, None)  # compiled already


def test_abort_and_failure():
    gate = GrammarGate(sampling_ranks=[0])
    gate.admit(add("a"))
    gate.admit(add("b"))
    assert [r.req_id for r in gate.abort(["a", "unknown"])] == ["a"]
    released, error = gate.compiled(GrammarCompiled(0, SPEC.key, error="bad regex"))
    assert [r.req_id for r in released] == ["b"] and error == "bad regex"
    ok, order = gate.admit(add("c"))  # a failed grammar is not remembered as ready
    assert not ok and order is not None


def test_key_ignores_the_reasoning_gate():
    gated = StructuredOutputs(regex="[a-z]+", after_token_id=7)
    assert gated.key == SPEC.key != StructuredOutputs(regex="[a-z]*").key


def regex(i: int) -> StructuredOutputs:
    return StructuredOutputs(regex=f"[a-z]{{{i}}}")


def compile_everywhere(gate: GrammarGate, req_id: str, spec: StructuredOutputs) -> list[str]:
    """Admit a request of `spec` whose grammar is not held; every rank compiles it. The keys the
    compile order drops."""
    ok, order = gate.admit(add(req_id, spec))
    assert not ok and order is not None and order.key == spec.key
    released, error = gate.compiled(GrammarCompiled(0, spec.key))
    assert [r.req_id for r in released] == [req_id] and error is None
    return order.drop_keys


def test_the_gate_drops_the_least_recently_used_grammar_no_request_uses():
    used: set[str] = set()
    gate = GrammarGate(sampling_ranks=[0], capacity=3, in_use=used.__contains__)
    specs = [regex(i) for i in range(1, 7)]
    for i in range(3):
        assert compile_everywhere(gate, f"r{i}", specs[i]) == []
    assert gate.admit(add("again", specs[0])) == (True, None)  # 0 is now the most recent
    used.add(specs[1].key)  # a request of grammar 1 is waiting or running
    assert compile_everywhere(gate, "r3", specs[3]) == [specs[2].key]  # 1 is skipped
    assert gate.held_keys == [specs[0].key, specs[1].key, specs[3].key]
    used.update(s.key for s in specs)  # every grammar in use: none is dropped
    assert compile_everywhere(gate, "r4", specs[4]) == []
    assert len(gate.held_keys) == 4
    used.clear()  # they finished: the next order drops the excess, oldest first
    assert compile_everywhere(gate, "r5", specs[5]) == [specs[0].key, specs[1].key]
    ok, order = gate.admit(add("r6", specs[2]))  # dropped earlier: it waits for a recompile
    assert not ok and order is not None and order.key == specs[2].key


def test_a_grammar_only_some_ranks_compiled_is_dropped_with_the_next_order():
    gate = GrammarGate(sampling_ranks=[0, 1])
    gate.admit(add("a"))
    gate.compiled(GrammarCompiled(0, SPEC.key))
    released, error = gate.compiled(GrammarCompiled(1, SPEC.key, error="too slow"))
    assert [r.req_id for r in released] == ["a"] and error == "too slow"
    assert gate.held_keys == []
    _, order = gate.admit(add("b", regex(2)))
    assert order is not None and order.drop_keys == [SPEC.key]
    _, order = gate.admit(add("c", regex(3)))
    assert order is not None and order.drop_keys == []  # dropped once


def test_waiting_requests_are_counted_and_aborted_in_one_pass():
    gate = GrammarGate(sampling_ranks=[0])
    for i in range(3000):
        gate.admit(add(f"a{i}"))
        gate.admit(add(f"b{i}", regex(2)))
    assert gate.num_waiting == 6000
    dropped = gate.abort([f"a{i}" for i in range(3000)] + ["b7", "b7", "unknown"])
    assert len(dropped) == 3001 and gate.num_waiting == 2999
    released, _ = gate.compiled(GrammarCompiled(0, regex(2).key))
    assert len(released) == 2999 and "b7" not in {r.req_id for r in released}
    assert gate.num_waiting == 0
