"""EAGLE-3 heads (`method: eagle3`), in the HF format vLLM loads: `fc.weight` [H, 3H] over the
target's hidden states at three layers (the residual stream entering each: config key
`eagle_aux_hidden_state_layer_ids`, else vLLM's default `(2, L // 2, L - 3)`), one decoder layer
(`midlayer.*`) whose attention reads `[input_layernorm(embedding) ; hidden_norm(hidden)]` (2H
wide) with the hidden state as its residual, a final `norm`, and its own `lm_head` over
`draft_vocab_size` tokens with `d2t` (draft id -> target id - draft id; `t2d` is not needed).

`forward` returns the pre-norm output (fed back with the next draft, as vLLM does);
`compute_logits` norms it and scatters the draft vocabulary's logits into the target's (-inf
elsewhere), so drafting and verification see target token ids. The target's three hidden
states are read by forward pre-hooks on its layers, which CUDA graphs and the compiled CPU
forward do not run: the config asks for `--enforce-eager`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.worker.eagle import EagleHead, EagleRunner
from pagedserve.worker.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.models.llama import LlamaAttention, LlamaMLP, ModelOptions


def aux_layer_ids(head_hf: dict[str, Any], num_target_layers: int) -> list[int]:
    """The target layers whose input hidden states (hidden + residual) feed the head."""
    ids = head_hf.get("eagle_aux_hidden_state_layer_ids")
    n = num_target_layers
    ids = list(ids) if ids else [2, n // 2, n - 3]
    if len(ids) != 3 or not all(0 <= i < n for i in ids):
        raise ValueError(
            f"eagle3: the target's hidden states of layers {ids} (eagle_aux_hidden_state_layer_"
            f"ids) are not three of its {n} layers"
        )
    return ids


class Eagle3Layer(nn.Module):
    def __init__(self, hf: dict[str, Any], backend: Any) -> None:
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        head_dim = hf.get("head_dim") or hidden // hf["num_attention_heads"]
        wide = {**hf, "hidden_size": 2 * hidden, "head_dim": head_dim}  # q/k/v read 2H
        self.self_attn = LlamaAttention(wide, 0, backend, ModelOptions())
        self.self_attn.o_proj = RowParallelLinear(  # back to H
            hf["num_attention_heads"] * head_dim, hidden, bool(hf.get("attention_bias", False))
        )
        self.mlp = LlamaMLP(hf, None)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        embeds: torch.Tensor,  # [T, H]
        hidden: torch.Tensor,  # [T, H]
        kv_cache: torch.Tensor,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, kv_cache, meta)  # [T, 2H] -> [T, H]
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x), residual


class Eagle3Head(EagleHead):
    """The EAGLE-3 head; checkpoint names and the shared embedding as `EagleHead`'s."""

    def __init__(self, hf: dict[str, Any], names: set[str], target: nn.Module, backend) -> None:
        nn.Module.__init__(self)
        hidden, vocab = hf["hidden_size"], hf["vocab_size"]
        self.vocab_size = vocab
        target_hidden = hf.get("target_hidden_size") or hidden
        self.fc = ColumnParallelLinear(3 * target_hidden, hidden, "fc.bias" in names, True)
        self.layers = nn.ModuleDict({"0": Eagle3Layer(hf, backend)})
        self.norm = RMSNorm(hidden, hf.get("rms_norm_eps", 1e-6))
        self.draft_vocab = hf.get("draft_vocab_size") or vocab
        self.lm_head = ParallelLMHead(self.draft_vocab, hidden)
        self.own_embed, self.own_head = "embed_tokens.weight" in names, True
        if self.own_embed:
            self.embed_tokens = VocabParallelEmbedding(vocab, hidden)
        self.target_embed = target.model.embed if target is not None else None
        self.register_buffer("target_ids", torch.arange(self.draft_vocab), persistent=False)
        attn = self.layers["0"].self_attn.attn
        self.head_dim, self.num_kv_heads_per_rank = attn.head_dim, attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, 3H] the target's three, or [T, H] the head's own
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: Any,
    ) -> torch.Tensor:  # [T, H] pre-norm
        embeds = self.embed_tokens(input_ids) if self.own_embed else self.target_embed(input_ids)
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        x, residual = self.layers["0"](positions, embeds, hidden, kv_caches[0], meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        logits = self.lm_head(self.norm(hidden), torch.float32)  # [N, Vd]
        if self.draft_vocab == self.vocab_size:
            return logits
        full = logits.new_full((len(logits), self.vocab_size), float("-inf"))
        full[:, self.target_ids] = logits
        return full

    def checkpoint_name_wanted(self, name: str) -> bool:
        return name.removeprefix("model.") not in ("d2t", "t2d") and super().checkpoint_name_wanted(
            name
        )

    def checkpoint_to_param(self, name: str) -> tuple[str, Any]:
        return super().checkpoint_to_param(name.replace("midlayer.", "layers.0."))

    def load_d2t(self, d2t: torch.Tensor | None, source: str) -> None:
        """The draft vocabulary's target ids: draft id + d2t (a checkpoint over the whole
        vocabulary needs none)."""
        if self.draft_vocab == self.vocab_size and d2t is None:
            return
        if d2t is None or tuple(d2t.shape) != (self.draft_vocab,):
            raise ValueError(
                f"{source}: an EAGLE-3 head with draft_vocab_size {self.draft_vocab} needs "
                f"'d2t' of shape ({self.draft_vocab},)"
            )
        ids = torch.arange(self.draft_vocab) + d2t.to(torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"{source}: 'd2t' maps draft tokens outside the target's vocabulary")
        self.target_ids.copy_(ids)


class Eagle3Runner(EagleRunner):
    """`EagleRunner` around an EAGLE-3 head: a pair reads the residual stream entering three
    target layers (`aux_layer_ids`), side by side."""

    head_cls = Eagle3Head
    width = 3

    def keep_target_states(self, target: nn.Module, hf: dict[str, Any], num_layers: int) -> None:
        """Forward pre-hooks that keep the residual stream entering the head's three target
        layers (hidden + residual; eager forwards only: the config asks for --enforce-eager)."""
        self.aux = [torch.empty(0)] * 3

        def keep(j: int):
            def hook(module: nn.Module, args: tuple) -> None:
                hidden, residual = args[1], args[2]
                self.aux[j] = hidden if residual is None else hidden + residual

            return hook

        for j, i in enumerate(aux_layer_ids(hf, num_layers)):
            target.model.layers[str(i)].register_forward_pre_hook(keep(j))
