"""benchmarks/cpu_profile.py, the cheap parts: the worker-ops table of the embedded model's decode
steps (ops by self CPU time plus the time outside them), and py-spy's raw stacks folded into the
functions a process spends its samples in. The serving part (launch + bench serve) is run by hand:
`python -m pagedserve.benchmarks.cpu_profile` (docs/cpu_avx.md)."""

from __future__ import annotations

import re

import pytest

from pagedserve import settings
from pagedserve.benchmarks import cpu_profile


def test_worker_ops_table(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDSERVE_CPU_COMPILE", "off")
    settings.forget()
    try:
        cpu_profile.profile_ops(cpu_profile.DEFAULT_MODEL, rows=2, ctx=16, top=6)
    finally:
        monkeypatch.undo()
        settings.forget()
    out = capsys.readouterr().out
    assert re.search(r"## worker ops, 2 rows, context 16: eager decode step [\d.]+ ms", out)
    rows = [line for line in out.splitlines() if line.startswith("| ") and "%" in line]
    assert len(rows) == 7 and "outside torch ops" in rows[-1]
    assert any(r.startswith("| aten::") or r.startswith("| mkldnn::") for r in rows[:-1])
    shares = [float(r.rsplit("|", 2)[-2].strip().rstrip("%")) for r in rows]
    assert 0 < sum(shares) <= 100.5


def test_py_spy_frames_fold_to_innermost_functions(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "main (a.py:1);step (b.py:2);forward (c.py:3) 30\n"
        "main (a.py:1);poll (d.py:9) 10\n"
        "main (a.py:1);step (b.py:2);forward (c.py:3) 10\n"
    )
    assert cpu_profile._top_frames(str(raw), 2) == "forward 80%, poll 20%"
    assert cpu_profile._top_frames(str(tmp_path / "missing.txt"), 2) == "no samples"


@pytest.mark.parametrize(
    ("cmd", "role"),
    [
        (["python", "-m", "pagedserve.worker.worker_process", "--rank", "0"], "worker_process"),
        (["python", "-m", "pagedserve.entrypoints.cli", "launch", "--model", "m"], "launch"),
        (["python", "-m", "pagedserve.entrypoints.cli", "bench", "serve"], "bench client"),
    ],
)
def test_process_roles(cmd, role):
    class Proc:
        def cmdline(self):
            return cmd

    assert cpu_profile._role(Proc()) == role
