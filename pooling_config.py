"""Pooling models (`--runner pooling`): which vector a request's prompt gives, decided once.

A pooling engine runs every request as prefill only: the hidden states of its prompt are pooled
into one vector (LAST token, MEAN over tokens, or the first, CLS, token) and, per task:
- `embed`: the vector, L2-normalized where the model says so (sentence-transformers' Normalize
  module; decoder embedders such as Qwen3-Embedding), cut to `dimensions` first for Matryoshka
  models;
- `classify`: a score head over the vector: a `*ForSequenceClassification` checkpoint's `score`
  weight (softmax over its labels; sigmoid for one label), or the LM head's logits of two tokens
  (`classifier_from_token`: ["no", "yes"] for Qwen3-Reranker), sigmoid(yes - no).

Pure Python (json only): the core reads it to know that a request's result is a vector.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# --pooler-config keys (vLLM's PoolerConfig ones we implement, and the two hf_overrides keys a
# decoder reranker needs)
POOLER_KEYS = ("pooling_type", "normalize", "classifier_from_token", "is_matryoshka")
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}  # fmt: skip
_CLASSIFIER_SUFFIX = "ForSequenceClassification"
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")  # worker/models/bert.py


def is_encoder(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in ENCODER_TYPES


def position_offset(hf: dict[str, Any]) -> int:
    """Where positions start: RoBERTa's after its padding id (so max_model_len is that much
    below max_position_embeddings)."""
    if hf.get("model_type") not in ("roberta", "xlm-roberta"):
        return 0
    return int(hf.get("pad_token_id") or 1) + 1


@dataclass(frozen=True)
class PoolingConfig:
    task: str  # "embed" | "classify"
    pooling_type: str  # POOLING_TYPES
    normalize: bool  # embed: L2-normalize the vector
    hidden_size: int
    num_labels: int = 0  # classify from a `score` head: its rows
    classifier_from_token: tuple[str, ...] = ()  # classify from these tokens' logits (no, yes)
    is_matryoshka: bool = False  # embed: `dimensions` may cut the vector
    encoder: bool = False  # bidirectional attention, no KV cache (worker/models/bert.py)

    @property
    def chunkable(self) -> bool:
        """A long prompt may run over several steps (a decoder attends causally; MEAN and CLS
        gather their part of each chunk). An encoder's prompt runs whole in one step."""
        return not self.encoder

    @property
    def uses_lm_head(self) -> bool:
        return bool(self.classifier_from_token)

    @property
    def out_dim(self) -> int:
        """Floats in a request's result (before `dimensions`)."""
        if self.task == "embed":
            return self.hidden_size
        return 1 if self.classifier_from_token else self.num_labels


def resolve_pooling(
    hf_dir: str, hf: dict[str, Any], runner: str, convert: str, overrides: dict[str, Any] | None
) -> PoolingConfig | None:
    """The model's pooling config (None: it generates text): from `--runner`, `--convert` and
    `--pooler-config`, else from the checkpoint (sentence-transformers' modules.json and
    1_Pooling/config.json, a `*ForSequenceClassification` architecture)."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner {runner!r}: choose {', '.join(RUNNERS)}")
    if convert == "reward":
        raise ValueError("--convert reward is not supported (embed and classify are)")
    if convert not in CONVERTS:
        raise ValueError(f"--convert {convert!r}: choose {', '.join(CONVERTS)}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(POOLER_KEYS))
    if unknown:
        raise ValueError(f"--pooler-config: {unknown[0]!r} is not supported "
                         f"(supported: {', '.join(POOLER_KEYS)})")  # fmt: skip
    architectures = hf.get("architectures") or []
    classifier = any(a.endswith(_CLASSIFIER_SUFFIX) for a in architectures)
    # no LM head: it cannot generate
    base = is_encoder(hf) or any(a.endswith("Model") for a in architectures)
    st = _sentence_transformers(hf_dir)
    if runner == "auto":
        pools = classifier or base or st is not None or convert in ("embed", "classify")
        runner = "pooling" if pools else "generate"
    if runner == "generate":
        if is_encoder(hf):
            raise ValueError(f"{hf.get('model_type')} is an encoder: it runs --runner pooling")
        if convert not in ("auto", "none") or overrides:
            raise ValueError("--convert and --pooler-config need --runner pooling")
        return None
    if convert in ("auto", "none"):
        convert = "classify" if classifier or overrides.get("classifier_from_token") else "embed"
    return _build(hf, convert, st or {}, overrides, classifier)


def _build(
    hf: dict[str, Any], task: str, st: dict[str, Any], overrides: dict[str, Any], classifier: bool
) -> PoolingConfig:
    default = "CLS" if is_encoder(hf) else "LAST"
    pooling_type = str(overrides.get("pooling_type") or st.get("pooling_type") or default).upper()
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"--pooler-config pooling_type {pooling_type!r}: choose "
                         f"{', '.join(POOLING_TYPES)}")  # fmt: skip
    normalize = overrides.get("normalize")
    if normalize is None:  # sentence-transformers say; decoder embedders normalize (vLLM)
        normalize = st.get("normalize", True)
    tokens = tuple(overrides.get("classifier_from_token") or ())
    if tokens and is_encoder(hf):
        raise ValueError("--pooler-config classifier_from_token needs a decoder (an LM head)")
    if tokens and (len(tokens) != 2 or not all(isinstance(t, str) for t in tokens)):
        raise ValueError("--pooler-config classifier_from_token: two token strings (no, yes)")
    num_labels = 0
    if task == "classify" and not tokens:
        if not classifier:
            raise ValueError(
                "--convert classify needs a *ForSequenceClassification checkpoint (its score "
                'head) or --pooler-config \'{"classifier_from_token": ["no", "yes"]}\''
            )
        num_labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
    matryoshka = bool(overrides.get("is_matryoshka", hf.get("is_matryoshka")))
    return PoolingConfig(
        task=task,
        pooling_type=pooling_type,
        normalize=bool(normalize),
        hidden_size=int(hf["hidden_size"]),
        num_labels=num_labels,
        classifier_from_token=tokens,
        is_matryoshka=matryoshka or bool(hf.get("matryoshka_dimensions")),
        encoder=is_encoder(hf),
    )


def _sentence_transformers(hf_dir: str) -> dict[str, Any] | None:
    """A sentence-transformers checkpoint's pooling (its Pooling module's mode) and whether a
    Normalize module follows; None: the directory is none."""
    path = os.path.join(hf_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    out: dict[str, Any] = {"normalize": False}
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            out["normalize"] = True
        elif kind.endswith("Pooling"):
            with open(os.path.join(hf_dir, module.get("path", ""), "config.json")) as f:
                pooling = json.load(f)
            modes = [mode for key, mode in _ST_MODES.items() if pooling.get(key)]
            if len(modes) != 1:
                raise ValueError(f"{hf_dir}: sentence-transformers pooling {pooling} is not one "
                                 f"of {', '.join(_ST_MODES)}")  # fmt: skip
            out["pooling_type"] = modes[0]
        elif not kind.endswith("Transformer"):
            raise ValueError(f"{hf_dir}/modules.json: module {kind!r} is not supported")
    return out
