"""The one-shot all-reduce of small TP messages (parallel/custom_all_reduce.py): vLLM's
`--disable-custom-all-reduce` reaches the config from `launch`, `bench` and `LLM`; where the path
cannot run it says why; on two GPUs its sums equal NCCL's bit for bit, eager and replayed in a
CUDA graph, and `tp_all_reduce` sends larger messages to NCCL."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedserve.parallel.custom_all_reduce import MAX_BYTES, unavailable_reason


def test_disable_flag_reaches_the_config_from_launch_bench_and_llm(tmp_path):
    from pagedserve.benchmarks.cli import add_bench_parser
    from pagedserve.benchmarks.common import engine_kwargs as bench_kwargs
    from pagedserve.entrypoints.args import engine_kwargs
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.frontend.engine_args import ENGINE_ARGS

    parser, _ = build_parser()
    on = parser.parse_args(["launch", "--tp", "2"])
    off = parser.parse_args(["launch", "--tp", "2", "--disable-custom-all-reduce"])
    assert not engine_kwargs(on)["disable_custom_all_reduce"]
    assert engine_kwargs(off)["disable_custom_all_reduce"]
    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    add_bench_parser(sub)
    bench = sub.choices["bench"].parse_args(
        ["latency", "--model", str(tmp_path), "--disable-custom-all-reduce"]
    )
    assert bench_kwargs(bench)["disable_custom_all_reduce"]
    assert ENGINE_ARGS["disable_custom_all_reduce"] is False  # LLM(disable_custom_all_reduce=)


def test_unavailable_reasons():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert unavailable_reason(cpu, 2, 2) == "not on CUDA"
    assert unavailable_reason(gpu, 1, 8) == "no tensor parallelism"
    assert "spans hosts" in unavailable_reason(gpu, 4, 2)
    assert "spans hosts" in unavailable_reason(gpu, 4, 6)  # tp 4 x pp 3 on two hosts


def _worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    from pagedserve.parallel.custom_all_reduce import setup_one_shot
    from pagedserve.parallel.state import init_tp_group, set_one_shot, tp_all_reduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device
    )
    group = dist.new_group([0, 1])
    init_tp_group(group, rank, 2)
    one_shot = setup_one_shot(group, device, 2, 2)
    assert one_shot is not None, "one-shot all-reduce did not set up on two GPUs"
    gen = torch.Generator(device).manual_seed(1234 + rank)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 7, 64):
            x = torch.randn(rows, 4096 // dtype.itemsize, generator=gen, device=device).to(dtype)
            want = x.clone()
            dist.all_reduce(want, group=group)  # two partials: one rounding either way
            assert torch.equal(one_shot.all_reduce(x.clone()), want), (dtype, rows)
    # replayed in a CUDA graph with new inputs each time, two all-reduces per replay
    static = torch.zeros(8, 2048, dtype=torch.bfloat16, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = one_shot.all_reduce(one_shot.all_reduce(static.clone()) * 0.5)
    for _ in range(3):
        static.copy_(torch.randn(static.shape, generator=gen, device=device))
        want = static.clone()
        dist.all_reduce(want, group=group)
        want = want * 0.5
        dist.all_reduce(want, group=group)
        graph.replay()
        assert torch.equal(out, want)
    set_one_shot(one_shot)  # tp_all_reduce: small ones one-shot, a large one to NCCL, all right
    big = torch.full((MAX_BYTES // 2 + 8,), rank + 1.0, dtype=torch.bfloat16, device=device)
    assert not one_shot.fits(big) and torch.all(tp_all_reduce(big) == 3)
    small = torch.full((16, 8), rank + 1.0, dtype=torch.bfloat16, device=device)
    assert one_shot.fits(small) and torch.all(tp_all_reduce(small) == 3)
    torch.cuda.synchronize()
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_shot_equals_nccl_on_two_gpus():
    import torch.multiprocessing as mp

    from pagedserve.ipc.sockets import free_port

    mp.spawn(_worker, args=(free_port(),), nprocs=2, join=True)
