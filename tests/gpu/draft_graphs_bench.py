"""What drafting costs eager against the drafter's own CUDA graphs (worker/draft_graphs.py): the
drafter alone (no target forward, no processes), ms per draft token at each batch size.

    python -m pagedserve.tests.gpu.draft_graphs_bench TARGET_DIR [--method draft_model eagle]
        [--batch 1 32] [--k 4] [--ctx 512] [--output-json F] [--device cpu --draft same]

TARGET_DIR is an HF config directory (e.g. the Llama-3-8B shape of .gpucarry/make_model_dir.py);
weights are dummy. `draft_model` drafts with a Llama-3.2-1B-shaped model (the target's
vocabulary: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, tied embeddings), `eagle`
with a one-layer EAGLE head of the target's width over the target's embedding and LM head (the
target is built: 16 GB for 8B in bf16). Each row holds a `--ctx`-token context and drafts k
tokens a step: forward 0 over its last known token, then k - 1 more forwards (eagle: k - 1
feedbacks after its pair). One step is timed synchronously (median of `--steps`), eager and
graphed in turn on one runner and one KV cache; a step's ms / k is the cost per draft token.
`--device cpu --draft same` (a draft of the target's shape) smoke-tests the script on a tiny
model: eager only, no graphs to capture there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from pagedserve.frontend.engine_args import build_engine_config
from pagedserve.ipc.messages import SamplingParams
from pagedserve.worker.draft_model import DraftRunner
from pagedserve.worker.eagle import EagleRunner
from pagedserve.worker.input_batch import StepInputs
from pagedserve.worker.models import build_model
from pagedserve.worker.sampler import Sampler, SamplingRow

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=8192, head_dim=64,
                tie_word_embeddings=True)  # fmt: skip


def step_inputs(
    rows: list[tuple[int, int, list[int]]], k: list[int] | None, per_row: int, block_size: int
) -> StepInputs:
    """A step of rows (batch row id, tokens computed before, tokens now), row b owning blocks
    b * per_row ..; `k`: each row's drafts (its last k tokens), every row sampling; None: a
    prompt step, none sampling."""
    ids, pos, qsl, tables = [], [], [0], []
    for row, start, tokens in rows:
        ids += tokens
        pos += range(start, start + len(tokens))
        qsl.append(qsl[-1] + len(tokens))
        tables.append(np.arange(row * per_row, (row + 1) * per_row, dtype=np.int32))
    positions, table = np.array(pos, dtype=np.int64), np.stack(tables)
    of_token = np.repeat(np.arange(len(rows)), np.diff(qsl))
    slots = table[of_token, positions // block_size].astype(np.int64) * block_size
    ends = np.array(qsl[1:], dtype=np.int64)
    return StepInputs(
        input_ids=np.array(ids, dtype=np.int64), positions=positions,
        slot_mapping=slots + positions % block_size, query_start_loc=np.array(qsl, np.int32),
        seq_lens=(positions[ends - 1] + 1).astype(np.int32), block_tables=table,
        logits_indices=ends - 1, sample_rows=[] if k is None else list(range(len(rows))),
        num_drafts=k or [],
    )  # fmt: skip


def config_dir(target: str, name: str, **changes) -> str:
    """The target's directory (config, tokenizer) with its config changed."""
    path = os.path.join(tempfile.gettempdir(), name)
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(target, path, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, **changes}, f)
    return path


def build_runner(args, method: str, max_batch: int) -> DraftRunner:
    if method == "eagle":
        draft = config_dir(args.target, "eagle-head-1layer", num_hidden_layers=1)
    else:
        draft = config_dir(
            args.target, "draft-model", **(LLAMA_1B if args.draft == "llama-1b" else {})
        )
    spec = {"method": method, "model": draft, "num_speculative_tokens": args.k}
    config = build_engine_config(
        args.target, load_format="dummy", dtype=args.dtype, max_num_seqs=max_batch,
        max_model_len=args.ctx + args.k + 16, speculative_config=spec,
    )  # fmt: skip
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sampler = Sampler(seed=0, device=device)
    if method == "eagle":
        target = build_model(config.model, dtype, device)
        runner = EagleRunner(config, dtype, device, sampler, target)
    else:
        runner = DraftRunner(config, dtype, device, sampler)
    per_row = -(-config.max_model_len // config.cache.block_size)
    runner.init_cache(max_batch * per_row)
    if device.type == "cuda":
        runner.capture_graphs(per_row)
    return runner


def time_steps(runner: DraftRunner, batch: int, args) -> dict[str, float]:
    """ms of one drafting step of `batch` rows, eager and graphed (interleaved rounds)."""
    block = runner.block_size
    per_row = runner.kv_caches[0].shape[0] // runner.max_num_seqs
    ids = [f"r{b}" for b in range(batch)]
    top = min(1000, int(runner.mc.hf["vocab_size"]))  # token ids drawn below this
    prompt = [[3 + (b * 31 + j * 17) % (top - 3) for j in range(args.ctx)] for b in range(batch)]
    runner.graphs, graphs = None, runner.graphs
    runner.run(step_inputs([(b, 0, p) for b, p in enumerate(prompt)], None, per_row, block),
               None, {}, ids)  # fmt: skip
    k = [args.k] * batch
    step = step_inputs([(b, args.ctx, [5] + [0] * args.k) for b in range(batch)], k, per_row, block)
    rows = {b: SamplingRow(SamplingParams(temperature=0), prompt[b], []) for b in range(batch)}
    times: dict[str, list[float]] = {"eager": [], "graphed": []} if graphs else {"eager": []}
    for _ in range(args.rounds):
        for mode in times:
            runner.graphs = graphs if mode == "graphed" else None
            for i in range(3 + args.steps):
                if graphs is not None:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.run(step, None, rows, ids).token_ids.cpu()
                if i >= 3:  # after the warm-up
                    times[mode].append(time.perf_counter() - t0)
    runner.graphs = graphs
    ms = {mode: 1000 * statistics.median(ts) for mode, ts in times.items()}
    return {"graphed": float("nan"), **ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--method", nargs="+", default=["draft_model", "eagle"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--draft", choices=["llama-1b", "same"], default="llama-1b")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    results = []
    for method in args.method:
        runner = build_runner(args, method, max(args.batch))
        for batch in args.batch:
            ms = time_steps(runner, batch, args)
            r = {"method": method, "batch": batch, "k": args.k, "ctx": args.ctx,
                 "eager_ms_per_step": ms["eager"], "graphed_ms_per_step": ms["graphed"],
                 "eager_ms_per_draft": ms["eager"] / args.k,
                 "graphed_ms_per_draft": ms["graphed"] / args.k,
                 "speedup": ms["eager"] / ms["graphed"]}  # fmt: skip
            results.append(r)
            print(f"{method:<12} batch {batch:>3} k {args.k}: eager {r['eager_ms_per_draft']:.3f} "
                  f"ms/draft token, graphed {r['graphed_ms_per_draft']:.3f} "
                  f"({r['speedup']:.2f}x)", flush=True)  # fmt: skip
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
