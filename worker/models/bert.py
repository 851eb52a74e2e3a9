"""Encoder models for the pooling runner: BERT and (XLM-)RoBERTa, as all-MiniLM, bge-m3 and
cross-encoder rerankers are built.

Each prompt attends to itself both ways (no causal mask) and keeps no KV cache: the scheduler runs
an encoder prompt whole in one step (`PoolingConfig.chunkable` is False), so a step's tokens are
whole prompts, packed. Post-norm layers, absolute position embeddings (RoBERTa's start after its
padding id), token type embeddings (a pair's second segment, after the first [SEP], is type 1).
Parameter names are the checkpoint's own (`bert.`/`roberta.` prefixes stripped); one device, no
tensor parallel. Classifier heads: BERT's pooler (tanh dense on [CLS]) then `classifier`;
RoBERTa's `classifier.dense` (tanh) then `classifier.out_proj`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.parallel.state import tp_size
from pagedserve.pooling_config import position_offset

_PREFIXES = ("bert.", "roberta.", "model.")
_BUFFERS = ("position_ids", "token_type_ids")  # saved buffers, not weights
_OTHER_HEADS = ("lm_head", "cls.")  # pre-training heads (masked LM, next sentence)


class _Layer(nn.Module):
    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        h, eps = hf["hidden_size"], hf.get("layer_norm_eps", 1e-12)
        self.num_heads = hf["num_attention_heads"]
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, nn.Linear(h, h))
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(h, h)
        self.attention.output.LayerNorm = nn.LayerNorm(h, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(h, hf["intermediate_size"])
        self.output = nn.Module()
        self.output.dense = nn.Linear(hf["intermediate_size"], h)
        self.output.LayerNorm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:  # [T, H]
        a = self.attention.self
        heads = [
            lin(x).view(len(x), self.num_heads, -1).transpose(0, 1)  # [N, T, D]
            for lin in (a.query, a.key, a.value)
        ]
        out = torch.empty_like(heads[0])
        for s, e in zip(starts[:-1], starts[1:], strict=True):  # each prompt attends to itself
            q, k, v = (t[:, s:e] for t in heads)
            out[:, s:e] = F.scaled_dot_product_attention(q, k, v)
        attn = self.attention.output.dense(out.transpose(0, 1).reshape(len(x), -1))
        x = self.attention.output.LayerNorm(x + attn)
        mlp = self.output.dense(F.gelu(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + mlp)


class BertModel(nn.Module):
    """The serving interface of the decoder models (`forward` -> hidden [T, H]), no KV cache."""

    def __init__(self, hf: dict[str, Any], backend: Any = None, layer_range: Any = None,
                 opts: Any = None) -> None:  # fmt: skip
        super().__init__()
        h = hf["hidden_size"]
        n = hf["num_hidden_layers"]
        if tp_size() > 1 or (layer_range or (0, n)) != (0, n):
            raise ValueError(f"{hf.get('model_type')}: encoders run on one device (no --tp, --pp)")
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(hf["vocab_size"], h)
        self.embeddings.position_embeddings = nn.Embedding(hf["max_position_embeddings"], h)
        self.embeddings.token_type_embeddings = nn.Embedding(hf.get("type_vocab_size", 2), h)
        self.embeddings.LayerNorm = nn.LayerNorm(h, eps=hf.get("layer_norm_eps", 1e-12))
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(hf) for _ in range(n))
        self.offset = position_offset(hf)
        self.sep_id = hf.get("sep_token_id", 102 if hf.get("model_type") == "bert" else 2)
        self.kind = hf.get("model_type")
        self.num_labels = 0
        if any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or []):
            self.num_labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
            self._add_classifier(h)
        self.num_layers = n
        self.num_kv_heads_per_rank = 0  # no KV cache: a block costs nothing
        self.head_dim = h // hf["num_attention_heads"]
        self.vocab_size = hf["vocab_size"]

    def _add_classifier(self, h: int) -> None:
        self.classifier = nn.Module()
        if self.kind == "bert":
            self.pooler = nn.Module()
            self.pooler.dense = nn.Linear(h, h)
            self.classifier = nn.Linear(h, self.num_labels)
        else:
            self.classifier.dense = nn.Linear(h, h)
            self.classifier.out_proj = nn.Linear(h, self.num_labels)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64: whole prompts, packed
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        intermediate: Any = None,
    ) -> torch.Tensor:  # [T, H]
        starts = meta.query_start_loc_cpu.tolist()
        types = torch.zeros_like(input_ids)
        if self.embeddings.token_type_embeddings.num_embeddings > 1:
            for s, e in zip(starts[:-1], starts[1:], strict=True):  # after the first [SEP]: 1
                sep = (input_ids[s:e] == self.sep_id).cumsum(0)
                types[s:e] = ((sep - (input_ids[s:e] == self.sep_id).long()) > 0).long()
        emb = self.embeddings
        x = (emb.word_embeddings(input_ids) + emb.position_embeddings(positions + self.offset)
             + emb.token_type_embeddings(types))  # fmt: skip
        x = emb.LayerNorm(x)
        for layer in self.encoder.layer:
            x = layer(x, starts)
        return x

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, L] logits
        c = self.classifier
        if self.kind == "bert":
            return c(torch.tanh(self.pooler.dense(cls_hidden)))
        return c.out_proj(torch.tanh(c.dense(cls_hidden)))

    # ------------------------------------------------------------------ checkpoint names
    def checkpoint_name_wanted(self, name: str) -> bool:
        name = _strip(name)
        if name.endswith(_BUFFERS) or name.startswith(_OTHER_HEADS):
            return False
        return not name.startswith("pooler.") or (self.num_labels and self.kind == "bert")

    def checkpoint_to_param(self, name: str) -> tuple[str, Any]:
        return _strip(name), None


def _strip(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name
