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

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pagedserve.grammar_spec import build_grammar
from pagedserve.ipc.messages import StructuredOutputs

logger = logging.getLogger("pagedserve.worker")
MAX_THREADS = 4  # compile threads per rank (each compile also uses xgrammar's own 2 threads)
MAX_OVERRAN = 1024  # grammars remembered as too slow: asked again, they are refused at once
COMPILE_NICE = 10  # compile threads yield the CPU to the step loop (Linux, per thread)
DEFAULT_BUDGET_S = 10.0  # --max-grammar-compile-seconds


def tokenizer_info(model_path: str, vocab_size: int) -> Any:
    """xgrammar's view of the tokenizer, over the tokenizer's own ids only (at most the model's
    `vocab_size`): xgrammar takes ids past the tokenizer for special tokens and scans that list on
    every accepted token, so the LM head's padding is masked by worker/grammar_masks.py instead."""
    import xgrammar as xgr
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # The class a tokenizer_config.json names when it is transformers' plain fast tokenizer is
    # the one AutoTokenizer would pick, without first importing the model's config classes
    # (torch.distributed among them: seconds of a server's first grammar).
    plain = _tokenizer_class(model_path) in ("TokenizersBackend", "PreTrainedTokenizerFast")
    loader = PreTrainedTokenizerFast if plain else AutoTokenizer
    tokenizer = loader.from_pretrained(model_path, local_files_only=True)
    own = max(tokenizer.get_vocab().values(), default=-1) + 1
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=min(own, vocab_size))


def _tokenizer_class(model_path: str) -> str | None:
    try:
        with open(os.path.join(model_path, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def compile_threads() -> int:
    """A few threads (two below 6 cores, four from 8): one slow grammar holds one thread, the
    others keep compiling (xgrammar releases the GIL while it compiles)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(MAX_THREADS, (cores or 1) // 2))


def _yield_cpu() -> None:
    """Run this thread (and the threads it starts) at a lower CPU priority (Linux)."""
    with contextlib.suppress(AttributeError, OSError):  # no per-thread nice: the same priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)


class _Job:
    __slots__ = (
        "key", "spec", "started", "ended", "compiled", "error", "done", "overran", "replaced",
    )  # fmt: skip

    def __init__(self, key: str, spec: StructuredOutputs) -> None:
        self.key, self.spec = key, spec
        self.started: float | None = None  # when a thread took it (the budget counts from here)
        self.ended: float | None = None  # when its compile returned
        self.compiled: Any = None
        self.error: str | None = None
        self.done = False
        self.overran = False  # past the budget: answered as failed, its result dropped
        self.replaced = False  # its thread was replaced in the pool while it ran over


class GrammarCompiler:
    """Compiles grammars on a few threads of its own, each within `budget_s` seconds of starting,
    and holds what the core told it to: it drops a grammar only when a `CompileGrammar` names
    it, so the core knows what every rank holds (core/grammar_gate.py) and `get` never compiles.
    xgrammar releases the GIL while it compiles (a 1 ms ticker thread saw gaps of 10 ms at most
    during a 0.7 s compile), and the threads run at a lower CPU priority than the step loop, so
    on a host short of cores a long compile slows no step.

    xgrammar cannot stop a compile: one past its budget is answered as failed at once and goes
    on in the background, its result dropped; its thread is replaced, so the pool keeps its size
    while at most `num_threads` run over (beyond that, the pool shrinks until one ends). Such a
    grammar, asked again, is refused at once (the last MAX_OVERRAN are remembered), so a client
    repeating it cannot start one runaway compile after another.
    """

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        budget_s: float = DEFAULT_BUDGET_S,
        num_threads: int | None = None,
    ) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.budget_s = budget_s
        self.num_threads = num_threads or compile_threads()
        self.num_compiles = 0  # compiles started, on any thread (tests read it)
        self._compiler: Any = None
        self._info: Any = None  # xgrammar's TokenizerInfo, built with the compiler
        self._lock = threading.Lock()  # a job's state and the counts (held briefly)
        self._init_lock = threading.Lock()  # the compiler's creation (loads the tokenizer)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._num_serving = 0  # threads taking jobs (started by the first grammar)
        self._num_overrunning = 0  # threads running a compile past its budget
        self._jobs: dict[str, _Job] = {}  # submitted, not yet answered
        self._answers: list[tuple[str, str | None]] = []  # answered without a compile
        self._compiled: dict[str, Any] = {}
        self._overran: OrderedDict[str, str] = OrderedDict()  # key -> its error, oldest first

    @property
    def mask_vocab_size(self) -> int:
        """The ids the grammars know (the tokenizer's); only once a grammar has compiled."""
        assert self._info is not None, "no grammar has compiled yet"
        return self._info.vocab_size

    @property
    def pending(self) -> bool:
        return bool(self._jobs or self._answers)

    @property
    def held_keys(self) -> set[str]:
        return set(self._compiled)

    def submit(self, key: str, spec: StructuredOutputs, drop_keys: Sequence[str] = ()) -> None:
        """Drop `drop_keys`, then compile `key` (answered by `poll`)."""
        for dropped in drop_keys:
            self._compiled.pop(dropped, None)
        if key in self._compiled or key in self._overran:
            self._answers.append((key, self._overran.get(key)))
        elif key not in self._jobs:
            self._jobs[key] = job = _Job(key, spec)
            self._queue.put(job)
            while self._num_serving < self.num_threads:
                self._start_thread()

    def poll(self) -> list[tuple[str, str | None]]:
        """(key, error or None) of each compile that ended or ran out of time since the last
        poll; a grammar that compiled is held from here on."""
        out, self._answers = self._answers, []
        now = time.monotonic()
        for key, job in list(self._jobs.items()):
            with self._lock:
                if not job.done and not self._ran_over(job, now):
                    continue
                if self._ended_late(job):  # polled only after it ended past its budget:
                    job.compiled = None  # the same answer as a timely poll's
                    self._answer_too_slow(job)
            del self._jobs[key]
            if job.error is None:
                self._compiled[key] = job.compiled
            out.append((key, job.error))
        return out

    def _ran_over(self, job: _Job, now: float) -> bool:
        """Whether `job` runs past its budget (then it is answered as failed, and its thread is
        replaced unless `num_threads` already run over). Called under the lock."""
        if job.started is None or now - job.started <= self.budget_s:
            return False
        self._answer_too_slow(job)
        self._num_overrunning += 1
        if self._num_overrunning <= self.num_threads:
            job.replaced = True
            self._num_serving -= 1
            self._start_thread()
        return True

    def _ended_late(self, job: _Job) -> bool:
        if not job.done or job.overran or job.started is None:
            return False
        return job.ended - job.started > self.budget_s

    def _answer_too_slow(self, job: _Job) -> None:
        job.overran = True
        job.error = (
            f"the grammar did not compile within this server's limit of {self.budget_s:g} s "
            "(--max-grammar-compile-seconds)"
        )
        logger.warning("grammar %s: %s", job.key, job.error)
        self._overran[job.key] = job.error
        if len(self._overran) > MAX_OVERRAN:
            self._overran.popitem(last=False)

    def get(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of a request a plan brings: held, as the core waited for it."""
        compiled = self._compiled.get(spec.key)
        if compiled is None:
            raise RuntimeError(
                f"grammar {spec.key} is not held on this rank: the core schedules a constrained "
                "request only once every sampling rank holds its grammar"
            )
        return compiled

    def hold(self, spec: StructuredOutputs) -> Any:
        """Compile `spec` now and hold it: for tests and benchmarks (it takes every answer `poll`
        has), never the step path."""
        self.submit(spec.key, spec)
        while spec.key not in self._compiled:
            for key, error in self.poll():
                if key == spec.key and error is not None:
                    raise ValueError(error)
            time.sleep(1e-3)
        return self.get(spec)

    def close(self) -> None:
        for _ in range(self._num_serving):
            self._queue.put(None)
        self._num_serving = 0

    def _start_thread(self) -> None:
        self._num_serving += 1
        threading.Thread(target=self._serve, name="grammar", daemon=True).start()

    def _serve(self) -> None:
        """A pool thread: compile jobs until told to stop, or until a job of its own ran over and
        the pool replaced it."""
        while (job := self._queue.get()) is not None:
            try:
                compiler = self._xgrammar_compiler()  # the first loads the tokenizer: no budget
                _yield_cpu()  # after that load; xgrammar's threads, made per compile, inherit it
                with self._lock:
                    job.started = time.monotonic()
                    self.num_compiles += 1
                compiled, error = compiler.compile_grammar(build_grammar(job.spec)), None
            except Exception as e:  # a grammar only a raw client could send, or a bug
                compiled, error = None, str(e)
            with self._lock:
                job.done, job.ended = True, time.monotonic()
                if job.overran:
                    self._num_overrunning -= 1
                    if job.replaced:
                        return
                    continue
                job.compiled, job.error = compiled, error

    def _xgrammar_compiler(self) -> Any:
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._info = tokenizer_info(self.model_path, self.vocab_size)
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)
            return self._compiler
