"""Host cost of one step's grammar masks on the sampling worker (`GrammarMasks.apply`): R rows of
`bench structured`'s JSON schema advance by one token each, fill their bitmasks and mask the
logits, with the embedded model's tokenizer padded to `--vocab` ids (the H100 benchmark's shape).

    python tests/bench_grammar_step.py [--rows 256] [--vocab 128256] [--steps 30] [--threads N]
        [--device cuda] [--share 0.5]

Prints milliseconds per step (median) for advancing the matchers, filling the bitmasks and
masking the logits (on `--device`, synchronized), and per row for the first two. `--share`: the
constrained fraction of the rows (the rest are unconstrained, as in `bench structured`'s 50%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import pagedserve
from pagedserve.benchmarks.structured import SCHEMA
from pagedserve.ipc.messages import StructuredOutputs
from pagedserve.worker.grammar import GrammarCompiler
from pagedserve.worker.grammar_masks import GrammarMasks, RowMatcher, fill_threads

EMBEDDED = os.path.join(os.path.dirname(pagedserve.__file__), "frontend", "default_model")


def allowed_token(bitmask_row: torch.Tensor, eos: int, rng: np.random.Generator) -> int:
    """A random token the row's bitmask allows (EOS only if nothing else is)."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")
    ids = np.nonzero(bits)[0]
    rest = ids[ids != eos]
    return int(rng.choice(rest if len(rest) else ids))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=EMBEDDED)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=fill_threads(1))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--share", type=float, default=1.0)
    a = ap.parse_args()
    device = torch.device(a.device)
    constrained = round(a.share * a.rows)
    compiler = GrammarCompiler(a.model, a.vocab)
    spec = StructuredOutputs(json=SCHEMA)
    compiled = compiler.hold(spec)
    matchers: list[RowMatcher | None] = [RowMatcher(compiled, spec, [1]) for _ in range(a.rows)]
    matchers[constrained:] = [None] * (a.rows - constrained)
    outputs: list[list[int]] = [[] for _ in range(a.rows)]
    masks = GrammarMasks(a.rows, compiler.mask_vocab_size, device, a.threads)
    logits = torch.zeros(a.rows, a.vocab, device=device)
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {"advance": [], "fill": [], "mask": []}
    for _ in range(a.steps):
        t0 = time.perf_counter()
        masks._advance(matchers, outputs)
        t1 = time.perf_counter()
        masks._next_buffer()
        rows = masks._fill(matchers)
        t2 = time.perf_counter()
        masks._mask_logits(logits, rows)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            times[name].append(dt)
        for j, out in enumerate(outputs[:constrained]):
            out.append(allowed_token(masks.host[j], 1, rng))
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}  # the first: no token
    per_row = {k: med[k] * 1e3 / max(constrained, 1) for k in ("advance", "fill")}
    print(
        f"{constrained} of {a.rows} rows constrained, vocab {a.vocab} "
        f"(tokenizer {compiler.mask_vocab_size}), "
        f"{a.threads} fill threads: advance {med['advance']:.2f} ms ({per_row['advance']:.1f} "
        f"us/row), fill {med['fill']:.2f} ms ({per_row['fill']:.1f} us/row), "
        f"mask {a.device} logits {med['mask']:.2f} ms per step"
    )
    compiler.close()


if __name__ == "__main__":
    main()
