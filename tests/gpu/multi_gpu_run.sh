#!/usr/bin/env bash
# Issue 35 on one host of four GPUs (device kind nvidia-h100-x4 or nvidia-h200-x4): pipeline and
# tensor parallel layouts of the Llama-3-70B shape (dummy bf16 weights), a short table last.
#   STEPS="pp-tests lat-pp2 lat-tp2pp2 lat-tp4 thr-tp4 thr-tp2pp2" bash tests/gpu/multi_gpu_run.sh
# `lat-L`: `bench latency`, batch 1, 128 in / 256 out; `thr-L`: `bench throughput`, 500 x 1024 in
# / 128 out ($THR_PROMPTS); L is a layout: tp4, pp2, tp2pp2, pp4 (tpN and ppN in any order).
# `pp-tests`: the GPU equality tests of pipeline stages (tests/test_gpu_equivalence.py).
# `serve-L`: `launch` layout L under `bench serve`, 600 requests ($SERVE_PROMPTS; 300 before
# 2026-11-27) of 512 +-50% in / 256 +-50% out at 8 req/s ($SERVE_RATE); target with tp2pp2: keeps
# up (sustained_request_throughput >= 7.8, beside the run's steady_send_rate; results.py
# keeping_up: completed / duration stays near 6 at any speed), TPOT p99 <= 45 ms. The arrivals'
# seed is $SERVE_SEED (default 0: its 600 sends come at 7.51 a second; seed 7's at 7.97).
# The A/B of planning micro-batches ahead: STEPS="base:serve-tp2pp2 serve-tp2pp2". `mt-dpN`: the 8B shape, `launch -dp N` under a multi-turn `bench serve` (the cached share of
# prompt tokens, -dp 4 within 10% of -dp 1's). `STEP@FLAG,FLAG`: STEP with these engine flags
# too (`thr-tp2pp2@--max-num-seqs=128`). TRACE=1: each engine writes a step trace
# (PAGEDSERVE_STEP_TRACE) to $OUT/trace-NAME, and every worker's is summed up after its step
# (tests/gpu/trace_summary.py: GPU busy and idle seconds per step kind, per rank).
# `base:STEP` runs STEP with the package of $BASE (another checkout: main's tree before a change)
# instead of this one: the A/B of a change in the same lease. LAT_FLAGS / THR_FLAGS add engine
# flags (the latency steps default to --max-num-seqs 8 --max-num-batched-tokens 512: batch 1
# needs no more, and fewer CUDA graphs to capture start the 70B engine sooner).
# Small TP all-reduces one-shot over NVLink (parallel/custom_all_reduce.py): `ar-tests` runs its
# GPU test (equal to NCCL bit for bit, eager and in a graph) and the tp2-vs-tp1 equality test;
# `ar-bench` times one all-reduce in a CUDA graph, NCCL vs one-shot, 8 KB to 2 MB, on every GPU;
# the engine's A/B in one lease is `lat-tp2@--disable-custom-all-reduce lat-tp2`:
#   ARCH=llama3-8b STEPS="ar-tests ar-bench lat-tp2@--disable-custom-all-reduce lat-tp2"
# On four GPUs (nvidia-h100-x4 / nvidia-h200-x4), in calls of under 10 minutes each:
#   STEPS="ar-tests ar-bench pp-tests lat-tp4@--disable-custom-all-reduce lat-tp4 lat-tp2pp2"
#   STEPS="lat-pp2 lat-pp4 thr-tp4 thr-tp2pp2"; STEPS="serve-tp2pp2 serve-tp4"
#   STEPS="w1-dp1 w1-dp4 mt-dp1 mt-dp4" (`w1-dpN`: the 8B shape, W1 = 1000 x 1024/128 at -dp N)
# On two GPUs: `ARCH=llama3-8b STEPS="lat-pp2 base:lat-pp2 lat-tp1 lat-tp2 thr-pp2 thr-tp2"`
# (batch 1 with async scheduling across stages: the first stage no longer waits for the core's
# round trip; docs/parallelism.md).
# From a helper's worktree (the device call sends the session's checkout): copy the branch with
# `git archive HEAD | tar -x -C CHECKOUT/.mycarry/NAME`, .whl and .gpucarry inside it, carry
# `.mycarry/NAME` and `cd` there first; BASE may be a tree beside it (`.mycarry/NAME/base`).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
ps_wheels
export PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
ps_link
if [ -n "${BASE:-}" ]; then mkdir -p /tmp/pkgbase && ln -sfn "$(cd "$BASE" && pwd)" /tmp/pkgbase/pagedserve; fi
ARCH=${ARCH:-llama3-70b}  # ARCH=llama3-8b: the 8B shape, for two GPUs (nvidia-h100-x2)
M=${M70:-/tmp/m${ARCH#llama3-}}  # M70, M8, VOCAB: other model dirs (a CPU dry run: tiny ones, VOCAB 4000)
[ -d $M ] || python3 .gpucarry/make_model_dir.py $M --arch $ARCH >/dev/null
M8=${M8:-/tmp/m8b}
COMMON="--model $M --load-format dummy --dtype bfloat16"
LAT_FLAGS=${LAT_FLAGS:-"--max-num-seqs 8 --max-num-batched-tokens 512"}
STEPS=${STEPS:-"pp-tests lat-pp2 lat-tp2pp2 lat-tp4 thr-tp4 thr-tp2pp2"}
layout() { echo "$1" | sed -E 's/tp([0-9]+)/ --tp \1 /; s/pp([0-9]+)/ --pp \1 /'; }
serve() {  # serve ENGINE_FLAGS BENCH_FLAGS: launch, wait for /health, bench serve, stop
  $PS launch $1 --port 8015 --host 127.0.0.1 --disable-log-requests > "$OUT/$name-server.log" 2>&1 &
  local srv=$!
  for _ in $(seq 2000); do curl -sf localhost:8015/health >/dev/null && break; sleep 0.2; done
  $PS bench serve --base-url http://127.0.0.1:8015 $2 --metric-percentiles 50,99 \
    --output-json "$json" 2>&1 | grep -v "^USDT" | tail -4
  kill -TERM $srv; wait $srv
}
table=()
for step in $STEPS; do
  t0=$(date +%s)
  tree=/tmp/pkg; name=$step
  case $step in base:*) tree=/tmp/pkgbase; step=${step#base:}; name=base-$step ;; esac
  X=""; case $step in *@*) X=$(echo "${step#*@}" | tr ',' ' '); step=${step%%@*} ;; esac
  name=${name//[@=,]/_}
  PS="env PYTHONPATH=$tree:${PYTHONPATH:-} timeout ${STEP_TIMEOUT:-420} python3 -m pagedserve.entrypoints.cli"
  json="$OUT/$name.json"
  if [ "${TRACE:-0}" = 1 ]; then export PAGEDSERVE_STEP_TRACE="$OUT/trace-$name"; fi
  case $step in
    ar-tests) env PYTHONPATH=$tree:${PYTHONPATH:-} timeout ${STEP_TIMEOUT:-420} python3 -m pytest \
          -q -m gpu -s tests/test_custom_all_reduce.py tests/test_gpu_equivalence.py \
          -k "one_shot or tp2_bf16" 2>&1 | tail -8
        table+=("$(printf '%-22s %s' "$name" "exit ${PIPESTATUS[0]}")") ;;
    ar-bench) env PYTHONPATH=$tree:${PYTHONPATH:-} timeout ${STEP_TIMEOUT:-420} python3 \
          tests/gpu/all_reduce_bench.py 2>&1 | tee "$OUT/$name.txt" | grep -v "^USDT" | tail -7 ;;
    w1-dp*) [ -d $M8 ] || python3 .gpucarry/make_model_dir.py $M8 --arch llama3-8b >/dev/null
        $PS bench throughput --model $M8 --load-format dummy --dtype bfloat16 -dp ${step#w1-dp} \
          $X --input-len 1024 --output-len 128 --num-prompts ${W1_PROMPTS:-1000} \
          --output-json "$json" 2>&1 | grep -v "^USDT" | tail -3 ;;
    pp-tests) env PYTHONPATH=$tree:${PYTHONPATH:-} timeout ${STEP_TIMEOUT:-420} python3 -m pytest \
          -q -m gpu -s tests/test_gpu_equivalence.py -k pipeline 2>&1 | tail -8
        table+=("$(printf '%-22s %s' "$name" "exit ${PIPESTATUS[0]}")") ;;
    lat-*) $PS bench latency $COMMON $(layout "${step#lat-}") $LAT_FLAGS $X --batch-size 1 \
          --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 2 \
          --output-json "$json" 2>&1 | grep -v "^USDT" | tail -3 ;;
    thr-*) $PS bench throughput $COMMON $(layout "${step#thr-}") ${THR_FLAGS:-} $X \
          --input-len 1024 --output-len 128 --num-prompts ${THR_PROMPTS:-500} \
          --output-json "$json" 2>&1 | grep -v "^USDT" | tail -3 ;;
    serve-*) serve "$COMMON $(layout "${step#serve-}") $X" "--model $M --vocab-size ${VOCAB:-128000} \
          --num-prompts ${SERVE_PROMPTS:-600} --random-input-len 512 --random-output-len 256 \
          --random-range-ratio 0.5 --request-rate ${SERVE_RATE:-8} --seed ${SERVE_SEED:-0} --ignore-eos" ;;
    mt-dp*) [ -d $M8 ] || python3 .gpucarry/make_model_dir.py $M8 --arch llama3-8b >/dev/null
        serve "--model $M8 --load-format dummy --dtype bfloat16 -dp ${step#mt-dp} $X \
          --enable-prompt-tokens-details" "--endpoint /v1/chat/completions \
          --dataset-name multi-turn --num-users ${MT_USERS:-256} --num-turns 4 --think-time 0.5" ;;
    *) echo "unknown step $step"; continue ;;
  esac
  unset PAGEDSERVE_STEP_TRACE
  for f in "$OUT/trace-$name".worker*; do
    [ -s "$f" ] && echo "${f##*/}" && python3 tests/gpu/trace_summary.py "$f"
  done
  if [ -f "$json" ]; then
    table+=("$(python3 - "$json" "$name" <<'PY'
import json, sys
d, name = json.load(open(sys.argv[1])), sys.argv[2]
if "request_throughput" in d:  # bench serve
    keys = ("request_throughput", "steady_send_rate", "sustained_request_throughput",
            "p50_tpot_ms", "p99_tpot_ms", "p99_ttft_ms", "cached_share")
    print(f"{name:<22} " + " ".join(f"{k} {d[k]:.3f}" for k in keys if d.get(k) is not None))
else:
    key = "ms_per_output_token" if "ms_per_output_token" in d else "requests_per_s"
    print(f"{name:<22} {key:<20} {d[key]:9.2f}")
PY
)")
  fi
  echo "== $name: $(( $(date +%s) - t0 )) s ${table[-1]:-}"
done
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
printf '%s\n' "${table[@]}"
