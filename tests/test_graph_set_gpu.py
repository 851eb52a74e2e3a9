"""On a GPU: the graphs' pinned host staging is never rewritten while a queued copy still has to
read it (the worker queues steps ahead of the device; with four pipeline stages a stage queued
three, and step N replayed with step N+2's inputs). Skipped without CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedserve.worker.graph_set import GraphSet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def test_staging_waits_for_queued_copies():
    device = torch.device("cuda")
    graphs = GraphSet(None, [8], 8, 16, 1, 16, 16, device)
    torch.cuda._sleep(200_000_000)  # the device is busy: every copy below stays queued a while
    seen = []
    for step in range(4):
        ids = np.full(4, step, dtype=np.int64)
        graphs._host_buffers(SimpleNamespace(input_ids=ids, positions=ids, slot_mapping=ids))
        graphs._upload(4, 0, ())
        seen.append(graphs.input_ids[:4].clone())  # what step `step`'s replay would read
    torch.cuda.synchronize()
    assert [int(t[0]) for t in seen] == [0, 1, 2, 3]
    assert all(bool((t == t[0]).all()) for t in seen)
