#!/usr/bin/env bash
# gpt-oss on one GPU (issue 42): Triton's attention sinks compiled (tests/test_gpt_oss.py -k
# triton), then the engine at the gpt-oss-20b shape with dummy weights (an MXFP4 checkpoint's
# config: by default the experts dequantize to bf16 at load; the `-mxfp4` steps keep them packed,
# random codes, PAGEDSERVE_MXFP4_EXPERTS=packed, kernels/triton_moe_mxfp4.py; 24 layers, hidden 2880, 64
# query / 8 KV heads of 64, 32 experts top 4, vocab 201088, sliding window 128 on every other
# layer): batch-1 ms/token (W3-shaped,
# 128 in / 128 out) and W1-shaped throughput (1024 in / 128 out), each beside its weight-read
# floor. Outputs in $OUT (or /tmp/out). Through the device tool like tests/gpu/lora_run.sh:
# The experts run the grouped Triton kernel (kernels/triton_moe.py, biases and clamped SwiGLU);
# steps replay CUDA graphs (each KV cache group's tables are graph inputs).
#   STEPS="sinks w3 w1 table" bash tests/gpu/gpt_oss_gpu.sh
# Further steps: `tests` (the CUDA tests of gpt-oss: Triton's sinks, graphs against eager with
# two KV cache groups for gpt-oss and Gemma 3, the grouped MoE kernel at the 20b shape),
# `profile` (tests/gpu/profile_step.py at batch 1: graph replay vs execute, and one eager decode
# step by kernel), `tiles` (tests/gpu/moe_tiles.py: the MoE kernels' tiles at batch 1 to 64),
# `w3-off` (w3 with the few-token MoE GEMVs off: the grouped kernel, PAGEDSERVE_DISABLE_FUSIONS),
# `w3-mxfp4`, `w1-mxfp4` (the experts kept in MXFP4, PAGEDSERVE_MXFP4_EXPERTS=packed), `mxbench`
# (tests/gpu/mxfp4_bench.py: the MXFP4 kernels' tiles against the bf16 ones, batch 1-256),
# `mxtests` (tests/test_mxfp4_experts.py compiled).
# The MXFP4 check (issue 42): STEPS="mxbench w3-mxfp4 w3 w1-mxfp4 w1 table".
# DEADLINE=S skips the steps that would start after S seconds (a device call's cap).
# The check of issue 42 in two calls (kind nvidia-h100-x1; `tests` alone takes over 2 minutes:
# five engines start, each compiling its Triton kernels):
#   STEP_TIMEOUT=300 STEPS=tests bash tests/gpu/gpt_oss_gpu.sh
#   W1_PROMPTS=100 STEPS="w3 w3-off w1 tiles profile table" bash tests/gpu/gpt_oss_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
ps_setup
PS="python3 -m pagedserve.entrypoints.cli"
M=${M:-/tmp/gpt-oss-20b-mxfp4}
if [ ! -f $M/config.json ]; then
  python3 - "$M" <<'PY'
import json, os, sys
sys.path.insert(0, ".gpucarry")
from make_model_dir import write_tokenizer
from transformers import GptOssConfig
path = sys.argv[1]
config = GptOssConfig(num_hidden_layers=24, num_local_experts=32, dtype="bfloat16",
                      layer_types=["sliding_attention", "full_attention"] * 12)
config.architectures = ["GptOssForCausalLM"]
config.save_pretrained(path)
with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
raw["quantization_config"] = {"quant_method": "mxfp4"}  # the released checkpoints' experts
with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(raw, f)
json.dump({"bos_token_id": 1, "eos_token_id": 2}, open(os.path.join(path, "generation_config.json"), "w"))
write_tokenizer(path, 128000)
PY
fi
COMMON="--model $M --load-format dummy --dtype bfloat16 --max-model-len 2048"
T="timeout ${STEP_TIMEOUT:-240}"
for step in ${STEPS:-sinks w3 w1 table}; do
  if [ -n "${DEADLINE:-}" ] && [ "$SECONDS" -ge "$DEADLINE" ]; then
    echo "=== $step skipped: ${SECONDS}s past DEADLINE=$DEADLINE"; continue
  fi
  echo "=== $step (at ${SECONDS}s)"
  case $step in
    sinks) $T python3 -m pytest -q tests/test_gpt_oss.py -k triton 2>&1 | tee "$OUT/gpt-oss-sinks.txt" | tail -3 ;;
    tests) $T python3 -m pytest -q -rs -s tests/test_gpt_oss.py::test_triton_sinks_match_reference \
          tests/test_graph_kv_groups.py tests/test_moe_fast_path.py tests/test_mxfp4_experts.py \
          -k "not deepseek and not gemma" \
          2>&1 | tee "$OUT/gpt-oss-tests.txt" | grep -E "moe batch|passed|failed|Error|assert" | tail -12 ;;
    profile) $T python3 tests/gpu/profile_step.py $M --batch 1 --decode-only --max-model-len 2048 \
          2>&1 | tee "$OUT/gpt-oss-profile.txt" | grep -E "^---|replay|^ +1 " | tail -12 ;;
    tiles) $T python3 tests/gpu/moe_tiles.py 2>&1 | tee "$OUT/gpt-oss-tiles.txt" | tail -34 ;;
    mxtests) $T python3 -m pytest -q tests/test_mxfp4_experts.py 2>&1 | tee "$OUT/gpt-oss-mxtests.txt" | tail -2 ;;
    mxbench) $T python3 tests/gpu/mxfp4_bench.py 2>&1 | tee "$OUT/gpt-oss-mxbench.txt" | grep "^|" ;;
    w3-mxfp4) PAGEDSERVE_MXFP4_EXPERTS=packed $T $PS bench latency $COMMON --batch-size 1 \
          --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 2 \
          --output-json "$OUT/gpt-oss-w3-mxfp4.json" > "$OUT/gpt-oss-w3-mxfp4.log" 2>&1
        tail -1 "$OUT/gpt-oss-w3-mxfp4.log" ;;
    w1-mxfp4) PAGEDSERVE_MXFP4_EXPERTS=packed $T $PS bench throughput $COMMON \
          --input-len 1024 --output-len 128 --num-prompts ${W1_PROMPTS:-200} \
          --output-json "$OUT/gpt-oss-w1-mxfp4.json" > "$OUT/gpt-oss-w1-mxfp4.log" 2>&1
        grep requests_per_s "$OUT/gpt-oss-w1-mxfp4.log" | tail -1 ;;
    w3) $T $PS bench latency $COMMON --batch-size 1 --input-len 128 --output-len 128 \
          --num-iters-warmup 1 --num-iters 2 --output-json "$OUT/gpt-oss-w3.json" \
          > "$OUT/gpt-oss-w3.log" 2>&1
        tail -1 "$OUT/gpt-oss-w3.log" ;;
    w3-off) PAGEDSERVE_DISABLE_FUSIONS=moe-gemv $T $PS bench latency $COMMON --batch-size 1 \
          --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 2 \
          --output-json "$OUT/gpt-oss-w3-off.json" 2>&1 | tail -1 ;;
    w1) $T $PS bench throughput $COMMON --input-len 1024 --output-len 128 \
          --num-prompts ${W1_PROMPTS:-200} --output-json "$OUT/gpt-oss-w1.json" \
          > "$OUT/gpt-oss-w1.log" 2>&1
        grep requests_per_s "$OUT/gpt-oss-w1.log" | tail -1 ;;
    table) python3 - "$OUT" "$M" <<'PY'
# Weight-read floor: the bytes a step must read once: attention, router, norms and the LM head
# (bf16) every step; experts (bf16: 2 bytes a weight, MXFP4: 17/32) of batch 1: its 4 of 32 per
# layer; a W1 decode step of 100-200 rows touches every expert. H100 SXM HBM3: 3.35 TB/s.
import json, os, sys
out, model = sys.argv[1], sys.argv[2]
c = json.load(open(os.path.join(model, "config.json")))
h, L, E, I = c["hidden_size"], c["num_hidden_layers"], c["num_local_experts"], c["intermediate_size"]
q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
dense = 2 * (L * (h * (q + 2 * kv) + q * h + E * h) + c["vocab_size"] * h)
expert = 3 * h * I
bw = 3.35e12
def floor(experts, per_weight):
    return (dense + L * experts * expert * per_weight) / bw * 1e3
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
print("| gpt-oss-20b shape, H100 | MXFP4 experts (PAGEDSERVE_MXFP4_EXPERTS=packed) | "
      "bf16 experts (dequantized at load, the default) |")
print("| --- | --- | --- |")
w3, w3b = load("gpt-oss-w3-mxfp4.json"), load("gpt-oss-w3.json")
if w3 or w3b:
    ms = [f"{r['ms_per_output_token']:.2f}" if r else "-" for r in (w3, w3b)]
    print(f"| batch 1 ms/token (128 in / 128 out) | {ms[0]} (floor {floor(4, 17 / 32):.2f}) | "
          f"{ms[1]} (floor {floor(4, 2):.2f}) |")
w3off = load("gpt-oss-w3-off.json")
if w3off:
    print(f"| batch 1, PAGEDSERVE_DISABLE_FUSIONS=moe-gemv (grouped MoE kernel) | "
          f"| {w3off['ms_per_output_token']:.2f} |")
w1, w1b = load("gpt-oss-w1-mxfp4.json"), load("gpt-oss-w1.json")
if w1 or w1b:
    cells = [f"{r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.0f} out tok/s"
             if r else "-" for r in (w1, w1b)]
    n = (w1 or w1b).get("num_prompts", "?")
    print(f"| W1-shaped ({n} x 1024 in / 128 out) | {cells[0]} (decode step reading every "
          f"expert: {floor(E, 17 / 32):.1f} ms) | {cells[1]} ({floor(E, 2):.1f} ms) |")
PY
    ;;
    *) echo "unknown step $step" ;;
  esac
done
