#!/usr/bin/env bash
# Issue 35 on one host of four GPUs (device kind nvidia-h100-x4 or nvidia-h200-x4): pipeline and
# tensor parallel layouts of the Llama-3-70B shape (dummy bf16 weights), a short table last.
#   STEPS="pp-tests lat-pp2 lat-tp2pp2 lat-tp4 thr-tp4 thr-tp2pp2" bash tests/gpu/multi_gpu_run.sh
# `lat-L`: `bench latency`, batch 1, 128 in / 256 out; `thr-L`: `bench throughput`, 500 x 1024 in
# / 128 out ($THR_PROMPTS); L is a layout: tp4, pp2, tp2pp2, pp4 (tpN and ppN in any order).
# `pp-tests`: the GPU equality tests of pipeline stages (tests/test_gpu_equivalence.py).
# `base:STEP` runs STEP with the package of $BASE (another checkout: main's tree before a change)
# instead of this one: the A/B of a change in the same lease. LAT_FLAGS / THR_FLAGS add engine
# flags (the latency steps default to --max-num-seqs 8 --max-num-batched-tokens 512: batch 1
# needs no more, and fewer CUDA graphs to capture start the 70B engine sooner).
# From a helper's worktree (the device call sends the session's checkout): copy the branch with
# `git archive HEAD | tar -x -C CHECKOUT/.mycarry/NAME`, .whl and .gpucarry inside it, carry
# `.mycarry/NAME` and `cd` there first; BASE may be a tree beside it (`.mycarry/NAME/base`).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pagedserve
if [ -n "${BASE:-}" ]; then mkdir -p /tmp/pkgbase && ln -sfn "$(cd "$BASE" && pwd)" /tmp/pkgbase/pagedserve; fi
M=/tmp/m70b
[ -d $M ] || python3 .gpucarry/make_model_dir.py $M --arch llama3-70b >/dev/null
COMMON="--model $M --load-format dummy --dtype bfloat16"
LAT_FLAGS=${LAT_FLAGS:-"--max-num-seqs 8 --max-num-batched-tokens 512"}
STEPS=${STEPS:-"pp-tests lat-pp2 lat-tp2pp2 lat-tp4 thr-tp4 thr-tp2pp2"}
layout() { echo "$1" | sed -E 's/tp([0-9]+)/ --tp \1 /; s/pp([0-9]+)/ --pp \1 /'; }
table=()
for step in $STEPS; do
  t0=$(date +%s)
  tree=/tmp/pkg; name=$step
  case $step in base:*) tree=/tmp/pkgbase; step=${step#base:}; name=base-$step ;; esac
  PS="env PYTHONPATH=$tree:${PYTHONPATH:-} timeout ${STEP_TIMEOUT:-420} python3 -m pagedserve.entrypoints.cli"
  json="$OUT/$name.json"
  case $step in
    pp-tests) env PYTHONPATH=$tree:${PYTHONPATH:-} timeout ${STEP_TIMEOUT:-420} python3 -m pytest \
          -q -m gpu -s tests/test_gpu_equivalence.py -k pipeline 2>&1 | tail -8
        table+=("$(printf '%-22s %s' "$name" "exit ${PIPESTATUS[0]}")") ;;
    lat-*) $PS bench latency $COMMON $(layout "${step#lat-}") $LAT_FLAGS --batch-size 1 \
          --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 2 \
          --output-json "$json" 2>&1 | grep -v "^USDT" | tail -3 ;;
    thr-*) $PS bench throughput $COMMON $(layout "${step#thr-}") ${THR_FLAGS:-} \
          --input-len 1024 --output-len 128 --num-prompts ${THR_PROMPTS:-500} \
          --output-json "$json" 2>&1 | grep -v "^USDT" | tail -3 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  if [ -f "$json" ]; then
    table+=("$(python3 - "$json" "$name" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
key = "ms_per_output_token" if "ms_per_output_token" in d else "requests_per_s"
print(f"{sys.argv[2]:<22} {key:<20} {d[key]:9.2f}")
PY
)")
  fi
  echo "== $name: $(( $(date +%s) - t0 )) s ${table[-1]:-}"
done
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
printf '%s\n' "${table[@]}"
