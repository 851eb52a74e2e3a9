"""Microseconds per TP all-reduce, NCCL against the one-shot path (parallel/custom_all_reduce.py),
each replayed in a CUDA graph of 64 all-reduces back to back (as a 32-layer decode step has), on
every GPU of this host: `python3 tests/gpu/all_reduce_bench.py [KB ...]` (bf16 messages)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CHAIN, REPLAYS = 64, 20


def _graph_us(fn, x: torch.Tensor) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CHAIN):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * CHAIN)


def _run(rank: int, world: int, port: int, sizes_kb: list[int]) -> None:
    from pagedserve.parallel.custom_all_reduce import setup_one_shot

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        device_id=device,
    )  # fmt: skip
    group = dist.new_group(list(range(world)))
    one_shot = setup_one_shot(group, device, world, world, max_bytes=max(sizes_kb) * 1024)
    rows = []
    for kb in sizes_kb:
        x = torch.zeros(kb * 512, dtype=torch.bfloat16, device=device)  # kb KB of bf16
        nccl = _graph_us(lambda t: dist.all_reduce(t, group=group), x)
        mine = _graph_us(one_shot.all_reduce, x) if one_shot is not None else float("nan")
        speedup = nccl / mine
        rows.append(f"{kb:>8} KB  NCCL {nccl:7.2f} us  one-shot {mine:7.2f} us  {speedup:5.2f}x")
    if rank == 0:
        name = torch.cuda.get_device_name(device)
        print(f"all-reduce of bf16 in a CUDA graph, {world} x {name}:", *rows, sep="\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from pagedserve.ipc.sockets import free_port

    sizes = [int(a) for a in sys.argv[1:]] or [8, 32, 128, 512, 2048]
    world = torch.cuda.device_count()
    mp.spawn(_run, args=(world, free_port(), sizes), nprocs=world, join=True)
