"""Where a benchmark's GPU time went, from a worker's step trace (PAGEDSERVE_STEP_TRACE=FILE
writes FILE.worker0; see worker/worker_process.py StepTrace):

    python tests/gpu/trace_summary.py FILE.worker0 [OTHER.worker0] [--graph-tokens 3072]

Steps are grouped by kind (decode-only: one token a row; mixed: some prompt tokens, split at
`--graph-tokens` into those a mixed CUDA graph holds and eager ones): count, GPU seconds, mean
ms, the GPU's idle seconds before them (waiting for the host to queue them) and the host's
seconds in their start(). With OTHER (e.g. the same run with LoRA adapters), its table follows
and then OTHER minus FILE per kind.
"""

from __future__ import annotations

import argparse

COLUMNS = ("steps", "GPU s", "idle s", "start s", "tokens")


def summarize(path: str, graph_tokens: int) -> dict[str, list[float]]:
    """kind -> [steps, GPU s, idle s, host s in start(), tokens]."""
    with open(path) as f:
        lines = [line.split() for line in f]
    kinds: dict[str, list[float]] = {}
    for i, parts in enumerate(lines):
        if len(parts) < 8:
            continue
        rows, tokens, gap, busy = int(parts[4]), int(parts[5]), float(parts[6]), float(parts[7])
        if rows == tokens:
            kind = "decode-only"
        else:
            kind = "mixed graph" if tokens <= graph_tokens else "mixed eager"
        # a line's GPU fields are the step before's, whose host fields are on the line before
        start_s = float(lines[i - 1][1]) if i > 0 else 0.0
        agg = kinds.setdefault(kind, [0, 0.0, 0.0, 0.0, 0])
        for j, value in enumerate((1, busy / 1e3, gap / 1e3, start_s, tokens)):
            agg[j] += value
    return kinds


def show(title: str, kinds: dict[str, list[float]], means: bool = True) -> None:
    print(f"--- {title}")
    print(f"{'kind':<12} {'steps':>6} {'GPU s':>8} {'mean ms':>8} {'idle s':>7} {'start s':>8} "
          f"{'tokens':>9}")  # fmt: skip
    for kind, (n, busy, gap, start_s, tokens) in sorted(kinds.items()):
        mean = 1e3 * busy / n if n and means else float("nan")
        print(f"{kind:<12} {n:>6.0f} {busy:>8.3f} {mean:>8.2f} {gap:>7.3f} {start_s:>8.3f} "
              f"{tokens:>9.0f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("other", nargs="?")
    ap.add_argument("--graph-tokens", type=int, default=3072, help="the largest mixed graph")
    args = ap.parse_args()
    base = summarize(args.trace, args.graph_tokens)
    show(args.trace, base)
    if args.other is None:
        return
    other = summarize(args.other, args.graph_tokens)
    show(args.other, other)
    zero = [0, 0.0, 0.0, 0.0, 0]
    diff = {
        kind: [b - a for a, b in zip(base.get(kind, zero), other.get(kind, zero), strict=True)]
        for kind in sorted(set(base) | set(other))
    }
    show("difference (second - first)", diff, means=False)


if __name__ == "__main__":
    main()
