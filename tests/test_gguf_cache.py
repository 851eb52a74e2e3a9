"""GGUF weights dequantized once (worker/gguf_weights.py): the first load of SmolLM2's Q4_1 file
writes its float32 tensors to a safetensors cache beside the converted metadata; the next load
reads that cache without the gguf package and gives the same weights. A load that stops midway
leaves no cache behind. A server started over the cache reads it and names the metadata
directory as the model's `root` in /v1/models."""

from __future__ import annotations

import os
import shutil
import sys

import httpx
import pytest
import torch
from test_server import Launched, launch_args

from pagedserve import settings
from pagedserve.config import ModelConfig
from pagedserve.gguf_checkpoint import cache_dir, gguf_metadata_dir
from pagedserve.worker import gguf_weights
from pagedserve.worker.models import build_model

from real_models import smollm2_gguf

CPU = torch.device("cpu")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A cache directory holding SmolLM2's converted metadata (copied from the machine's cache:
    converting it again takes tens of seconds) and no cached weights."""
    metadata = gguf_metadata_dir(smollm2_gguf())
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    settings.forget()
    target = os.path.join(cache_dir(), os.path.basename(metadata))
    shutil.copytree(metadata, target, ignore=shutil.ignore_patterns("weights", "gguf.sha256"))
    yield target
    settings.forget()


def test_second_load_reads_the_cache(fresh_cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    dequantize = gguf_weights.iter_gguf
    monkeypatch.setattr(gguf_weights, "iter_gguf", lambda *a: calls.append(a) or dequantize(*a))
    config = ModelConfig("smollm2")
    assert config.hf_dir == fresh_cache

    first = build_model(config, torch.float32, CPU)
    weights_dir = os.path.join(fresh_cache, "weights")
    (cached,) = os.listdir(weights_dir)
    assert cached.startswith("float32-") and cached.endswith(".safetensors") and len(calls) == 1

    monkeypatch.setitem(sys.modules, "gguf", None)  # the dequantizer is out of reach
    second = build_model(config, torch.float32, CPU)
    assert len(calls) == 1 and os.listdir(weights_dir) == [cached]
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A server started over this cache reads it (the file is not written again) and names the
    # converted metadata directory as the model's `root` (PAGEDSERVE_CACHE: the fixture's).
    written = os.stat(os.path.join(weights_dir, cached)).st_mtime_ns
    args = launch_args("smollm2", "--max-model-len", "1024", "--kv-cache-memory", "64M")
    proc = Launched(args, os.path.join(os.path.dirname(fresh_cache), "launch.log"))
    try:
        url = proc.wait_ready()
        (card,) = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    finally:
        assert proc.stop() == 0, proc.output()
    assert card["id"] == "smollm2" and card["root"] == fresh_cache
    assert os.stat(os.path.join(weights_dir, cached)).st_mtime_ns == written


def test_only_a_whole_cache_is_written(tmp_path) -> None:
    """A load that stops midway (a crash, a bad tensor) leaves nothing; a whole one leaves a
    safetensors file of every tensor in the serving dtype."""
    tensors = {"a": torch.randn(3, 5), "b.weight": torch.randn(7), "c": torch.randn(2, 2, 2)}
    (tmp_path / "weights").mkdir()
    path = str(tmp_path / "weights" / "bfloat16-x.safetensors")
    stream = gguf_weights._write_through(iter(tensors.items()), path, torch.bfloat16)
    next(stream), next(stream)
    stream.close()
    assert os.listdir(tmp_path / "weights") == []
    loaded = dict(gguf_weights._write_through(iter(tensors.items()), path, torch.bfloat16))
    assert os.listdir(tmp_path / "weights") == ["bfloat16-x.safetensors"]
    with gguf_weights._open(path) as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor.to(torch.bfloat16))
            assert torch.equal(loaded[name], tensor.to(torch.bfloat16))


def test_a_damaged_cache_is_not_read(tmp_path) -> None:
    path = tmp_path / "float32-0.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert gguf_weights._open(str(path)) is None
    assert gguf_weights._open(str(tmp_path / "absent.safetensors")) is None
