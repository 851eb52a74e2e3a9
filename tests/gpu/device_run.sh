#!/usr/bin/env bash
# The GPU run, through the device tool (see docs/performance.md): installs the wheels the GPU
# image lacks, builds the Llama-3-8B-shaped benchmark model dir, then runs the steps named in
# $STEPS (default: all) and prints a short table last. Outputs land in $OUT (or /tmp/out).
#   STEPS="kernels gpu-tests w3 w1 w4 w2 profile" bash tests/gpu/device_run.sh
# FP8 (issue 17): `fp8-tests` runs the FP8 kernel tests compiled; a step name ending in `-fp8`
# (w1-fp8, w2-fp8, w3-fp8, profile-fp8) runs that step with `--quantization fp8 --kv-cache-dtype
# fp8`; `table` prints W1/W2/W3 of bf16 and fp8 side by side from the JSON files:
#   STEPS="fp8-tests w3 w3-fp8 w1 w1-fp8 w2 w2-fp8 table" bash tests/gpu/device_run.sh
# `fp8-gemv`: GPU tests of the small-M weight-only FP8 kernel (incl. CUDA graph capture) and of
# the fused silu+quantization, then the kernel's GB/s per (N, K) at M = 1, 4, 16 against
# per-token quantization + _scaled_mm and bf16 matmul (fp8-gemv.json); `fp8-gemv-sweep`: its launch-config sweep -> $OUT/fp8_gemv_configs.json,
# installed into kernels/ so later steps of the same run use it, then the GB/s table again
# (fp8-gemv-tuned.json). Commit $OUT/fp8_gemv_configs.json as kernels/fp8_gemv_configs.json.
#   STEPS="fp8-gemv fp8-gemv-sweep w3-fp8 profile-fp8" bash tests/gpu/device_run.sh
# From a helper's worktree: the device call sends the session's checkout, not the worktree, so
# copy the branch (`git archive HEAD | tar -x -C CHECKOUT/.mycarry/pagedserve`, plus .whl and
# .gpucarry inside it), list `.mycarry/` in .git/info/exclude, carry it, `cd` there first.
# Decode latency (issue 18): `kernels-b1` times the small-batch GEMV against cuBLAS at the 8B
# weight shapes and sweeps its launch configs; `decode-tests` runs the fused kernels' GPU tests;
# `w3-ablate` runs W3 once with every fusion on, then with each one off, then all off:
#   STEPS="decode-tests kernels-b1 w3-ablate w3 w1" bash tests/gpu/device_run.sh
# FP8 round 3 (issue 17): `fp8-probe` times `_scaled_mm` with row-wise / tensor-wise scales and
# exact / fast accumulation at prefill M, and PDL on a W3-shaped chain (tests/gpu/probe_fp8_pdl.py);
# `attn-sweep-decode` sweeps the attention kernel's launch configs on decode batches over bf16 and
# FP8 caches and W1's prefill / mixed tiles over FP8 (float16 dots or not); the end-to-end A/B of
# a fusion is a W step with PAGEDSERVE_DISABLE_FUSIONS=fp8-fast-accum (or norm-quant):
#   STEPS="fp8-probe attn-sweep-decode w1-fp8" bash tests/gpu/device_run.sh
# W5's decode-only steps (issue 18): `attn-sweep-long` sweeps split counts x launch configs on
# 12-40 rows at 16k tokens (block sizes 16 and 128):
#   STEPS="attn-sweep-long w5" bash tests/gpu/device_run.sh
# `l2-probe` (issue 18, W3): L2 prefetch of the next weight on a side stream, on a W3-shaped
# chain (tests/gpu/probe_l2_prefetch.py); the engine's A/B is `ABLATE="none l2-prefetch"`
# with `w3-ablate` (ABLATE lists the fusions to turn off in turn, `none` for all on):
#   ABLATE="none l2-prefetch" STEPS="l2-probe w3-ablate" bash tests/gpu/device_run.sh
# `structured`: the device grammar masks against the CPU ones, `bench structured` at 0/50/100%
# JSON-schema requests (issue 14's cost target), then the grammar host work per step on this
# machine's CPU (tests/bench_grammar_step.py).
# (`tp`: tp=2 vs tp=1 greedy equality and decode latency; needs two GPUs, e.g. nvidia-h200-x2)
# (`dp`: issue 35's data parallel targets on four GPUs, e.g. nvidia-h100-x4: W1 at -dp 1 and -dp 4
# on the 8B shape, and a multi-turn `bench serve` against `launch -dp 1|4`; $OUT/dp.txt sums up:
#   STEPS="dp" bash tests/gpu/device_run.sh)
# Before the device call, on this machine: `bash ../shared/gpu/fetch-wheels.sh starlette==0.49.3
# annotated-doc==0.0.7` (wheels in .whl/; its own starlette pin does not resolve, FastAPI needs these)
# and `mkdir -p .gpucarry && cp ../shared/bench/make_model_dir.py .gpucarry/` (both git-ignored
# through .git/info/exclude); name `.whl` and `.gpucarry` in the device call's `carry`.
# `TRACE=1` writes each step's PAGEDSERVE_STEP_TRACE to $OUT/trace-STEP and prints where the GPU
# time went by step kind, with the GPU's idle time between steps (tests/gpu/trace_summary.py).
# `gemm-silu-probe`: a Triton gate/up GEMM with silu-and-mul in its epilogue against cuBLAS + our
# silu-and-mul at W1's prefill shape (tests/gpu/probe_gemm_silu.py); `gemm-mid-probe`: its plain
# GEMM against cuBLAS at M = 64-512, the layer shapes, weights out of L2 (probe_gemm_mid.py).
# `EXTRA` adds engine flags to the W steps that take `$X` (w1, w2, w3, w5, w6):
#   EXTRA="--max-num-seqs 512" STEPS="w1 w1-fp8 w6" bash tests/gpu/device_run.sh
# Issue 18: `fa4-install` installs FlashAttention 4 from the parts tests/gpu/fa4_wheels.sh made
# (its header lists the device calls that stash them in /tmp/fa4parts); `fa4-tests` checks FA4
# against the torch reference, `attn-bench` times Triton vs FA4 per layer (prefill, decode, mixed;
# writes $OUT/attention_choice.json for kernels/attention/), and `w5`, `w6`, `w6-online` run the long-context
# and shared-prefix workloads with `--attention-backend ${ATTN:-auto}`, or the backend a step
# name carries after `@` (`w5@flash`); W5_FLAGS / W6_FLAGS add engine flags (`--block-size 128`):
#   STEPS="fa4-install w5@triton w5@flash w6@triton w6@flash w6-online@flash" bash tests/gpu/device_run.sh
# Cascade attention (issue 18, W6): `cascade-tests` runs the cascade kernel tests compiled (incl.
# a CUDA graph replayed with other prefixes) and the engine's cascade-vs-plain token equality;
# `cascade-bench` times one attention layer of W6 decode steps (256/512 rows behind a 2,048-token
# prefix) with the cascade off and on, and sweeps the prefix pass (cascade-bench.json);
# `w6-nocascade` is `w6` with PAGEDSERVE_DISABLE_FUSIONS=cascade, the end-to-end A/B:
#   STEPS="cascade-tests cascade-bench w6 w6-nocascade w3 w4" bash tests/gpu/device_run.sh
# `quack-probe` (issue 18, W1/W5; after `fa4-install`, which brings quack-kernels): quack's GEMM
# with a SwiGLU epilogue against cuBLAS + our silu-and-mul (tests/gpu/probe_quack_mlp.py);
# `swiglu-tests`: the engine's use of it (kernels/swiglu_gemm.py) against the two kernels.
# `overlap-probe` (issue 18, W5): a mixed step's decode attention beside its prompt attention, on
# a side stream or a green context of N SMs, for 8k/4k/2k prompt chunks (tests/gpu/probe_overlap.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
# The repo root is the package `pagedserve`: expose it under that name without installing.
ps_setup
# The image sets PYTHONDONTWRITEBYTECODE=1, so every process compiled torch._dynamo, sympy, cutlass
# and quack from source again: `import quack` (which FA4 does) took 15-16 s a process, 4.7 s with
# bytecode kept (`STEPS=compile-probe`). An installed package has its bytecode; keep it here too.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
# FA4 (once `fa4-install` ran in this or an earlier call of a warm machine) and its kernel cache.
# nvidia_cutlass_dsl/dsl_packages holds `cutlass`: its .pth (skipped by --target) would add it.
# The folder is named site-packages because quack fingerprints an epilogue's dependencies and
# treats only functions under a site-packages/ path as installed code (else it recurses into
# cutlass' internals and refuses a ContextVar there).
FA4_PATH=/tmp/fa4/site-packages:/tmp/fa4/site-packages/nvidia_cutlass_dsl/dsl_packages
[ -d /tmp/fa4/site-packages ] && export PYTHONPATH=$FA4_PATH:$PYTHONPATH
export PAGEDSERVE_FLASH_CACHE_DIR=${PAGEDSERVE_FLASH_CACHE_DIR:-/tmp/fa4cache}
PS="python3 -m pagedserve.entrypoints.cli"
M=/tmp/m8b
[ -d $M ] || python3 .gpucarry/make_model_dir.py $M --arch llama3-8b >/dev/null
M32=/tmp/m8b-32k  # W5: the same model allowing 32k positions
if [ ! -d $M32 ]; then
  cp -r $M $M32 && python3 - $M32/config.json <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1])); cfg["max_position_embeddings"] = 32768
json.dump(cfg, open(sys.argv[1], "w"), indent=1)
PY
fi
COMMON="--model $M --load-format dummy --dtype bfloat16"
STEPS=${STEPS:-"kernels gpu-tests w3 w1 w4 w2 profile"}
# MoE (issue 16): a Qwen3-30B-A3B-shaped dir (dummy bf16 weights, ~61 GB); `moe` = moe-w1 (W1 shape,
# $MOE_PROMPTS prompts), moe-lat (bench latency at batch 1 and 64), moe-prof (the grouped-GEMM
# kernel's share of a decode step and its fraction of peak, tests/gpu/profile_moe.py).
MOE=/tmp/qwen3-30b-a3b
MOE_ARGS="--model $MOE --load-format dummy --dtype bfloat16"
moe_dir() {
  [ -f $MOE/config.json ] && return
  python3 .gpucarry/make_model_dir.py $MOE --arch qwen3-8b >/dev/null  # its tokenizer
  python3 - $MOE <<'PY'
import json, sys
json.dump(dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
               hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
               num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
               rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
               torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2),
          open(sys.argv[1] + "/config.json", "w"), indent=1)
PY
}
moe_line() {  # one short table line per number from a bench JSON
  python3 - "$@" <<'PY'
import json, sys
path, label = sys.argv[1], sys.argv[2]
d = json.load(open(path))
for key in sys.argv[3:]:
    if d.get(key) is not None:
        print(f"{label:<22} {key:<26} {d[key]:10.2f}")
PY
}
STEPS=$(echo " $STEPS " | sed 's/ moe / moe-w1 moe-lat moe-prof /g')
summary=()
FP8="--quantization fp8 --kv-cache-dtype fp8"
for step in $STEPS; do
  t0=$(date +%s)
  T="timeout ${STEP_TIMEOUT:-240}"
  X=""; name=$step; ATTN_FLAG="--attention-backend ${ATTN:-auto}"
  case $step in *@*) ATTN_FLAG="--attention-backend ${step#*@}"; step=${step%@*} ;; esac
  case $step in *-fp8) X=$FP8; step=${step%-fp8} ;; esac
  # TRACE=1: the engine's and worker's step traces of each step, and where its GPU time went
  [ -n "${TRACE:-}" ] && export PAGEDSERVE_STEP_TRACE="$OUT/trace-$name"
  [ -n "${EXTRA:-}" ] && X="$X $EXTRA"  # engine flags for the w* steps, e.g. EXTRA="--max-num-seqs 512"
  case $step in moe*) moe_dir ;; esac
  case $step in
    moe-w1) $T $PS bench throughput $MOE_ARGS --input-len 1024 --output-len 128 \
          --num-prompts ${MOE_PROMPTS:-400} --output-json "$OUT/moe-w1.json" 2>&1 | tail -6
        moe_line "$OUT/moe-w1.json" "moe W1 (${MOE_PROMPTS:-400} prompts)" requests_per_s \
          output_tokens_per_s total_tokens_per_s ;;
    moe-lat) for bs in 1 64; do
          $T $PS bench latency $MOE_ARGS --batch-size $bs --input-len 128 --output-len 256 \
            --num-iters-warmup 1 --num-iters 2 --output-json "$OUT/moe-lat-bs$bs.json" 2>&1 | tail -4
          moe_line "$OUT/moe-lat-bs$bs.json" "moe latency bs=$bs" avg_latency_s ms_per_output_token
        done ;;
    moe-prof) $T python3 tests/gpu/profile_moe.py $MOE --batch 1 64 --json "$OUT/moe-prof.json" \
          2>&1 | grep -v "^USDT" | tail -4 ;;
    profile) $T python3 tests/gpu/profile_step.py $M ${X:+--fp8} ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/$name.txt" | tail -60 ;;
    fp8-tests) $T python3 -m pytest -q -s tests/test_triton_fp8.py 2>&1 | tee "$OUT/fp8-tests.txt" | tail -40
        $T python3 -m pagedserve.benchmarks.kernels.bench_fp8 2>&1 | tee "$OUT/fp8-gemm.txt" ;;
    fp8-sweep) $T python3 -m pagedserve.benchmarks.kernels.bench_fp8 --sweep > "$OUT/fp8_block_configs.json" ;;
    fp8-gemv) $T python3 -m pytest -q -s -k "gemv or linear_paths or silu" tests/test_triton_fp8.py \
          2>&1 | tee "$OUT/fp8-gemv-tests.txt" | tail -8
        $T python3 -m pagedserve.benchmarks.kernels.bench_fp8 --gemv --out "$OUT/fp8-gemv.json" 2>&1 \
          | tee "$OUT/fp8-gemv.txt" ;;
    fp8-gemv-sweep) timeout ${SWEEP_TIMEOUT:-300} python3 -m pagedserve.benchmarks.kernels.bench_fp8 \
          --sweep-gemv --out "$OUT/fp8_gemv_configs.json" 2>&1 >/dev/null \
          | tee "$OUT/fp8-gemv-sweep.txt" | grep "M<="
        [ -s "$OUT/fp8_gemv_configs.json" ] && cp "$OUT/fp8_gemv_configs.json" kernels/
        $T python3 -m pagedserve.benchmarks.kernels.bench_fp8 --gemv --out "$OUT/fp8-gemv-tuned.json" ;;
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
    kernels) $T python3 -m pagedserve.benchmarks.kernels.bench_kernels 2>&1 | tee "$OUT/kernels.txt" ;;
    fp8-probe) $T python3 tests/gpu/probe_fp8_pdl.py 2>&1 | tee "$OUT/fp8-probe.txt" ;;
    gemm-mid-probe) $T python3 tests/gpu/probe_gemm_mid.py 2>&1 | tee "$OUT/gemm-mid-probe.txt" | tail -24 ;;
    gemm-silu-probe) $T python3 tests/gpu/probe_gemm_silu.py 2>&1 | tee "$OUT/gemm-silu-probe.txt" | tail -20 ;;
    overlap-probe) $T python3 tests/gpu/probe_overlap.py --json "$OUT/overlap-probe.json" 2>&1 \
          | tee "$OUT/overlap-probe.txt" | tail -70 ;;
    # `compile-probe`: a fresh process's quack import, first SwiGLU GEMM and first FA4 call, twice
    compile-probe) for run in 1 2; do $T python3 tests/gpu/probe_startup_compile.py; done 2>&1 \
          | grep -v Warning | tee "$OUT/compile-probe.txt" | tail -16 ;;
    swiglu-tests) $T python3 -m pytest -q -m gpu tests/test_swiglu_gemm.py 2>&1 \
          | tee "$OUT/swiglu-tests.txt" | tail -8 ;;
    quack-probe) timeout ${PROBE_TIMEOUT:-420} python3 tests/gpu/probe_quack_mlp.py ${QUACK_ARGS:-} 2>&1 \
          | tee "$OUT/quack-probe.txt" | tail -40 ;;
    l2-probe) $T python3 tests/gpu/probe_l2_prefetch.py 2>&1 | tee "$OUT/l2-probe.txt" ;;
    attn-sweep-decode) timeout ${SWEEP_TIMEOUT:-300} python3 -m pagedserve.benchmarks.kernels.bench_kernels \
          --sweep-decode 2>&1 | tee "$OUT/attn-sweep-decode.txt" | tail -12 ;;
    attn-sweep-long) timeout ${SWEEP_TIMEOUT:-300} python3 -m pagedserve.benchmarks.kernels.bench_kernels \
          --sweep-long 2>&1 | tee "$OUT/attn-sweep-long.txt" | tail -20 ;;
    kernels-b1) $T python3 -m pagedserve.benchmarks.kernels.bench_gemv --sweep --json "$OUT/kernels-b1.json" \
          2>&1 | tee "$OUT/kernels-b1.txt" ;;
    decode-tests) { $T python3 -m pytest -q tests/test_triton_decode.py tests/test_sampler.py
          $T python3 -m pytest -q -m gpu tests/test_gpu_equivalence.py -k "graph or bf16"; } \
          2>&1 | tee "$OUT/decode-tests.txt" | tail -20 ;;
    w3-ablate)  # W3 with each decode fusion off in turn (kernels/backend.py: PAGEDSERVE_DISABLE_FUSIONS)
        for off in ${ABLATE:-none gemv gated-gemv rope-cache qkv-rope graph-head l2-prefetch all}; do
          [ $off = none ] && fus="" || fus=$off
          PAGEDSERVE_DISABLE_FUSIONS=$fus timeout 60 $PS bench latency $COMMON --batch-size 1 \
            --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 2 \
            --output-json "$OUT/w3-off-$off.json" > "$OUT/w3-off-$off.txt" 2>&1
          python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f'W3 off={sys.argv[2]:<13} {d[\"ms_per_output_token\"]:.3f} ms/token')" \
            "$OUT/w3-off-$off.json" $off 2>/dev/null || { echo "W3 off=$off failed:"; tail -5 "$OUT/w3-off-$off.txt"; }
        done | tee "$OUT/w3-ablate.txt" ;;
    gpu-tests) $T python3 -m pytest -q -m gpu -s tests/test_gpu_equivalence.py 2>&1 | tee "$OUT/gpu-tests.txt" | tail -25 ;;
    kernel-tests) $T python3 -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_triton_fp8.py \
          2>&1 | tee "$OUT/kernel-tests.txt" | tail -15 ;;
    w3) $T $PS bench latency $COMMON $X --batch-size 1 --input-len 128 --output-len 256 \
          --num-iters-warmup 1 --num-iters 3 --output-json "$OUT/$name.json" 2>&1 | tail -12 ;;
    w1) $T $PS bench throughput $COMMON $X --input-len 1024 --output-len 128 \
          --num-prompts ${W1_PROMPTS:-1000} ${W1_FLAGS:-} --output-json "$OUT/$name.json" 2>&1 | tail -12 ;;
    dp) # issue 35, four GPUs (nvidia-h100-x4 / nvidia-h200-x4): W1 at -dp 1 and -dp 4 on the 8B
        # shape, then `launch -dp 1|4` under a multi-turn `bench serve` (cached share of prompt
        # tokens per core count); the summary prints W1's ratio (target >= 3.7) and both shares.
        for dp in 1 4; do
          timeout ${DP_TIMEOUT:-480} $PS bench throughput $COMMON $X -dp $dp --input-len 1024 \
            --output-len 128 --num-prompts ${W1_PROMPTS:-1000} --output-json "$OUT/dp$dp-w1.json" \
            2>&1 | tail -4
        done
        for dp in 1 4; do
          $PS launch $COMMON $X -dp $dp --port 8014 --host 127.0.0.1 --disable-log-requests \
            --enable-prompt-tokens-details > "$OUT/dp$dp-server.log" 2>&1 &
          srv=$!
          for _ in $(seq 1500); do curl -sf localhost:8014/health >/dev/null && break; sleep 0.2; done
          $T $PS bench serve --base-url http://127.0.0.1:8014 --endpoint /v1/chat/completions \
            --dataset-name multi-turn \
            --num-users ${DP_USERS:-256} --num-turns ${DP_TURNS:-4} --think-time 0.5 \
            --output-json "$OUT/dp$dp-multi-turn.json" 2>&1 | tail -6
          curl -s localhost:8014/metrics | grep -E '^pagedserve:prefix_cache_(queries|hits)_total' \
            > "$OUT/dp$dp-metrics.txt"
          kill -TERM $srv; wait $srv
        done
        python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/dp.txt"
import json, os, sys
def get(name):
    path = os.path.join(sys.argv[1], name + ".json")
    return json.load(open(path)) if os.path.exists(path) else {}
w1 = [get(f"dp{dp}-w1").get("requests_per_s") for dp in (1, 4)]
if all(w1):
    print(f"W1 -dp 1 {w1[0]:.2f} req/s, -dp 4 {w1[1]:.2f} req/s: {w1[1] / w1[0]:.2f}x (target >= 3.7)")
for dp in (1, 4):
    mt = get(f"dp{dp}-multi-turn")
    print(f"multi-turn -dp {dp}: cached share {mt.get('cached_share')}, conversation cached share "
          f"{mt.get('conversation_cached_share')}, {mt.get('completed')} requests")
PY
        ;;
    tp) $T python3 -m pytest -q -m gpu -s tests/test_gpu_equivalence.py -k tp2 2>&1 | tail -8
        for tp in 1 2; do for bs in 1 64; do
          $T $PS bench latency $COMMON --tp $tp --batch-size $bs --input-len 128 --output-len 256 \
            --num-iters-warmup 1 --num-iters 2 --output-json "$OUT/tp$tp-bs$bs.json" 2>&1 | tail -3
        done; done ;;
    fa4-install) if ! python3 -c "import flash_attn.cute" 2>/dev/null; then
          # each part's own sum, then the joined tar's; an empty --target (pip does not merge
          # into folders already there, and the three cutlass wheels share nvidia_cutlass_dsl/)
          ( set -e; cd /tmp/fa4parts; sha256sum -c fa4.tar.part*.sha256
            cat fa4.tar.part?? > fa4.tar; sha256sum -c fa4.tar.sha256
            rm -rf w /tmp/fa4/site-packages && mkdir w && tar -xf fa4.tar -C w
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
              --target /tmp/fa4/site-packages w/*.whl )
          case ":$PYTHONPATH:" in *":$FA4_PATH:"*) ;; *) export PYTHONPATH=$FA4_PATH:$PYTHONPATH ;; esac
        fi
        python3 -c "import flash_attn.cute, cutlass; print('fa4 ok, cutlass', cutlass.__version__)" \
          2>&1 | tail -3 | tee "$OUT/fa4-install.txt" ;;
    fa4-tests) timeout ${FA4_TIMEOUT:-480} python3 -m pytest -q -m gpu -s tests/test_flash_attention.py 2>&1 \
          | tee "$OUT/fa4-tests.txt" | tail -25 ;;
    attn-bench) timeout ${FA4_TIMEOUT:-480} python3 -m pagedserve.benchmarks.kernels.bench_attention --json "$OUT/attn-bench.json" \
          --write-choice "$OUT/attention_choice.json" 2>&1 | tee "$OUT/attn-bench.txt" ;;
    w5) $T $PS bench throughput --model $M32 --load-format dummy --dtype bfloat16 $ATTN_FLAG $X \
          --input-len 16384 --output-len 256 --num-prompts ${W5_PROMPTS:-64} ${W5_FLAGS:-} \
          --output-json "$OUT/$name.json" 2>&1 | tail -14 ;;
    w6|w6-nocascade) [ $step = w6-nocascade ] && off=cascade || off=${PAGEDSERVE_DISABLE_FUSIONS:-}
        PAGEDSERVE_DISABLE_FUSIONS=$off $T $PS bench throughput $COMMON $ATTN_FLAG $X \
          --random-prefix-len 2048 --input-len 128 \
          --output-len 128 --num-prompts ${W6_PROMPTS:-2000} ${W6_FLAGS:-} \
          --output-json "$OUT/$name.json" 2>&1 | tail -14 ;;
    cascade-tests) { $T python3 -m pytest -q tests/test_cascade_attention.py
          $T python3 -m pytest -q -m gpu tests/test_gpu_equivalence.py -k cascade; } \
          2>&1 | tee "$OUT/cascade-tests.txt" | tail -20 ;;
    cascade-bench) $T python3 -m pagedserve.benchmarks.kernels.bench_attention --cascade --sweep \
          --json "$OUT/cascade-bench.json" 2>&1 | tee "$OUT/cascade-bench.txt" ;;
    w6-online) $PS launch $COMMON $ATTN_FLAG --port 8013 --host 127.0.0.1 > "$OUT/$name-server.log" 2>&1 &
        srv=$!
        for _ in $(seq 600); do curl -sf localhost:8013/health >/dev/null && break; sleep 0.2; done
        $T $PS bench serve --base-url http://127.0.0.1:8013 --model $M --vocab-size 128000 \
          --num-prompts ${W6_PROMPTS:-2000} --random-prefix-len 2048 --random-input-len 128 \
          --random-output-len 128 --request-rate 30 --ignore-eos \
          --output-json "$OUT/$name.json" 2>&1 | tail -25
        kill -TERM $srv; wait $srv ;;
    structured) $T python3 -m pytest -q -m gpu tests/test_grammar_masks.py 2>&1 | tail -3
        S=/tmp/m8s; mkdir -p $S  # the 8B shape with the embedded tokenizer: it spells JSON
        cp $M/config.json $M/generation_config.json frontend/default_model/tokenizer.json \
          frontend/default_model/tokenizer_config.json $S/
        $T $PS bench structured --model $S --load-format dummy --dtype bfloat16 --num-prompts 256 \
          --input-len 128 --output-len 128 --repeats 3 --fractions ${STRUCT_FRACTIONS:-0,0.5,1} --output-json "$OUT/structured.json" \
          2>&1 | tail -12
        $T python3 tests/bench_grammar_step.py 2>&1 | tee "$OUT/grammar-step.txt" ;;
    structured-trace) S=/tmp/m8s; mkdir -p $S  # per-step worker host times at 0 / 50 / 100%
        cp $M/config.json $M/generation_config.json frontend/default_model/tokenizer.json \
          frontend/default_model/tokenizer_config.json $S/
        for f in 0 0.5 1; do
          PAGEDSERVE_STEP_TRACE=$OUT/trace-$f $T $PS bench structured --model $S --load-format dummy \
            --dtype bfloat16 --num-prompts 256 --input-len 128 --output-len 128 --repeats 2 \
            --fractions $f 2>&1 | grep "tok/s"
          python3 - "$OUT/trace-$f.worker0" "$f" <<'PY'
import statistics as st, sys
rows = [list(map(float, line.split())) for line in open(sys.argv[1])]
rows = [r for r in rows if len(r) == 4][50:]  # past start-up and warm-up
cols = list(zip(*rows))
med = [1000 * st.median(c) for c in cols[1:]]
span = rows[-1][0] - rows[0][0]
print(f"{sys.argv[2]:>4}: {len(rows)} steps in {span:.2f} s ({1000 * span / len(rows):.2f} ms/step); "
      f"median host ms: start {med[0]:.2f}, finish {med[1]:.2f}, sample {med[2]:.2f}")
PY
        done 2>&1 | tee "$OUT/structured-trace.txt" ;;
    grammar-gpu) for share in 1 0.5; do  # host + device mask time of all vs half the rows
          $T python3 tests/bench_grammar_step.py --device cuda --share $share; done \
          2>&1 | tee "$OUT/grammar-gpu.txt" ;;
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
  [ -s "$OUT/trace-$name.worker0" ] && python3 tests/gpu/trace_summary.py "$OUT/trace-$name.worker0"
  summary+=("$name: $(( $(date +%s) - t0 )) s")
done
printf '%s\n' "${summary[@]}"
