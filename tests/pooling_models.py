"""Tiny pooling checkpoints (random weights, fixed seed) for tests/test_pooling.py: a
sentence-transformers decoder embedder (Qwen3-Embedding's shape: Qwen3Model, last-token pooling,
Normalize, Matryoshka) and a Qwen3ForSequenceClassification cross-encoder."""

from __future__ import annotations

import json
import os

import torch
from transformers import Qwen3Config, Qwen3ForSequenceClassification, Qwen3Model

from tiny_models import PAD_ID, SEED, VOCAB_SIZE, make_tokenizer

SHAPE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    pad_token_id=PAD_ID,
)  # fmt: skip


def _save(model: torch.nn.Module, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)


def make_embedder(path: str) -> str:
    """A sentence-transformers checkpoint: Transformer, last-token Pooling, Normalize."""
    if os.path.isfile(os.path.join(path, "modules.json")):
        return path
    torch.manual_seed(SEED)
    _save(Qwen3Model(Qwen3Config(**SHAPE, tie_word_embeddings=True)).eval(), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "is_matryoshka": True}, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}, f)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    return path


def make_classifier(path: str) -> str:
    """A Qwen3ForSequenceClassification with two labels (a cross-encoder)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(SEED + 1)
    config = Qwen3Config(**SHAPE, num_labels=2, id2label={0: "no", 1: "yes"},
                         label2id={"no": 0, "yes": 1})  # fmt: skip
    model = Qwen3ForSequenceClassification(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    _save(model, path)
    return path
