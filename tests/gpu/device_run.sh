#!/usr/bin/env bash
# The GPU run, through the device tool (see README "Performance"): installs the wheels the GPU
# image lacks, builds the Llama-3-8B-shaped benchmark model dir, then runs the steps named in
# $STEPS (default: all) and prints a short table last. Outputs land in $OUT (or /tmp/out).
#   STEPS="kernels gpu-tests w3 w1 w4 w2 profile" bash tests/gpu/device_run.sh
# FP8 (issue 17): `fp8-tests` runs the FP8 kernel tests compiled; a step name ending in `-fp8`
# (w1-fp8, w2-fp8, w3-fp8, profile-fp8) runs that step with `--quantization fp8 --kv-cache-dtype
# fp8`; `table` prints W1/W2/W3 of bf16 and fp8 side by side from the JSON files:
#   STEPS="fp8-tests w3 w3-fp8 w1 w1-fp8 w2 w2-fp8 table" bash tests/gpu/device_run.sh
# From a helper's worktree: the device call sends the session's checkout, not the worktree, so
# copy the branch (`git archive HEAD | tar -x -C CHECKOUT/.mycarry/pagedserve`, plus .whl and
# .gpucarry inside it), list `.mycarry/` in .git/info/exclude, carry it, `cd` there first.
# `structured`: the device grammar masks against the CPU ones, `bench structured` at 0/50/100%
# JSON-schema requests (issue 14's cost target), then the grammar host work per step on this
# machine's CPU (tests/bench_grammar_step.py).
# (`tp`: tp=2 vs tp=1 greedy equality and decode latency; needs two GPUs, e.g. nvidia-h200-x2)
# Before the device call, on this machine: `bash ../shared/gpu/fetch-wheels.sh starlette==0.49.3
# annotated-doc==0.0.7` (wheels in .whl/; its own starlette pin does not resolve, FastAPI needs these)
# and `mkdir -p .gpucarry && cp ../shared/bench/make_model_dir.py .gpucarry/` (both git-ignored
# through .git/info/exclude); name `.whl` and `.gpucarry` in the device call's `carry`.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# The repo root is the package `pagedserve`: expose it under that name without installing.
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pagedserve && export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
PS="python3 -m pagedserve.frontend.cli"
M=/tmp/m8b
[ -d $M ] || python3 .gpucarry/make_model_dir.py $M --arch llama3-8b >/dev/null
COMMON="--model $M --load-format dummy --dtype bfloat16"
STEPS=${STEPS:-"kernels gpu-tests w3 w1 w4 w2 profile"}
summary=()
FP8="--quantization fp8 --kv-cache-dtype fp8"
for step in $STEPS; do
  t0=$(date +%s)
  T="timeout ${STEP_TIMEOUT:-240}"
  X=""; name=$step
  case $step in *-fp8) X=$FP8; step=${step%-fp8} ;; esac
  case $step in
    profile) $T python3 tests/gpu/profile_step.py $M ${X:+--fp8} 2>&1 | tee "$OUT/$name.txt" | tail -60 ;;
    fp8-tests) $T python3 -m pytest -q -s tests/test_triton_fp8.py 2>&1 | tee "$OUT/fp8-tests.txt" | tail -40
        $T python3 -m pagedserve.kernels.bench_fp8 2>&1 | tee "$OUT/fp8-gemm.txt" ;;
    fp8-sweep) $T python3 -m pagedserve.kernels.bench_fp8 --sweep > "$OUT/fp8_block_configs.json" ;;
    table) python3 - "$OUT" <<'PY'
import json, os, sys
def get(name, key):
    path = os.path.join(sys.argv[1], name + ".json")
    return json.load(open(path)).get(key) if os.path.exists(path) else None
rows = [("W1 req/s", "w1", "requests_per_s"), ("W1 out tok/s", "w1", "output_tokens_per_s"),
        ("W3 ms/token", "w3", "ms_per_output_token"), ("W2 TPOT p50 ms", "w2", "p50_tpot_ms"),
        ("W2 TPOT p99 ms", "w2", "p99_tpot_ms"), ("W2 TTFT p99 ms", "w2", "p99_ttft_ms"),
        ("W2 ITL p99 ms", "w2", "p99_itl_ms"), ("W2 out tok/s", "w2", "output_throughput")]
print(f"{'':16} {'bf16':>10} {'fp8':>10} {'fp8/bf16':>9}")
for label, step, key in rows:
    a, b = get(step, key), get(step + "-fp8", key)
    ratio = f"{b / a:9.3f}" if a and b else ""
    fmt = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10}"
    print(f"{label:16} {fmt(a)} {fmt(b)} {ratio}")
PY
    ;;
    kernels) $T python3 -m pagedserve.kernels.bench_kernels 2>&1 | tee "$OUT/kernels.txt" ;;
    gpu-tests) $T python3 -m pytest -q -m gpu -s tests/test_gpu_equivalence.py 2>&1 | tee "$OUT/gpu-tests.txt" | tail -25 ;;
    kernel-tests) $T python3 -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_triton_fp8.py \
          2>&1 | tee "$OUT/kernel-tests.txt" | tail -15 ;;
    w3) $T $PS bench latency $COMMON $X --batch-size 1 --input-len 128 --output-len 256 \
          --num-iters-warmup 1 --num-iters 3 --output-json "$OUT/$name.json" 2>&1 | tail -12 ;;
    w1) $T $PS bench throughput $COMMON $X --input-len 1024 --output-len 128 \
          --num-prompts ${W1_PROMPTS:-1000} ${W1_FLAGS:-} --output-json "$OUT/$name.json" 2>&1 | tail -12 ;;
    tp) $T python3 -m pytest -q -m gpu -s tests/test_gpu_equivalence.py -k tp2 2>&1 | tail -8
        for tp in 1 2; do for bs in 1 64; do
          $T $PS bench latency $COMMON --tp $tp --batch-size $bs --input-len 128 --output-len 256 \
            --num-iters-warmup 1 --num-iters 2 --output-json "$OUT/tp$tp-bs$bs.json" 2>&1 | tail -3
        done; done ;;
    structured) $T python3 -m pytest -q -m gpu tests/test_grammar_masks.py 2>&1 | tail -3
        S=/tmp/m8s; mkdir -p $S  # the 8B shape with the embedded tokenizer: it spells JSON
        cp $M/config.json $M/generation_config.json frontend/default_model/tokenizer.json \
          frontend/default_model/tokenizer_config.json $S/
        $T $PS bench structured --model $S --load-format dummy --dtype bfloat16 --num-prompts 256 \
          --input-len 128 --output-len 128 --repeats 3 --output-json "$OUT/structured.json" \
          2>&1 | tail -12
        $T python3 tests/bench_grammar_step.py 2>&1 | tee "$OUT/grammar-step.txt" ;;
    w4) $T $PS bench startup --port 8011 --num-iters 2 --output-json "$OUT/w4.json" -- \
          $COMMON 2>&1 | tail -6 ;;
    w1big) $T $PS bench throughput $COMMON --input-len 1024 --output-len 128 --num-prompts 1000 \
          --max-num-seqs 512 --max-num-batched-tokens 16384 --output-json "$OUT/w1big.json" \
          2>&1 | tail -4 ;;
    w2) $PS launch $COMMON $X --port 8012 --host 127.0.0.1 > "$OUT/$name-server.log" 2>&1 &
        srv=$!
        for _ in $(seq 600); do curl -sf localhost:8012/health >/dev/null && break; sleep 0.2; done
        $T $PS bench serve --base-url http://127.0.0.1:8012 --model $M --vocab-size 128000 \
          --num-prompts ${W2_PROMPTS:-800} --random-input-len 512 --random-output-len 256 \
          --random-range-ratio 0.5 --request-rate 20 --ignore-eos \
          --output-json "$OUT/$name.json" 2>&1 | tail -25
        kill -TERM $srv; wait $srv ;;
  esac
  summary+=("$name: $(( $(date +%s) - t0 )) s")
done
printf '%s\n' "${summary[@]}"
