#!/usr/bin/env bash
# pagedserve against vLLM-CPU on this machine, with vLLM's own client (issue 15; docs/performance.md, "Performance
# on a CPU"). Per model: vLLM serves (../shared/peers/vllm-cpu.sh), `vllm bench serve` runs at each
# concurrency, vLLM stops; then pagedserve launches, waits for its compiled CPU forward if it builds
# one, and the same runs. One server at a time; both float32, --max-model-len 1024.
#   bash tests/cpu_side_by_side.sh emb|m110 [concurrency ...]   (defaults: emb 32 1, m110 16 1)
# PROMPTS=N sends N prompts per run instead of the defaults below (a quick check of the script).
# `m110` is a 110M-parameter Llama shape (hidden 768, 12 layers, 12 heads, intermediate 2048, vocab
# 32000, tied) with dummy weights, written to $M110 (default /tmp/m110) when missing.
# Prints the machine first (CPU model, cores, its vector extensions: avx2, avx512*, amx*, and the
# load average), then one line per run: server, concurrency, req/s, TTFT p50, TPOT p50.
set -uo pipefail
cd "$(dirname "$0")/.."
PEER=${PEER:-../shared/peers/vllm-cpu.sh}
model=${1:?emb or m110}; shift
if [ "$model" = emb ]; then
  M=$PWD/frontend/default_model; extra=""; conc=${*:-32 1}
  shape="--random-input-len 128 --random-output-len 128"
  prompts() { [ "$1" -le 1 ] && echo "${PROMPTS:-50}" || echo "${PROMPTS:-$((200 > 6 * $1 ? 200 : 6 * $1))}"; }
else
  M=${M110:-/tmp/m110}; extra="--load-format dummy"; conc=${*:-16 1}
  if [ ! -f "$M/config.json" ]; then
    python3 - "$M" "$(dirname "$PEER")/../bench" <<'PY'
import json, os, sys
sys.path.insert(0, sys.argv[2])
from make_model_dir import ARCHS, write_tokenizer
config = dict(ARCHS["tiny"], vocab_size=32000, hidden_size=768, intermediate_size=2048,
              num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
              max_position_embeddings=2048, tie_word_embeddings=True)
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(config, open(f"{sys.argv[1]}/config.json", "w"), indent=1)
write_tokenizer(sys.argv[1], 32000)
PY
  fi
  shape="--random-input-len 256 --random-output-len 64"
  prompts() { [ "$1" -le 1 ] && echo "${PROMPTS:-10}" || echo "${PROMPTS:-$((4 * $1))}"; }
fi
up() { for _ in $(seq 1 1200); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 0.5; done; return 1; }
runs() {  # server-name port
  for c in $conc; do
    out=$(bash "$PEER" bench "http://127.0.0.1:$2" def "$M" --dataset-name random $shape \
      --num-prompts "$(prompts "$c")" --max-concurrency "$c" --ignore-eos 2>&1)
    val() { echo "$out" | grep -m1 "$1" | awk '{print $NF}'; }
    printf '%-10s %-4s %3s in flight: %7s req/s  TTFT p50 %8s ms  TPOT p50 %7s ms\n' "$1" "$model" \
      "$c" "$(val 'Request throughput')" "$(val 'Median TTFT')" "$(val 'Median TPOT')"
  done
}
cpu() {  # the machine beside each table: README's CPU table names it by this line
  local name; name=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
  printf 'CPU: %s, %s cores, %s; load %s\n' "$name" "$(nproc)" "$(grep -m1 -o -w -E \
    'avx2|fma|avx512[a-z_0-9]*|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/ $//')" \
    "$(cut -d' ' -f1-3 /proc/loadavg)"
}
cpu
t0=$(date +%s)
bash "$PEER" serve "$M" --served-model-name def --dtype float32 --max-model-len 1024 $extra \
  > /tmp/side_by_side_vllm.log 2>&1 &
pid=$!
up 8100 && echo "vllm ready after $(( $(date +%s) - t0 )) s" && runs vllm 8100
kill $pid; wait $pid 2>/dev/null; sleep 3
t0=$(date +%s)
log=/tmp/side_by_side_pagedserve.log
python3 -m pagedserve.entrypoints.cli launch --model "$M" --served-model-name def --dtype float32 \
  --max-model-len 1024 --port 8015 $extra > $log 2>&1 &
pid=$!
up 8015 && echo "pagedserve ready after $(( $(date +%s) - t0 )) s"
if grep -q "compiling the CPU forward" $log; then  # first start for this shape: wait for it
  for _ in $(seq 1 240); do  # the worker switches at a step: a small request makes one
    grep -q "compiled CPU forward in use" $log && break
    curl -s http://127.0.0.1:8015/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "def", "prompt": "def", "max_tokens": 2}' >/dev/null; sleep 1
  done
fi
runs pagedserve 8015
kill $pid; wait $pid 2>/dev/null
