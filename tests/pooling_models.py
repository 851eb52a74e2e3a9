"""Tiny pooling checkpoints (random weights, fixed seed) for tests/test_pooling.py: a
sentence-transformers decoder embedder (Qwen3-Embedding's shape: Qwen3Model, last-token pooling,
Normalize, Matryoshka) and a Qwen3ForSequenceClassification cross-encoder."""

from __future__ import annotations

import json
import os

import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    BertConfig,
    BertModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForSequenceClassification,
    Qwen3Model,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
)

from tiny_models import PAD_ID, SEED, TEXT, VOCAB_SIZE, make_tokenizer

SHAPE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    pad_token_id=PAD_ID,
)  # fmt: skip


MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]


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
    _write_st(path, "pooling_mode_lasttoken")
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


def _wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer trained on tiny_models.TEXT: [CLS] a [SEP] b [SEP]."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials,
                                        show_progress=False)  # fmt: skip
    tok.train_from_iterator(TEXT.splitlines() * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )  # fmt: skip
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip


def make_bert_embedder(path: str) -> str:
    """all-MiniLM's shape: BertModel, mean Pooling, Normalize (sentence-transformers)."""
    if os.path.isfile(os.path.join(path, "modules.json")):
        return path
    tokenizer = _wordpiece_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
                        pad_token_id=0, sep_token_id=3)  # fmt: skip
    torch.manual_seed(SEED)
    model = BertModel(config).eval()
    _randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    _write_st(path, "pooling_mode_mean_tokens")
    return path


def make_xlmr_reranker(path: str) -> str:
    """bge-reranker's shape: XLMRobertaForSequenceClassification, one label, <s> q </s></s> d </s>
    (a byte-level BPE with RoBERTa's pair template; positions from pad_token_id + 1)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    fast = make_tokenizer()
    fast.backend_tokenizer.post_processor = processors.RobertaProcessing(("</s>", 1), ("<s>", 0))
    config = XLMRobertaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128 + PAD_ID + 1, type_vocab_size=1,
        pad_token_id=PAD_ID, bos_token_id=0, eos_token_id=1, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(SEED + 2)
    model = XLMRobertaForSequenceClassification(config).eval()
    _randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


def _randomize(model: torch.nn.Module) -> None:
    """Layer norms and biases off their 1 / 0 init, so that a wrong one shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)


def _write_st(path: str, mode: str) -> None:
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, mode: True}, f)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(MODULES, f)
