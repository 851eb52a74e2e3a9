"""benchmarks/cpu_ab.py, the parts that need no server: the arms' environments as given on the
command line, and the summary's medians and pair wins. The launches and `bench serve` runs are
the ones `cpu_profile` makes (run by hand: `python -m pagedserve.benchmarks.cpu_ab`)."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.benchmarks.cpu_ab import parse_arm, summary


def test_parse_arm():
    assert parse_arm("base:") == ("base", {})
    assert parse_arm("t2:OMP_NUM_THREADS=2,X=a=b") == ("t2", {"OMP_NUM_THREADS": "2", "X": "a=b"})
    for bad in ("noenv", ":X=1", "a:X", "a:=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_arm(bad)


def test_summary_medians_and_pair_wins():
    def run(rps: float, tpot: float) -> dict:
        return {8: {"request_throughput": rps, "median_tpot_ms": tpot}}

    runs = {"A": [run(10, 9), run(12, 8), run(11, 7)], "B": [run(9, 9), run(13, 6), run(10, 8)]}
    lines = summary(runs, [8])
    assert lines[2] == "| A | 8 | 11.00 | 8.00 |  |"
    assert lines[3] == "| B | 8 | 10.00 | 8.00 | 2/3 |"
