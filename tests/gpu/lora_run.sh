#!/usr/bin/env bash
# Issue 39's GPU numbers (multi-LoRA), through the device tool like tests/gpu/device_run.sh (same
# carry: .whl and .gpucarry/make_model_dir.py; same Llama-3-8B-shaped dummy model; add the peft
# wheel to .whl, `bash ../shared/gpu/fetch-wheels.sh peft==0.21.2`, or lora-tests skip their
# peft comparisons), outputs in $OUT (or /tmp/out):
#   STEPS="lora-tests lora-kernels lora-w1 lora-w3 lora-table" bash tests/gpu/lora_run.sh
# lora-tests:   tests/test_lora.py on the GPU (the Triton pair compiled; bf16 rows with adapters on
#               the fused decode/prompt paths against peft); LORA_TESTS_ARGS: more pytest arguments
# lora-ktests:  only its kernel tests (compiled) and the bf16 engine test against peft
# lora-profile: tests/gpu/profile_lora.py: decode batch 1 and 256 and an 8 x 1024 prompt step,
#               base rows against 4 adapters in one runner (graph ms, kernels a layer, by kind,
#               the kernels' differences); PROFILE_ARGS: its arguments (W1's decode and mixed
#               steps: "--decode 64 256 --mixed 248:776 128:8064 --pipelined 256 --prefill 0")
# lora-swiglu:  a prompt's gate/up deltas inside silu-and-mul against the dense expand + the
#               activation, 8,192 tokens (bench_lora --swiglu)
# lora-kernels: shrink + expand (Triton) against the torch reference and the base matmul at the
#               8B shapes, 4 adapters rank 16 (python -m pagedserve.benchmarks.kernels.bench_lora)
# lora-w1:      W1 (1,000 prompts, 1024 in / 128 out) base alone, then 4 random rank-16 adapters
#               on all seven projections, requests spread uniformly (--num-loras 4); W1_TRACE=1:
#               with the worker's step trace, summed by step kind, adapters minus base
#               (tests/gpu/trace_summary.py: GPU s, idle s, host s in start())
# lora-w3:      W3 (batch 1, 128 in / 256 out) base alone, then with one adapter (--num-loras 1)
# lora-table:   the ratios the issue asks for (W1 >= 0.85x, W3 overhead <= 10%)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
ps_wheels
python3 -c "import peft" 2>/dev/null || echo "peft is not installed: lora-tests skip its peft comparisons"
ps_tree
export PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
PS="python3 -m pagedserve.entrypoints.cli"
M=/tmp/m8b
[ -d $M ] || python3 .gpucarry/make_model_dir.py $M --arch llama3-8b >/dev/null
COMMON="--model $M --load-format dummy --dtype bfloat16"
T="timeout ${STEP_TIMEOUT:-540}"
for name in ${STEPS:-lora-tests lora-kernels lora-w1 lora-w3 lora-table}; do
  echo "== $name =="
  case $name in
    lora-tests) $T python3 -m pytest -q tests/test_lora.py ${LORA_TESTS_ARGS:-} 2>&1 | tee "$OUT/lora-tests.txt" | tail -8 ;;
    lora-ktests) $T python3 -m pytest -q tests/test_lora.py \
          -k "triton or decode_lora or dense or fused_decode" 2>&1 | tee "$OUT/lora-ktests.txt" | tail -8 ;;
    lora-profile) $T python3 tests/gpu/profile_lora.py $M ${PROFILE_ARGS:-} 2>&1 \
          | tee "$OUT/lora-profile.txt" | grep -A14 "===\|^---" ;;
    lora-swiglu) $T python3 -m pagedserve.benchmarks.kernels.bench_lora --swiglu 2>&1 \
          | tee "$OUT/lora-swiglu.txt" ;;
    lora-kernels) $T python3 -m pagedserve.benchmarks.kernels.bench_lora \
          --json "$OUT/lora-kernels.json" 2>&1 | tee "$OUT/lora-kernels.txt" ;;
    lora-w1) for n in ${W1_NS:-0 4}; do
          rm -f "$OUT/lora-w1-trace-$n".*
          ${W1_TRACE:+env PAGEDSERVE_STEP_TRACE=$OUT/lora-w1-trace-$n} \
          $T $PS bench throughput $COMMON --input-len 1024 --output-len 128 \
            --num-prompts ${W1_PROMPTS:-1000} --num-loras $n --lora-rank 16 \
            --output-json "$OUT/lora-w1-$n.json" 2>&1 | tail -4
        done
        [ -s "$OUT/lora-w1-trace-4.worker0" ] && python3 tests/gpu/trace_summary.py \
          "$OUT/lora-w1-trace-0.worker0" "$OUT/lora-w1-trace-4.worker0" ;;
    lora-w3) for n in ${W3_NS:-0 1}; do
          $T $PS bench latency $COMMON --batch-size 1 --input-len 128 --output-len 256 \
            --num-iters-warmup 1 --num-iters 3 --num-loras $n --lora-rank 16 \
            --output-json "$OUT/lora-w3-$n.json" 2>&1 | tail -3
        done ;;
    lora-table) python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
w1 = [load(f"lora-w1-{n}.json") for n in (0, 4)]
w3 = [load(f"lora-w3-{n}.json") for n in (0, 1)]
if all(w1):
    r = w1[1]["output_tokens_per_s"] / w1[0]["output_tokens_per_s"]
    print(f"W1 out tok/s: base {w1[0]['output_tokens_per_s']:.0f}, 4 adapters "
          f"{w1[1]['output_tokens_per_s']:.0f}: {r:.3f}x (target >= 0.85)")
if all(w3):
    o = w3[1]["ms_per_output_token"] / w3[0]["ms_per_output_token"] - 1
    print(f"W3 ms/token: base {w3[0]['ms_per_output_token']:.3f}, 1 adapter "
          f"{w3[1]['ms_per_output_token']:.3f}: {100 * o:+.1f}% (target <= +10%)")
PY
    ;;
    *) echo "unknown step $name" ;;
  esac
done
