"""A vLLM user's habits: a checkpoint's generation_config (every EOS id stops a reply, sampling
defaults), a hub id served from an offline huggingface_hub cache with `pagedserve serve MODEL`,
vLLM's flags, request chat templates under a time limit, `LLM` keyword arguments.

One launched server (`serve acme/tiny` over HTTPS with many flags at once) carries the end-to-end
checks; every flag is also checked where it lands in the config (cheap, no processes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from test_server import CPU_ARGS, Launched

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.cli import build_parser, engine_config, launch_options
from pagedserve.frontend.generation_config import stop_eos_ids
from pagedserve.frontend.hub import resolve_model

from tiny_models import EOS_ID, PAD_ID, tiny_model_dir

HUB_ID = "acme/tiny"
SHA = "0123456789abcdef0123456789abcdef01234567"
API_KEY = "vllm-key"
PROMPT_A, PROMPT_B, PROMPT_C = [5, 17, 42, 99], [7, 300, 12, 8, 250], [11, 22, 33, 44]
DEFAULTS = dict(temperature=0.7, top_p=0.9, top_k=1, min_p=0.05, repetition_penalty=1.3)
MAX_NEW = 5
TEMPLATE = "{{ bos_token }}CUSTOM{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
CHAT = [{"role": "user", "content": "Hello there"}]


def hf_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def first_new(tokens: list[int], avoid: set[int]) -> int:
    """The first position (from 2) whose token is new in `tokens` and not in `avoid`."""
    for k in range(2, len(tokens)):
        if tokens[k] not in tokens[:k] and tokens[k] not in avoid | {EOS_ID, PAD_ID}:
            return k
    raise AssertionError(f"no usable stop token in {tokens}")


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The tiny llama in a huggingface_hub cache as `acme/tiny` (refs/main -> a snapshot), its
    generation_config listing two EOS ids (besides PAD) that greedy decoding of PROMPT_A and
    PROMPT_B reaches after a few tokens, and sampling defaults."""
    base = tiny_model_dir("llama", tmp_path_factory.getbasetemp())
    ref_a, ref_b = hf_greedy(base, PROMPT_A, 16), hf_greedy(base, PROMPT_B, 16)
    k_a = first_new(ref_a, set())
    k_b = first_new(ref_b, set(ref_a[: k_a + 1]))
    assert ref_b[k_b] not in ref_a[:k_a]
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / SHA
    shutil.copytree(base, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    generation = {
        "bos_token_id": 0, "eos_token_id": [ref_a[k_a], PAD_ID, ref_b[k_b]], "pad_token_id": 2,
        **DEFAULTS, "max_new_tokens": MAX_NEW,
    }  # fmt: skip
    (snapshot / "generation_config.json").write_text(json.dumps(generation))
    return SimpleNamespace(
        home=str(home), snapshot=str(snapshot), base=base, stops={"a": k_a + 1, "b": k_b + 1}
    )


def hub_env(hub: SimpleNamespace) -> dict[str, str]:
    env = dict(os.environ, HF_HOME=hub.home, HF_HUB_OFFLINE="1", VLLM_API_KEY=API_KEY)
    env.pop("PAGEDSERVE_API_KEY", None)
    env.pop("HF_HUB_CACHE", None)
    return env


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    key, cert = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
         cert, "-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
def served(hub, certs, tmp_path_factory):
    """`pagedserve serve acme/tiny` offline, over HTTPS, with vLLM's flags."""
    d = tmp_path_factory.mktemp("served")
    (d / "template.jinja").write_text(TEMPLATE)
    key, cert = certs
    args = [
        HUB_ID, "--host", "127.0.0.1", "--port", "0", *CPU_ARGS,
        "--served-model-name", HUB_ID, "tiny-alias",
        "--chat-template", str(d / "template.jinja"), "--trust-request-chat-template",
        "--allowed-origins", '["https://ok.example"]', "--root-path", "/api",
        "--ssl-keyfile", key, "--ssl-certfile", cert, "--uvicorn-log-level", "warning",
        "--max-num-seqs", "4", "--seed", "7", "--enable-chunked-prefill",
        "--no-enable-prefix-caching", "--disable-log-requests",
    ]  # fmt: skip
    proc = Launched(args, str(d / "serve.log"), command="serve", env=hub_env(hub))
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def offline_llm(served, hub) -> SimpleNamespace:
    """`LLM` on the same checkpoint (run while the server starts)."""
    with LLM(hub.snapshot, device="cpu", dtype="float32", kv_cache_memory=16 << 20) as llm:
        prompts = [{"prompt_token_ids": p} for p in (PROMPT_A, PROMPT_B)]
        stopped = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        ignored = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        )
        defaults = llm.generate([{"prompt_token_ids": PROMPT_C}])[0]
    return SimpleNamespace(stopped=stopped, ignored=ignored, defaults=defaults)


@pytest.fixture(scope="module")
def url(served) -> str:
    return served.wait_ready()


@pytest.fixture(scope="module")
def http(url: str):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60, verify=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(url: str):
    with httpx.Client(verify=False, timeout=60) as transport:  # a self-signed certificate
        yield openai.OpenAI(
            base_url=url + "/v1", api_key=API_KEY, max_retries=0, http_client=transport
        )


# ---------------------------------------------------------------------- generation_config
def test_every_eos_id_stops(client: openai.OpenAI, offline_llm, hub) -> None:
    """Each prompt stops at its own EOS id of generation_config (one listed first, one last),
    finish_reason "stop"; ignore_eos still runs to max_tokens. The same through LLM."""
    for name, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        kw = dict(model=HUB_ID, prompt=prompt, max_tokens=16, temperature=0)
        done = client.completions.create(**kw, extra_body={"repetition_penalty": 1.0})
        assert done.choices[0].finish_reason == "stop", (name, done)
        assert done.usage.completion_tokens == hub.stops[name]
        extra = {"repetition_penalty": 1.0, "ignore_eos": True}
        ignored = client.completions.create(**kw, extra_body=extra)
        assert ignored.choices[0].finish_reason == "length"
        assert ignored.usage.completion_tokens == 16
    for out, want in zip(offline_llm.stopped, (hub.stops["a"], hub.stops["b"]), strict=True):
        assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) == want
        assert out.outputs[0].stop_reason is None
    assert all(len(o.outputs[0].token_ids) == 16 for o in offline_llm.ignored)


def test_stop_ids_include_the_tokenizers_eos(hub) -> None:
    from pagedserve.frontend.engine_args import build_engine_config
    from pagedserve.frontend.tokenizer import load_tokenizer

    config = build_engine_config(hub.snapshot)
    ids = stop_eos_ids(config.model, load_tokenizer(hub.snapshot))
    assert ids[:3] == config.model.eos_token_ids and len(config.model.eos_token_ids) == 3
    assert ids[3:] == [EOS_ID]  # </s> is not in generation_config's list, yet it stops too


def test_generation_config_defaults(client: openai.OpenAI, served, offline_llm) -> None:
    """A request that sets nothing gets generation_config's values (top_k 1: greedy; penalty
    1.3; 5 tokens), as does LLM.generate without sampling params; explicit values win."""
    bare = client.completions.create(model=HUB_ID, prompt=PROMPT_C, extra_body={"ignore_eos": True})
    assert bare.usage.completion_tokens == MAX_NEW
    explicit = client.completions.create(
        model=HUB_ID, prompt=PROMPT_C, temperature=0, max_tokens=MAX_NEW,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )  # fmt: skip
    assert bare.choices[0].text == explicit.choices[0].text
    longer = client.completions.create(
        model=HUB_ID, prompt=PROMPT_C, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert longer.usage.completion_tokens == 8
    assert offline_llm.defaults.outputs[0].text == explicit.choices[0].text
    line = "sampling defaults from generation_config.json: temperature=0.7, top_p=0.9, top_k=1, "
    assert line + "min_p=0.05, repetition_penalty=1.3, max_tokens=5" in served.output()


def test_generation_config_modes(hub, tmp_path) -> None:
    from pagedserve.frontend.engine_args import build_engine_config

    auto = build_engine_config(hub.snapshot).model
    assert auto.default_sampling == {**DEFAULTS, "max_tokens": MAX_NEW}
    assert build_engine_config(hub.snapshot, generation_config="vllm").model.default_sampling == {}
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.2, "eos_token_id": 9}')
    other = build_engine_config(hub.snapshot, generation_config=str(tmp_path)).model
    assert other.default_sampling == {"temperature": 0.2} and other.eos_token_ids == [9]
    with pytest.raises(ValueError, match="--generation-config"):
        build_engine_config(hub.snapshot, generation_config=str(tmp_path / "none"))
    (tmp_path / "generation_config.json").write_text('{"top_p": 7}')
    with pytest.raises(ValueError, match="top_p"):
        LLM(hub.snapshot, generation_config=str(tmp_path))


def test_llm_and_sampling_params_refuse_unknown_arguments(hub) -> None:
    with pytest.raises(TypeError, match="kv_transfer_config"):  # (swap_space exists: issue 41)
        LLM(hub.snapshot, kv_transfer_config={"kv_connector": "LMCacheConnectorV1"})
    with pytest.raises(TypeError, match="guided_decoding"):
        SamplingParams(guided_decoding={"json": {}})


# ---------------------------------------------------------------------- hub ids, serve, flags
def test_hub_id_and_served_names(http: httpx.Client, client: openai.OpenAI, url: str) -> None:
    cards = http.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [HUB_ID, "tiny-alias"]
    assert f"models--acme--tiny/snapshots/{SHA}" in cards[0]["root"]
    reply = client.completions.create(model="tiny-alias", prompt="Hello", max_tokens=2)
    assert reply.model == "tiny-alias" and reply.usage.completion_tokens == 2
    assert url.startswith("https://")  # --ssl-keyfile / --ssl-certfile
    assert httpx.get(url + "/v1/models", verify=False).status_code == 401  # VLLM_API_KEY


def test_server_flags(http: httpx.Client, served) -> None:
    preflight = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST"}
    ok = http.options("/v1/completions", headers=preflight)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://ok.example"
    bad = http.options("/v1/completions", headers=preflight | {"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in bad.headers
    assert http.get("/openapi.json").json()["servers"] == [{"url": "/api"}]  # --root-path
    assert http.get("/health").status_code == 200
    assert "Application startup complete" not in served.output()  # --uvicorn-log-level warning


def test_chat_templates(http: httpx.Client) -> None:
    """--chat-template FILE renders chats; a request's own template runs (trusted) but only
    for up to REQUEST_TEMPLATE_TIMEOUT_S."""

    def tokens(body: dict) -> list[int]:
        r = http.post("/tokenize", json={"model": HUB_ID, **body})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    rendered = "<s>CUSTOM[Hello there]"
    want = tokens({"prompt": rendered, "add_special_tokens": False})
    assert tokens({"messages": CHAT, "add_generation_prompt": False}) == want
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    want = tokens({"prompt": "<<Hello there>>", "add_special_tokens": False})
    assert tokens({"messages": CHAT, "chat_template": own}) == want
    endless = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    r = http.post("/tokenize", json={"model": HUB_ID, "messages": CHAT, "chat_template": endless})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "took over 1 s" in r.json()["error"]["message"]
    assert time.monotonic() - start < 10


def run_serve(hub: SimpleNamespace, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", *args, *CPU_ARGS]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=hub_env(hub))


@pytest.mark.parametrize(
    "args,message",
    [
        (["acme/missing"], "'acme/missing': not in the local cache"),
        ([HUB_ID, "--revision", "v9"], "'acme/tiny' (revision 'v9'): not in the local cache"),
        ([HUB_ID, "--no-enable-chunked-prefill"], "chunked prefill cannot be turned off"),
    ],
    ids=["missing", "revision", "chunked-prefill"],
)
def test_serve_errors_are_one_line(hub, args: list[str], message: str) -> None:
    r = run_serve(hub, *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def parse(*argv: str) -> tuple:
    parser, _ = build_parser()
    args = parser.parse_args(list(argv))
    return args, engine_config(args), launch_options(args)


def test_flags_land_in_the_config(hub, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    args, config, opts = parse(
        "serve", hub.snapshot, "--served-model-name", "x", "y", "--tokenizer", hub.base,
        "--trust-remote-code", "--generation-config", "vllm", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "1024", "--no-enable-prefix-caching", "--seed", "11",
        "--enable-chunked-prefill", "--chat-template", str(tmp_path / "t.jinja"),
        "--uvicorn-log-level", "error", "--allowed-origins", "https://a.example,https://b.example",
        "--root-path", "/v", "--log-requests", "--disable-log-requests",
    )  # fmt: skip
    mc = config.model
    assert (mc.names, mc.tokenizer_path, mc.trust_remote_code) == (["x", "y"], hub.base, True)
    assert (mc.generation_config, mc.seed) == ("vllm", 11)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (3, 1024)
    assert config.cache.enable_prefix_caching is False
    assert opts.api_key == "from-vllm" and opts.chat_template == TEMPLATE
    assert (opts.uvicorn_log_level, opts.root_path, opts.log_requests) == ("error", "/v", False)
    assert opts.allowed_origins == ["https://a.example", "https://b.example"]
    _, config, opts = parse("launch", "--model", hub.snapshot, "--enable-log-requests",
                            "--chat-template", "{{ 'inline' }}")  # fmt: skip
    assert config.model.name == hub.snapshot and config.cache.enable_prefix_caching
    assert opts.log_requests and opts.chat_template == "{{ 'inline' }}"
    assert opts.uvicorn_log_level == "info"  # follows --log-level
    with pytest.raises(ValueError, match="--ssl-keyfile and --ssl-certfile"):
        parse("serve", hub.snapshot, "--ssl-keyfile", "k.pem")
    with pytest.raises(ValueError, match="no such file"):
        parse("serve", hub.snapshot, "--chat-template", "missing.jinja")
    with pytest.raises(ValueError, match="--revision"):
        parse("serve", hub.snapshot, "--revision", "main")


def test_download_dir_resolves_hub_ids(hub, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = os.path.join(hub.home, "hub")
    assert resolve_model(HUB_ID, download_dir=cache) == hub.snapshot
    assert resolve_model(HUB_ID, revision=SHA, download_dir=cache) == hub.snapshot  # --revision
    with pytest.raises(ValueError, match="not in the local cache"):
        resolve_model("acme/other", download_dir=cache)
