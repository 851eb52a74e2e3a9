"""Sampled ids from the last pipeline stage to the first, on the device (async scheduling, pp > 1).

With several stages the first one embeds tokens that only the last one samples. Async scheduling
(`EngineConfig.pipelined_async`) lets the core plan a decode of a token still in flight (a
placeholder) while fewer requests run than there are stages, so the first stage must get that
token without the core's round trip: after sampling every step that samples, each last-stage rank
sends the step's ids [S] to the first-stage rank of its TP rank, on a process group of their own
(parallel/groups.py: send_sampled); the first stage posts the receive of each such step as it
queues the step (both sides agree on which steps sample: the rows whose known tokens are all
computed), and a plan that feeds a placeholder waits for that receive on the device (under NCCL
the compute stream waits, the host goes on; on a CPU, gloo blocks until the ids are there).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np
import torch

from pagedserve.parallel.groups import recv_sampled, send_sampled
from pagedserve.worker.sampler import to_device

KEEP_SENDS = 16  # steps whose transfer is kept unwaited; older ones have long arrived (pp < 16)


class SampledSender:
    """The last stage's side: `send(ids)` after each step's sampling."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self._sent: deque = deque()  # (work, tensor): the tensor must live until it is sent

    def send(self, token_ids: torch.Tensor) -> None:
        ids = token_ids.to(torch.int64).contiguous()
        self._sent.append((send_sampled(ids, self.dst), ids))
        while len(self._sent) > KEEP_SENDS:
            self._sent.popleft()[0].wait()


class SampledReceiver:
    """The first stage's side: `post(step_id, req_ids)` for each step that samples, in step
    order; `fill(unknown, unknown_ids)` gives the device's (token indices, ids) of a plan's
    placeholders; `forget(req_ids)` for requests that left the batch."""

    def __init__(self, src: int, device: torch.device) -> None:
        self.src, self.device = src, device
        self._posted: OrderedDict[int, tuple] = OrderedDict()  # step -> (work, ids), in order
        self._ready: dict[int, torch.Tensor] = {}  # step -> ids received (the stream waits)
        self._where: dict[str, tuple[int, int]] = {}  # request -> (its last sampling step, row)

    def post(self, step_id: int, req_ids: list[str]) -> None:
        ids = torch.empty(len(req_ids), dtype=torch.int64, device=self.device)
        self._posted[step_id] = (recv_sampled(ids, self.src), ids)
        while len(self._posted) > KEEP_SENDS:  # no plan fed a placeholder (every stage had work)
            self._wait_through(next(iter(self._posted)))
        for j, req_id in enumerate(req_ids):
            self._where[req_id] = (step_id, j)
        live = {step for step, _ in self._where.values()}
        for step in [s for s in self._ready if s not in live]:
            del self._ready[step]

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._where.pop(req_id, None)

    def fill(
        self, unknown: np.ndarray, unknown_ids: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token indices, token ids) on the device: each placeholder is its request's token
        from the last step that sampled it."""
        sources = [self._where[req_id] for req_id in unknown_ids]
        self._wait_through(max(step for step, _ in sources))
        steps = sorted({step for step, _ in sources})
        offsets = dict(
            zip(steps, np.cumsum([0] + [len(self._ready[s]) for s in steps]), strict=False)
        )
        ids = (
            self._ready[steps[0]] if len(steps) == 1 else torch.cat([self._ready[s] for s in steps])
        )
        src = np.asarray([offsets[step] + j for step, j in sources], dtype=np.int64)
        idx = to_device(np.stack([unknown.astype(np.int64), src]), self.device)
        return idx[0], ids[idx[1]]

    def _wait_through(self, step_id: int) -> None:
        """Wait (on the device under NCCL) for every posted receive up to `step_id`, in order."""
        while self._posted and next(iter(self._posted)) <= step_id:
            step, (work, ids) = self._posted.popitem(last=False)
            work.wait()
            self._ready[step] = ids


def stage_links(config, info, device: torch.device):
    """(receiver on the first stage, sender on the last), each None elsewhere or when
    `config.pipelined_async` is off."""
    if not config.pipelined_async:
        return None, None
    first, last = info.tp_rank, (info.pp_size - 1) * info.tp_size + info.tp_rank
    receiver = SampledReceiver(last, device) if info.is_first_stage else None
    return receiver, SampledSender(first) if info.is_last_stage else None
