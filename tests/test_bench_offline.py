"""`pagedserve bench throughput` on the embedded default model (CPU): the measured prompts find
nothing of the warm-up's in the prefix cache (a warm-up over the first measured prompts had let 8
of W5's 64 prompts skip their prefill on a GPU), and the result says how many prompt tokens came
from the cache."""

from __future__ import annotations

import json

from pagedserve.entrypoints.cli import main
from pagedserve.frontend.hub import default_model_dir


def test_throughput_measures_no_warm_up_cache_hits(tmp_path) -> None:
    out = tmp_path / "w.json"
    argv = ["bench", "throughput", "--model", default_model_dir(), "--device", "cpu",
            "--dtype", "float32", "--num-prompts", "10", "--input-len", "40",
            "--output-len", "2", "--output-json", str(out)]  # fmt: skip
    assert main(argv) in (0, None)
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 10
    assert result["cached_prompt_tokens"] == 0
