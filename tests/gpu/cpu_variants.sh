#!/usr/bin/env bash
# Issue 43's AVX-512 evidence, on the GPU machine's host CPU (no GPU used): its CPU flags, the C++
# decode attention (kernels/cpu_native.py) built as native, avx2 and avx512 with each build's
# vector instruction counts, the kernel tests (every variant this CPU runs, against the torch
# reference), and a short timing of the variants per layer (tests/bench_cpu_attention.py, one
# thread). Carry as tests/gpu/device_run.sh says (.whl); outputs in $OUT (or /tmp/out):
#   bash tests/gpu/cpu_variants.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
ps_setup
export PAGEDSERVE_CACHE=/tmp/ps_cache
T="timeout ${STEP_TIMEOUT:-120}"
{ lscpu | grep -E "Model name|^CPU\(s\)"; grep -m1 -o -w -E "avx2|fma|avx512[a-z_0-9]*" /proc/cpuinfo \
  | sort -u | tr '\n' ' '; echo; c++ --version | head -1; } 2>&1 | tee "$OUT/cpu.txt"
$T python3 -m pytest -q -p no:cacheprovider tests/test_cpu_variants.py tests/test_cpu_native.py \
  2>&1 | tee "$OUT/tests.txt" | tail -6
for heads in "4 2 32" "32 8 128"; do
  $T python3 tests/bench_cpu_attention.py --rows 1 8 32 --heads $heads \
    --paths native avx2 avx512 2>&1 | tee -a "$OUT/bench.txt"
done
