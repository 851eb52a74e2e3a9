#!/usr/bin/env bash
# DeepSeek-V3 on one GPU (issue 42): the tiny model on CUDA against transformers, then the
# engine with dummy weights at DeepSeek-V3's shapes (hidden 7168, MLA with 128 heads, q_lora 1536,
# kv_lora 512 + rope 64, 256 experts of 2048 top-8 in 8 groups, a shared expert, vocab 129280) cut
# to LAYERS decoder layers of which 3 dense, in its FP8 block format (128 x 128): batch-1
# ms/token (W3-shaped) and offline throughput (W1-shaped, W1_PROMPTS prompts), each beside the
# weight-read floor. Routed experts stay FP8 on the GPU (11.3 GB per MoE layer, the grouped
# Triton kernel scaling each tile by its block): LAYERS=8 (3 dense + 5 MoE, ~63 GB) fits an
# 80 GB card. Decode steps and steps of up to 256 tokens run in CUDA graphs. `gpu-test`: the tiny
# model on CUDA (decode and mixed-step graphs) against transformers, the grouped kernel at DeepSeek's and gpt-oss's shapes, and the Triton MLA
# decode kernel against torch at V3's head shapes (and in a replayed graph). `mla-bench`: that
# kernel's time against the torch decode it replaced (`mla-sweep`, not in the default steps: its
# launch configurations and split counts); `w3-off` (and `w1-off`, not in the default steps):
# W3 (W1) with the torch MLA and no mixed-step graphs (PAGEDSERVE_DISABLE_FUSIONS=mla-decode),
# beside `w3` (`w1`) in the same lease.
#   bash tests/gpu/deepseek_gpu.sh                    # all steps; outputs in $OUT (or /tmp/out)
#   LAYERS=8 W1_PROMPTS=32 STEPS="w3 w1" bash tests/gpu/deepseek_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
if [ -d .whl ]; then  # the device machine: the wheels, and this tree as `pagedserve`
  ps_wheels
  ps_tree
fi
export PYTHONUNBUFFERED=1
LAYERS=${LAYERS:-8}
M=${M:-/tmp/deepseek-v3-shape-$LAYERS}
PS="python3 -m pagedserve.entrypoints.cli"
COMMON="--model $M --load-format dummy --dtype bfloat16 --max-model-len 2048 ${EXTRA:-}"
STEPS=${STEPS:-"gpu-test mla-bench floor w3 w3-off w1"}
T="timeout ${STEP_TIMEOUT:-300}"

[ -f $M/config.json ] || python3 tests/gpu/deepseek_shape.py "$M" "$LAYERS" "${SHAPE:-v3}"

for step in $STEPS; do
  echo "=== $step"
  case $step in
    gpu-test) $T python3 -m pytest -q -s tests/test_deepseek_v3.py tests/test_moe_fast_path.py \
        tests/test_triton_mla.py -k "gpu or fp8 or latent or gpt_oss or mla" 2>&1 \
        | tee "$OUT/deepseek-gpu-test.txt" | grep -E "moe batch|passed|failed|Error" ;;
    floor) python3 - "$M" <<'PY' 2>&1 | tee "$OUT/deepseek-floor.txt"
# Bytes one decode step must read (the active parameters): every dense weight (fp8, 1 byte),
# the shared and the chosen experts of each MoE layer (fp8), the LM head (bf16). Batch 1 reads
# 8 of 256 routed experts per layer; a W1 decode step of 32+ rows reads nearly all of them.
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
h, heads, r, p = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
attn = h * c["q_lora_rank"] + c["q_lora_rank"] * heads * (128 + p) + h * (r + p) \
    + r * heads * 256 + heads * 128 * h
dense, moe = 3, c["num_hidden_layers"] - 3
expert = 3 * h * c["moe_intermediate_size"]
fp8 = c["num_hidden_layers"] * attn + dense * 3 * h * c["intermediate_size"] + moe * expert
head = h * c["vocab_size"] * 2
for label, routed in (("batch-1", 8), ("all-experts", c["n_routed_experts"])):
    gb = (fp8 + moe * routed * expert + head) / 1e9
    print(f"{label} weight read: {gb:.2f} GB per decode step -> floor {gb / 3.35:.3f} ms at 3.35 TB/s")
PY
    ;;
    w3) $T $PS bench latency $COMMON --batch-size 1 --input-len 128 --output-len 64 \
          --num-iters-warmup 1 --num-iters 2 --output-json "$OUT/deepseek-w3.json" 2>&1 | tail -6 ;;
    w3-off) PAGEDSERVE_DISABLE_FUSIONS=mla-decode $T $PS bench latency $COMMON --batch-size 1 \
          --input-len 128 --output-len 64 --num-iters-warmup 1 --num-iters 2 \
          --output-json "$OUT/deepseek-w3-off.json" 2>&1 | tail -6 ;;
    mla-bench) $T python3 -m pagedserve.benchmarks.kernels.bench_mla 2>&1 \
          | tee "$OUT/deepseek-mla-bench.txt" ;;
    mla-sweep) $T python3 -m pagedserve.benchmarks.kernels.bench_mla --sweep 2>&1 \
          | tee "$OUT/deepseek-mla-sweep.txt" ;;
    w1-off) PAGEDSERVE_DISABLE_FUSIONS=mla-decode $T $PS bench throughput $COMMON --input-len 1024 \
          --output-len 128 --num-prompts ${W1_PROMPTS:-64} --output-json "$OUT/deepseek-w1-off.json" \
          2>&1 | tail -6 ;;
    w1) $T $PS bench throughput $COMMON --input-len 1024 --output-len 128 \
          --num-prompts ${W1_PROMPTS:-64} --output-json "$OUT/deepseek-w1.json" 2>&1 | tail -6 ;;
    *) echo "unknown step $step" ;;
  esac
done
