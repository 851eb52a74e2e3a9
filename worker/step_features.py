"""The optional step paths a worker runs, decided once at start-up.

Each is a rule over the config, the device, the pipeline/tensor layout, the attention backend's
capabilities (kernels/attention/registry.py) and the fusion switches (kernels/backend.py); the
model runner reads the flags and never re-derives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.config import EngineConfig
from pagedserve.kernels.attention.registry import backend_caps
from pagedserve.kernels.attention.selection import attention_backend_name
from pagedserve.kernels.backend import fusion_enabled
from pagedserve.parallel.groups import RankInfo
from pagedserve.pooling_config import is_encoder
from pagedserve.worker.cpu_compile import eligible


@dataclass(frozen=True)
class StepFeatures:
    # Shared-prefix attention (kernels/attention/cascade.py): each step looks for a common
    # prefix, and decode graphs get cascade variants. On where a backend the model may run reads
    # it (under `auto`, one of its candidates).
    cascade: bool
    # Decode and mixed-step CUDA graphs (worker/cuda_graphs.py), on every pipeline stage:
    # capturable attention (every backend the model may run). Models with recurrent state get
    # decode graphs only (their state slots are a graph input; cuda_graphs.py); with several KV
    # cache groups, each group's block table and slots are (worker/graph_kv_groups.py).
    cuda_graphs: bool
    # LM head and greedy argmax inside small decode graphs (one TP rank: no collective inside;
    # the last pipeline stage, which holds the head).
    graph_head: bool
    # The compiled CPU forward (worker/cpu_compile.py says for which models).
    cpu_compile: bool
    # The drafter's own one-token CUDA graphs (worker/draft_graphs.py; draft_model, eagle,
    # eagle3; PAGEDSERVE_DRAFT_CUDA_GRAPHS=0 turns them off) where the target has CUDA graphs,
    # or eagle3's head, whose target runs eager only for its hooks (--enforce-eager holds it).
    draft_cuda_graphs: bool = False


def step_features(
    config: EngineConfig, device: torch.device, info: RankInfo, model: nn.Module, dtype: torch.dtype
) -> StepFeatures:
    """The features of a worker on `device` running the loaded `model`."""
    model_config = config.model
    name = attention_backend_name(
        device, model_config.attention_backend, config.cache.kv_fp8, dtype,
        getattr(model, "attention_sinks", False),
    )  # fmt: skip
    caps = backend_caps(name)
    is_cuda = device.type == "cuda"
    cuda_graphs = (
        is_cuda
        and not model_config.enforce_eager
        and model_config.pooling is None  # prefill only: the pooler reads eager hidden states
        and getattr(model, "cuda_graphs", True)  # False: its attention reads host metadata
        and all(c.cuda_graphs for c in caps)
    )
    spec = config.speculative
    draft_cuda_graphs = (
        config.settings.draft_cuda_graphs
        and spec is not None
        and spec.in_workers
        # eagle3's target runs eager (its hooks), its head need not
        and (
            cuda_graphs
            or (spec.method == "eagle3" and is_cuda and all(c.cuda_graphs for c in caps))
        )
    )
    return StepFeatures(
        cascade=is_cuda and any(c.cascade for c in caps) and fusion_enabled("cascade"),
        cuda_graphs=cuda_graphs,
        graph_head=(
            cuda_graphs
            and fusion_enabled("graph-head")
            and info.tp_size == 1
            and info.is_last_stage
        ),
        cpu_compile=(
            not is_encoder(model_config.hf)  # (encoders: plain torch, per-prompt attention)
            and eligible(config, device, model)
            and config.lora is None  # no LoRA inside
        ),
        draft_cuda_graphs=bool(draft_cuda_graphs),
    )
