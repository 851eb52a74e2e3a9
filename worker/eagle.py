"""EAGLE heads (`method: eagle`): a one-layer Llama decoder that drafts from the target's own
hidden states, in the HF format vLLM loads (config.json + safetensors: `fc.weight` [H, 2H] and
maybe `fc.bias`, `layers.N.*` without layer 0's `input_layernorm`, maybe `embed_tokens.weight`
and `lm_head.weight`; otherwise the target's embedding and LM head serve).

The head at position p reads the pair (token p+1, the target's hidden state at p, after the
final norm, as vLLM feeds it) through `fc([embed ; hidden])`, its decoder layer and no final
norm, and predicts the target's next hidden state, whose logits (the LM head) give the token
after p+1. Drafting feeds each draft back with the head's own predicted hidden state, one
position on.

The draft runs in every worker before the target's forward (worker/draft_model.py), so the
pairs of a row's tokens wait one step for their hidden states: the target's forward leaves each
row's hidden states and input ids (`after_target`); the next step that schedules the row runs the
head over those pairs up to its first new position (the accepted ones; rejected drafts' lie past
it), which writes the head's KV there (one tensor per head layer, indexed by the target's block
ids) and gives the first draft. A row with no hidden state for its last known token (its first
step, after a recompute or a prompt found in the prefix cache) drafts from zeros that once:
verification keeps the output exact whatever a head drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.config import EngineConfig
from pagedserve.kernels.attention.selection import select_backend
from pagedserve.worker.draft_graphs import DraftPlan
from pagedserve.worker.draft_model import Drafted, DraftRunner, pick
from pagedserve.worker.input_batch import StepInputs, _last_tokens
from pagedserve.worker.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    VocabParallelEmbedding,
)
from pagedserve.worker.loader import (
    after_loading,
    init_dummy_weights,
    iter_checkpoint,
    load_weights,
)
from pagedserve.worker.models import _default_dtype
from pagedserve.worker.models.llama import STACKED_PARAMS, LlamaDecoderLayer, ModelOptions
from pagedserve.worker.sampler import Sampler, SamplingRow, to_device
from pagedserve.worker.step_metadata import attention_metadata

IGNORED = ("layers.0.input_layernorm.weight", "rotary_emb.inv_freq")  # as vLLM skips them


class EagleHead(nn.Module):
    """fc over [embedding ; target hidden], Llama decoder layers (layer 0 without its input
    norm), hidden + residual out. `names`: the checkpoint's tensor names (an own embedding,
    LM head or fc bias where it has them); `target`: the target model, whose embedding and LM
    head serve otherwise (not submodules here: the target loads and owns them)."""

    def __init__(self, hf: dict[str, Any], names: set[str], target: nn.Module, backend) -> None:
        super().__init__()
        hidden, vocab = hf["hidden_size"], hf["vocab_size"]
        self.fc = ColumnParallelLinear(2 * hidden, hidden, "fc.bias" in names, gather_output=True)
        opts = ModelOptions()
        self.layers = nn.ModuleDict(
            {
                str(i): LlamaDecoderLayer(hf, i, backend, opts)
                for i in range(hf["num_hidden_layers"])
            }
        )
        self.layers["0"].input_layernorm = nn.Identity()
        self.own_embed = "embed_tokens.weight" in names
        self.own_head = "lm_head.weight" in names
        if self.own_embed:
            self.embed_tokens = VocabParallelEmbedding(vocab, hidden)
        if self.own_head:
            self.lm_head = ParallelLMHead(vocab, hidden)
        self.target_embed = target.model.embed  # bound methods: not registered as modules
        self.target_logits = target.compute_logits
        attn = self.layers["0"].self_attn.attn
        self.head_dim, self.num_kv_heads_per_rank = attn.head_dim, attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H] the target's (or the head's own) hidden states
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: Any,
    ) -> torch.Tensor:  # [T, H] the predicted next hidden states
        embeds = self.embed_tokens(input_ids) if self.own_embed else self.target_embed(input_ids)
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        residual = None
        for layer, kv_cache in zip(self.layers.values(), kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        if self.own_head:
            return self.lm_head(hidden, torch.float32)
        return self.target_logits(hidden)

    def checkpoint_name_wanted(self, name: str) -> bool:
        return not name.removeprefix("model.").endswith(IGNORED)

    def checkpoint_to_param(self, name: str) -> tuple[str, Any]:
        name = name.removeprefix("model.")
        for ours, theirs, shard_id in STACKED_PARAMS:
            if theirs in name:
                return name.replace(theirs, ours), shard_id
        return name, None

    def checkpoint_name(self, param_name: str, shard_id: Any) -> str:
        for ours, theirs, sid in STACKED_PARAMS:
            if ours in param_name and sid == shard_id:
                return param_name.replace(ours, theirs)
        return param_name


def build_eagle_head(
    mc: Any, target: nn.Module, dtype: torch.dtype, device, cls: type[EagleHead] = EagleHead
) -> EagleHead:
    """The head (`cls`) of `mc` (its ModelConfig) on `device`, weights from its safetensors
    (random for `--load-format dummy`, with no own embedding, and an EAGLE-3 head's draft
    vocabulary the target's first ids)."""
    dummy = mc.load_format == "dummy"
    names = set() if dummy else {n.removeprefix("model.") for n, _ in iter_checkpoint(mc.model)}
    with _default_dtype(dtype), torch.device(device):
        backend = select_backend(torch.device(device), mc.attention_backend, False, dtype, False)
        head = cls(mc.hf, names, target, backend)
    if dummy:
        init_dummy_weights(head, mc.seed)
    else:
        load_weights(head, iter_checkpoint(mc.model), mc.model)
        if hasattr(head, "load_d2t"):
            found = (
                t[:] for n, t in iter_checkpoint(mc.model) if n.removeprefix("model.") == "d2t"
            )
            head.load_d2t(next(found, None), mc.model)
    after_loading(head)
    return head.eval()


@dataclasses.dataclass
class RowHidden:
    """A row's last target forward: its first position, input ids [q] and hidden states [q, H]."""

    start: int
    input_ids: torch.Tensor
    hidden: torch.Tensor


class EagleRunner(DraftRunner):
    """The draft model's runner (its KV cache, profile and draws) around an EAGLE head: pairs
    from the target's hidden states kept one step, drafts fed back with the head's own.
    EAGLE-3's (worker/eagle3.py) sets the head class and the target layers a pair reads."""

    head_cls: type[EagleHead] = EagleHead
    width = 1  # target layers whose hidden states a pair reads

    def __init__(
        self,
        config: EngineConfig,
        dtype: torch.dtype,
        device: torch.device,
        sampler: Sampler,
        target: nn.Module,
    ) -> None:
        mc = config.speculative.draft_model_config(config.model)
        head = build_eagle_head(mc, target, dtype, device, self.head_cls)
        super().__init__(config, dtype, device, sampler, head)
        # [.., width * H]: the target hidden states a pair reads
        self.hidden_size = self.width * int(config.model.hf["hidden_size"])
        self.vocab_size = int(mc.hf["vocab_size"])
        self.rows: dict[str, RowHidden] = {}  # req_id -> its hidden states not yet paired
        self.aux: list[torch.Tensor] = []  # EAGLE-3: this step's hidden states of three layers
        self.keep_target_states(target, mc.hf, config.model.num_layers)

    def _graph_forward(self, ids, positions, meta, hidden) -> torch.Tensor:
        return self.model(ids, hidden, positions, self.kv_caches, meta)  # [n, H]

    def _graph_hidden(self) -> tuple[int, torch.dtype]:
        return int(self.mc.hf["hidden_size"]), self.dtype  # the head's own, fed back

    def keep_target_states(self, target: nn.Module, hf: dict[str, Any], num_layers: int) -> None:
        """Hooks on the target that keep the hidden states a pair reads besides its output's
        (EAGLE: none)."""

    def forget(self, finished_ids: list[str]) -> None:
        for req_id in finished_ids:
            self.rows.pop(req_id, None)

    def after_target(
        self,
        req_ids: list[str],
        inputs: StepInputs,
        fill: tuple[torch.Tensor, torch.Tensor] | None,
        hidden: torch.Tensor,  # [T, H] the target's, after its final norm
    ) -> None:
        """Keep each row's hidden states for the head's next step (a copy: a CUDA graph's
        output buffer is rewritten by the next replay)."""
        num_tokens = len(inputs.input_ids)
        if self.aux:
            hidden = torch.cat(self.aux, dim=-1)  # [T, 3H]
        ids = self._device_ids(inputs, fill)
        hidden = hidden[:num_tokens].clone()
        qsl = inputs.query_start_loc.tolist()
        for b, req_id in enumerate(req_ids):
            s, e = qsl[b], qsl[b + 1]
            self.rows[req_id] = RowHidden(int(inputs.positions[s]), ids[s:e], hidden[s:e])

    def _device_ids(
        self, inputs: StepInputs, fill: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:  # [T] the step's input ids with those only on the device
        ids = to_device(inputs.input_ids, self.device)
        if fill is not None:
            ids[fill[0]] = fill[1]
        return ids

    def before_profile(self, inputs: StepInputs) -> None:
        """The hidden states a step as large as the profiled one leaves for the next ([T, width
        * H], `after_target`), kept in `rows` through the profiled step so that its peak counts
        them; `profile` drops them."""
        ids = to_device(inputs.input_ids, self.device)
        hidden = torch.zeros(len(ids), self.hidden_size, dtype=self.dtype, device=self.device)
        qsl = inputs.query_start_loc.tolist()
        for b in range(len(qsl) - 1):
            s, e = qsl[b], qsl[b + 1]
            self.rows[f"profile-{b}"] = RowHidden(int(inputs.positions[s]), ids[s:e], hidden[s:e])

    def profile(self, inputs: StepInputs, num_blocks: int) -> None:
        self.init_cache(num_blocks)
        ids = to_device(inputs.input_ids, self.device)
        zeros = torch.zeros(len(ids), self.hidden_size, dtype=self.dtype, device=self.device)
        hidden = self._head(inputs, ids, zeros)
        self.model.compute_logits(hidden[to_device(inputs.logits_indices, self.device)])
        self.kv_caches = []
        self.rows.clear()  # the profile's kept states (`before_profile`)

    def _head(self, inputs: StepInputs, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None:  # a pair a row: the head's decode graphs
            out = self.graphs.forward(inputs, ids, hidden)
            if out is not None:
                return out
        meta = attention_metadata(inputs, self.block_size, self.device)
        positions = to_device(inputs.positions, self.device)
        return self.model(ids, hidden, positions, self.kv_caches, meta)  # [T, H]

    def run(
        self,
        inputs: StepInputs,
        fill: tuple[torch.Tensor, torch.Tensor] | None,
        rows: dict[int, SamplingRow],
        req_ids: list[str],
    ) -> Drafted | None:
        """Pair the rows' hidden states from their last step (writing the head's KV up to each
        row's first new position), then draft for the rows that verify (`rows`)."""
        k = np.zeros(len(inputs.seq_lens), dtype=np.int64)  # [B] drafts per batch row
        if inputs.num_drafts:
            k[inputs.sample_rows] = inputs.num_drafts
        pairs, ids, hidden, of_row = self._pairs(inputs, self._device_ids(inputs, fill), k, req_ids)
        out_hidden = self._head(pairs, ids, hidden) if pairs is not None else None
        spec = np.nonzero(k)[0]  # batch rows that verify drafts (each has a pair row)
        if not len(spec):
            return None
        g = out_hidden[to_device(pairs.query_start_loc[1:][of_row[spec]] - 1, self.device)]
        return self._draft(inputs, k, spec, [rows[b] for b in spec], g)

    def _pairs(
        self, inputs: StepInputs, ids: torch.Tensor, k: np.ndarray, req_ids: list[str]
    ) -> tuple[StepInputs | None, torch.Tensor, torch.Tensor, np.ndarray]:
        """The head's inputs for the pairs each row has ready: (token p + 1, hidden p) at
        positions p from its last step's first position up to its first position now; a row
        that drafts without any gets one pair of zeros before its first position."""
        qsl = inputs.query_start_loc.tolist()
        of_row = np.full(len(req_ids), -1, dtype=np.int64)  # batch row -> its pair row
        positions, tokens, hiddens, rows = [], [], [], []
        for b, req_id in enumerate(req_ids):
            prev, first = self.rows.pop(req_id, None), int(inputs.positions[qsl[b]])
            now = ids[qsl[b] : qsl[b] + 1]  # [1] the row's first token this step
            n = first - prev.start if prev is not None else 0
            if prev is not None and 0 < n <= len(prev.hidden):
                tokens.append(torch.cat([prev.input_ids[1:n], now]))
                hiddens.append(prev.hidden[:n])
                start = prev.start
            elif k[b]:
                n, start = 1, max(first - 1, 0)
                tokens.append(now)
                hiddens.append(ids.new_zeros(1, self.hidden_size, dtype=self.dtype))
            else:
                continue
            of_row[b] = len(rows)
            rows.append(b)
            positions.append(np.arange(start, start + n, dtype=np.int64))
        if not rows:
            return None, ids, ids, of_row
        return (
            self._pair_inputs(inputs, rows, positions),
            torch.cat(tokens),
            torch.cat(hiddens),
            of_row,
        )

    def _pair_inputs(
        self, inputs: StepInputs, rows: list[int], positions: list[np.ndarray]
    ) -> StepInputs:
        pos = np.concatenate(positions)  # [P]
        tables = inputs.block_tables[rows]  # [R, max_blocks]
        row_of = np.repeat(np.arange(len(rows)), [len(p) for p in positions])
        slots = tables[row_of, pos // self.block_size].astype(np.int64) * self.block_size
        qsl = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum([len(p) for p in positions], out=qsl[1:])
        return dataclasses.replace(
            inputs,
            input_ids=np.zeros(len(pos), dtype=np.int64),  # on the device only
            positions=pos,
            slot_mapping=slots + pos % self.block_size,
            query_start_loc=qsl,
            seq_lens=np.array([p[-1] + 1 for p in positions], dtype=np.int32),
            block_tables=tables,
            unknown=np.zeros(0, dtype=np.int64),
            unknown_ids=[],
            cascade_len=0,
        )

    def _draft(
        self,
        inputs: StepInputs,
        k: np.ndarray,
        spec: np.ndarray,
        spec_rows: list[SamplingRow],
        g: torch.Tensor,  # [R] the head's hidden state after each row's last pair
    ) -> Drafted:
        """Draft j of each row from the head's logits, fed back with its hidden state at the
        position of the token before it (n + j - 1, n: the row's last known token)."""
        ends = inputs.query_start_loc[1:].astype(np.int64)  # [B]
        num = int(k.sum())
        out = torch.empty(num, dtype=torch.int64, device=self.device)  # [D]
        probs = None
        if any(not r.params.greedy for r in spec_rows):
            probs = torch.zeros(num, self.vocab_size, device=self.device)
        offsets = np.cumsum(k[spec]) - k[spec]  # [R] each row's first draft in `out`
        live = np.arange(len(spec))  # rows of `spec` still drafting
        # graphed: every row replays (draft j at position n + j - 1 while it has more to make)
        before = ends[spec] - k[spec] - 1  # [R] input index of each row's position n
        plan = self._graph_plan(inputs, spec, before, k[spec] - 1)
        g_all = g  # [R, H] graphed: every row's hidden state
        for j in range(1, int(k.max()) + 1):
            logits = self.model.compute_logits(g)  # [L, V]
            slots = to_device(offsets[live] + j - 1, self.device)
            ids, q = self._draw(logits, [spec_rows[i] for i in live], j - 1)
            out[slots] = ids
            if q is not None:
                probs[slots] = q
            more = k[spec[live]] > j  # rows with a further draft to make
            if not more.any():
                break
            g, g_all = self._feed_back(inputs, spec, before, live, more, j, ids, g, g_all, plan)
            live = live[more]
        draft_idx = _last_tokens(ends, k)  # [D] the drafts' input indices, row by row
        return Drafted((to_device(draft_idx, self.device), out), out, probs)

    def _feed_back(
        self,
        inputs: StepInputs,
        spec: np.ndarray,
        before: np.ndarray,  # [R] input index of each row's position n
        live: np.ndarray,
        more: np.ndarray,
        j: int,
        ids: torch.Tensor,  # [L] draft j of rows `spec[live]`
        g: torch.Tensor,  # [L, H] the hidden states they were drafted from
        g_all: torch.Tensor,  # [R, H] graphed: every row's
        plan: DraftPlan | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over draft j at position n + j - 1 of the rows with a further draft to
        make (`more`): their next hidden states, and graphed, every row's (all replay)."""
        if plan is not None:
            g_all = self.graphs.replay(plan, j, live, ids, g_all)  # [R, H]
            return pick(g_all, live[more], self.device), g_all
        again = live[more]
        idx = before[again] + j - 1  # the input index of position n + j - 1
        keep = to_device(np.nonzero(more)[0], self.device)
        return self._head(self._one_token(inputs, spec[again], idx), ids[keep], g[keep]), g_all
