"""This process's tensor-parallel group, behind explicit collectives.

All state sits in one `TPState` object set once at worker start by `init_tp_group`; without it (or
without torch.distributed) the process is its own group of one and every collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TPState:
    group: Any = None  # a torch.distributed ProcessGroup, or None for a group of one
    rank: int = 0
    size: int = 1
    one_shot: Any = None  # a custom_all_reduce.OneShotAllReduce for small messages, or None


_TP = TPState()


def init_tp_group(group: Any, rank: int, size: int) -> None:
    """Record this worker's TP group; called once at worker start, before building the model."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel rank {rank} of size {size}")
    _TP.group, _TP.rank, _TP.size = group, rank, size


def set_one_shot(one_shot: Any) -> None:
    """Sum small messages with this one-shot all-reduce (None: NCCL for every message)."""
    _TP.one_shot = one_shot


def tp_rank() -> int:
    return _TP.rank if _active() else 0


def tp_size() -> int:
    return _TP.size if _active() else 1


def _active() -> bool:
    return _TP.size > 1 and dist.is_available() and dist.is_initialized()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group, in place; returns it."""
    if tp_size() > 1:
        if _TP.one_shot is not None and _TP.one_shot.fits(x):
            return _TP.one_shot.all_reduce(x)
        dist.all_reduce(x, group=_TP.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    size = tp_size()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=dim)
