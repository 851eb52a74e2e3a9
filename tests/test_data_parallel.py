"""Data parallel on one host (`-dp N`, `LLM(data_parallel_size=N)`): the router's rule, the config's
errors, and on CPU through a real `launch -dp 2 --api-servers 2` and the openai client: greedy and
seeded outputs equal one core's, requests sharing a long prefix land on one core whichever API
server takes them (per-core /metrics), and a dead core's worker stops `launch` (exit 1, within
seconds) with the open stream ended by an error."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest
import torch
from test_cli import stream_in_background
from test_server import Launched, launch_args

from pagedserve import LLM, SamplingParams
from pagedserve.frontend.engine_cores import check_devices
from pagedserve.frontend.llm import build_engine_config
from pagedserve.frontend.prefix_router import LOAD_SLACK, PrefixRouter, block_hashes
from pagedserve.parallel_config import ParallelConfig

from proctools import descendants, wait_gone
from tiny_models import tiny_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [random_ids(n, seed) for seed, n in enumerate((5, 21, 40, 17, 33, 9))]
SHARED = random_ids(64, 100)  # four blocks every affinity prompt starts with
AFFINITY = [SHARED + random_ids(6, 200 + i) for i in range(5)]
BATCH = [{"prompt_token_ids": p} for p in PROMPTS * 2]
PARAMS = [GREEDY] * len(PROMPTS) + [SEEDED] * len(PROMPTS)


# ---------------------------------------------------------------------- the router's rule
def test_router_keeps_a_prefix_on_its_core_and_bounds_the_load():
    router = PrefixRouter(4, block_size=4)
    first = router.route(list(range(100, 130)))
    turn2 = list(range(100, 130)) + [7, 8, 9, 10, 11]  # the next turn resends the history
    assert router.route(turn2) == first
    # Prompts no core holds go to the core their first block hashes to while it is not busier
    # than the mean, else to the least loaded core: a burst spreads evenly.
    fresh = PrefixRouter(4, block_size=4)
    cores = [fresh.route(random_ids(12, 300 + i)) for i in range(40)]
    assert all(9 <= cores.count(c) <= 11 for c in range(4)), cores
    # A held prompt's continuations stay on its core until it is clearly busier than the mean.
    busy = PrefixRouter(2, block_size=4)
    home = busy.route(SHARED)
    placed = [busy.route(SHARED + [i]) for i in range(20)]
    stayed = placed.index(1 - home) if 1 - home in placed else len(placed)
    assert stayed > LOAD_SLACK and (1 - home) in placed
    for core in placed:
        busy.release(core)
    assert busy.route(SHARED + [99]) == home
    assert block_hashes([1, 2, 3, 4, 5], 2) == block_hashes([1, 2, 3, 4, 6], 2)
    with pytest.raises(AssertionError):
        PrefixRouter(2, 4).release(1)


def test_router_keys_include_the_lora_adapter():
    """A LoRA request's prompt is another prefix than the same prompt without the adapter (or
    with another one): the core's prefix cache keys include the adapter, so do the router's."""
    prompt = next(
        p
        for p in (random_ids(12, 700 + i) for i in range(100))
        if block_hashes(p, 4)[0] % 2 != block_hashes(p, 4, lora_id=1)[0] % 2
    )
    router = PrefixRouter(2, block_size=4)
    home = router.route(prompt, lora_id=1)
    assert home == block_hashes(prompt, 4, lora_id=1)[0] % 2
    assert router.route(prompt + [5], lora_id=1) == home  # the adapter's next turn stays
    assert router.route(prompt + [5]) == 1 - home  # the base model's is a new prefix
    assert set(block_hashes(prompt, 4)).isdisjoint(block_hashes(prompt, 4, lora_id=2))


def test_router_spreads_a_shared_system_prompt_and_keeps_conversations():
    """New conversations that share only a system prompt spread evenly (every core soon caches
    the system prompt); each one's next turn, sent while all are in flight, finds its core."""
    router = PrefixRouter(2, block_size=4)
    system = random_ids(10, 400)
    firsts = [system + random_ids(9, 500 + i) for i in range(20)]
    cores = [router.route(p) for p in firsts]
    assert sorted(cores.count(c) for c in (0, 1)) == [10, 10], cores
    answer = [5, 6, 7]
    assert [
        router.route(p + answer + random_ids(4, 600 + i)) for i, p in enumerate(firsts)
    ] == cores


def test_data_parallel_config_errors(monkeypatch, tmp_path_factory):
    with pytest.raises(ValueError, match="--data-parallel-size must be at least 1"):
        ParallelConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="--nnodes > 1 is not supported"):
        ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, nnodes=2, master_port=1)
    parallel = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2)
    assert [c.first_local_device for c in (parallel.core(0), parallel.core(1))] == [0, 2]
    check_devices(ParallelConfig(data_parallel_size=8, device="cpu"))  # gloo: any number
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    check_devices(ParallelConfig(data_parallel_size=3))
    with pytest.raises(ValueError, match=r"x --tp 2 x --pp 1 needs 4 GPUs on this host; 3 vis"):
        check_devices(parallel)
    path = tiny_model_dir("llama", tmp_path_factory.getbasetemp())
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", "/tmp/trace")
    config = build_engine_config(path, data_parallel_size=3, tensor_parallel_size=2)
    cores = config.core_configs()
    assert [c.parallel.data_parallel_rank for c in cores] == [0, 1, 2]
    assert [c.settings.step_trace for c in cores] == [f"/tmp/trace.dp{i}" for i in range(3)]


# ---------------------------------------------------------------------- LLM and launch, on CPU
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir("llama", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def launched(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    log = str(tmp_path_factory.mktemp("dp-launch") / "launch.log")
    args = launch_args(model_dir, "-dp", "2", "--api-servers", "2", "--disable-log-stats")
    proc = Launched(args, log)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(launched: Launched, model_dir: str) -> list[str]:
    """One core's greedy and seeded outputs (built while `launch -dp 2` starts)."""
    with LLM(model_dir, device="cpu", dtype="float32") as llm:
        return [o.outputs[0].text for o in llm.generate(BATCH, PARAMS)]


@pytest.fixture(scope="module")
def url(launched: Launched) -> str:
    return launched.wait_ready()


def test_llm_data_parallel_equals_one_core(model_dir: str, reference: list[str]) -> None:
    with LLM(model_dir, device="cpu", dtype="float32", data_parallel_size=2) as llm:
        outs = llm.generate(BATCH, PARAMS)
        assert sorted(set(llm._cores.router._owner.values())) == [0, 1]  # both cores served
    assert [o.outputs[0].text for o in outs] == reference


def engine_series(url: str, name: str) -> dict[str, float]:
    """engine label -> value of one pagedserve engine series in /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"pagedserve:{name}{{"):
            engine = re.search(r'engine="(\d+)"', line)
            assert engine is not None, line
            out[engine.group(1)] = float(line.rsplit(" ", 1)[1])
    return out


def test_launch_dp2_equals_one_core(url: str, reference: list[str]) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = launched_model(client)
    texts = []
    for prompt, params in zip(BATCH, PARAMS, strict=True):
        out = client.completions.create(
            model=model, prompt=prompt["prompt_token_ids"], max_tokens=params.max_tokens,
            temperature=params.temperature, top_p=params.top_p, seed=params.seed,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts.append(out.choices[0].text)
    assert texts == reference
    queries = engine_series(url, "prefix_cache_queries_total")
    assert set(queries) == {"0", "1"} and min(queries.values()) > 0, queries  # both cores served
    assert httpx.get(url + "/health").status_code == 200


def launched_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_shared_prefix_lands_on_one_core(url: str) -> None:
    """Requests that start alike (a conversation's turns, a shared system prompt) go to the core
    whose prefix cache holds that start: only its query and hit counts grow."""
    before_q = engine_series(url, "prefix_cache_queries_total")
    before_h = engine_series(url, "prefix_cache_hits_total")
    before_p = engine_series(url, "prompt_tokens_total")
    for prompt in AFFINITY:  # a connection each: the two API servers share them out
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    time.sleep(1.2)  # each core sends its stats to every API server twice a second
    after_q = engine_series(url, "prefix_cache_queries_total")
    after_h = engine_series(url, "prefix_cache_hits_total")
    grew = {e: after_q[e] - before_q.get(e, 0) for e in after_q}
    (home,) = [e for e, d in grew.items() if d > 0]
    assert grew[home] == sum(len(p) for p in AFFINITY), grew
    assert after_h[home] - before_h.get(home, 0) >= 4 * len(SHARED), (before_h, after_h)
    # per-request series carry the core that ran the request
    prompt = {
        e: v - before_p.get(e, 0) for e, v in engine_series(url, "prompt_tokens_total").items()
    }
    assert prompt == {home: grew[home], str(1 - int(home)): 0}, prompt


def core_pids(launched: Launched) -> dict[int, int]:
    """Data parallel rank -> its EngineCore's pid (from the command lines)."""
    out = {}
    for pid in descendants(launched.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if "pagedserve.entrypoints.engine_process" in argv:
            directory = argv[argv.index("--ipc-dir") + 1]
            out[int(directory.rsplit("core-", 1)[1])] = pid
    return out


def test_dead_core_stops_launch(launched: Launched, url: str) -> None:
    """kill -9 a worker of core 1 while a stream runs: its core reports the death and exits,
    every open stream ends with an error, `launch` exits 1 within seconds naming the core, and
    no process is left (runs last: it stops the module's server)."""
    cores = core_pids(launched)
    assert sorted(cores) == [0, 1]
    (victim,) = descendants(cores[1])
    pids = descendants(launched.proc.pid)
    events, thread = stream_in_background(url, 400)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    launched.proc.wait(timeout=30)
    assert time.monotonic() - killed_at < 15
    thread.join(10)
    errors = [e for e in events if isinstance(e, Exception) or '"error"' in e]
    assert errors, events[-3:]
    assert isinstance(errors[0], Exception) or "EngineCore 1 failed: worker 0" in errors[0], errors
    assert launched.stop() == 1
    log = launched.output()
    assert re.search(r"error: EngineCore 1 \(pid \d+\) exited with code 1 \(worker 0", log), log
    assert wait_gone(pids, 10) == []
