#!/usr/bin/env bash
# The host KV tier on a GPU (issue 41, docs/kv-offloading.md), 8B shape (dummy weights):
#  1. `gpu-tests`: tests/test_host_tier_engine.py's GPU test (tier on/off, swap and recompute
#     give the float32 tiny model's greedy tokens, through the copy stream);
#  2. `multi-turn`: `launch --kv-cache-memory 4G` under `bench serve --dataset-name multi-turn`
#     (users whose histories do not fit on the GPU together), tier off, then
#     `--kv-offloading-size 64`: cached share of prompt tokens, TTFT p50, throughput;
#  3. `w1`: W1's shape (1024 in, 128 out) with --kv-cache-memory at a quarter of its need,
#     recompute (tier off) against `--kv-offloading-size 16`, auto (a lazy swap: recompute
#     with spills and host hits) and `--preemption-mode swap` (eager);
#  4. `copy-bench`: tests/gpu/host_tier_copy_bench.py (host time per plan's copies; a round trip);
#  5. `sim`: benchmarks/kv_tier_sim.py, the same W1 and multi-turn shapes through the core alone
#     (what each mode computes and copies; CPU only, seconds);
#  the host<->device bandwidth the workers measured at start-up beside a plain torch copy of the
#  same bytes (their log line), and where each run's copies spent their time (the shutdown line).
#   STEPS="multi-turn w1 gpu-tests" bash tests/gpu/kv_tier_run.sh
# (from a helper's worktree: see tests/gpu/device_run.sh's note on carrying the branch)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
ps_setup
unset PYTHONDONTWRITEBYTECODE
PS="python3 -m pagedserve.entrypoints.cli"
M=${M:-/tmp/m8b}
[ -d $M ] || python3 .gpucarry/make_model_dir.py $M --arch llama3-8b >/dev/null
COMMON=${COMMON:-"--model $M --load-format dummy --dtype bfloat16"}
USERS=${USERS:-64}; TURNS=${TURNS:-4}; W1_PROMPTS=${W1_PROMPTS:-400}
MT_KV=${MT_KV:-4G}; W1_KV=${W1_KV:-9G}; W1_IN=${W1_IN:-1024}  # W1 at 256 rows x 1152 tokens: 36G
for step in ${STEPS:-multi-turn w1 gpu-tests}; do
  case $step in
    gpu-tests) timeout 120 python3 -m pytest -q -x -m gpu tests/test_host_tier_engine.py \
        -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/gpu-tests.txt" ;;
    copy-bench) timeout 120 python3 tests/gpu/host_tier_copy_bench.py 2>&1 | tee "$OUT/copy-bench.txt" ;;
    sim) { python3 -m pagedserve.benchmarks.kv_tier_sim --num-prompts $W1_PROMPTS
        python3 -m pagedserve.benchmarks.kv_tier_sim --workload multi-turn --num-users $USERS \
          --num-turns $TURNS --device-blocks 2048 --host-blocks 32768 --modes off,auto
      } 2>&1 | tee "$OUT/sim.txt" ;;
    multi-turn)
      for tier in off on; do
        flags=""; [ $tier = on ] && flags="--kv-offloading-size ${TIER_GIB:-64}"
        $PS launch $COMMON --kv-cache-memory $MT_KV $flags --port 8041 --host 127.0.0.1 \
          --disable-log-requests --enable-prompt-tokens-details > "$OUT/mt-$tier-server.log" 2>&1 &
        srv=$!
        for _ in $(seq 900); do curl -sf localhost:8041/health >/dev/null && break; sleep 0.2; done
        timeout 120 $PS bench serve --base-url http://127.0.0.1:8041 --endpoint /v1/chat/completions \
          --dataset-name multi-turn --tokenizer $M --num-users $USERS --num-turns $TURNS \
          --system-prompt-len 32 --user-turn-len 256 --turn-output-len 64 --think-time 1.0 \
          --output-json "$OUT/mt-$tier.json" > "$OUT/mt-$tier.txt" 2>&1
        curl -s localhost:8041/metrics | grep -E '^(pagedserve|vllm):(prefix_cache|host_cache|kv_swap|num_requests_swapped|num_preemptions)' \
          > "$OUT/mt-$tier-metrics.txt"
        kill -TERM $srv; wait $srv
      done ;;
    w1)  # recompute: tier off; lazy: tier on, auto (recompute + spills + host hits); swap: eager
      for mode in ${W1_MODES:-recompute lazy swap}; do
        flags="--kv-offloading-size ${W1_TIER_GIB:-16}"
        case $mode in recompute) flags="" ;; swap) flags="$flags --preemption-mode swap" ;; esac
        timeout 150 $PS bench throughput $COMMON --kv-cache-memory $W1_KV $flags --input-len $W1_IN \
          --output-len 128 --num-prompts $W1_PROMPTS --output-json "$OUT/w1-$mode.json" \
          > "$OUT/w1-$mode.txt" 2>&1
      done ;;
  esac
done
grep -h "host KV tier:" "$OUT"/*.log "$OUT"/*.txt 2>/dev/null | sort -u | head -4
for f in "$OUT"/mt-*-server.log "$OUT"/w1-*.txt; do
  [ -f "$f" ] && grep -h "host KV tier copies" "$f" | sed "s|^|$(basename "$f"): |"
done
python3 - "$OUT" <<'PY'
import json, os, sys
def get(name):
    path = os.path.join(sys.argv[1], name + ".json")
    return json.load(open(path)) if os.path.exists(path) else {}
for tier in ("off", "on"):
    r = get(f"mt-{tier}")
    if r:
        print(f"multi-turn tier {tier:<3}: cached share {r.get('cached_share', 0):.3f}, TTFT p50 "
              f"{r.get('median_ttft_ms', 0):.1f} ms, {r.get('request_throughput', 0):.2f} req/s, "
              f"{r.get('output_throughput', 0):.0f} out tok/s, completed {r.get('completed')}")
for mode in ("recompute", "lazy", "swap"):
    r = get(f"w1-{mode}")
    if r:
        print(f"W1 quarter KV {mode:<9}: {r.get('requests_per_s', 0):.2f} req/s, "
              f"{r.get('output_tokens_per_s', 0):.0f} out tok/s")
PY
