"""The model runner: weights, the paged KV cache, the persistent batch and one forward per plan.

A step has three parts, so that the worker can queue step N+1 on the device before it reads step
N's sampled ids back: `start(plan, prev)` applies the plan's delta to the persistent batch,
prepares inputs on the host with numpy, copies them to the device and queues the forward;
`sample(step)` queues sampling of the rows whose known tokens are all computed (finished prompts
and decodes) and the copy of the ids to the host; `finish(step)` waits for those ids only and
builds the StepResult. `execute(plan)` is the three in a row. KV capacity comes from
`profile_num_blocks()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from pagedserve.config import EngineConfig, kv_cache_groups
from pagedserve.core.spec_decode.decoder import token_proposer
from pagedserve.ipc.messages import (
    MAX_LOGPROBS,
    PoolingParams,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from pagedserve.kernels import cpu_native
from pagedserve.kernels.attention.cascade import cascade_len
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.parallel.groups import RankInfo, layer_range, recv_intermediate, send_intermediate
from pagedserve.worker.cpu_compile import MAX_TOKENS, CpuCompiler, attention_layers
from pagedserve.worker.cuda_graphs import (
    DecodeGraphs,
    GraphOutputs,
    MixedGraphs,
    capture_graphs,
    max_graph_tokens,
)
from pagedserve.worker.draft_model import Drafted, DraftRunner, merge_fills
from pagedserve.worker.eagle import EagleRunner
from pagedserve.worker.eagle3 import Eagle3Runner
from pagedserve.worker.grammar import GrammarCompiler
from pagedserve.worker.grammar_masks import ConstrainedRows
from pagedserve.worker.host_tier import (
    HostKVTier,
    host_tier_blocks,
    measure_recompute,
    new_kv_caches,
)
from pagedserve.worker.input_batch import InputBatch, RequestRow, StepInputs
from pagedserve.worker.lora.manager import LoRAManager
from pagedserve.worker.memory_profile import worst_sampling_rows, worst_step_inputs
from pagedserve.worker.models import build_model
from pagedserve.worker.pooler import PooledRows, Pooler
from pagedserve.worker.prompt_logprobs import (
    CHUNK,
    PromptRows,
    PromptScores,
    prompt_rows,
    score_positions,
    score_prompt,
)
from pagedserve.worker.sampler import (
    Sampler,
    SamplingRow,
    argmax_rows,
    compute_logprobs,
    to_device,
)
from pagedserve.worker.sampler_drafts import SamplerDrafts
from pagedserve.worker.spec_verify import verify
from pagedserve.worker.stage_tokens import stage_links
from pagedserve.worker.step_features import step_features
from pagedserve.worker.step_metadata import attention_metadata
from pagedserve.worker.warm_up import warm_up_attention, warm_up_head

DEFAULT_CPU_KV_BYTES = 512 << 20
NO_KV_LIMIT = 1 << 30  # blocks a stage without KV cache can "hold": the other stages decide

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StartedStep:
    """A plan whose forward is queued: logits [S, V] on the last stage when it samples (and
    their argmax [S] when a decode graph computed it)."""

    plan: StepPlan
    inputs: StepInputs | None
    logits: torch.Tensor | None
    argmax: torch.Tensor | None = None
    prompt_scores: PromptScores | None = None  # prompt logprobs of the rows that asked
    pooled: PooledRows | None = None  # pooling runner: vectors of the prompts that ended
    drafted: Drafted | None = None  # the draft model's drafts for this step
    drafts: dict[str, list[int]] | None = None  # the sampling ranks' (num_sampler_drafts)


@dataclass
class PendingStep:
    """A step whose sampling is queued; its ids reach `host_ids` once `ready` has passed."""

    plan: StepPlan
    inputs: StepInputs | None
    members: list[RequestRow]  # the batch rows that sample, in order
    index: dict[str, int]  # req_id -> its position in token_ids
    token_ids: torch.Tensor | None  # [S] on the device
    host_ids: torch.Tensor | None  # [S] on the host (pinned with CUDA)
    ready: torch.cuda.Event | None
    logprobs: list[list[TokenLogprobs] | None] | None  # one per new token of each row
    accepted: list[list[int]] | None = None  # each row's new tokens, where drafts were verified
    prompt_scores: PromptScores | None = None
    pooled: PooledRows | None = None
    drafts: dict[str, list[int]] | None = None  # the sampling ranks' (num_sampler_drafts)
    kept: bool = False  # its sampled ids are in the batch (`_keep`)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, info: RankInfo) -> None:
        self.config = config
        self.device = device
        self.info = info
        self.dtype = _DTYPES[config.model.resolved_dtype]
        self.hidden_size = int(config.model.hf["hidden_size"])
        torch.manual_seed(config.model.seed)
        layers = layer_range(config.model.num_layers, info, config.parallel.pp_layer_partition)
        kv_fp8 = config.cache.kv_fp8
        self.model = build_model(
            config.model, self.dtype, device, layers, kv_fp8=kv_fp8, show_progress=info.rank == 0
        )
        self.lora = (  # adapter slots in the linear layers, before the memory profile counts them
            LoRAManager(
                config.lora,
                self.model,
                config.model.hf,
                device,
                self.dtype,
                max_graph_tokens(config),
            )  # fmt: skip
            if config.lora is not None
            else None
        )
        self.kv_dtype = torch.float8_e4m3fn if kv_fp8 else self.dtype  # fp8: half the bytes
        self.block_size = config.cache.block_size
        # KV cache groups (config.kv_cache_groups): layer i of every group shares one tensor
        # (its slot), so a block costs the same bytes whichever group owns it.
        groups = kv_cache_groups(config.model.hf)
        slot_of = {layer: j for group in groups for j, layer in enumerate(group.layer_ids)}
        # per layer of this stage; None: a linear-attention layer (recurrent state, no KV)
        self.kv_slots = [slot_of.get(i) for i in range(*layers)]
        self.states_ready = False  # allocate_states (models with recurrent state)
        self.batch = InputBatch(
            config.scheduler.max_num_seqs, config.max_model_len, self.block_size, len(groups)
        )
        self.sampler = Sampler(seed=config.model.seed, device=device)
        spec = config.speculative
        self.drafter = None  # a draft's weights, before the memory profile counts them
        if spec is not None and spec.method in ("eagle", "eagle3"):
            runner = Eagle3Runner if spec.method == "eagle3" else EagleRunner
            self.drafter = runner(config, self.dtype, device, self.sampler, self.model)
        elif spec is not None and spec.in_workers:
            self.drafter = DraftRunner(config, self.dtype, device, self.sampler)
        self.sampler_drafts = None  # ngram: drafted here after sampling (one pipeline stage)
        if spec is not None and spec.method == "ngram":
            self.sampler_drafts = SamplerDrafts(partial(token_proposer, spec))
        self.profiled_peak: int | None = None
        self.scoring: set[str] = set()  # requests whose prompt logprobs are not all scored
        self._pin = device.type == "cuda"
        self.kv_caches: list[torch.Tensor] = []
        self.kv_stack: torch.Tensor | None = None  # [slots, blocks, *block]: kv_caches' tensor
        self.host_tier: HostKVTier | None = None  # --kv-offloading-size (worker/host_tier.py)
        self.tier_costs: dict[str, float] = {}  # what init_cache measured for the core
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        # A later pipeline stage's graphs read the hidden states and residual it receives from
        # these static buffers ([2, max graph tokens, H]).
        self.stage_in: torch.Tensor | None = None
        self.cpu_compiler: CpuCompiler | None = None  # the compiled CPU forward, once built
        self.features = step_features(config, device, info, self.model, self.dtype)
        # Structured outputs: grammars compile here; the sampling ranks mask constrained rows.
        self.grammars = GrammarCompiler(
            config.model.tokenizer_path, config.model.vocab_size,
            config.scheduler.max_grammar_compile_seconds,
        )  # fmt: skip
        self.constrained = ConstrainedRows(
            self.grammars, config.scheduler.max_num_seqs, device, config.parallel.ranks_per_node
        )
        pooling = config.model.pooling  # the pooling runner: vectors instead of samples
        self.pooler = (
            Pooler(pooling, self.model, device, config.model.tokenizer_path)
            if pooling is not None and info.is_last_stage
            else None
        )
        self.sampled_in, self.sampled_out = stage_links(config, info, device)  # async, pp > 1

    # ------------------------------------------------------------------ KV cache
    def _kv_block_shape(self) -> tuple[int, ...]:
        # [2, block_size, num_kv_heads_per_rank, head_dim] per layer and block; a model with
        # its own layout says so (MLA's latent rows: worker/models/deepseek_v3.py)
        if hasattr(self.model, "kv_block_shape"):
            return self.model.kv_block_shape(self.block_size)
        return (2, self.block_size, self.model.num_kv_heads_per_rank, self.model.head_dim)

    def _block_bytes(self) -> int:
        per_layer = int(np.prod(self._kv_block_shape())) * self.kv_dtype.itemsize
        draft = self.drafter.block_bytes() if self.drafter is not None else 0
        return per_layer * len(set(self.kv_slots) - {None}) + draft

    def _new_kv_caches(
        self, num_blocks: int
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """One cache per layer of this stage; layers of one slot share it (None: no KV); all
        views of one tensor, returned first (worker/host_tier.py: the host tier's copies)."""
        shape = (num_blocks, *self._kv_block_shape())
        return new_kv_caches(self.kv_slots, shape, self.kv_dtype, self.device)

    def _allocate_states(self) -> None:
        """Linear-attention layers' recurrent state, one row per state slot of the core
        (core/state_pool.py), before the profile so its peak counts them."""
        num_slots = self.config.num_state_slots
        if num_slots is None or self.states_ready:
            return
        # One more: the scratch slot decode graphs' padding rows step in (cuda_graphs.py).
        self.model.allocate_states(num_slots + 1, self.dtype, self.device)
        self.states_ready = True

    def profile_num_blocks(self) -> int:
        """How many KV blocks fit: an explicit size, else (GPU) what a peak-sized forward leaves."""
        cache = self.config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget(cache.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_BYTES
        if self.device.type != "cuda" or cache.kv_cache_memory is not None:
            self._check_state_memory(budget)
        if self.pooler is not None and not self.pooler.config.chunkable:  # an encoder: no KV
            max_blocks = -(-self.config.max_model_len // self.block_size)
            return self.config.scheduler.max_num_seqs * max_blocks
        if not self._block_bytes():  # a pipeline stage of linear-attention layers only
            return NO_KV_LIMIT
        return max(int(budget // self._block_bytes()), 0)

    def _profile_cuda_budget(self, utilization: float) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free, total = torch.cuda.mem_get_info()
        self._check_state_memory(total * utilization - (total - free))
        self._dummy_forward()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        ours = torch.cuda.memory_reserved()
        others = total - free - ours  # other processes and the CUDA context
        peak = torch.cuda.max_memory_allocated()
        self.profiled_peak = peak  # weights + the worst step's activations, for memory_report
        return int(total * utilization - others - peak)

    def _dummy_forward(self) -> None:
        """The worst step the scheduler can plan (worker/memory_profile.py), over a throwaway
        cache: the full token budget over max_num_seqs rows, all sampled with every sampler
        stage on, for the peak."""
        sched = self.config.scheduler
        inputs, num_blocks = worst_step_inputs(
            sched.max_num_batched_tokens, sched.max_num_seqs, self.config.max_model_len,
            self.block_size,
        )  # fmt: skip
        _, caches = self._new_kv_caches(num_blocks)
        self._allocate_states()
        if self.states_ready:  # the worst step's rows, each in a slot of its own
            inputs.state_slots = np.arange(len(inputs.seq_lens), dtype=np.int64)
        num_tokens = len(inputs.input_ids)
        with torch.inference_mode():
            if self.drafter is not None:  # e.g. an EAGLE head's kept hidden states
                self.drafter.before_profile(inputs)
            intermediate = None
            if not self.info.is_first_stage:
                zeros = torch.zeros(
                    (num_tokens, self.hidden_size), dtype=self.dtype, device=self.device
                )
                intermediate = (zeros, zeros)
            hidden = self._forward(inputs, caches, intermediate)
            if self.pooler is not None:
                rows = to_device(inputs.logits_indices, self.device)
                self.pooler.head(hidden[rows].float(), [PoolingParams()] * len(rows))
            elif self.info.is_last_stage:
                logits_idx = to_device(inputs.logits_indices, self.device)
                logits = self.model.compute_logits(hidden[logits_idx])  # [R, V] float32
                rows = worst_sampling_rows(inputs, logits.shape[1])
                token_ids = self.sampler.sample_ids(logits, rows)  # [R]
                compute_logprobs(logits, token_ids, rows)
                del logits  # prompt logprobs: one chunk of the LM head, with the top-N
                n = min(num_tokens, CHUNK)
                idx = torch.arange(n, device=self.device)
                top_n = min(MAX_LOGPROBS, self.config.model.vocab_size)
                score_positions(self.model.compute_logits, hidden, idx, idx * 0, top_n)
            if self.drafter is not None:
                self.drafter.profile(inputs, num_blocks)
        del caches

    def num_host_blocks(self) -> int:
        return host_tier_blocks(self.config.cache.kv_offloading_size, self._block_bytes())

    def init_cache(self, num_blocks: int, num_host_blocks: int = 0) -> dict[str, float]:
        """Allocate the KV cache (and its host tier) and capture the CUDA graphs; seconds spent
        on each."""
        t0 = time.perf_counter()
        self.kv_stack, self.kv_caches = self._new_kv_caches(num_blocks)
        if self.drafter is not None:
            self.drafter.init_cache(num_blocks)
        self._allocate_states()
        timings = {"KV cache": time.perf_counter() - t0}
        if num_host_blocks:
            self._init_host_tier(num_blocks, num_host_blocks)
            timings["host KV tier"] = time.perf_counter() - t0 - timings["KV cache"]
        if self.device.type == "cpu":  # build (once per machine) or load the C++ kernels now
            t1 = time.perf_counter()
            cpu_native.available()
            timings["CPU kernels"] = time.perf_counter() - t1
        if self.features.cpu_compile:
            self.cpu_compiler = CpuCompiler(self.config, self.model, self.kv_caches)
        if self.device.type == "cuda" and self._block_bytes():
            t1 = time.perf_counter()
            layers = attention_layers(self.model)
            kv_cache = next(c for c in self.kv_caches if c is not None)
            warm_up_attention(layers, kv_cache, self.dtype, self.features.cascade)
            timings["attention warm-up"] = time.perf_counter() - t1
        if self.features.cuda_graphs:
            if not self.info.is_first_stage:
                shape = (2, max_graph_tokens(self.config), self.hidden_size)
                self.stage_in = torch.zeros(shape, dtype=self.dtype, device=self.device)

            def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata):
                if self.lora is not None:  # graphs read the LoRA rows' buffer (stage_graph)
                    self.lora.capture_rows(len(ids))
                n = len(ids)
                received = None if self.stage_in is None else tuple(self.stage_in[:, :n])
                return self.model(ids, pos, self.kv_caches, meta, received)

            max_blocks = self.batch.block_tables.shape[2]
            self.graphs, self.mixed_graphs = capture_graphs(
                forward, self.config, max_blocks, self.device, self._graph_head(),
                self.features.cascade, self.config.num_state_slots,
                mixed=getattr(self.model, "mixed_cuda_graphs", True),
                num_groups=self.batch.block_tables.shape[0],
            )  # fmt: skip
            timings["CUDA graphs"] = time.perf_counter() - t0 - sum(timings.values())
        if self.features.draft_cuda_graphs and self.drafter is not None:
            t1 = time.perf_counter()  # the drafter's own, in the target's pool where it has one
            pool = next((g.pool for g in (self.mixed_graphs, self.graphs) if g is not None), None)
            self.drafter.capture_graphs(self.batch.block_tables.shape[2], pool)
            timings["draft CUDA graphs"] = time.perf_counter() - t1
        if (
            self.device.type == "cuda"
            and self.info.is_last_stage
            and hasattr(self.model, "lm_head")
        ):
            t1 = time.perf_counter()
            max_rows = self.config.scheduler.max_num_seqs
            warm_up_head(self.model, self.hidden_size, self.dtype, self.device, max_rows)
            timings["LM head warm-up"] = time.perf_counter() - t1
        return timings

    def _init_host_tier(self, num_blocks: int, num_host_blocks: int) -> None:
        """Allocate the host tier, measure its copies and the recompute cost (the core's
        preemption cost model)."""
        self.host_tier = tier = HostKVTier(self.kv_stack, num_host_blocks)
        swap_s, out_bw, in_bw = tier.measure_swap(num_blocks)
        plain_out, plain_in = tier.measure_plain()  # the ceiling, beside the tier's own
        recompute_s = measure_recompute(self.model, self.hidden_size, self.dtype, self.device)
        self.tier_costs = dict(
            block_bytes=tier.block_bytes, swap_s_per_block=swap_s,
            recompute_s_per_token=recompute_s, d2h_bytes_per_s=out_bw, h2d_bytes_per_s=in_bw,
            plain_d2h_bytes_per_s=plain_out, plain_h2d_bytes_per_s=plain_in,
        )  # fmt: skip

    def _graph_head(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """LM head and greedy argmax for small decode graphs."""
        if not self.features.graph_head:
            return None

        def head(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.model.compute_logits(hidden)  # [n, V] float32
            return logits, argmax_rows(logits)

        return head

    # ------------------------------------------------------------------ steps
    def _forward(
        self,
        inputs: StepInputs,
        kv_caches: list[torch.Tensor],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        meta = attention_metadata(inputs, self.block_size, self.device)
        input_ids = to_device(inputs.input_ids, self.device)
        positions = to_device(inputs.positions, self.device)
        if fill is not None:
            input_ids[fill[0]] = fill[1]
        compiled = self.cpu_compiler.forward() if self.cpu_compiler is not None else None
        if compiled is not None and kv_caches is self.kv_caches and len(input_ids) <= MAX_TOKENS:
            return compiled(input_ids, positions, meta)
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one plan start to finish; the result on the driver (None elsewhere)."""
        return self.finish(self.sample(self.start(plan, None)))

    @torch.inference_mode()
    def start(self, plan: StepPlan, prev: PendingStep | None) -> StartedStep:
        """Apply the plan and queue its forward (and logits) on the device without waiting.

        `prev` is the step before, started but not finished: its sampled tokens are still on the
        device. Under async scheduling this plan feeds some of them in (a decode of a token the
        host does not know yet); they are copied on the device, so the host never waits for them.
        """
        if self.host_tier is not None:  # before anything reads or writes the KV cache
            self.host_tier.copy(plan.kv_to_host, plan.kv_from_host, plan.kv_to_host_ahead)
        self.batch.apply(plan)
        if self.sampled_in is not None:
            self.sampled_in.forget(plan.finished_ids)
        if self.drafter is not None:
            self.drafter.forget(plan.finished_ids)
        if self.sampler_drafts is not None:
            self.sampler_drafts.forget(plan.finished_ids)
        if self.scoring or plan.new_requests:
            self._track_scoring(plan)
        if self.lora is not None:
            self.lora.track(plan)
        if self.pooler is not None:
            self.pooler.track(plan)
        if self.info.is_last_stage and (self.constrained or plan.new_requests):
            self.constrained.track(plan.finished_ids, plan.new_requests)
        if not plan.scheduled_ids:
            return StartedStep(plan, None, None)
        counts, drafts = plan.num_scheduled_tokens, None
        if plan.num_sampler_drafts:
            counts, drafts = self._draft_after_sampling(plan, prev)
        inputs = self.batch.prepare(plan.scheduled_ids, counts)
        if self.lora is not None:  # which slot each row uses; graphs hold LoRA too
            self.lora.prepare(plan.scheduled_ids, inputs.query_start_loc)
        if self.features.cascade:
            q_lens = np.diff(inputs.query_start_loc)
            inputs.cascade_len = cascade_len(
                inputs.block_tables, inputs.seq_lens, q_lens, self.block_size
            )
        fill = self._device_fill(inputs, prev)
        drafted = None
        if self.drafter is not None:
            rows = self._step_rows(plan, inputs)
            drafted = self.drafter.run(inputs, fill, rows, plan.scheduled_ids)
            fill = merge_fills(fill, drafted.fill if drafted is not None else None)
        scored = self._prompt_rows(plan, inputs) if self.scoring else None
        bucket = self._graph_bucket(inputs) if scored is None else None  # graphs keep no hidden
        mixed = self._mixed_bucket(inputs) if bucket is None and scored is None else None
        graph_size = bucket[0] if bucket is not None else mixed
        intermediate = None if self.info.is_first_stage else self._receive(inputs, graph_size)
        if self.lora is not None and self.lora.in_graphs and graph_size is not None:
            self.lora.stage_graph()  # this step's LoRA rows into the graphs' buffer
        if bucket is not None:
            outputs = self.graphs.run(inputs, bucket, fill)  # [T, H], then residual or head
        elif mixed is not None:
            outputs = self.mixed_graphs.run(inputs, mixed, fill)
        else:
            outputs = self._forward(inputs, self.kv_caches, intermediate, fill)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if not self.info.is_last_stage:
            send_intermediate(*outputs, self.info.next_rank)  # hidden, residual [T, H]
            if self.sampled_in is not None and inputs.sample_rows:  # the last stage sends them
                self.sampled_in.post(
                    plan.step_id, [plan.scheduled_ids[i] for i in inputs.sample_rows]
                )
            return StartedStep(plan, inputs, None)
        hidden, *head = outputs  # head: a decode graph's logits [T, V] and ids [T]
        if self.drafter is not None:
            self.drafter.after_target(plan.scheduled_ids, inputs, fill, hidden)
        if self.pooler is not None:
            return StartedStep(plan, inputs, None, pooled=self.pooler.pool(hidden, plan, inputs))
        scores = None
        if scored is not None:
            scores = score_prompt(self.model.compute_logits, hidden, scored)
        if not inputs.sample_rows:
            return StartedStep(plan, inputs, None, prompt_scores=scores)
        if head:
            logits, argmax = self._sampled_rows(inputs, *head)
            return StartedStep(plan, inputs, logits, argmax, drafts=drafts)
        logits_idx = to_device(inputs.logits_indices, self.device)
        logits = self.model.compute_logits(hidden[logits_idx])  # [S, V] (a TP collective)
        return StartedStep(
            plan, inputs, logits, prompt_scores=scores, drafted=drafted, drafts=drafts
        )

    def _draft_after_sampling(
        self, plan: StepPlan, prev: PendingStep | None
    ) -> tuple[list[int], dict[str, list[int]]]:
        """The sampling ranks' ngram drafts (worker/sampler_drafts.py) and each row's tokens
        this step. The step before is kept first (its ids on the host) where that is free or
        where a row of it has a draft in sight; otherwise (a GPU still running it) its rows
        decode their token in flight plainly, copied in on the device, and do not wait."""
        in_flight: dict[str, int] = {}
        if prev is not None and not prev.kept:
            free = prev.accepted is not None or self.is_done(prev)
            if free or self.sampler_drafts.in_sight(plan, self.batch, prev.index):
                self._keep(prev)
            else:
                in_flight = prev.index
        return self.sampler_drafts.draft(plan, self.batch, in_flight)

    def _step_rows(self, plan: StepPlan, inputs: StepInputs) -> dict[int, SamplingRow]:
        """The sampling row of each batch row that verifies drafts (for the draft model)."""
        return {
            i: self._sampling_row(plan.scheduled_ids[i])
            for i, n in zip(inputs.sample_rows, inputs.num_drafts, strict=False)
            if n
        }

    def _prompt_rows(self, plan: StepPlan, inputs: StepInputs) -> PromptRows | None:
        """The rows of this step that score prompt tokens (every rank decides alike, so that
        all stages skip the graphs together); a request leaves `scoring` with its last one."""
        wanted = []
        for i, req_id in enumerate(plan.scheduled_ids):
            if req_id not in self.scoring:
                continue
            req = self.batch.requests[req_id]
            start = int(inputs.positions[inputs.query_start_loc[i]])
            n = plan.num_scheduled_tokens[i]
            if start + n >= req.prompt_len - 1:
                self.scoring.discard(req_id)
            wanted.append((i, req.row, start, n, req.prompt_len, req.sampling.prompt_logprobs))
        return prompt_rows(wanted, self.batch.token_ids, inputs.query_start_loc)

    def _track_scoring(self, plan: StepPlan) -> None:
        """Requests that join with their prompt to score (one resumed after its prompt was
        done has nothing left to score)."""
        self.scoring.difference_update(plan.finished_ids)
        for new in plan.new_requests:
            if new.sampling.prompt_logprobs is not None and not new.output_token_ids:
                self.scoring.add(new.req_id)

    def _receive(self, inputs: StepInputs, graph_size: int | None) -> GraphOutputs:
        """The previous stage's hidden states and residual [T, H] for this step: into the
        graphs' static buffers when a graph of `graph_size` tokens runs it (its padding rows
        zeroed), else into fresh tensors."""
        n = len(inputs.input_ids)
        if graph_size is None:
            hidden = torch.empty((n, self.hidden_size), dtype=self.dtype, device=self.device)
            return recv_intermediate(hidden, torch.empty_like(hidden), self.info.prev_rank)
        if graph_size > n:
            self.stage_in[:, n:graph_size].zero_()
        return recv_intermediate(self.stage_in[0, :n], self.stage_in[1, :n], self.info.prev_rank)

    def _sampled_rows(
        self, inputs: StepInputs, logits: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A head graph's logits [n, V] and ids [n] of every row -> those of the sampling rows."""
        if len(inputs.sample_rows) == len(ids):
            return logits, ids
        idx = to_device(inputs.logits_indices, self.device)
        return logits[idx], ids[idx]

    def _device_fill(
        self, inputs: StepInputs, prev: PendingStep | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices, token ids) on the device for the input tokens the host lacks."""
        if not len(inputs.unknown):
            return None
        if self.info.pp_size > 1:  # only the first stage embeds tokens: from the last stage
            if self.sampled_in is None:
                return None
            return self.sampled_in.fill(inputs.unknown, inputs.unknown_ids)
        assert prev is not None, "an input token is unknown but no step is in flight"
        src = [prev.index[req_id] for req_id in inputs.unknown_ids]
        idx = to_device(np.stack([inputs.unknown, np.asarray(src, dtype=np.int64)]), self.device)
        return idx[0], prev.token_ids[idx[1]]

    @torch.inference_mode()
    def sample(self, step: StartedStep) -> PendingStep:
        """Queue sampling and the copy of the sampled ids to the host (the host does not wait).

        Every rank of the last stage samples (same gathered logits, same generator state, so the
        same tokens) and keeps the tokens in its batch. Call after the step before has finished:
        penalties and seeded sampling read each request's outputs, which then include its token.
        """
        if step.logits is None:
            return PendingStep(
                step.plan, step.inputs, [], {}, None, None, None, None,
                prompt_scores=step.prompt_scores, pooled=step.pooled,
            )  # fmt: skip
        plan, inputs = step.plan, step.inputs
        sample_ids = [plan.scheduled_ids[i] for i in inputs.sample_rows]
        rows = [self._sampling_row(req_id) for req_id in sample_ids]
        if inputs.num_drafts:
            return self._verify(step, sample_ids, rows)
        if self.constrained:
            self.constrained.mask(step.logits, sample_ids, [r.output_token_ids for r in rows])
        argmax = None if self.constrained else step.argmax  # grammar masks change the logits
        token_ids = self.sampler.sample_ids(step.logits, rows, argmax)  # [S] on the device
        if self.sampled_out is not None:  # to the first stage (async scheduling, pp > 1)
            self.sampled_out.send(token_ids)
        logprobs = None
        if self.info.is_driver and any(r.params.logprobs is not None for r in rows):
            logprobs = compute_logprobs(step.logits, token_ids, rows)  # waits for the device
            logprobs = [None if lp is None else [lp] for lp in logprobs]
        host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=self._pin)
        host.copy_(token_ids, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        members = [self.batch.requests[r] for r in sample_ids]
        index = {r: j for j, r in enumerate(sample_ids)}
        return PendingStep(
            plan, inputs, members, index, token_ids, host, ready, logprobs,
            prompt_scores=step.prompt_scores, drafts=step.drafts,
        )  # fmt: skip

    def _verify(self, step: StartedStep, sample_ids: list[str], rows: list) -> PendingStep:
        """Sample every position of rows that verify drafts (worker/spec_verify.py); waits
        for the device (the core plans a speculating row only once it has its tokens)."""
        plan, inputs = step.plan, step.inputs
        if self.constrained:  # constrained rows verify no drafts: mask their one position
            heads = to_device(
                np.cumsum([0, *inputs.num_drafts[:-1]]) + np.arange(len(rows)), self.device
            )
            sub = step.logits[heads]  # [S, V], each row's first position
            self.constrained.mask(sub, sample_ids, [r.output_token_ids for r in rows])
            step.logits[heads] = sub
        want = self.info.is_driver and any(r.params.logprobs is not None for r in rows)
        probs = None
        if step.drafted is not None:  # the draft model's
            drafts, probs = step.drafted.per_row(inputs.num_drafts), step.drafted.probs
        else:
            source = step.drafts if step.drafts is not None else plan.draft_token_ids
            drafts = [source.get(r, []) for r in sample_ids]
        v = verify(self.sampler, step.logits, rows, drafts, want, probs)
        members = [self.batch.requests[r] for r in sample_ids]
        index = {r: j for j, r in enumerate(sample_ids)}
        host = v.token_ids.cpu()
        return PendingStep(
            plan, inputs, members, index, v.token_ids, host, None, v.logprobs, v.accepted,
            step.prompt_scores, drafts=step.drafts,
        )  # fmt: skip

    def is_done(self, step: PendingStep) -> bool:
        """Whether the step's sampled ids are on the host (finish() will not wait)."""
        return step.ready is None or step.ready.query()

    def finish(self, step: PendingStep) -> StepResult | None:
        """Wait for this step's sampled ids (not for later work), keep them, build the result."""
        plan = step.plan
        new_ids = self._keep(step)
        if not self.info.is_driver:
            return None
        sampled: list[list[int]] = [[] for _ in plan.scheduled_ids]
        logprobs = [None] * len(sampled) if step.logprobs is not None else None
        sampled_rows = step.inputs.sample_rows if step.host_ids is not None else []
        for j, i in enumerate(sampled_rows):  # (none where the pooler took the rows)
            sampled[i] = new_ids[j]
            if logprobs is not None:
                logprobs[i] = step.logprobs[j]
        result = StepResult(plan.step_id, sampled, logprobs)
        if step.prompt_scores is not None:
            result.prompt_logprobs = step.prompt_scores.to_messages(len(plan.scheduled_ids))
        if step.pooled is not None:
            result.pooled = step.pooled.to_messages(len(plan.scheduled_ids))
        if self.lora is not None:
            result.lora_loads, result.lora_evictions = self.lora.num_loads, self.lora.num_evictions
        if plan.num_sampler_drafts:
            drafts = step.drafts or {}
            result.num_drafts = [len(drafts.get(r, ())) for r in plan.scheduled_ids]
        return result

    def _keep(self, step: PendingStep) -> list[list[int]]:
        """Wait for the step's sampled ids and append them to the batch (once); each sampling
        row's new tokens."""
        if step.ready is not None:
            step.ready.synchronize()
        token_ids = step.host_ids.tolist() if step.host_ids is not None else []
        new_ids = step.accepted if step.accepted is not None else [[t] for t in token_ids]
        if not step.kept:
            self.batch.append_sampled(step.members, new_ids)
            step.kept = True
        return new_ids

    def _graph_bucket(self, inputs: StepInputs) -> tuple[int, bool] | None:
        num_seqs = len(inputs.seq_lens)
        if self.lora is not None and self.lora.batch.active and not self.lora.in_graphs:
            return None
        if self.graphs is None or len(inputs.input_ids) != num_seqs:  # not decode-only
            return None
        if inputs.state_slots is not None and (inputs.seq_lens == 1).any():
            return None  # a one-token prompt: its state starts from zeros (eager)
        return self.graphs.bucket(num_seqs, inputs.cascade_len > 0)

    def runs_eager(self, plan: StepPlan) -> bool:
        """Whether the plan's forward goes out kernel by kernel, no CUDA graph holding it (a
        prompt-sized step: more tokens than the largest mixed graph). Its launches, hundreds a
        stage, fill the device's queue behind a step still running, and start() then waits."""
        tokens = sum(plan.num_scheduled_tokens)
        if self.mixed_graphs is not None:
            return tokens > self.mixed_graphs.sizes[0]
        return self.graphs is None or tokens != len(plan.scheduled_ids)

    def _mixed_bucket(self, inputs: StepInputs) -> int | None:
        if self.lora is not None and self.lora.batch.active and not self.lora.in_graphs:
            return None
        if self.mixed_graphs is None:
            return None
        return self.mixed_graphs.bucket(len(inputs.input_ids), len(inputs.seq_lens))

    def _sampling_row(self, req_id: str) -> SamplingRow:
        req = self.batch.requests[req_id]
        return SamplingRow(
            params=req.sampling,
            prompt_token_ids=self.batch.token_ids[req.row, : req.prompt_len],
            output_token_ids=req.output_token_ids,
            eos_token_ids=req.eos_token_ids,
        )

    def _check_state_memory(self, budget: float) -> None:
        """Refuse, with the flag to change, recurrent state for `max_num_seqs` requests that
        would take more than half of `budget`, the bytes the KV cache and the states share (on
        a CPU: the KV cache's)."""
        num_slots = self.config.num_state_slots
        if num_slots is None or self.states_ready:
            return
        need = num_slots * self.model.state_bytes_per_slot(self.dtype)
        if need > budget / 2:
            raise ValueError(
                f"recurrent state for --max-num-seqs {num_slots} takes {need / 2**30:.1f} GiB, "
                f"more than half of the {budget / 2**30:.1f} GiB left for the KV cache and the "
                "states: lower --max-num-seqs (or give the KV cache more memory)"
            )
