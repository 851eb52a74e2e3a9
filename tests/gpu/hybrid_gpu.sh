#!/usr/bin/env bash
# Hybrid models on one GPU (issue 37): the Triton kernels' tests compiled and the engine on CUDA
# against transformers (tiny models), the engine's CPU hybrid tests, the chunked delta rule's time at the 8B-class Qwen3.5 shape, and the
# engine's batch-1 latency and W1 throughput with dummy weights at that shape (Qwen3.5's default
# config: hidden 4096, 32 layers of which 24 Gated DeltaNet with 16 key / 32 value heads of 128,
# 8 full-attention layers, vocab 248320; bfloat16). Outputs land in $OUT (or /tmp/out).
#   bash tests/gpu/hybrid_gpu.sh            # all steps
#   STEPS="kernel-tests bench-rule w3" bash tests/gpu/hybrid_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${M:-/tmp/qwen3.5-9b-shape}
PS="python3 -m pagedserve.entrypoints.cli"
COMMON="--model $M --load-format dummy --dtype bfloat16 --max-model-len 4096"
STEPS=${STEPS:-"kernel-tests engine-tests bench-rule w3 w1"}
T="timeout ${STEP_TIMEOUT:-300}"

if [ ! -f $M/config.json ]; then
  python3 - "$M" <<'PY'
import sys
sys.path.insert(0, "tests")
from tiny_models import make_tokenizer
from transformers import Qwen3_5TextConfig
config = Qwen3_5TextConfig(dtype="bfloat16")
config.architectures = ["Qwen3_5ForCausalLM"]
config.save_pretrained(sys.argv[1])
make_tokenizer().save_pretrained(sys.argv[1])  # ids < 512: enough for random prompts
PY
fi

for step in $STEPS; do
  echo "=== $step"
  case $step in
    kernel-tests) $T python3 -m pytest -q tests/test_hybrid_models.py -k "triton or gpu" 2>&1 \
        | tee "$OUT/hybrid-kernel-tests.txt" | tail -5 ;;
    engine-tests) $T python3 -m pytest -q tests/test_hybrid_models.py tests/test_state_pool.py \
        2>&1 | tee "$OUT/hybrid-engine-tests.txt" | tail -5 ;;
    bench-rule) $T python3 - <<'PY' 2>&1 | tee "$OUT/hybrid-rule.txt"
# The gated delta rule of one linear layer at the 8B shape, in Triton: the chunked form over one
# 1024-token prompt; one decode step of 64 rows.
import time, torch
from pagedserve.kernels.gated_delta import StateLayout, gated_delta_rule
dev, hk, hv, d = "cuda", 16, 32, 128
def run(rows, n, fresh):
    T = rows * n
    q, k = (torch.randn(T, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(T, hv, d, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(T, hv, device=dev) * 0.1
    beta = torch.rand(T, hv, device=dev, dtype=torch.bfloat16)
    state = torch.zeros(rows, hv, d, d, device=dev, dtype=torch.bfloat16)
    qsl = [i * n for i in range(rows + 1)]
    lens = [n if fresh else n + 100] * rows
    layout = StateLayout.build(list(range(rows)), qsl, lens, torch.device(dev))
    args = (q, k, v, g, beta, state, layout)
    gated_delta_rule(*args); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5): gated_delta_rule(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 5 * 1e3
ms = run(1, 1024, True)
flops = 1024 * hv * d * d * 2 * 4  # ~4 [C, D] x [D, D] products per token and head
print(f"prefill 1024 tokens, one layer: {ms:.2f} ms, {flops / ms / 1e9:.2f} TFLOP/s (Triton, fp32 ieee dots)")
ms = run(64, 1, False)
print(f"decode 64 rows, one layer: {ms * 1e3:.0f} us; state read+write "
      f"{64 * hv * d * d * 2 * 2 / ms / 1e6:.0f} GB/s")
PY
    ;;
    w3) $T $PS bench latency $COMMON --batch-size 1 --input-len 128 --output-len 256 \
          --num-iters-warmup 1 --num-iters 3 --output-json "$OUT/hybrid-w3.json" 2>&1 | tail -12 ;;
    w1) $T $PS bench throughput $COMMON --input-len 1024 --output-len 128 \
          --num-prompts ${W1_PROMPTS:-200} --output-json "$OUT/hybrid-w1.json" 2>&1 | tail -12 ;;
    *) echo "unknown step $step" ;;
  esac
done
