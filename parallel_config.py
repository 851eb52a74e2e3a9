"""Parallelism's config: tensor and pipeline parallel sizes, nodes, data parallel cores, devices.

Pure Python, like config.py, whose `EngineConfig` holds it; every value a user can set is checked
in `__post_init__` with a message that names the flag.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    pp_layer_partition: tuple[int, ...] | None = None
    # Data parallel: `data_parallel_size` engine cores on this host, each with its own tp x pp
    # workers on its own GPUs (core `data_parallel_rank` uses GPUs [rank * tp * pp, ...)).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    disable_custom_all_reduce: bool = False  # NCCL for every TP all-reduce (no one-shot path)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("--tp and --pp must be at least 1")
        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be at least 1")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError("data_parallel_rank must be in [0, --data-parallel-size)")
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError(
                "--data-parallel-size > 1 with --nnodes > 1 is not supported: data parallel "
                "runs its cores on one host (scale out with replicas behind deploy/nginx)"
            )
        if self.pp_layer_partition is not None:
            object.__setattr__(self, "pp_layer_partition", tuple(self.pp_layer_partition))
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("--node-rank must be in [0, --nnodes)")
        if self.world_size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} does not divide tp*pp={self.world_size}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("--nnodes > 1 needs --master-port (and --master-addr of node 0)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: choose auto, cpu or cuda")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def first_local_device(self) -> int:
        """The device index of this core's rank 0 on this node (data parallel cores take
        consecutive device ranges)."""
        return self.data_parallel_rank * self.ranks_per_node

    @property
    def local_ranks_of_host(self) -> int:
        """Worker processes on this node, over every data parallel core (they share its CPUs)."""
        return self.data_parallel_size * self.ranks_per_node

    def core(self, rank: int) -> ParallelConfig:
        """This config for data parallel core `rank`."""
        return dataclasses.replace(self, data_parallel_rank=rank)
