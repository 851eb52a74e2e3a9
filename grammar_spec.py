"""The xgrammar Grammar of a `StructuredOutputs` spec, with no tokenizer: how API servers and
`LLM` check a spec before anything runs (a ValueError names what is wrong: a 400), and the first
step of a sampling worker's compile (worker/grammar.py).

A leaf below frontend/ and worker/ (it imports nothing from pagedserve at run time), so checking a
grammar does not bring the worker's modules into an API server. xgrammar itself loads on the
first call, not on import: its package imports torch (xgrammar/matcher.py), which an API server
never loads at start-up.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from pagedserve.ipc.messages import StructuredOutputs

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def build_grammar(spec: StructuredOutputs) -> Any:
    """The xgrammar Grammar of a spec (no tokenizer needed); ValueError names what is wrong."""
    import xgrammar as xgr

    ws = None if spec.any_whitespace else (",", ":")
    try:
        if spec.json is not None:
            schema = (
                spec.json if isinstance(spec.json, str) else msgspec.json.encode(spec.json).decode()
            )
            return xgr.Grammar.from_json_schema(
                schema, any_whitespace=spec.any_whitespace, separators=ws
            )
        if spec.json_object:
            if spec.any_whitespace:
                return xgr.Grammar.builtin_json_grammar()
            return xgr.Grammar.from_json_schema('{"type": "object"}', separators=ws, **_COMPACT)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_quote(c) for c in spec.choice))
        if spec.grammar is not None:
            return xgr.Grammar.from_ebnf(spec.grammar)
        return _structural_tag(xgr, spec.structural_tag)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with a C++ location prefix
        message = _XGR_PREFIX.sub("", str(e).strip()).splitlines()[0]
        raise ValueError(f"invalid {_kind(spec)}: {message}") from None


def _structural_tag(xgr: Any, text: str | None) -> Any:
    """xgrammar's format, or vLLM's older {"structures": [{begin, schema, end}], "triggers"}."""
    tag = msgspec.json.decode(text or "null")
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(
                begin=s["begin"], schema=msgspec.json.encode(s["schema"]).decode(), end=s["end"]
            )
            for s in tag["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))
    return xgr.Grammar.from_structural_tag(text)


_COMPACT = dict(any_whitespace=False, strict_mode=False)


def _quote(text: str) -> str:
    return msgspec.json.encode(text).decode()  # an EBNF string literal: JSON escapes work


def _kind(spec: StructuredOutputs) -> str:
    if spec.json is not None or spec.json_object:
        return "JSON schema"
    if spec.grammar is not None:
        return "grammar"
    if spec.structural_tag is not None:
        return "structural_tag"
    return "regex" if spec.regex is not None else "choice"
