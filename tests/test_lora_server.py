"""LoRA over HTTP through a real `pagedserve launch`: adapters from --lora-modules (both forms)
selected by `model` and token-exact against transformers + peft, /v1/models with parents, an
unknown adapter as OpenAI's 404, and adapters loaded and unloaded at run time while requests of
the base model and of the adapter being unloaded stream to their end."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import httpx
import pytest
from lora_adapters import edit_config, make_adapter, peft_greedy
from test_server import CPU_ARGS, Launched, assert_error

from tiny_models import tiny_model_dir

MODEL = "tiny"
NUM = 8
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("lora-server"))
    model = tiny_model_dir("llama", tmp_path_factory.getbasetemp())
    allowed = os.path.join(base, "adapters")
    paths = {
        "attn": make_adapter(model, os.path.join(allowed, "attn"), 8, ["q_proj", "v_proj"], 11),
        "mlp": make_adapter(
            model, os.path.join(allowed, "mlp"), 16, ["gate_proj", "down_proj"], 12
        ),
        "late": make_adapter(model, os.path.join(allowed, "late"), 8, ["o_proj", "up_proj"], 13),
    }
    args = [
        "--model", model, "--host", "127.0.0.1", "--port", "0", *CPU_ARGS,
        "--served-model-name", MODEL, "--enable-lora", "--max-loras", "2",
        "--lora-modules", f"attn={paths['attn']}",
        json.dumps({"name": "mlp", "path": paths["mlp"], "base_model_name": MODEL}),
        "--allow-runtime-lora-updating", "--lora-allowed-dirs", allowed,
    ]  # fmt: skip
    proc = Launched(args, os.path.join(base, "launch.log"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    want = {  # bytes of a character cut at the end are not text yet (the server holds them)
        name: tokenizer.decode(
            peft_greedy(model, path, [PROMPT], NUM)[0], skip_special_tokens=True
        ).rstrip("\ufffd")
        for name, path in paths.items()
    }
    url = proc.wait_ready()
    with httpx.Client(base_url=url, timeout=60) as http:
        yield http, paths, want, base
    assert proc.stop() == 0, proc.output()


def complete(http: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NUM, "min_tokens": NUM,
            "temperature": 0}  # fmt: skip
    return http.post("/v1/completions", json=body)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_models_list_adapters_with_parent(setup):
    http, paths, _, _ = setup
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL, "attn", "mlp"}
    assert cards[MODEL]["parent"] is None
    for name in ("attn", "mlp"):
        assert cards[name]["parent"] == MODEL
        assert cards[name]["root"] == os.path.realpath(paths[name])


def test_model_selects_the_adapter_token_exact(setup):
    http, _, want, _ = setup
    for name in ("attn", "mlp"):
        response = complete(http, name)
        assert text(response) == want[name]
        assert response.json()["model"] == name
    chat = {"model": "mlp", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200 and response.json()["model"] == "mlp"
    assert http.post("/tokenize", json={"model": "attn", "prompt": "Hi"}).status_code == 200


def test_unknown_adapter_is_a_404(setup):
    http = setup[0]
    error = assert_error(complete(http, "no-such-adapter"), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "no-such-adapter" in error["message"]


def test_load_and_unload_while_requests_stream(setup):
    http, paths, want, base = setup
    streams: dict[str, list] = {}

    def stream(model: str) -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        chunks = streams.setdefault(model, [])
        with (
            httpx.Client(base_url=http.base_url, timeout=60) as own,
            own.stream("POST", "/v1/completions", json=body) as r,
        ):
            chunks.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0])

    threads = [threading.Thread(target=stream, args=(m,)) for m in (MODEL, "mlp")]
    for t in threads:
        t.start()
    while len(streams.get("mlp", [])) < 3:  # both are running
        assert all(t.is_alive() for t in threads), streams
        time.sleep(0.01)
    load = {"lora_name": "late", "lora_path": paths["late"]}
    response = http.post("/v1/load_lora_adapter", json=load)
    assert response.status_code == 200, response.text
    assert text(complete(http, "late")) == want["late"]
    assert_error(http.post("/v1/load_lora_adapter", json=load), 400)  # loaded already
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    assert_error(complete(http, "mlp"), 404)
    assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}), 404)
    for t in threads:
        t.join(timeout=120)
    for model in (MODEL, "mlp"):  # neither stream broke: every token, to the end
        assert streams[model][0] == 200
        out = "".join(c["text"] for c in streams[model][1:])
        assert streams[model][-1]["finish_reason"] == "length" and out
    assert text(complete(http, "attn")) == want["attn"]  # the others still serve

    outside = os.path.join(base, "elsewhere")
    shutil.copytree(paths["late"], outside)
    error = assert_error(
        http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": outside}), 403
    )
    assert "--lora-allowed-dirs" in error["message"]
    dora = os.path.join(os.path.dirname(paths["late"]), "dora")
    shutil.copytree(paths["late"], dora)
    edit_config(dora, use_dora=True)
    error = assert_error(
        http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": dora}), 400
    )
    assert "'d'" in error["message"] and "use_dora" in error["message"]
    assert text(complete(http, MODEL))  # the server keeps serving


def test_lora_requests_info_metric(setup):
    http = setup[0]
    text = http.get("/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2"' in text
    assert "pagedserve:lora_requests_info{" in text
    counts = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("pagedserve:lora_loads_total", "pagedserve:lora_evictions_total"))
    }
    # attn, mlp and late over two slots: three loads, at least one eviction
    assert counts["pagedserve:lora_loads_total"] >= 3
    assert counts["pagedserve:lora_evictions_total"] >= 1
