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
`after_token_id` (a reasoning model's `</think>`) it starts after that token.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import torch

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
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


class GrammarCompiler:
    """Compiles grammars on one background thread and keeps the last MAX_CACHED by key."""

    def __init__(self, model_path: str, vocab_size: int) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._pool: ThreadPoolExecutor | None = None  # started by the first grammar
        self._futures: dict[str, Future] = {}
        self._compiled: OrderedDict[str, Any] = OrderedDict()

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
            info = tokenizer_info(self.model_path, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._compiled[key] = self._compiler.compile_grammar(build_grammar(spec))
        while len(self._compiled) > MAX_CACHED:
            self._compiled.popitem(last=False)


class RowMatcher:
    """One constrained request's matcher and how many of its outputs it has consumed."""

    def __init__(self, compiled: Any, spec: StructuredOutputs, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr

        stops = list(eos_token_ids) or None  # every EOS id may end a completed grammar
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.after_token_id = spec.after_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.num_seen = 0
        self.broken = False  # a token the grammar refused got in: only EOS from here

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        for token in output_token_ids[self.num_seen :]:
            self.num_seen += 1
            if self.after_token_id is not None:
                self.after_token_id = None if token == self.after_token_id else self.after_token_id
                continue
            if self.broken or self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(int(token)):
                logger.warning("the grammar refused sampled token %d; ending the request", token)
                self.broken = True

    @property
    def active(self) -> bool:
        """Whether this row's next token is constrained."""
        return self.after_token_id is None and not self.matcher.is_terminated()


class GrammarMasks:
    """The bitmask rows of one step's constrained samples, applied to the logits in place.

    On a GPU the host bitmask goes over in a non-blocking copy that runs only when the stream
    reaches it, and the worker fills the next step's masks before that (it runs a step ahead):
    two pinned buffers take turns, and a buffer is refilled only once its last copy is done (an
    event, normally long passed), so a step never reads the next step's masks.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.device = device
        self._batch = xgr.BatchGrammarMatcher()
        # [R, ceil(V / 32)] int32 each
        self._hosts = [xgr.allocate_token_bitmask(max_rows, vocab_size) for _ in range(2)]
        if device.type == "cuda":
            self._hosts = [h.pin_memory() for h in self._hosts]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.host = self._hosts[0]

    def _next_buffer(self) -> None:
        """Switch to the other host buffer, waiting for its previous copy to the GPU if needed."""
        self._turn ^= 1
        self.host = self._hosts[self._turn]
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()

    def apply(
        self, logits: torch.Tensor, matchers: list[RowMatcher | None], outputs: list[Sequence[int]]
    ) -> None:
        """`logits [S, V]`; `matchers[j]` None for an unconstrained row. The active rows' masks
        fill in one call over xgrammar's C++ threads (a row's fill is ~0.1 ms on a CPU)."""
        self._next_buffer()
        rows, active, filled = [], [], []
        for j, (m, out) in enumerate(zip(matchers, outputs, strict=True)):
            if m is None:
                continue
            m.catch_up(out)
            if m.broken:
                self._only(j, m.eos_token_ids)
                rows.append(j)
            elif m.active:
                active.append(m.matcher)
                filled.append(j)
        if filled:
            self._batch.batch_fill_next_token_bitmask(active, self.host, indices=filled)
        rows += filled
        if not rows:
            return
        bitmask = self.host[: logits.shape[0]]
        if self.device.type == "cuda":
            bitmask = bitmask.to(self.device, non_blocking=True)
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()
        self._xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=sorted(rows)
        )

    def _only(self, j: int, token_ids: list[int]) -> None:
        """Row j allows only `token_ids` (its EOS ids; none: every logit masked)."""
        self.host[j].zero_()
        for token in token_ids:
            bit = 1 << (token % 32) if token % 32 != 31 else -(2**31)
            self.host[j, token // 32] |= bit
