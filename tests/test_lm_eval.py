"""lm-eval's `local-completions` model (loglikelihood: echo + logprobs on /v1/completions)
against a real `launch` of SmolLM2-135M, and lm-eval's own `hf` model on the same checkpoint:
the same accuracy on a small multiple-choice task shipped in tests/data/lmeval (no hub), and
the same loglikelihood for every choice."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_server import Launched, launch_args

from real_models import smollm2_hf_dir

DATA = Path(__file__).parent / "data" / "lmeval"
TASK = "pagedserve_tiny_mc"


@pytest.fixture(scope="module")
def hf_dir() -> str:
    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def url(hf_dir: str, tmp_path_factory: pytest.TempPathFactory):
    # The packaged smollm2 GGUF as transformers loads it (tests/real_models.py): the server starts
    # in seconds (a GGUF parse takes tens on 2 cores), and lm-eval's hf model reads the same files.
    args = launch_args(
        hf_dir, "--served-model-name", "smollm2", "--max-model-len", "512",
        "--kv-cache-memory", "64M",
    )  # fmt: skip
    proc = Launched(args, str(tmp_path_factory.mktemp("launch") / "launch.log"))
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


def evaluate(model: str, model_args: str) -> dict:
    """Batches of 8 (local-completions: 8 prompts per HTTP request)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], log_samples=True, batch_size=8,
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False), device="cpu",
    )  # fmt: skip


def loglikelihoods(out: dict) -> list[list[float]]:
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [[resp[0][0] for resp in s["resps"]] for s in samples]


def test_local_completions_equals_hf(url: str, hf_dir: str, monkeypatch) -> None:
    monkeypatch.chdir(DATA)  # the task's data_files path is relative
    ours = evaluate(
        "local-completions",
        f"model=smollm2,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={hf_dir},num_concurrent=1,max_retries=1",
    )
    hf = evaluate("hf", f"pretrained={hf_dir},dtype=float32")
    got, want = loglikelihoods(ours), loglikelihoods(hf)
    assert len(got) == 10 and all(len(choices) == 4 for choices in got)
    for a, b in zip(got, want, strict=True):
        assert all(math.isclose(x, y, abs_tol=1e-3) for x, y in zip(a, b, strict=True)), (a, b)
    acc = ours["results"][TASK]["acc,none"]
    print(f"lm-eval acc: local-completions {acc}, hf {hf['results'][TASK]['acc,none']}")
    assert acc == hf["results"][TASK]["acc,none"] and acc > 0.25  # above chance: it scored
