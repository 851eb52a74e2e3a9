"""`--speculative-config JSON` / `LLM(speculative_config=...)`: vLLM's keys, checked by name.

Pure Python (the core reads it). Methods built: `ngram` (prompt lookup) and `suffix` (a suffix
automaton over the request's prompt and output) propose from token ids alone, so they run in the
core (core/spec_decode/) and need no weights; `draft_model` (`model`: a smaller model with the
target's vocabulary), `eagle` and `eagle3` (`model`: an EAGLE-1 / EAGLE-3 Llama head over the
target's hidden states, worker/eagle.py, worker/eagle3.py) run in the workers beside the target
(worker/draft_model.py). `mtp`, `medusa` and `mlp_speculator` are vLLM methods we do not build:
refused by name, as is any key vLLM does not have or that does not apply to the method.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from pagedserve.hf_config import has_recurrent_state, kv_cache_groups

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # draft in the workers, with own weights
NOT_BUILT = ("mtp", "medusa", "mlp_speculator")
MAX_SPECULATIVE_TOKENS = 32
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: match the last n tokens, n from max down to min (vLLM: one given sets the other; none:
    # both 5, arbitrarily chosen there too)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # suffix: the longest suffix of the sequence that occurred before, at most this long, and
    # a draft at most `max_spec_factor * match length` tokens long (vLLM's keys and defaults)
    suffix_decoding_max_tree_depth: int = 64
    suffix_decoding_max_spec_factor: float = 1.0
    # no speculation in a step while this many requests are running or waiting (vLLM's key)
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model / eagle: the draft's (head's) directory (HF format)
    # draft_model: the draft's tensor parallel size, 1 or the target's (None: the target's)
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.method in NOT_BUILT:
            raise ValueError(
                f"--speculative-config: method {self.method!r} is not implemented; "
                f"choose one of {', '.join(METHODS)}"
            )
        if self.method not in METHODS:
            raise ValueError(
                f"--speculative-config: unknown method {self.method!r}; choose one of "
                f"{', '.join(METHODS)}"
            )
        if self.method in MODEL_METHODS:
            if not self.model:
                raise ValueError(f"--speculative-config: {self.method!r} needs 'model'")
        else:
            for key in ("model", "draft_tensor_parallel_size"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"--speculative-config: {key!r} applies to draft models, not "
                        f"{self.method!r}"
                    )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--speculative-config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}]"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("--speculative-config: disable_by_batch_size must be at least 1")
        if self.method == "ngram":
            self._check_ngram()
        elif self.method == "suffix" and not (
            self.suffix_decoding_max_tree_depth >= 1 and self.suffix_decoding_max_spec_factor > 0
        ):
            raise ValueError(
                "--speculative-config: suffix_decoding_max_tree_depth must be >= 1 and "
                "suffix_decoding_max_spec_factor > 0"
            )

    def _check_ngram(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                "--speculative-config: prompt_lookup_min and prompt_lookup_max must be integers "
                "with 1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @property
    def in_workers(self) -> bool:
        """Whether the workers draft (a model of their own), not the core (from token ids)."""
        return self.method in MODEL_METHODS

    def check_engine(self, target: Any, tp: int, pp: int) -> None:
        """What the draft model needs of the engine (`target`: its ModelConfig): refused by
        name where not built (pipeline stages, a draft TP size that is neither 1 nor tp), and
        any method on a target with linear-attention layers."""
        if has_recurrent_state(target.hf):
            raise ValueError(
                f"--speculative-config: {self.method!r} on a model with linear-attention layers "
                "(Qwen3-Next, Qwen3.5) is not implemented: their recurrent state would have to "
                "roll back past each rejected draft"
            )
        if not self.in_workers:
            return
        if pp > 1:
            raise ValueError(
                f"--speculative-config: {self.method!r} with --pipeline-parallel-size {pp} is "
                "not implemented (the draft runs beside the whole target model)"
            )
        dtp = self.draft_tensor_parallel_size
        if dtp is not None and dtp != tp:
            raise ValueError(
                f"--speculative-config: draft_tensor_parallel_size {dtp} with --tp {tp} is not "
                f"implemented: the draft is sharded like the target (leave it out, or {tp})"
            )
        draft = self.draft_model_config(target)
        for what, mc in (("target", target), ("draft", draft)):
            groups = kv_cache_groups(mc.hf)
            if len(groups) > 1 or groups[0].window is not None or has_recurrent_state(mc.hf):
                raise ValueError(
                    f"--speculative-config: {self.method!r} with a {what} model of sliding-window "
                    "or linear-attention layers is not implemented (the draft's KV cache "
                    "mirrors one global block table)"
                )
        if self.method in ("eagle", "eagle3"):
            _check_eagle_head(draft, target, self.method)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"--speculative-config: the draft model's vocabulary ({draft.vocab_size}) is "
                f"not the target's ({target.vocab_size}); a draft needs the same tokenizer"
            )

    def draft_model_config(self, target: Any) -> Any:
        """The draft's ModelConfig: the target's dtype, max_model_len, load format and seed."""
        from pagedserve.config import ModelConfig  # config.py imports this module

        return ModelConfig(
            self.model, dtype=target.resolved_dtype, max_model_len=target.max_model_len,
            load_format=target.load_format, seed=target.seed,
            attention_backend=target.attention_backend, enforce_eager=True,
        )  # fmt: skip

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str | None):
        """From a dict or JSON text (the CLI's); None stays None. Unknown keys, and keys of the
        other method, are refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config: not JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key {unknown[0]!r}")
        method = value.get("method")
        if method is None:
            raise ValueError(f"--speculative-config: 'method' is required ({', '.join(METHODS)})")
        other = {
            "ngram": _SUFFIX_KEYS,
            "suffix": _NGRAM_KEYS,
            "draft_model": _NGRAM_KEYS + _SUFFIX_KEYS,
            "eagle": _NGRAM_KEYS + _SUFFIX_KEYS,
            "eagle3": _NGRAM_KEYS + _SUFFIX_KEYS,
        }.get(method, ())
        wrong = sorted(set(value) & set(other))
        if wrong:
            raise ValueError(f"--speculative-config: {wrong[0]!r} does not apply to {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("--speculative-config: 'num_speculative_tokens' is required")
        return cls(**value)


EAGLE_HEAD_ARCHITECTURES = (
    "LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM",
)  # fmt: skip


def _check_eagle_head(head: Any, target: Any, method: str) -> None:
    """An EAGLE head (`head`, `target`: ModelConfigs) is a Llama decoder over [embedding ;
    the target's hidden state(s)]: its hidden size must be the target's. EAGLE-3 reads three
    target layers through hooks, which only eager forwards run."""
    names = head.hf.get("architectures") or [head.hf.get("model_type")]
    if not set(names) & set(EAGLE_HEAD_ARCHITECTURES) and head.hf.get("model_type") != "llama":
        raise ValueError(
            f"--speculative-config: {method!r} head {head.model!r} is {names[0]!r}; only Llama "
            f"EAGLE heads ({', '.join(EAGLE_HEAD_ARCHITECTURES)}) are implemented"
        )
    if method == "eagle3" and not target.enforce_eager:
        raise ValueError(
            "--speculative-config: 'eagle3' needs --enforce-eager (the target's hidden states "
            "of three layers are read in eager forwards, not CUDA graphs or the compiled CPU "
            "forward)"
        )
    if method == "eagle3" and head.hf["num_hidden_layers"] != 1:
        raise ValueError(
            "--speculative-config: EAGLE-3 heads of more than one layer are not implemented"
        )
    if head.hf.get("add_para_norm"):
        raise ValueError(
            "--speculative-config: EAGLE heads with 'add_para_norm' (HASS: norms of the "
            "embedding and hidden state before fc) are not implemented"
        )
    hidden = head.hf.get("target_hidden_size") or head.hf["hidden_size"]
    if hidden != target.hf["hidden_size"]:
        raise ValueError(
            f"--speculative-config: the EAGLE head's hidden_size ({hidden}) is "
            f"not the target's ({target.hf['hidden_size']}); it reads the target's hidden states"
        )
