"""Structured outputs on the sampling ranks: xgrammar grammars and one matcher per constrained row.

The matcher lives on the sampling ranks (every TP rank of the last pipeline stage) because they
are the first to know each sampled token: under async scheduling the core plans step N+1 before
it has seen step N's token, but a worker runs `finish(N)` (its ids are on the host) before
`sample(N+1)`, so the mask of N+1 always follows every earlier token. The core never sees a
grammar: it only holds a request back until every sampling rank has compiled its grammar
(`CompileGrammar` -> `GrammarCompiled`), so compiling never stalls the step loop. Every sampling
rank advances an identical matcher with identical tokens, so every rank applies the same mask.

A matcher catches up lazily, just before each mask, on the row's outputs it has not seen (its
own samples, tokens a plan told it, or the outputs of a request resumed after preemption); with
`after_token_id` (a reasoning model's `</think>`) it starts after that token. The matchers and
the per-step masks are in worker/grammar_masks.py; this module builds and compiles grammars.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from pagedserve.ipc.messages import StructuredOutputs

logger = logging.getLogger("pagedserve.worker")
MAX_CACHED = 512  # compiled grammars kept per rank (the core asks again for one evicted)
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


def tokenizer_info(model_path: str, vocab_size: int) -> Any:
    """xgrammar's view of the tokenizer, over the tokenizer's own ids only (at most the model's
    `vocab_size`): xgrammar takes ids past the tokenizer for special tokens and scans that list on
    every accepted token, so the LM head's padding is masked by worker/grammar_masks.py instead."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    own = max(tokenizer.get_vocab().values(), default=-1) + 1
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=min(own, vocab_size))


class GrammarCompiler:
    """Compiles grammars on one background thread and keeps the last MAX_CACHED by key."""

    def __init__(self, model_path: str, vocab_size: int) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._info: Any = None  # xgrammar's TokenizerInfo, built with the compiler
        self._pool: ThreadPoolExecutor | None = None  # started by the first grammar
        self._futures: dict[str, Future] = {}
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    @property
    def mask_vocab_size(self) -> int:
        """The ids the grammars know (the tokenizer's); only once a grammar has compiled."""
        assert self._info is not None, "no grammar has compiled yet"
        return self._info.vocab_size

    @property
    def pending(self) -> bool:
        return bool(self._futures)

    def submit(self, key: str, spec: StructuredOutputs) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        if key not in self._futures:
            self._futures[key] = self._pool.submit(self._compile, key, spec)

    def poll(self) -> list[tuple[str, str | None]]:
        """(key, error or None) of each compile that ended since the last poll."""
        done = [k for k, f in self._futures.items() if f.done()]
        out = []
        for key in done:
            error = self._futures.pop(key).exception()
            out.append((key, None if error is None else str(error)))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def get(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar; compiles here only if it was evicted (the core waited for it)."""
        key = spec.key
        if key in self._futures:
            self._futures[key].result()
        if key not in self._compiled:
            logger.warning("grammar %s was not compiled ahead: compiling on the step path", key)
            self._compile(key, spec)
        self._compiled.move_to_end(key)
        return self._compiled[key]

    def _compile(self, key: str, spec: StructuredOutputs) -> None:
        import xgrammar as xgr

        if self._compiler is None:
            self._info = tokenizer_info(self.model_path, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)
        self._compiled[key] = self._compiler.compile_grammar(build_grammar(spec))
        while len(self._compiled) > MAX_CACHED:
            self._compiled.popitem(last=False)
