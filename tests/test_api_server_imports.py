"""API servers never import torch (DESIGN: plain tokenizers load with `tokenizers`): importing the
API server process and every module of its app pulls in no torch, xgrammar or transformers.
Grammars are checked through pagedserve/grammar_spec.py, which loads xgrammar (and with it torch)
only on the first constrained request, never at start-up."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pagedserve.frontend.openai

FORBIDDEN = ("torch", "xgrammar", "transformers")

SCRIPT = f"""
import importlib, pkgutil, sys
import pagedserve.entrypoints.api_server, pagedserve.frontend.openai
names = [m.name for m in pkgutil.iter_modules(pagedserve.frontend.openai.__path__,
                                              "pagedserve.frontend.openai.")]
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in {FORBIDDEN!r})
print(len(names), bad)
"""


def test_api_server_imports_no_torch():
    expected = sum(1 for _ in pkgutil.iter_modules(pagedserve.frontend.openai.__path__))
    assert expected >= 8  # api_server, protocol, serving, serving_chat, ...
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split(maxsplit=1)
    assert int(out[0]) == expected
    assert out[1].strip() == "[]", f"the API server imported {out[1].strip()}"
