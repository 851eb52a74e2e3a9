#!/usr/bin/env bash
# vLLM 0.26 beside pagedserve in one lease, for the issues whose numbers want that anchor
# (pooling #40, gpt-oss #42, LoRA #39, Qwen3.5 #37). Qwen3.5 needs `--gdn-prefill-backend triton`
# (the default FlashInfer / CuteDSL prefill kernels are unavailable offline: the engine dies with
# "SM90 GDN prefill DSL kernel is unavailable"); DeepSeek runs without DeepGEMM (its warm-up JIT of
# ~3,000 shapes outlasts a 10-minute call), on CUTLASS block-FP8 GEMMs.
# vLLM travels as ../shared/gpu/vllm-bundle.sh's four parts (.vla .vlb .vlc .vld, one device call
# each while the machine stays warm); the last call installs it and runs the steps:
#   call 1-3: mkdir -p /tmp/vlp && cp .vlX/* /tmp/vlp/          (carry [".vlX"])
#   call 4:   cp .vld/part_* /tmp/vlp/ && STEPS="vllm-install ..." bash tests/gpu/vllm_anchor.sh
#             (carry [".vld", ".gpucarry"]; with .whl as well it passes the 64 MiB limit, so
#             pagedserve's steps run in a fifth call carrying [".whl", ".gpucarry"])
# Later calls on the same warm machine: STEPS="..." bash tests/gpu/vllm_anchor.sh.
# Steps (each prints one line of the table at the end; logs and JSON in $OUT):
#   embed-vllm embed-ours   10,000 x 512-token inputs through the Llama-3-8B-shaped decoder
#                           embedder (last token, normalized): prompt tokens/s
#   oss-vllm oss-ours       gpt-oss-20b shape (dummy bf16): batch-1 ms/token (128 in / 128 out),
#                           W1-shaped req/s (OSS_PROMPTS x 1024/128)
#   lora-vllm lora-ours     8B shape, W1-shaped (LORA_PROMPTS x 1024/128), base vs 4 random rank-16
#                           adapters on all seven projections, mixed uniformly
#   qwen35-vllm qwen35-ours Qwen3.5-9B shape: batch-1 ms/token and W1-shaped req/s
#   ds-vllm ds-ours         DeepSeek-V3 shape cut to DS_LAYERS=6 (3 dense + 3 MoE; vLLM runs out of
#                           memory loading 8 on an H100), FP8 block
#                           weights (tests/gpu/deepseek_shape.py): batch-1 ms/token, W1-shaped
#                           req/s (DS_PROMPTS x 1024/128)
#   offload-vllm            issue 41's multi-turn run (tests/gpu/kv_tier_run.sh's, same client and
#                           users) against `vllm serve` of the 8B shape, KV at 4 GiB, offloading
#                           off, then native at 64 GiB: cached share, TTFT p50, req/s (own lines)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
ps_wheels_apart /tmp/site-ps  # ours apart from vLLM's /tmp/site
ps_link
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
# vLLM's own site first (its pins), ours after; pagedserve runs with its wheels only
# vLLM's own site dir, apart from /tmp/site where the other tests/gpu scripts install our wheels
VS=${VLLM_SITE:-/tmp/site-vllm}
VLLM="env PYTHONPATH=$VS python3"
OURS="env PYTHONPATH=/tmp/pkg:/tmp/site-ps python3"
VB="$VLLM -m vllm.entrypoints.cli.main bench"
PS="$OURS -m pagedserve.entrypoints.cli bench"
T="timeout ${STEP_TIMEOUT:-480}"
M8=/tmp/m8b
[ -d $M8 ] || $OURS .gpucarry/make_model_dir.py $M8 --arch llama3-8b >/dev/null

oss_dir() {  # the gpt-oss-20b shape of tests/gpu/gpt_oss_gpu.sh
  local d=/tmp/gpt-oss-20b-shape
  [ -f $d/config.json ] || $OURS - "$d" <<'PY'
import json, os, sys
sys.path.insert(0, ".gpucarry")
from make_model_dir import write_tokenizer
from transformers import GptOssConfig
config = GptOssConfig(num_hidden_layers=24, num_local_experts=32, dtype="bfloat16",
                      layer_types=["sliding_attention", "full_attention"] * 12)
config.architectures = ["GptOssForCausalLM"]
config.save_pretrained(sys.argv[1])
json.dump({"bos_token_id": 1, "eos_token_id": 2},
          open(os.path.join(sys.argv[1], "generation_config.json"), "w"))
write_tokenizer(sys.argv[1], 128000)
PY
  echo $d
}
qwen_dir() {  # the Qwen3.5-9B shape of tests/gpu/hybrid_gpu.sh, as the multimodal checkpoint
  # (vLLM 0.26 serves Qwen3.5 only as Qwen3_5ForConditionalGeneration; both engines run it text-only)
  local d=/tmp/qwen3.5-9b-mm-shape
  [ -f $d/config.json ] || $OURS - "$d" <<'PY'
import sys
sys.path.insert(0, "tests")
from tiny_models import make_tokenizer
from transformers import Qwen3_5Config
config = Qwen3_5Config(text_config={"dtype": "bfloat16"}, vision_config={"out_hidden_size": 4096},
                       dtype="bfloat16")
config.architectures = ["Qwen3_5ForConditionalGeneration"]
config.save_pretrained(sys.argv[1])
make_tokenizer().save_pretrained(sys.argv[1])
PY
  echo $d
}
ds_dir() {  # DeepSeek-V3's shape cut to DS_LAYERS layers, FP8 blocks: tests/gpu/deepseek_gpu.sh's model
  local d=/tmp/deepseek-v3-shape-${DS_LAYERS:-6}
  [ -f $d/config.json ] || $OURS tests/gpu/deepseek_shape.py $d ${DS_LAYERS:-6} >/dev/null
  echo $d
}
cat > /tmp/vllm_embed.py <<'PY'
# vLLM's offline LLM.embed over random token ids: MODEL N LEN JSON
import json, sys, time
import numpy as np
from vllm import LLM
model, n, length, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = LLM(model=model, load_format="dummy", dtype="bfloat16", runner="pooling", convert="embed",
          max_model_len=length + 16)
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(1000, 100000, length).tolist()} for _ in range(n)]
llm.embed(prompts[:64], use_tqdm=False)  # warm-up
t = time.perf_counter()
outs = llm.embed(prompts, use_tqdm=False)
dt = time.perf_counter() - t
assert len(outs) == n and len(outs[0].outputs.embedding) > 0
r = {"engine": "vllm", "num_prompts": n, "elapsed_s": dt, "prompt_tokens_per_s": n * length / dt}
json.dump(r, open(out, "w")); print(r)
PY
lora_path() {  # one PEFT rank-16 adapter on all seven projections of the 8B shape
  $OURS - <<'PY'
from pagedserve.benchmarks.lora import write_random_adapter
from pagedserve.config import ModelConfig
print(write_random_adapter(ModelConfig("/tmp/m8b").hf, 16, "/tmp/anchor-loras", 0))
PY
}
W1="--input-len 1024 --output-len 128"
VW1="--dataset-name random --random-input-len 1024 --random-output-len 128"
VW3="--batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3"
vllm_pair() {  # MODEL NAME PROMPTS [ARGS]: vLLM's batch-1 latency and W1-shaped throughput
  $T $VB latency --model $1 --load-format dummy --max-model-len 2048 $VW3 "${@:4}" \
    --output-json "$OUT/$2-vllm-w3.json" > "$OUT/$2-vllm-w3.log" 2>&1; tail -2 "$OUT/$2-vllm-w3.log"
  $T $VB throughput --model $1 --load-format dummy --max-model-len 2048 $VW1 "${@:4}" \
    --num-prompts $3 --output-json "$OUT/$2-vllm-w1.json" > "$OUT/$2-vllm-w1.log" 2>&1
  tail -2 "$OUT/$2-vllm-w1.log"
}
ours_pair() {  # the same two runs through pagedserve bench
  $T $PS latency --model $1 --load-format dummy --dtype bfloat16 --max-model-len 2048 $VW3 \
    --output-json "$OUT/$2-ours-w3.json" 2>&1 | tail -2
  $T $PS throughput --model $1 --load-format dummy --dtype bfloat16 --max-model-len 2048 $W1 \
    --num-prompts $3 --output-json "$OUT/$2-ours-w1.json" 2>&1 | tail -2
}
offload_vllm() {  # TIER (off|on): one multi-turn run against vLLM; JSON apart from the table's
  local flags="" srv
  [ $1 = on ] && flags="--kv-offloading-size ${TIER_GIB:-64} --kv-offloading-backend native"
  mkdir -p "$OUT/offload"
  $VLLM -m vllm.entrypoints.cli.main serve $M8 --load-format dummy --dtype bfloat16 \
    --kv-cache-memory-bytes 4294967296 $flags --enable-prompt-tokens-details \
    --host 127.0.0.1 --port 8041 > "$OUT/offload/vllm-$1-server.log" 2>&1 &
  srv=$!
  for _ in $(seq 1500); do
    curl -sf localhost:8041/health >/dev/null && break; kill -0 $srv 2>/dev/null || break; sleep 0.2
  done
  $T $PS serve --base-url http://127.0.0.1:8041 --endpoint /v1/chat/completions \
    --dataset-name multi-turn --tokenizer $M8 --num-users ${USERS:-64} --num-turns ${TURNS:-4} \
    --system-prompt-len 32 --user-turn-len 256 --turn-output-len 64 --think-time 1.0 \
    --output-json "$OUT/offload/vllm-$1.json" > "$OUT/offload/vllm-$1.txt" 2>&1
  kill -TERM $srv; wait $srv
  python3 - "$OUT/offload/vllm-$1.json" $1 <<'PY'
import json, sys
r = json.load(open(sys.argv[1])) if __import__("os").path.exists(sys.argv[1]) else {}
print(f"offload-vllm tier {sys.argv[2]}: cached share {r.get('cached_share', 0):.3f}, TTFT p50 "
      f"{r.get('median_ttft_ms', 0):.1f} ms, {r.get('request_throughput', 0):.2f} req/s, "
      f"completed {r.get('completed')}")
PY
}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
t0=$(date +%s)
for step in ${STEPS:-embed-vllm embed-ours}; do
  echo "=== $step ($(( $(date +%s) - t0 )) s)"
  case $step in
    vllm-install) mkdir -p /tmp/vlb && cat /tmp/vlp/part_* | tar xf - -C /tmp/vlb
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target $VS /tmp/vlb/wh/*.whl
      python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        /tmp/vlb/vllm-stripped.zip $VS
      $VLLM -c "import vllm; print('vllm', vllm.__version__)" ;;
    embed-vllm) $T $VLLM /tmp/vllm_embed.py $M8 ${EMBED_PROMPTS:-10000} 512 "$OUT/embed-vllm.json" \
          > "$OUT/embed-vllm.log" 2>&1; tail -2 "$OUT/embed-vllm.log" ;;
    embed-ours) $T $PS embed --model $M8 --load-format dummy --dtype bfloat16 --input-len 512 \
          --num-prompts ${EMBED_PROMPTS:-10000} --output-json "$OUT/embed-ours.json" 2>&1 | tail -3 ;;
    oss-vllm) vllm_pair "$(oss_dir)" oss ${OSS_PROMPTS:-200} ;;
    oss-ours) ours_pair "$(oss_dir)" oss ${OSS_PROMPTS:-200} ;;
    lora-vllm) L=$(lora_path)
      $T $VB throughput --model $M8 --load-format dummy $VW1 --num-prompts ${LORA_PROMPTS:-500} \
        --output-json "$OUT/lora-vllm-0.json" > "$OUT/lora-vllm-0.log" 2>&1; tail -2 "$OUT/lora-vllm-0.log"
      $T $VB throughput --model $M8 --load-format dummy $VW1 --num-prompts ${LORA_PROMPTS:-500} \
        --enable-lora --lora-path "$L" --max-loras 4 --max-lora-rank 16 \
        --output-json "$OUT/lora-vllm-4.json" > "$OUT/lora-vllm-4.log" 2>&1; tail -2 "$OUT/lora-vllm-4.log" ;;
    lora-ours) for n in 0 4; do
        $T $PS throughput --model $M8 --load-format dummy --dtype bfloat16 $W1 \
          --num-prompts ${LORA_PROMPTS:-500} --num-loras $n --lora-rank 16 \
          --output-json "$OUT/lora-ours-$n.json" 2>&1 | tail -2
      done ;;
    qwen35-vllm) vllm_pair "$(qwen_dir)" qwen35 ${QWEN_PROMPTS:-200} \
          --limit-mm-per-prompt '{"image": 0, "video": 0}' --gdn-prefill-backend triton ;;
    qwen35-ours) ours_pair "$(qwen_dir)" qwen35 ${QWEN_PROMPTS:-200} ;;
    ds-vllm) VLLM_USE_DEEP_GEMM=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        vllm_pair "$(ds_dir)" ds ${DS_PROMPTS:-32} --gpu-memory-utilization 0.8 ;;  # 0.92: OOM in capture
    ds-ours) ours_pair "$(ds_dir)" ds ${DS_PROMPTS:-32} ;;
    offload-vllm) offload_vllm off; offload_vllm on ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(( $(date +%s) - t0 )) s)"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print("| result | req/s | tokens/s | ms/token, batch 1 |")
print("|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = json.load(open(path))
    rps = r.get("requests_per_second") or r.get("requests_per_s")
    tps = r.get("prompt_tokens_per_s") or r.get("tokens_per_second") or r.get("total_tokens_per_s")
    ms = r.get("ms_per_output_token")
    if ms is None and r.get("avg_latency"):  # vLLM's latency JSON: the whole request, 128 out
        ms = r["avg_latency"] / 128 * 1e3
    cells = [f"{v:.2f}" if isinstance(v, float) else "" for v in (rps, tps, ms)]
    print(f"| {os.path.basename(path)[:-5]} | " + " | ".join(cells) + " |")
PY
