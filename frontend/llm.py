"""`LLM`: the offline Python API, shaped like vLLM's so users switch by changing an import.

    from pagedserve import LLM, SamplingParams
    with LLM(model="path/to/hf-model") as llm:
        outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

The LLM starts its own EngineCore process (which starts the workers), or one per data parallel
rank (`data_parallel_size=N`: each request goes to the core its prefix or the load picks,
frontend/engine_cores.py), tokenizes and detokenizes here, and blocks until every request of a
`generate` call has finished.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from pagedserve.frontend.engine_args import build_engine_config
from pagedserve.frontend.engine_cores import EngineCores
from pagedserve.frontend.generation_config import default_params, describe_defaults, stop_eos_ids
from pagedserve.frontend.output_processor import OutputProcessor
from pagedserve.frontend.outputs import RequestOutput
from pagedserve.frontend.pooling import (
    POOLING_SAMPLING,
    ClassificationOutput,
    EmbeddingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    cosine,
    decode_vector,
    pair_up,
    runner_error,
    score_prompts,
    task_error,
    truncate,
)
from pagedserve.frontend.tokenizer import encode_prompt, load_tokenizer, render_chat
from pagedserve.grammar_spec import build_grammar  # xgrammar loads on the first call
from pagedserve.ipc.messages import (
    AbortRequests,
    EngineDead,
    EngineOutputs,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    SchedulerStats,
)
from pagedserve.lora_checkpoint import read_adapter

PromptType = str | dict[str, Any]
logger = logging.getLogger("pagedserve")


class LLM:
    def __init__(self, model: str, skip_tokenizer_init: bool = False, **kwargs: Any) -> None:
        """`model`: a directory or a hub id; `kwargs`: vLLM's engine arguments that pagedserve
        has (`frontend/engine_args.py`; any other raises TypeError). `skip_tokenizer_init`: no
        tokenizer (prompts must be token ids; outputs carry ids, no text), as in vLLM."""
        self._cores: EngineCores | None = None
        self.config = build_engine_config(model, **kwargs)
        mc = self.config.model
        self._default_params = default_params(mc)  # a bad generation_config fails here, first
        message = describe_defaults(mc)
        if message is not None:
            logger.warning(message)
        self._cores = EngineCores(self.config)
        try:
            self.tokenizer = (
                None
                if skip_tokenizer_init
                else load_tokenizer(mc.tokenizer_path, mc.trust_remote_code)
            )
            self._cores.wait_ready()
        except BaseException:
            self.close()
            raise
        self._eos_ids = stop_eos_ids(mc, self.tokenizer)
        self._ids = itertools.count()
        self._checked_loras: set[LoRARequest] = set()
        # the engine's latest SchedulerStats (KV use, prefix cache and speculative decoding
        # counters), as of the last generate call
        self.last_stats: SchedulerStats | None = None

    # ------------------------------------------------------------------ API
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one per prompt (None: the base
        model), as vLLM's (needs `enable_lora=True`)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _per_prompt(sampling_params or self._default_params, len(prompts))
        loras = self._loras(lora_request, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, params, list(priority or [0] * len(prompts)), use_tqdm, loras)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        encoded = []
        for conv in conversations:
            text = render_chat(self.tokenizer, conv, add_generation_prompt, chat_template)
            encoded.append((text, encode_prompt(self.tokenizer, text, add_special_tokens=False)))
        params = _per_prompt(sampling_params or self._default_params, len(encoded))
        return self._run(encoded, params, [0] * len(encoded), use_tqdm)

    # ------------------------------------------------------------------ pooling models
    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (an embed model, `--runner pooling`), as vLLM's."""
        params = pooling_params or PoolingParams(task="embed")
        outs = self._pool(prompts, params, "embed", truncate_prompt_tokens, use_tqdm)
        return [_pooled(o, EmbeddingOutput(decode_vector(o.pooled))) for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities (a classify model)."""
        params = PoolingParams(task="classify")
        outs = self._pool(prompts, params, "classify", truncate_prompt_tokens, use_tqdm)
        return [_pooled(o, ClassificationOutput(decode_vector(o.pooled))) for o in outs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """A relevance score per (query, document): a classify model reads the pair as one
        prompt (cross-encoder); an embed model gives the cosine of the two embeddings."""
        queries, documents = pair_up(data_1, data_2)
        if self.config.model.pooling is not None and self.config.model.pooling.task == "embed":
            texts = list(dict.fromkeys(queries + documents))  # each distinct text once
            embedded = dict(zip(texts, self.embed(texts, None, truncate_prompt_tokens, use_tqdm),
                                strict=True))  # fmt: skip
            return [
                _pooled(embedded[d], ScoringOutput(cosine(embedded[q].outputs.embedding,
                                                          embedded[d].outputs.embedding)))
                for q, d in zip(queries, documents, strict=True)
            ]  # fmt: skip
        if self.tokenizer is None:
            raise ValueError("score needs a tokenizer (skip_tokenizer_init is set)")
        prompts = score_prompts(self.tokenizer, queries, documents)
        outs = self.classify([{"prompt_token_ids": p} for p in prompts], truncate_prompt_tokens,
                             use_tqdm)  # fmt: skip
        return [_pooled(o, ScoringOutput(o.outputs.probs[-1])) for o in outs]

    def _pool(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: PoolingParams,
        task: str,
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        error = task_error(self.config.model.pooling, task, f"LLM.{task}")
        if error is not None:
            raise ValueError(error)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        encoded = [
            (text, truncate(ids, truncate_prompt_tokens))
            for text, ids in map(self._encode, prompts)
        ]
        sampling = [POOLING_SAMPLING] * len(encoded)
        return self._run(encoded, sampling, [0] * len(encoded), use_tqdm, pooling=params)

    def close(self) -> None:
        if self._cores is not None:
            self._cores.close()
            self._cores = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ internals
    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if self.tokenizer is None and not (
            isinstance(prompt, dict) and "prompt_token_ids" in prompt
        ):
            raise ValueError("without a tokenizer (skip_tokenizer_init) prompts must be token ids")
        if isinstance(prompt, str):
            return prompt, encode_prompt(self.tokenizer, prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], encode_prompt(self.tokenizer, prompt["prompt"])
        raise ValueError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _loras(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked against the model once per LLM."""
        if lora_request is None:
            return [None] * count
        loras = [lora_request] * count if isinstance(lora_request, LoRARequest) else lora_request
        if len(loras) != count:
            raise ValueError(f"{len(loras)} lora requests for {count} prompts")
        lora_config = self.config.lora
        for lora in loras:
            if lora is None or lora in self._checked_loras:
                continue
            if lora_config is None:
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: the LLM needs enable_lora=True")
            read_adapter(lora.lora_name, lora.lora_path, self.config.model.hf,
                         lora_config.max_lora_rank)  # fmt: skip
            self._checked_loras.add(lora)
        return list(loras)

    def _check_prompt(self, ids: list[int]) -> None:
        max_len = self.config.max_model_len
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {max_len}")
        vocab = self.config.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        priority: list[int],
        use_tqdm: bool = False,
        loras: list[LoRARequest | None] | None = None,
        pooling: PoolingParams | None = None,
    ) -> list[RequestOutput]:
        cores = self._cores
        if cores is None:
            raise RuntimeError("this LLM is closed")
        error = runner_error(self.config.model.pooling, pooling is not None, "LLM.generate")
        if error is not None:
            raise ValueError(error)
        for _, ids in encoded:
            self._check_prompt(ids)
        for p in params:
            if p.structured_outputs is not None:
                build_grammar(p.structured_outputs)  # ValueError naming what does not compile
        processor = OutputProcessor(self.tokenizer, self._eos_ids)
        order = []
        try:
            loras = loras or [None] * len(encoded)
            for (text, ids), p, prio, lora in zip(encoded, params, priority, loras, strict=True):
                request_id = str(next(self._ids))
                order.append(request_id)
                messages = processor.add(
                    request_id, text, ids, p, prio, cores.client_index, lora, pooling
                )
                core = cores.route(request_id, ids, lora.lora_int_id if lora is not None else 0)
                for msg in messages:
                    cores.send(core, msg)
            results = self._collect(processor, len(order), use_tqdm)
        except BaseException:  # e.g. Ctrl-C: leave nothing running in the engine
            cores.abort((p.request_id, cid) for cid, (p, _) in processor.children.items())
            raise
        finally:
            for request_id in order:
                cores.release(request_id)
        return [results[r] for r in order]

    def _collect(
        self, processor: OutputProcessor, total: int, use_tqdm: bool
    ) -> dict[str, RequestOutput]:
        """Every request's final output, as the cores finish them."""
        cores = self._cores
        assert cores is not None
        results: dict[str, RequestOutput] = {}
        progress = _progress(total) if use_tqdm else None
        while processor.parents:
            item = cores.next_message(timeout=0.5)
            if item is None:
                cores.check_alive()
                continue
            core, msg = item
            if isinstance(msg, EngineDead):
                cores.set_dead(core, msg.message)
                cores.check_alive()
            elif isinstance(msg, EngineOutputs):
                self.last_stats = msg.stats or self.last_stats
                touched, to_abort = processor.process(msg.outputs)
                if to_abort:
                    cores.send(core, AbortRequests(to_abort))
                for parent in touched:
                    _raise_if_refused(parent)
                    if parent.finished:
                        results[parent.request_id] = parent.make_output()
                        if progress is not None:
                            progress.update(1)
        if progress is not None:
            progress.close()
        return results


def _pooled(out: RequestOutput, result: Any) -> PoolingRequestOutput:
    return PoolingRequestOutput(out.request_id, result, out.prompt_token_ids)


def _raise_if_refused(parent: Any) -> None:
    """The core refused a request (its reason rides in stop_reason): the whole call fails; the
    caller's `except` aborts the requests still running."""
    for child in parent.children:
        if child.finish_reason == "invalid":
            raise ValueError(f"the engine refused request {parent.request_id}: {child.stop_reason}")


def _progress(total: int) -> Any:
    """vLLM's bar over a generate/chat call; tqdm's disable=None keeps it off unless stderr is a
    terminal (logs, pipes and CI stay clean)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", mininterval=1.0, disable=None)


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)
