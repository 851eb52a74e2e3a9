#!/usr/bin/env bash
# Hybrid models on one GPU (issue 37): the Triton kernels' tests and the engine on CUDA against
# transformers (tiny models; decodes replay CUDA graphs), the chunked delta rule's time at the
# 8B-class Qwen3.5 shape, then tests/gpu/hybrid_bench.py (W3 batch-1 ms/token, one 1024-token
# prefill step, W1-shaped throughput, the weight-read floor) with dummy weights in bfloat16 at
# Qwen3.5's default shape (hidden 4096, 32 layers: 24 Gated DeltaNet with 16 key / 32 value heads
# of 128, 8 full attention; vocab 248320) and at Qwen3-Next-80B-A3B's shape cut to
# NEXT_LAYERS layers (512 experts, top 10; bf16: FP8 weights are refused for MoE models).
# A table last; outputs in $OUT (or /tmp/out).
#   bash tests/gpu/hybrid_gpu.sh
#   STEPS="bench-rule qwen3.5" W1_PROMPTS=1000 bash tests/gpu/hybrid_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # the device machine: the wheels its image lacks, and this checkout
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pagedserve && export PYTHONPATH=/tmp/pkg:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"kernel-tests bench-rule qwen3.5 qwen3-next"}
T="timeout ${STEP_TIMEOUT:-300}"

make_dir() {  # make_dir DIR CONFIG_EXPRESSION
  [ -f "$1/config.json" ] && return
  python3 - "$1" "$2" <<'PY'
import sys
sys.path.insert(0, "tests")
from tiny_models import make_tokenizer
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
config = eval(sys.argv[2])
config.save_pretrained(sys.argv[1])
make_tokenizer().save_pretrained(sys.argv[1])  # ids < 512: enough for random prompts
PY
}

t0=$(date +%s)
for step in $STEPS; do
  echo "=== $step ($(( $(date +%s) - t0 )) s)"
  case $step in
    kernel-tests) $T python3 -m pytest -q tests/test_hybrid_models.py -k "${TESTS:-triton or gpu}" \
        2>&1 | tee "$OUT/hybrid-kernel-tests.txt" | tail -3 ;;
    bench-rule) $T python3 - "$OUT/hybrid-rule.json" <<'PY' 2>&1 | tee "$OUT/hybrid-rule.txt"
# The gated delta rule of one linear layer at the 8B shape, in Triton: the chunked form over one
# 1024-token prompt; one decode step of 64 rows.
import json, sys, time, torch
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
out = {"prefill_layer_ms": ms, "tflops": flops / ms / 1e9}
print(f"prefill 1024 tokens, one layer: {ms:.2f} ms, {out['tflops']:.2f} TFLOP/s (fp32 dots)")
ms = run(64, 1, False)
out["decode64_layer_us"] = ms * 1e3
print(f"decode 64 rows, one layer: {ms * 1e3:.0f} us; state read+write "
      f"{64 * hv * d * d * 2 * 2 / ms / 1e6:.0f} GB/s")
json.dump(out, open(sys.argv[1], "w"))
PY
    ;;
    qwen3.5) M=/tmp/qwen3.5-9b-shape
      make_dir $M 'Qwen3_5TextConfig(dtype="bfloat16", architectures=["Qwen3_5ForCausalLM"])'
      $T python3 tests/gpu/hybrid_bench.py $M --prompts ${W1_PROMPTS:-200} \
        --json "$OUT/hybrid-qwen3.5.json" 2>&1 | tail -16 ;;
    qwen3-next) M=/tmp/qwen3-next-cut
      make_dir $M "Qwen3NextConfig(num_hidden_layers=${NEXT_LAYERS:-16}, dtype='bfloat16', \
architectures=['Qwen3NextForCausalLM'])"
      $T python3 tests/gpu/hybrid_bench.py $M --prompts ${NEXT_PROMPTS:-100} \
        --json "$OUT/hybrid-qwen3-next.json" 2>&1 | tail -16 ;;
    *) echo "unknown step $step" ;;
  esac
done

echo "=== done ($(( $(date +%s) - t0 )) s)"; nvidia-smi --query-gpu=name --format=csv,noheader
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
rule = load("hybrid-rule.json")
print(f"{'model':<22}{'W3 ms/tok':>10}{'floor':>8}{'x':>6}{'prefill1k ms':>13}{'W1 out tok/s':>13}"
      f"{'W1 tot tok/s':>13}{'rule share':>11}")
for name in ("qwen3.5", "qwen3-next"):
    r = load(f"hybrid-{name}.json")
    if r is None:
        continue
    config = json.load(open(os.path.join(r["model"], "config.json")))
    linear = config.get("layer_types", []).count("linear_attention")
    share = ""
    if rule and linear:
        share = f"{linear * rule['prefill_layer_ms'] / r['prefill_1024_ms']:.0%}"
    print(f"{name:<22}{r['w3_ms_per_token']:>10.2f}{r['floor_ms_per_token']:>8.2f}"
          f"{r['w3_over_floor']:>6.1f}{r['prefill_1024_ms']:>13.1f}{r['w1_output_tok_s']:>13.0f}"
          f"{r['w1_total_tok_s']:>13.0f}{share:>11}")
if rule:
    print(f"chunked rule, one layer, 1024 tokens: {rule['prefill_layer_ms']:.2f} ms, "
          f"{rule['tflops']:.1f} TFLOP/s ({rule['tflops'] / 67:.0%} of fp32 peak 67, "
          f"{rule['tflops'] / 989:.1%} of bf16 dense peak 989)")
PY
