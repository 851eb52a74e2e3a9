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
the per-step masks are in worker/grammar_masks.py; this module compiles grammars (built from
their specs by pagedserve/grammar_spec.py, which API servers use to check them).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedserve.grammar_spec import build_grammar
from pagedserve.ipc.messages import StructuredOutputs

logger = logging.getLogger("pagedserve.worker")
MAX_CACHED = 512  # compiled grammars kept per rank (the core asks again for one evicted)


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
