"""The compiled CPU forward (worker/cpu_compile.py): built by its child process into a fresh
cache, loaded with the live model's weights, it gives the eager forward's tokens and logprobs
for prefills, decodes and mixed steps, on Llama with GQA and on Gemma 3 (q/k norms,
sliding-window KV cache groups). Models it does not apply to stay eager."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pagedserve import settings
from pagedserve.config import kv_cache_groups
from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import CachedDelta, NewRequest, SamplingParams, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.worker import cpu_compile
from pagedserve.worker.model_runner import ModelRunner

from tiny_models import tiny_model_dir

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=64, logprobs=3)


@pytest.fixture
def compile_on(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CPU_COMPILE", "auto")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    settings.forget()
    yield
    settings.forget()


def make_runner(path: str) -> ModelRunner:
    config = build_engine_config(path, device="cpu", dtype="float32", block_size=BLOCK,
                                 num_gpu_blocks_override=96)  # fmt: skip
    runner = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    runner.init_cache(96)
    return runner


def run_requests(runner: ModelRunner, tag: str) -> list[tuple[list[int], list[float]]]:
    """Two prompts prefilled, a third joining mid-way (a mixed step), greedy decodes; each
    request's tokens and the logprob of every token."""
    prompts = [list(range(20, 31)), list(range(40, 47)), list(range(60, 78))]
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    ids = [f"{tag}{i}" for i in range(len(prompts))]

    num_groups = len(kv_cache_groups(runner.config.model.hf))

    def new(i: int) -> NewRequest:
        blocks = [
            list(range(b, b + 8)) for b in range(i * 8 * num_groups, (i + 1) * 8 * num_groups, 8)
        ]
        return NewRequest(ids[i], prompts[i], blocks[0], GREEDY, 0, group_block_ids=blocks[1:])

    def record(rows: list[int], res) -> None:
        for i, t, lps in zip(rows, res.sampled_token_ids, res.logprobs, strict=True):
            tokens[i].extend(t)
            logprobs[i].extend(lp.logprobs[0] for lp in lps)  # one entry per new token

    record([0, 1], runner.execute(StepPlan(0, ids[:2], [11, 7], new_requests=[new(0), new(1)])))
    for step in range(1, 9):
        running = [i for i in range(len(prompts)) if tokens[i]]
        cached = [
            CachedDelta(ids[i], [tokens[i][-1]], [], len(prompts[i]) + len(tokens[i]) - 1)
            for i in running
        ]
        news = [new(2)] if step == 4 else []
        rows = running + [2] * len(news)
        counts = [1] * len(running) + [len(prompts[2])] * len(news)
        plan = StepPlan(step, [ids[i] for i in rows], counts, cached=cached, new_requests=news)
        record(rows, runner.execute(plan))
    runner.execute(StepPlan(99, [], [], finished_ids=ids))
    return list(zip(tokens, logprobs, strict=True))


KINDS = ["llama", "gemma3"]


@pytest.fixture(scope="module")
def compiling(tmp_path_factory):
    """A runner of each kind over one fresh cache, whose children compile side by side (each
    on one thread: CI time); kind -> (model path, runner, its compile child)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDSERVE_CPU_COMPILE", "auto")
        patch.setenv("PAGEDSERVE_CACHE", str(tmp_path_factory.mktemp("compiling") / "cache"))
        settings.forget()
        started = {}
        for kind in KINDS:
            path = tiny_model_dir(kind, str(tmp_path_factory.getbasetemp()))
            runner = make_runner(path)
            compiler = runner.cpu_compiler
            assert compiler is not None and compiler.child is not None, "no package: a child builds"
            assert compiler.forward() is None or compiler.child is None  # eager until it is done
            started[kind] = (path, runner, compiler.child)
        yield started
    settings.forget()


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_forward_equals_eager(compiling, monkeypatch, kind):
    path, runner, child = compiling[kind]
    compiler = runner.cpu_compiler
    child.proc.wait(timeout=240)
    assert child.proc.returncode == 0
    assert compiler.forward() is not None
    assert os.path.exists(compiler.path)

    calls = []
    real_call = cpu_compile.CompiledForward.__call__

    def counted(self, input_ids, positions, meta):
        calls.append(len(input_ids))
        return real_call(self, input_ids, positions, meta)

    monkeypatch.setattr(cpu_compile.CompiledForward, "__call__", counted)
    compiled = run_requests(runner, "c")
    assert len(calls) == 9 and max(calls) > 1, calls  # every step compiled, prefills included
    runner.cpu_compiler = None
    eager = run_requests(runner, "e")
    for (c_tokens, c_lps), (e_tokens, e_lps) in zip(compiled, eager, strict=True):
        assert c_tokens == e_tokens
        assert c_lps == pytest.approx(e_lps, abs=1e-4)

    # A second runner of the same shape finds the package and loads it at start.
    again = make_runner(path)
    assert again.cpu_compiler is not None and again.cpu_compiler.child is None
    assert again.cpu_compiler.forward() is not None


def test_models_it_does_not_apply_to_stay_eager(compile_on, tmp_path_factory, monkeypatch):
    path = tiny_model_dir("llama", str(tmp_path_factory.getbasetemp()))
    config = build_engine_config(path, device="cpu", dtype="float32")
    runner = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    eager = dataclasses.replace(config, model=dataclasses.replace(config.model, enforce_eager=True))
    assert cpu_compile.eligible(config, torch.device("cpu"), runner.model)
    assert not cpu_compile.eligible(eager, torch.device("cpu"), runner.model)
    bf16 = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
    assert not cpu_compile.eligible(bf16, torch.device("cpu"), runner.model)
    assert not cpu_compile.eligible(config, torch.device("cuda"), runner.model)
    layer = next(iter(runner.model.model.layers.values())).mlp.down_proj
    monkeypatch.setattr(layer, "packed", torch.empty(0), raising=False)  # a oneDNN-packed weight
    assert not cpu_compile.eligible(config, torch.device("cpu"), runner.model)
    monkeypatch.setenv("PAGEDSERVE_CPU_COMPILE", "off")
    settings.forget()
    assert not cpu_compile.eligible(config, torch.device("cpu"), runner.model)
    monkeypatch.setenv("PAGEDSERVE_CPU_COMPILE", "yes")
    settings.forget()
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_COMPILE='yes'"):
        cpu_compile.eligible(config, torch.device("cpu"), runner.model)


def test_a_package_that_does_not_load_leaves_the_runner_eager(compile_on, tmp_path_factory):
    path = tiny_model_dir("llama", str(tmp_path_factory.getbasetemp()))
    config = build_engine_config(path, device="cpu", dtype="float32", block_size=BLOCK)
    target = cpu_compile.package_path(config)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as f:
        f.write(b"not a package")
    runner = make_runner(path)
    assert runner.cpu_compiler is not None and runner.cpu_compiler.child is None
    assert runner.cpu_compiler.forward() is None
    res = runner.execute(StepPlan(0, ["a"], [5], new_requests=[
        NewRequest("a", [5, 6, 7, 8, 9], list(range(4)), GREEDY, 0)]))  # fmt: skip
    assert len(res.sampled_token_ids) == 1
