#!/usr/bin/env bash
# Issue 40's GPU numbers (pooling), through the device tool like tests/gpu/device_run.sh (same
# carry: .whl and .gpucarry/make_model_dir.py; the Llama-3-8B-shaped dummy model served as a
# decoder embedder: last-token pooling, normalized), outputs in $OUT (or /tmp/out):
#   EMBED_PROMPTS=10000 PREFILL_PROMPTS=10000 bash tests/gpu/pooling_run.sh
# embed:   pagedserve bench embed, EMBED_PROMPTS inputs of 512 tokens (--runner pooling)
# prefill: the generate runner on the same prompts' shape, W1's command with --output-len 1
#          (prefill plus one sampled token per request): its prompt tokens/s beside embed's
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
ps_setup
PS="python3 -m pagedserve.entrypoints.cli"
M=/tmp/m8b
[ -d $M ] || python3 .gpucarry/make_model_dir.py $M --arch llama3-8b >/dev/null
COMMON="--model $M --load-format dummy --dtype bfloat16"
T="timeout ${STEP_TIMEOUT:-540}"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
$T $PS bench embed $COMMON --input-len 512 --num-prompts ${EMBED_PROMPTS:-10000} \
  --output-json "$OUT/embed.json" 2>&1 | tail -8
$T $PS bench throughput $COMMON --input-len 512 --output-len 1 \
  --num-prompts ${PREFILL_PROMPTS:-10000} --output-json "$OUT/prefill.json" 2>&1 | tail -8
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
e, p = load("embed.json"), load("prefill.json")
print("| run | prompts | seconds | prompt tokens/s |")
print("|---|---|---|---|")
if e:
    print(f"| embed (--runner pooling) | {e['num_prompts']} | {e['elapsed_s']:.1f} | {e['prompt_tokens_per_s']:.0f} |")
if p:
    rate = p["num_prompts"] * p["input_len"] / p["elapsed_s"]
    print(f"| generate, --output-len 1 | {p['num_prompts']} | {p['elapsed_s']:.1f} | {rate:.0f} |")
if e and p:
    print(f"embed / prefill: {e['prompt_tokens_per_s'] / rate:.3f}x")
PY
