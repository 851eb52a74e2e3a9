"""settings.py: the one reader of PAGEDSERVE_* variables, validated once, carried by the config."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pagedserve import settings
from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.settings import FUSIONS, Settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "frontend", "default_model")


def test_from_env_parses_and_validates():
    env = {
        "PAGEDSERVE_DISABLE_FUSIONS": "gemv, cascade",
        "PAGEDSERVE_ATTENTION_BACKEND": "torch",
        "PAGEDSERVE_MIXED_SPLIT_TOKENS": "0",
        "PAGEDSERVE_CACHE": "/tmp/x",
        "PAGEDSERVE_DISABLE_TRITON": "1",
    }
    s = Settings.from_env(env)
    assert s.disabled_fusions == ("gemv", "cascade") and not s.fusion_enabled("gemv")
    assert s.fusion_enabled("graph-head") and s.attention_backend == "torch"
    assert s.mixed_split_tokens == 0 and s.disable_triton
    assert s.cache_dir == "/tmp/x" and s.flash_cache_dir == "/tmp/x/flash_attn"
    assert Settings.from_env({"PAGEDSERVE_DISABLE_FUSIONS": "all"}).disabled_fusions == FUSIONS
    bad = {
        "PAGEDSERVE_DISABLE_FUSIONS": "rotary",
        "PAGEDSERVE_ATTENTION_BACKEND": "fa3",
        "PAGEDSERVE_CPU_LINEAR": "mkl",
        "PAGEDSERVE_MIXED_SPLIT_TOKENS": "many",
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=re.escape(name)):
            Settings.from_env({name: value})


def test_settings_travel_in_the_config():
    env = {"PAGEDSERVE_DISABLE_FUSIONS": "qkv-rope", "PAGEDSERVE_STEP_TRACE": "/tmp/trace"}
    config = EngineConfig(ModelConfig(DEFAULT_MODEL), settings=Settings.from_env(env))
    back = EngineConfig.from_json(config.to_json())
    assert back.settings == config.settings and back.settings.step_trace == "/tmp/trace"


def test_no_other_module_reads_pagedserve_variables():
    """Every PAGEDSERVE_* variable is read in settings.py (tests and benchmarks may set them)."""
    reads = re.compile(r"(environ|getenv)[^\n]{0,40}PAGEDSERVE_")
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs if not d.startswith(".") and d not in ("tests", "benchmarks", "deploy")
        ]
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and name != "settings.py":
                with open(path) as f:
                    found += [f"{path}: {m.group(0)}" for m in reads.finditer(f.read())]
    assert not found, found


def test_a_bad_variable_stops_launch_before_any_process():
    env = dict(os.environ, PAGEDSERVE_DISABLE_FUSIONS="rotary")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "launch", "--port", "0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "PAGEDSERVE_DISABLE_FUSIONS names rotary" in proc.stderr
    assert "Traceback" not in proc.stderr and "serving" not in proc.stderr


def test_current_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "torch")
    settings.forget()
    try:
        assert settings.current().cpu_kernels == "torch"
    finally:
        monkeypatch.delenv("PAGEDSERVE_CPU_KERNELS")
        settings.forget()
