"""One-shot all-reduce of small messages over NVLink, for tensor-parallel decode.

A batch-1 decode step of a Llama sums two partials per layer across the TP group, each a few KB:
NCCL's ring spends most of such an all-reduce on its protocol, not on moving bytes. Here each TP
rank owns a buffer in torch symmetric memory (mapped into every peer's address space over
NVLink at start-up), and torch's `one_shot_all_reduce_copy` kernel does the whole all-reduce in
one launch: it copies this rank's partial into its own buffer, meets every peer at a barrier of
signal pads, sums all ranks' buffers in rank order (every rank gets the same bits, which random
sampling on each rank needs), and meets them at a second barrier, so no rank overwrites its
buffer while a peer still reads it. No host sync: CUDA graphs capture it as they capture NCCL.

Messages above `MAX_BYTES` (prompt steps, large batches) and tensors the kernel cannot take
(float16 or another dtype, unaligned, not contiguous) go to NCCL. The path is set up only on
GPUs of one host and only if it passes a check with exact sums on every rank (all ranks agree
through NCCL before any uses it); `--disable-custom-all-reduce` (vLLM's flag) keeps NCCL for
every message.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_BYTES = 512 * 1024  # a decode step of 64 rows at hidden size 4096 in bf16
ALIGN = 16  # the kernel's widest vector; input and buffer must share their alignment
# torch's one-shot kernel dispatches bfloat16 and float32 only (torch 2.11 raises
# NotImplementedError for float16): float16 models stay on NCCL
DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class OneShotAllReduce:
    """A TP group's symmetric buffers (one per dtype, `max_bytes` each) and its group name."""

    group_name: str
    buffers: dict[torch.dtype, torch.Tensor]
    max_bytes: int = MAX_BYTES

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in self.buffers
            and 0 < nbytes <= self.max_bytes
            and nbytes % ALIGN == 0
            and x.data_ptr() % ALIGN == 0
            and x.is_contiguous()
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place (each thread reads its elements into the buffer
        before the barrier and writes their sums after it, so `x` may be the output too)."""
        staging = self.buffers[x.dtype][: x.numel()].view(x.shape)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, x)
        return x


def unavailable_reason(device: torch.device, tp_size: int, tp_ranks_per_host: int) -> str | None:
    """Why the one-shot path cannot serve this TP group (None: it may, if its check passes)."""
    if device.type != "cuda":
        return "not on CUDA"
    if tp_size < 2:
        return "no tensor parallelism"
    if tp_ranks_per_host % tp_size:  # TP groups are runs of tp ranks; hosts, of ranks_per_host
        return "the TP group spans hosts (NVLink peers only)"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy_out"
    return None


def setup_one_shot(
    group, device: torch.device, tp_size: int, tp_ranks_per_host: int, max_bytes: int = MAX_BYTES
) -> OneShotAllReduce | None:
    """Allocate and exchange the symmetric buffers of this TP group and check the kernel's sums;
    every rank of the group must call it. None (NCCL for everything) if any rank cannot."""
    reason = unavailable_reason(device, tp_size, tp_ranks_per_host)
    if reason is not None:
        log.info("one-shot all-reduce off: %s", reason)
        return None
    one_shot, error = None, None
    try:
        one_shot = _allocate(group.group_name, device, max_bytes)
        error = _check(one_shot, dist.get_rank(group), tp_size, device)
    except Exception as e:  # the same software on every rank fails the same way; agree below
        error = f"{type(e).__name__}: {e}"
    ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item() == 0:
        log.warning("one-shot all-reduce off, NCCL for every message: %s", error or "a peer failed")
        return None
    log.info("one-shot all-reduce on for messages up to %d bytes", max_bytes)
    return one_shot


def _allocate(group_name: str, device: torch.device, max_bytes: int) -> OneShotAllReduce:
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # older torch needs it
    if enable is not None:
        with warnings.catch_warnings():  # deprecated, and no longer needed, in newer torch
            warnings.simplefilter("ignore", FutureWarning)
            enable(group_name)
    buffers = {}
    for dtype in DTYPES:
        buf = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group_name)
        buffers[dtype] = buf
    return OneShotAllReduce(group_name, buffers, max_bytes)


def _check(one_shot: OneShotAllReduce, rank: int, size: int, device: torch.device) -> str | None:
    """Small integers sum exactly in every dtype and order: each rank's result must equal the
    expected sum, at the smallest and the largest size the path takes."""
    for dtype in DTYPES:
        for numel in (ALIGN // dtype.itemsize, one_shot.max_bytes // dtype.itemsize):
            base = torch.arange(numel, device=device) % 5
            x = (base + rank).to(dtype)
            one_shot.all_reduce(x)
            want = (base * size + size * (size - 1) // 2).to(dtype)
            if not torch.equal(x, want):
                return f"wrong sums for {numel} x {dtype} on rank {rank}"
    return None
