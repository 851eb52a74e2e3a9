"""Process groups for one worker: the world, its tensor-parallel group and its pipeline neighbours.

Rank layout: `rank = pp_stage * tp + tp_rank`, so a TP group is a contiguous run of ranks (one
host's NVLink island when tp <= GPUs per host) and pipeline stages talk rank to rank +/- tp, each
link over a group of its own two ranks (P2P on the world group would be serialized with every other
op of that group, and NCCL warns so).
NCCL on GPU, gloo on CPU; both rendezvous over TCP at master_addr:master_port, with a timeout so
that a missing peer fails start-up instead of hanging it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.parallel.custom_all_reduce import setup_one_shot
from pagedserve.parallel.state import init_tp_group, set_one_shot
from pagedserve.parallel_config import ParallelConfig

INIT_TIMEOUT = timedelta(seconds=120)


@dataclass
class _StageLinks:
    """This rank's groups of two with the previous and the next pipeline stage (None: none)."""

    prev: Any = None
    next: Any = None
    tokens: Any = None  # last stage <-> first stage, same TP rank: sampled ids (async, pp > 1)


_LINKS = _StageLinks()


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_stage: int
    pp_size: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_stage == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """TP rank 0 of the last stage: the one rank that sends StepResults."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size


def rank_info(parallel: ParallelConfig, rank: int) -> RankInfo:
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    return RankInfo(rank, tp * pp, rank % tp, tp, rank // tp, pp)


def init_distributed(
    info: RankInfo,
    master_addr: str,
    master_port: int,
    device: torch.device,
    sampled_links: bool = False,
    custom_all_reduce: bool = False,
    ranks_per_host: int | None = None,
):
    """Join the world group and build every TP group (all ranks must create all groups);
    `sampled_links`: also the last stage's links back to the first (send_sampled);
    `custom_all_reduce`: small TP all-reduces one-shot over NVLink where the TP group lies on
    one host of `ranks_per_host` ranks (parallel/custom_all_reduce.py)."""
    if info.world_size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=INIT_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    my_group = None
    for stage in range(info.pp_size):
        ranks = list(range(stage * info.tp_size, (stage + 1) * info.tp_size))
        group = dist.new_group(ranks) if info.tp_size > 1 else None
        if stage == info.pp_stage:
            my_group = group
    init_tp_group(my_group, info.tp_rank, info.tp_size)
    for rank in range(info.world_size - info.tp_size):  # every stage-to-stage link, on all ranks
        link = dist.new_group([rank, rank + info.tp_size])
        if rank == info.rank:
            _LINKS.next = link
        elif rank == info.prev_rank:
            _LINKS.prev = link
    last = (info.pp_size - 1) * info.tp_size
    for tp_rank in range(info.tp_size if sampled_links else 0):  # all ranks create them all
        link = dist.new_group([tp_rank, last + tp_rank])
        if info.tp_rank == tp_rank and (info.is_first_stage or info.is_last_stage):
            _LINKS.tokens = link
    if device.type == "cuda" and info.tp_size > 1:
        check_same_devices(gather_devices(device, info.world_size))
    if custom_all_reduce and info.tp_size > 1:
        per_host = ranks_per_host or info.world_size
        set_one_shot(setup_one_shot(my_group, device, info.tp_size, per_host))


_NAME_BYTES = 64


def gather_devices(device: torch.device, world_size: int) -> list[tuple[str, int]]:
    """(device name, SM count) of every rank, gathered as one small tensor per rank."""
    props = torch.cuda.get_device_properties(device)
    mine = torch.zeros(_NAME_BYTES + 1, dtype=torch.int64, device=device)
    name = props.name.encode()[:_NAME_BYTES]
    mine[: len(name)] = torch.tensor(list(name), dtype=torch.int64)
    mine[-1] = props.multi_processor_count
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    out = []
    for t in everyone:
        values = t.tolist()
        out.append((bytes(v for v in values[:-1] if v).decode(errors="replace"), values[-1]))
    return out


def check_same_devices(devices: list[tuple[str, int]]) -> None:
    """Refuse ranks on different kinds of GPU: random sampling is identical on every TP rank only
    if each runs the same kernels, and their launch grids depend on the SM count."""
    if len(set(devices)) > 1:
        listing = ", ".join(
            f"rank {r}: {name} ({sms} SMs)" for r, (name, sms) in enumerate(devices)
        )
        raise RuntimeError(
            "tensor parallelism needs the same GPU model on every rank (random sampling must "
            f"match across ranks, and kernels' launch grids depend on the SM count): {listing}"
        )


def split_layers(num_layers: int, pp_size: int, partition: list[int] | None = None) -> list[int]:
    """Layer counts per stage: `partition` if given, else as even as possible (earlier stages
    take the remainder last, since the last stage also runs the LM head)."""
    if partition is not None:
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(
                f"--pp-layer-partition {partition}: needs {pp_size} positive counts summing "
                f"to the model's {num_layers} layers"
            )
        return list(partition)
    if num_layers < pp_size:
        raise ValueError(f"--pp {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if i < extra else 0) for i in range(pp_size)]


def layer_range(num_layers: int, info: RankInfo, partition: list[int] | None) -> tuple[int, int]:
    counts = split_layers(num_layers, info.pp_size, partition)
    start = sum(counts[: info.pp_stage])
    return start, start + counts[info.pp_stage]


def send_intermediate(hidden: torch.Tensor, residual: torch.Tensor, dst: int) -> None:
    """Hidden states and residual ([T, H] each) to the next stage, sent from where they lie
    (a CUDA graph's static outputs: no stacked copy). Under NCCL the host never waits: each send
    runs on NCCL's own stream after an event of the compute stream, and the compute stream waits
    for it on the device only (so the next replay cannot overwrite what is still being sent)."""
    dist.send(hidden.contiguous(), dst, group=_LINKS.next)
    dist.send(residual.contiguous(), dst, group=_LINKS.next)


def recv_intermediate(
    hidden: torch.Tensor, residual: torch.Tensor, src: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous stage's hidden states and residual into `hidden` and `residual` ([T, H]:
    fresh tensors, or a graph's static input buffers); under NCCL the compute stream waits for
    them on the device, the host goes on queueing the forward."""
    dist.recv(hidden, src, group=_LINKS.prev)
    dist.recv(residual, src, group=_LINKS.prev)
    return hidden, residual


def send_sampled(token_ids: torch.Tensor, dst: int):
    """A step's sampled ids [S] (int64) from the last stage to the first (same TP rank), on a
    group of their own: under NCCL on its own stream, the host does not wait. Returns the work
    (keep it, and the tensor, until the first stage has them)."""
    return dist.isend(token_ids, dst, group=_LINKS.tokens)


def recv_sampled(token_ids: torch.Tensor, src: int):
    """Post the receive of a step's sampled ids into `token_ids`; `wait()` on the returned work
    before reading them (under NCCL the compute stream waits on the device, not the host)."""
    return dist.irecv(token_ids, src, group=_LINKS.tokens)
