"""The attention backend registry (kernels/attention/registry.py): every entry's capabilities,
the names the CLI and the environment accept, and the refusal of an unknown backend, by config
and CLI alike, with the list of known ones."""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys

import pytest

from pagedserve.config import ModelConfig
from pagedserve.entrypoints.args import add_engine_args
from pagedserve.kernels.attention import registry
from pagedserve.kernels.attention.interface import BackendCaps, PagedAttention

CAPS = {  # name: (cuda_graphs, cascade, fp8_cache, soft_cap, sinks, multi_token_queries, float32)
    "torch": (False, False, True, True, True, True, True),
    "sdpa": (False, False, True, True, True, True, True),
    "triton": (True, True, True, True, True, True, True),
    "flash": (True, False, False, True, False, True, False),
}


def test_every_backend_has_its_capabilities():
    assert set(registry.BACKENDS) == set(CAPS)
    for name, caps in CAPS.items():
        entry = registry.get_backend(name)
        assert entry.name == name
        assert entry.caps == BackendCaps(*caps), name


def test_names_accepted_stay_as_they_were():
    assert registry.REQUESTABLE_BACKENDS == ("auto", "triton", "flash")  # --attention-backend
    assert registry.ATTENTION_BACKENDS == ("torch", "sdpa", "triton", "flash")  # the env override
    assert [n for n, e in registry.BACKENDS.items() if e.cuda_only] == ["triton", "flash"]
    assert registry.backend_caps("auto") == tuple(
        registry.get_backend(n).caps for n in registry.AUTO_CANDIDATES
    )


@pytest.mark.parametrize("name", ["torch", "sdpa", "triton"])
def test_backends_load_lazily_and_keep_the_call_signature(name):
    fn = registry.get_backend(name).load()
    params = list(inspect.signature(fn).parameters)
    want = list(inspect.signature(PagedAttention.__call__).parameters)[1:]  # without self
    assert params[:6] == want[:6]  # query, kv_cache, meta, scale, sliding_window, logit_softcap
    assert {"k_scale", "v_scale"} <= set(params)


def test_registry_imports_no_torch():
    code = "import sys, pagedserve.kernels.attention.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_backend_refused_with_the_known_ones(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown attention backend 'fa3'.*torch, sdpa"):
        registry.get_backend("fa3")
    hf = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1}
    hf.update(num_attention_heads=2, vocab_size=16)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="'fa3': choose one of auto, triton, flash"):
        ModelConfig(str(tmp_path), attention_backend="fa3")
    cli = argparse.ArgumentParser()
    add_engine_args(cli)
    assert cli.parse_args(["--attention-backend", "flash"]).attention_backend == "flash"
    with pytest.raises(SystemExit):
        cli.parse_args(["--attention-backend", "fa3"])
    assert "choose from 'auto', 'triton', 'flash'" in capsys.readouterr().err
