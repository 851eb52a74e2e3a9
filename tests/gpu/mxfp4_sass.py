"""The MXFP4 expert kernels compiled for an H100 (sm_90a) without one: registers and spills
(ptxas), and the instructions of the gate/up GEMV's loop by opcode (nvdisasm), with the tools
Triton ships. Runs on any machine with Triton (no GPU, no interpreter):

    python3 tests/gpu/mxfp4_sass.py

What it answers before a device call: which tiles compile without spilling, and how many
instructions a weight costs in the GEMV (its decode is the bound on an H100: docs/gpt-oss.md).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from pagedserve.kernels import triton_moe_mxfp4 as grouped
from pagedserve.kernels import triton_moe_mxfp4_decode as gemv

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
GATE_UP = dict(
    x_ptr="*bf16",
    wb_ptr="*u8",
    ws_ptr="*u8",
    b_ptr="*bf16",
    ids_ptr="*i64",
    h_ptr="*bf16",
    H="i32",
    I="i32",
    stride_x="i32",
    stride_be="i64",
    stride_bn="i32",
    stride_se="i32",
    stride_sn="i32",
    stride_h="i32",
    alpha="fp32",
    limit="fp32",
)
DOWN = dict(
    h_ptr="*bf16",
    wb_ptr="*u8",
    ws_ptr="*u8",
    ids_ptr="*i64",
    weights_ptr="*fp32",
    out_ptr="*bf16",
    H="i32",
    I="i32",
    stride_h="i32",
    stride_be="i64",
    stride_bn="i32",
    stride_se="i32",
    stride_sn="i32",
    stride_o="i32",
)
GROUPED = dict(
    a_ptr="*bf16",
    wb_ptr="*u8",
    ws_ptr="*u8",
    c_ptr="*bf16",
    sorted_pairs_ptr="*i64",
    block_experts_ptr="*i64",
    weights_ptr="*fp32",
    bias_ptr="*bf16",
    num_pairs="i32",
    N="i32",
    K="i32",
    stride_am="i32",
    stride_be="i64",
    stride_bn="i32",
    stride_se="i32",
    stride_sn="i32",
    stride_cm="i32",
)


def build(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(
        src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def registers(kernel) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    log = subprocess.run(
        [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
        capture_output=True,
        text=True,
    ).stderr
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return f"{regs[0] if regs else '?'} registers, {spills[0] if spills else '?'} B spilled"


def loop_opcodes(kernel) -> collections.Counter:
    """Opcodes between the loop's label and its backward branch (the longest such loop)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run(
        [os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True
    ).stdout.splitlines()
    os.unlink(f.name)
    labels = {m[1]: i for i, line in enumerate(sass) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    best: collections.Counter = collections.Counter()
    for i, line in enumerate(sass):
        target = re.search(r"BRA `\(\.(L_x_\d+)\)", line)
        if target and labels.get(target[1], i) < i:
            ops = [
                m[1]
                for text in sass[labels[target[1]] : i + 1]
                if (m := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", text))
            ]
            best = max(best, collections.Counter(ops), key=lambda c: c.total())
    return best


def main() -> None:
    print("| kernel | tiles | BLOCK_M | ptxas (sm_90a) | loop instructions per thread |")
    print("| --- | --- | --- | --- | --- |")
    for tiles in [gemv.MXFP4_DECODE_TILES, (8, 16, 4, 2), (16, 8, 4, 2)]:
        block_n, groups, warps, stages = tiles
        consts = dict(TOP_K=4, HAS_BIAS=True, BLOCK_N=block_n, GROUPS=groups)
        kernel = build(gemv._gate_up_kernel, GATE_UP, consts, warps, stages)
        ops = loop_opcodes(kernel)
        per = 2 * block_n * groups * 32 // (32 * warps)  # weights a thread decodes per step
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
        print(
            f"| gate/up GEMV | {tiles} | | {registers(kernel)} | {ops.total()} for {per} "
            f"weights ({top}) |"
        )
        consts = dict(TOP_K=4, BLOCK_N=block_n, GROUPS=groups)
        kernel = build(gemv._down_kernel, DOWN, consts, warps, stages)
        print(f"| down GEMV | {tiles} | | {registers(kernel)} | |")
    for block_m in (16, 64):
        tiles = grouped.MXFP4_TILES if block_m == 16 else grouped.MXFP4_TILES_LARGE_M
        block_n, block_k, warps, stages = tiles
        consts = dict(
            TOP_K=4,
            A_PER_TOKEN=True,
            MUL_WEIGHT=False,
            HAS_BIAS=True,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            PRECISION="tf32",
        )
        kernel = build(grouped._grouped_mxfp4_kernel, GROUPED, consts, warps, stages)
        print(f"| grouped | {tiles} | {block_m} | {registers(kernel)} | |")


if __name__ == "__main__":
    main()
