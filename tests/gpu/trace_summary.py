"""Where a benchmark's GPU time went, from a worker's step trace (PAGEDSERVE_STEP_TRACE=FILE
writes FILE.worker0; see worker/worker_process.py StepTrace):

    python tests/gpu/trace_summary.py FILE.worker0

Steps are grouped by kind (decode-only: one token a row; mixed: some prompt tokens): count, GPU
seconds, mean ms, and the GPU's idle seconds before them (waiting for the host to queue them).
"""

from __future__ import annotations

import sys


def main() -> None:
    kinds: dict[str, list[float]] = {}
    with open(sys.argv[1]) as f:
        lines = f.readlines()
    for line in lines:
        parts = line.split()
        if len(parts) < 8:
            continue
        rows, tokens, gap, busy = int(parts[4]), int(parts[5]), float(parts[6]), float(parts[7])
        kind = "decode-only" if rows == tokens else "mixed"
        agg = kinds.setdefault(kind, [0, 0.0, 0.0, 0])
        agg[0] += 1
        agg[1] += busy / 1e3
        agg[2] += gap / 1e3
        agg[3] += tokens
    print(f"{'kind':<12} {'steps':>6} {'GPU s':>8} {'mean ms':>8} {'idle s':>7} {'tokens':>9}")
    for kind, (n, busy, gap, tokens) in sorted(kinds.items()):
        print(f"{kind:<12} {n:>6} {busy:>8.2f} {1e3 * busy / n:>8.2f} {gap:>7.2f} {tokens:>9}")


if __name__ == "__main__":
    main()
