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
