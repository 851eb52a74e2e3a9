#!/usr/bin/env bash
# Issue 38, greedy output with speculation on against off on a GPU, in one device call: where each
# request first differs and the top-2 margin there in both arms (tests/gpu/spec_numerics.py),
# SmolLM2's shape with dummy weights (nothing to carry), bfloat16 and float32, CUDA graphs and
# eager; then the CUDA tests of tests/test_spec_numerics_gpu.py. With BASE=DIR (another tree,
# e.g. the commit before a fix, holding these two files) its float32 arm and tests run beside,
# in parallel. Logs and JSON in $OUT; the per-prompt lines last.
#   BASE=../spec38c-base bash tests/gpu/spec_numerics.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tests/gpu/env.sh
ps_wheels
export PYTHONUNBUFFERED=1
tree() {  # tree NAME DIR: PYTHONPATH that imports DIR as pagedserve
  mkdir -p "/tmp/pkg-$1" && ln -sfn "$(cd "$2" && pwd)" "/tmp/pkg-$1/pagedserve"
  echo "/tmp/pkg-$1:${PYTHONPATH:-}"
}
NEW=$(tree new .)
PYTHONPATH=$NEW python3 - <<'PY' | tee "$OUT/settings.txt"
import torch
from pagedserve.kernels.attention.selection import attention_backend_name
b = torch.backends.cuda.matmul
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: matmul.allow_tf32={b.allow_tf32}, "
      f"float32_matmul_precision={torch.get_float32_matmul_precision()}, "
      f"allow_bf16_reduced_precision_reduction={b.allow_bf16_reduced_precision_reduction}; "
      f"attention: {attention_backend_name('cuda', dtype=torch.bfloat16)}")
PY
S=(-m pagedserve.tests.gpu.spec_numerics --arch smollm2 --kv-cache-memory 1G)
T=(-m pytest -q -x -p no:cacheprovider tests/test_spec_numerics_gpu.py)
LIMIT=${LIMIT:-200}
PYTHONPATH=$NEW timeout $LIMIT python3 "${S[@]}" --dtype bfloat16 float32 --label graphs \
  --output-json "$OUT/graphs.json" > "$OUT/graphs.log" 2>&1 &
PYTHONPATH=$NEW timeout $LIMIT python3 "${S[@]}" --dtype bfloat16 float32 --enforce-eager \
  --label eager --output-json "$OUT/eager.json" > "$OUT/eager.log" 2>&1 &
PYTHONPATH=$NEW timeout $LIMIT python3 "${T[@]}" > "$OUT/tests.log" 2>&1 &
if [ -n "${BASE:-}" ]; then
  BASEP=$(tree base "$BASE")
  PYTHONPATH=$BASEP timeout $LIMIT python3 "${S[@]}" --dtype float32 --label base-graphs \
    --output-json "$OUT/base.json" > "$OUT/base.log" 2>&1 &
  (cd "$BASE" && PYTHONPATH=$BASEP timeout $LIMIT python3 "${T[@]}" > "$OUT/base-tests.log" 2>&1) &
fi
wait
for f in "$OUT"/*.log; do
  echo "== $(basename "$f")"; grep -E "prompt [0-9]|verification steps|passed|failed|Error|assert" "$f" | tail -12
done
