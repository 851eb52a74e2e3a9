"""Where a worker runs: its device, and on a CPU how many threads its ops take."""

from __future__ import annotations

import os

import torch


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


LARGE_CPU_MODEL_BYTES = 64 << 20


def set_cpu_threads(ranks_per_node: int, weight_bytes: int) -> int:
    """Intra-op threads for a CPU worker (`OMP_NUM_THREADS` wins when set).

    A small model's steps are short ops that the host (API server, core) keeps pace with only on
    a core of its own: such a worker takes the cores less one, shared by the ranks of this node
    (a thread more than that buys nothing and makes every op wait at an OpenMP barrier for a
    thread the scheduler has parked). A model of `LARGE_CPU_MODEL_BYTES` or more per rank is
    bound by its matmuls (prefill) and by streaming its weights (decode): it takes every core."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores, ranks = cores or 1, max(ranks_per_node, 1)
    spare = 0 if weight_bytes >= LARGE_CPU_MODEL_BYTES else 1
    threads = max(1, (cores - spare) // ranks)
    torch.set_num_threads(threads)
    return threads


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's weights, plain parameters and CPU-packed ones (kernels/cpu_linear)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            total += packed.numel() * packed.element_size()
    return total
