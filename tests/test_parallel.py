"""Tensor and pipeline parallelism on CPU with gloo: greedy outputs at tp/pp > 1 equal tp=1 pp=1
token for token (fp32), including GQA with fewer KV heads than TP ranks (replicated KV heads),
and grammar-constrained requests in the same batch (every sampling rank applies the same mask;
pp > 1 plans ahead too, while fewer requests run than stages)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from msgspec.structs import replace

from pagedserve import LLM, SamplingParams, StructuredOutputs
from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.curve import KEY_ENV, CurveKey
from pagedserve.parallel.groups import check_same_devices, layer_range, rank_info, split_layers
from pagedserve.parallel_config import ParallelConfig

from tiny_models import make_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
OBJECT = {"type": "object", "properties": {"k": {"type": "integer"}}}
GRAMMARS = [StructuredOutputs(regex="[a-m]{2,5}( [n-z]{1,4}){1,3}"), StructuredOutputs(json=OBJECT)]


def prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()}
            for n in (4, 19, 40, 9, 27)]  # fmt: skip


# Seeded random sampling must match too: every rank samples the same token from the same logits.
RANDOM = [
    SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.4,
                   repetition_penalty=1.3, seed=13, max_tokens=6, ignore_eos=True),
    SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, seed=14, max_tokens=6,
                   ignore_eos=True),
    SamplingParams(temperature=1.2, min_p=0.05, seed=15, max_tokens=6, ignore_eos=True),
]  # fmt: skip


def generate(path: str, tp: int, pp: int, grammars: bool = False, **kw) -> list[list[int]]:
    """Greedy and seeded random outputs, with constrained rows among them if `grammars` (one LLM
    per layout: CI time)."""
    batch, params = prompts() * 2, [PARAMS] * len(RANDOM) + RANDOM
    if grammars:
        batch += prompts()[:2]
        params += [SamplingParams(temperature=0, max_tokens=10, structured_outputs=g)
                   for g in GRAMMARS]  # fmt: skip
    with LLM(path, device="cpu", dtype="float32", tensor_parallel_size=tp,
             pipeline_parallel_size=pp, **kw) as llm:  # fmt: skip
        return [c.token_ids for o in llm.generate(batch, params) for c in o.outputs]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_model("llama", str(tmp_path_factory.mktemp("par-llama")))
    want = generate(path, 1, 1, grammars=True)
    assert want[5] != want[0] and want[6] != want[1], "the grammars changed the output"
    return path, want


@pytest.fixture(scope="module")
def greedy_text(llama) -> tuple[str, list[str]]:
    """tp=1 pp=1 greedy text of `prompts()`: the launch tests' reference (one engine for both)."""
    with LLM(llama[0], device="cpu", dtype="float32") as llm:
        return llama[0], [o.outputs[0].text for o in llm.generate(prompts(), PARAMS)]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_equals_single(llama, tp, pp):
    path, want = llama
    # A small budget makes several chunked steps, so pp=2 really keeps two plans in flight (two
    # micro-batches of half the running requests each); with pp, a KV cache of 24 blocks of 4
    # tokens (a request needs up to 13) preempts requests while micro-batches are in flight.
    kw = dict(block_size=4, num_gpu_blocks_override=24, max_model_len=64) if pp > 1 else {}
    assert generate(path, tp, pp, grammars=True, max_num_batched_tokens=24, **kw) == want


def test_kv_heads_fewer_than_tp_are_replicated(tmp_path_factory):
    path = make_tiny_model("qwen3", str(tmp_path_factory.mktemp("par-qwen3")))  # 2 KV heads
    assert generate(path, 4, 1) == generate(path, 1, 1)


def test_layer_split_and_rank_layout():
    assert split_layers(10, 3) == [4, 3, 3]
    assert split_layers(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(ValueError, match="pp-layer-partition"):
        split_layers(4, 2, [2, 3])
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    infos = [rank_info(parallel, r) for r in range(4)]
    assert [(i.pp_stage, i.tp_rank) for i in infos] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [i.is_driver for i in infos] == [False, False, True, False]
    assert layer_range(5, infos[2], None) == (3, 5)


def test_ranks_on_different_gpus_are_refused():
    """The start-up check (a no-op on CPU, where the tp tests above pass through it)."""
    h100 = ("NVIDIA H100 80GB HBM3", 132)
    check_same_devices([h100, h100])
    for other in [("NVIDIA H100 PCIe", 114), ("NVIDIA H100 80GB HBM3", 114)]:
        with pytest.raises(RuntimeError, match="rank 1: .*114 SMs"):
            check_same_devices([h100, other])


def test_indivisible_sizes_are_refused(tmp_path_factory):
    path = make_tiny_model("llama", str(tmp_path_factory.mktemp("par-bad")))
    with pytest.raises(ValueError, match="does not divide"):
        build_engine_config(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="exceeds"):
        build_engine_config(path, pipeline_parallel_size=5)


def test_launch_tp2_pp2_over_openai_and_worker_death(tmp_path_factory, greedy_text):
    """`launch --tp 2 --pp 2` on CPU: greedy completions over the openai client equal tp=1 pp=1
    (text of token-id prompts);
    then kill -9 one of the four workers mid-stream: the stream ends with an error, launch exits 1
    within 30 s naming it, and no process is left."""
    import re
    import signal
    import time

    import openai
    from test_cli import child_pids, stream_in_background
    from test_server import Launched, launch_args

    from proctools import descendants, wait_gone

    path, want = greedy_text
    log = str(tmp_path_factory.mktemp("par-launch-log") / "launch.log")
    launched = Launched(launch_args(path, "--tp", "2", "--pp", "2"), log)
    try:
        url = launched.wait_ready()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        got = []
        for p in prompts():
            out = client.completions.create(
                model=path, prompt=p["prompt_token_ids"], max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            got.append(out.choices[0].text)
        assert got == want
        pids = descendants(launched.proc.pid)
        victim = child_pids(launched)["worker 3"]
        events, thread = stream_in_background(url, 400)
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        launched.proc.wait(timeout=30)
        assert time.monotonic() - killed_at < 30
        thread.join(10)
        # the open stream is answered by an error event (or cut), never left hanging
        assert not thread.is_alive()
        assert any(isinstance(e, Exception) or '"error"' in e for e in events), events[-3:]
    finally:
        rc = launched.stop()
    assert rc == 1
    assert re.search(rf"worker 3 \(pid {victim}\) killed by SIGKILL", launched.output())
    assert wait_gone(pids, 10) == []


def test_two_node_launch_on_one_machine(tmp_path_factory, monkeypatch, greedy_text):
    """`launch --nnodes 2`: node 0 runs the EngineCore, the API server and TP rank 0; node 1 (a
    second `launch --node-rank 1`) runs TP rank 1 and joins over TCP. Greedy output equals tp=1.
    The plan and result ports listen on the master address only and talk CURVE with holders of
    the shared key: an intruder without it (or with another key) reads no plan and pushes no
    result, and the engine is unaffected."""
    import openai
    from test_cli import child_pids
    from test_reliability import listening_tcp_ports
    from test_server import Launched, launch_args

    from pagedserve.ipc.sockets import free_port

    from proctools import wait_gone

    path, want = greedy_text
    port = free_port()
    common = [
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    key = CurveKey.generate()
    monkeypatch.setenv(KEY_ENV, key.text())
    logs = tmp_path_factory.mktemp("two-node-logs")
    head = Launched(launch_args(path, *common, "--node-rank", "0"), str(logs / "head.log"))
    node1 = Launched(launch_args(path, *common, "--node-rank", "1"), str(logs / "node1.log"))
    try:
        url = head.wait_ready()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        got = [
            client.completions.create(
                model=path, prompt=p["prompt_token_ids"], max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True},
            ).choices[0].text
            for p in prompts()
        ]  # fmt: skip
        assert got == want
        core = child_pids(head)["EngineCore"]
        assert {("0100007F", port + 1), ("0100007F", port + 2)} <= listening_tcp_ports(core)
        assert intrude(port, key, lambda: client.completions.create(model=path, prompt="hi")) == []
        assert "pwned" not in head.output()
        again = client.completions.create(
            model=path, prompt=prompts()[0]["prompt_token_ids"], max_tokens=10, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert again.choices[0].text == want[0]
    finally:
        pids = [head.proc.pid, node1.proc.pid]
        assert head.stop() == 0, head.output()
        node1.stop()
    assert wait_gone(pids, 10) == []


def intrude(port: int, key: CurveKey, busy) -> list[bytes]:
    """Sockets without `key` on the plan and result ports (plain; another key pair that knows
    the core's public key; another key pair altogether) push forged results, then read plans
    while `busy()` makes the engine plan steps: what they read (nothing, if CURVE holds)."""
    import msgspec
    import zmq

    from pagedserve.ipc.messages import StepResult, WorkerError

    ctx = zmq.Context()
    stranger = CurveKey.generate()
    socks, got = [], []
    knows_public = {**stranger.client_options(), zmq.CURVE_SERVERKEY: key.public}
    for options in ({}, knows_public, stranger.client_options()):
        sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
        for sock in (sub, push):
            for option, value in options.items():
                sock.setsockopt(option, value)
            sock.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port + 1}")
        push.connect(f"tcp://127.0.0.1:{port + 2}")
        for msg in (WorkerError(0, "pwned"), StepResult(0, [[5]])):
            try:
                push.send(msgspec.msgpack.encode(msg), zmq.NOBLOCK)
            except zmq.Again:  # no connection to queue on: refused already
                pass
        socks += [sub, push]
    time.sleep(0.5)
    busy()
    for sock in socks[::2]:
        while sock.poll(200):
            got.append(sock.recv())
    for sock in socks:
        sock.close()
    ctx.term()
    return got


def test_pipeline_keeps_micro_batches_in_flight(llama, tmp_path, monkeypatch):
    """--pp 2 on CPU: two plans in flight over disjoint halves of the running requests (the
    core's step trace: one line per plan, sent / result in / handled / requests / tokens)."""
    from pagedserve import settings

    path, _ = llama
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", str(tmp_path / "trace"))
    settings.forget()
    try:
        batch = [{"prompt_token_ids": [5 + i, 9, 17 + i]} for i in range(8)]
        with LLM(path, device="cpu", dtype="float32", pipeline_parallel_size=2) as llm:
            outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        settings.forget()
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    with open(tmp_path / "trace") as f:
        plans = [line.split() for line in f]
    sent, received = [float(p[0]) for p in plans], [float(p[1]) for p in plans]
    rows = [int(p[3]) for p in plans if p[3] == p[4]]  # decode-only plans
    assert max(rows) == 4 and len(rows) >= 14, rows  # 8 running: micro-batches of 4
    overlapped = sum(s < r for s, r in zip(sent[1:], received, strict=False))
    assert overlapped >= len(plans) // 2, "the next plan left before the one before came back"


def test_pipeline_async_decodes_a_lone_request_ahead(llama, tmp_path, monkeypatch):
    """--pp 2 on CPU, one request at a time: async scheduling sends its next decode before the
    step before comes back (the last stage sends the sampled token to the first: gloo here),
    greedy equal to pp=1; a stop token and a stop string end it where they should, the steps
    planned past them are dropped, and the engine goes on."""
    from pagedserve import settings

    path, want = llama
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", str(tmp_path / "trace"))
    settings.forget()
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    try:
        with LLM(path, device="cpu", dtype="float32", pipeline_parallel_size=2) as llm:
            first, third = (llm.generate([prompts()[i]], greedy)[0].outputs[0] for i in (0, 2))
            stop_id = want[0][3]
            by_id = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id])
            stopped = llm.generate([prompts()[0]], by_id)[0].outputs[0]
            text = first.text
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            by_text = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop])
            cut = llm.generate([prompts()[0]], by_text)[0].outputs[0]
            again = llm.generate([prompts()[1]], greedy)[0].outputs[0]
    finally:
        settings.forget()
    assert [first.token_ids, third.token_ids, again.token_ids] == [want[0], want[2], want[1]]
    assert stop_id not in want[0][:3] and stopped.token_ids == want[0][:4]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    with open(tmp_path / "trace") as f:
        plans = [[float(x) for x in line.split()[:2]] for line in f]
    ahead = sum(s < r for (s, _), (_, r) in zip(plans[1:], plans, strict=False))
    assert ahead >= 20, f"{ahead} of {len(plans)} plans left before the one before came back"


def test_pipeline_plans_micro_batches_ahead(llama, tmp_path, monkeypatch):
    """--pp 2 on CPU with more requests than stages: each micro-batch is planned again while its
    step is in flight (four plans out: the core's step trace), greedy and seeded outputs equal
    pp=1 token for token, max_tokens holds; stop strings (the client aborts the request) and stop
    ids end requests whose next steps are already planned, and no request or block stays held."""
    from pagedserve import settings

    path, want = llama
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", str(tmp_path / "trace"))
    settings.forget()
    try:
        with LLM(path, device="cpu", dtype="float32", pipeline_parallel_size=2) as llm:
            outs = llm.generate(prompts() * 2, [PARAMS] * len(RANDOM) + RANDOM)
            texts = [o.outputs[0].text for o in outs[: len(RANDOM)]]
            stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]
            by_text = [replace(PARAMS, stop=[s]) for s in stops]
            by_id = [replace(PARAMS, stop_token_ids=[w[3]]) for w in want[:5]]
            cut = llm.generate(prompts() * 2, by_text + by_id)
            llm.generate(prompts()[:1], replace(PARAMS, max_tokens=1))
            stats = llm.last_stats
    finally:
        settings.forget()
    assert [c.token_ids for o in outs for c in o.outputs] == want[:-2]  # no grammar rows
    for out, text, stop in zip(cut, texts, stops, strict=False):
        assert out.outputs[0].text == text[: text.index(stop)], stop
        assert out.outputs[0].finish_reason == "stop"
    for out, w in zip(cut[5:], want, strict=False):
        assert out.outputs[0].token_ids == w[: w.index(w[3]) + 1]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == w[3]
    assert stats.num_unfinished == 0 and stats.kv_cache_usage == 0, stats
    with open(tmp_path / "trace") as f:
        plans = [[float(x) for x in line.split()[:2]] for line in f]
    inflight = [1 + sum(r > s for _, r in plans[:j]) for j, (s, _) in enumerate(plans)]
    assert max(inflight) == 4, inflight


def test_last_stage_reports_a_step_before_queueing_an_eager_one():
    """On a GPU a worker queues step N+1 before it reports N; the last of several pipeline
    stages reports N first when N+1 runs eagerly (queueing it waits for the device's launch
    queue, which would hold N's tokens back a whole stage forward). Graph replays keep the
    order, as do other stages and single-stage engines."""
    from pagedserve.worker.worker_process import _step_ahead

    class Runner:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def runs_eager(self, plan: str) -> bool:
            return plan.startswith("prompt")

        def start(self, plan: str, prev: str | None) -> str:
            self.calls.append(f"start {plan}")
            return plan

        def sample(self, started: str) -> str:
            self.calls.append(f"sample {started}")
            return started

        def finish(self, pending: str) -> str:
            self.calls.append(f"finish {pending}")
            return f"result {pending}"

    class Results:
        def __init__(self) -> None:
            self.sent: list[str] = []

        def send(self, result: str) -> None:
            self.sent.append(result)

    for report_first, plan, order in [
        (True, "prompt B", ["finish A", "start prompt B", "sample prompt B"]),
        (True, "decode B", ["start decode B", "finish A", "sample decode B"]),
        (False, "prompt B", ["start prompt B", "finish A", "sample prompt B"]),
    ]:
        runner, results = Runner(), Results()
        assert _step_ahead(runner, plan, "A", results, None, report_first) == plan
        assert runner.calls == order and results.sent == ["result A"], (plan, runner.calls)
