#!/usr/bin/env bash
# Hybrid models on one GPU (issue 37): the Triton kernels' tests and the engine on CUDA against
# transformers (tiny models; decodes replay CUDA graphs), the chunked delta rule's time at the
# 8B-class Qwen3.5 shape, then tests/gpu/hybrid_bench.py (W3 batch-1 ms/token, one 1024-token
# prefill step, W1-shaped throughput, the weight-read floor) with dummy weights in bfloat16 at
# Qwen3.5's default shape (hidden 4096, 32 layers: 24 Gated DeltaNet with 16 key / 32 value heads
# of 128, 8 full attention; vocab 248320) and at Qwen3-Next-80B-A3B's shape (transformers'
# Qwen3NextConfig defaults: hidden 2048, 512 experts top 10 + a shared expert, 3 of 4 layers
# Gated DeltaNet) cut to NEXT_LAYERS layers in bf16 ("qwen3-next"), or to NEXT_FP8_LAYERS of its
# 48 in the block-FP8 checkpoint's layout ("qwen3-next-fp8": experts, projections and shared
# expert fp8 with 128 x 128 block scales; 36 layers, ~60 GB, fit one H100 beside the state
# slots of --max-num-seqs 128; all 48 would be ~80 GB).
# A table last; outputs in $OUT (or /tmp/out).
#   bash tests/gpu/hybrid_gpu.sh
#   STEPS="bench-rule qwen3.5" W1_PROMPTS=1000 bash tests/gpu/hybrid_gpu.sh
#   STEPS="qwen3-next-fp8 qwen3.5" W1_PROMPTS=100 bash tests/gpu/hybrid_gpu.sh
#   OLD_RULE=/tmp/old_triton_chunk_gated_delta.py STEPS=bench-rule bash tests/gpu/hybrid_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tests/gpu/env.sh
if [ -d .whl ]; then  # the device machine: the wheels its image lacks, and this checkout
  ps_wheels
  ps_tree
fi
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"kernel-tests bench-rule qwen3.5 qwen3-next"}
T="timeout ${STEP_TIMEOUT:-300}"

make_dir() {  # make_dir DIR CONFIG_EXPRESSION
  [ -f "$1/config.json" ] && return
  python3 - "$1" "$2" <<'PY'
import sys
sys.path.insert(0, "tests")
from tiny_models import make_tokenizer
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
config = eval(sys.argv[2])
config.save_pretrained(sys.argv[1])
make_tokenizer().save_pretrained(sys.argv[1])  # ids < 512: enough for random prompts
PY
}

t0=$(date +%s)
for step in $STEPS; do
  echo "=== $step ($(( $(date +%s) - t0 )) s)"
  case $step in
    kernel-tests) $T python3 -m pytest -q tests/test_hybrid_models.py -k "${TESTS:-triton or gpu}" \
        2>&1 | tee "$OUT/hybrid-kernel-tests.txt" | tail -3 ;;
    bench-rule) $T python3 - "$OUT/hybrid-rule.json" <<'PY' 2>&1 | tee "$OUT/hybrid-rule.txt"
# The gated delta rule of one linear layer at the 8B shape, in Triton: the chunked form over one
# and eight 1024-token prompts; one decode step of 64 rows. OLD_RULE=path/to/an older
# triton_chunk_gated_delta.py times that file's triton_chunk_rule beside it (same inputs).
import importlib.util, json, os, sys, time, torch
from pagedserve.kernels.gated_delta import StateLayout, chunk_rule, gated_delta_rule
dev, hk, hv, d = "cuda", 16, 32, 128
old, out = None, {}
if os.environ.get("OLD_RULE"):
    spec = importlib.util.spec_from_file_location("old_rule", os.environ["OLD_RULE"])
    old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
def run(rows, n, fresh, use_old=False):
    T = rows * n
    q, k = (torch.randn(T, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(T, hv, d, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(T, hv, device=dev) * 0.1
    beta = torch.rand(T, hv, device=dev, dtype=torch.bfloat16)
    state = torch.zeros(rows, hv, d, d, device=dev, dtype=torch.bfloat16)
    qsl = [i * n for i in range(rows + 1)]
    lens = [n if fresh else n + 100] * rows
    layout = StateLayout.build(list(range(rows)), qsl, lens, torch.device(dev))
    if use_old:
        call = lambda: old.triton_chunk_rule(q, k, v, g, beta, state, *layout.chunk_tensors[:4])
    else:
        call = lambda: gated_delta_rule(q, k, v, g, beta, state, layout)
    call(); torch.cuda.synchronize()
    if rows == 1 and n > 1 and not use_old:  # bf16 against the float32 reference
        state.zero_(); got = call().float()
        want, _ = chunk_rule(*(x.float().repeat_interleave(hv // hk, dim=1) for x in (q, k)),
                             v.float(), g, beta.float(), None)
        err = ((got - want).norm() / want.norm()).item()
        print(f"bf16 chunked rule vs float32 reference: relative error {err:.2e}", flush=True)
        out["rel_err_bf16"] = err
    t0 = time.perf_counter()
    for _ in range(5): call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 5 * 1e3
flops = 1024 * hv * d * d * 2 * 4  # ~4 [C, D] x [D, D] products per token and head
for tag, use in (("", False), ("old_", True)):
    if use and old is None:
        continue
    for rows in (1,) if use else (1, 8):  # old: one prompt (8 overran a 100 s step on an H100)
        ms = run(rows, 1024, True, use)
        key = f"{tag}prefill{'' if rows == 1 else rows}_layer_ms"
        out[key] = ms
        out[f"{tag}tflops{'' if rows == 1 else rows}"] = rows * flops / ms / 1e9
        print(f"{'old ' if tag else 'new '}prefill {rows} x 1024 tokens, one layer: {ms:.3f} ms, "
              f"{rows * flops / ms / 1e9:.2f} TFLOP/s", flush=True)
ms = run(64, 1, False)
out["decode64_layer_us"] = ms * 1e3
print(f"decode 64 rows, one layer: {ms * 1e3:.0f} us; state read+write "
      f"{64 * hv * d * d * 2 * 2 / ms / 1e6:.0f} GB/s")
json.dump(out, open(sys.argv[1], "w"))
PY
    ;;
    qwen3.5) M=/tmp/qwen3.5-9b-shape
      make_dir $M 'Qwen3_5TextConfig(dtype="bfloat16", architectures=["Qwen3_5ForCausalLM"])'
      $T python3 tests/gpu/hybrid_bench.py $M --prompts ${W1_PROMPTS:-200} \
        --json "$OUT/hybrid-qwen3.5.json" 2>&1 | tee "$OUT/hybrid-qwen3.5.log" | tail -24 ;;
    qwen3-next) M=/tmp/qwen3-next-cut
      make_dir $M "Qwen3NextConfig(num_hidden_layers=${NEXT_LAYERS:-16}, dtype='bfloat16', \
architectures=['Qwen3NextForCausalLM'])"
      $T python3 tests/gpu/hybrid_bench.py $M --prompts ${NEXT_PROMPTS:-100} \
        --json "$OUT/hybrid-qwen3-next.json" 2>&1 | tail -16 ;;
    qwen3-next-fp8) M=/tmp/qwen3-next-fp8-cut  # the FP8 checkpoint's layout, dummy weights
      make_dir $M "Qwen3NextConfig(num_hidden_layers=${NEXT_FP8_LAYERS:-36}, dtype='bfloat16', \
architectures=['Qwen3NextForCausalLM'], quantization_config=dict(quant_method='fp8', fmt='e4m3', \
activation_scheme='dynamic', weight_block_size=[128, 128]))"
      $T python3 tests/gpu/hybrid_bench.py $M --prompts ${NEXT_PROMPTS:-100} --max-num-seqs 128 \
        --json "$OUT/hybrid-qwen3-next-fp8.json" 2>&1 | tee "$OUT/hybrid-qwen3-next-fp8.log" \
        | tail -16 ;;
    *) echo "unknown step $step" ;;
  esac
done

echo "=== done ($(( $(date +%s) - t0 )) s)"; nvidia-smi --query-gpu=name --format=csv,noheader
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
rule = load("hybrid-rule.json")
print(f"{'model':<22}{'W3 ms/tok':>10}{'floor':>8}{'x':>6}{'prefill1k ms':>13}{'W1 out tok/s':>13}"
      f"{'W1 tot tok/s':>13}{'rule share':>11}")
for name in ("qwen3.5", "qwen3-next", "qwen3-next-fp8"):
    r = load(f"hybrid-{name}.json")
    if r is None:
        continue
    config = json.load(open(os.path.join(r["model"], "config.json")))
    linear = config.get("layer_types", []).count("linear_attention")
    share = ""
    if rule and linear:
        share = f"{linear * rule['prefill_layer_ms'] / r['prefill_1024_ms']:.0%}"
    if "w3_ms_per_token" not in r:
        continue
    print(f"{name:<22}{r['w3_ms_per_token']:>10.2f}{r['floor_ms_per_token']:>8.2f}"
          f"{r['w3_over_floor']:>6.1f}{r['prefill_1024_ms']:>13.1f}{r['w1_output_tok_s']:>13.0f}"
          f"{r['w1_total_tok_s']:>13.0f}{share:>11}")
for tag in ("", "old_") if rule else ():  # H100 SXM dense peaks: fp32 67, bf16 989 TFLOP/s
    for rows in ("", "8"):
        if f"{tag}prefill{rows}_layer_ms" in rule:
            tf = rule[f"{tag}tflops{rows}"]
            print(f"{'old ' if tag else 'new '}chunked rule, one layer, {rows or 1} x 1024 tokens: "
                  f"{rule[f'{tag}prefill{rows}_layer_ms']:.3f} ms, {tf:.2f} TFLOP/s "
                  f"({tf / 67:.1%} of fp32 peak, {tf / 989:.2%} of bf16 peak)")
PY
