"""Adapters on a worker: a host pool of loaded adapters and the layers' device slots.

`--max-cpu-loras` adapters stay loaded in host memory (least recently used first out);
`--max-loras` of them sit in device slots, which every wrapped layer holds (worker/lora/layer.py).
The core schedules at most `max_loras` distinct adapters per step, so `prepare` always finds
slots: an adapter of the step that has none takes a free slot, else the least recently used one
that this step does not need. Requests learn their adapter from `NewRequest.lora`; an adapter
is read here on first use (the API server checked it against the model when it was loaded, with
lora_checkpoint.py, which this reads again to find the tensors).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedserve.config import LoRAConfig
from pagedserve.ipc.messages import LoRARequest, StepPlan
from pagedserve.kernels.backend import triton_available
from pagedserve.kernels.lora import SlotRows, group_layout
from pagedserve.lora_checkpoint import AdapterSpec, read_adapter
from pagedserve.worker.layers.quant_linear import LinearBase
from pagedserve.worker.lora.layer import LoRABatch, LoRASlots

# our layer -> the checkpoint modules of its parts, and the name of the fused module
TARGETS = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    "gate_up_proj": (("gate_proj", "up_proj"), "gate_up_proj"),
    "o_proj": (("o_proj",), None),
    "down_proj": (("down_proj",), None),
}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class HostAdapter:
    """An adapter in host memory: (layer, module) -> (A [r, in], B [out, r] scaled)."""

    request: LoRARequest
    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        model: nn.Module,
        hf: dict,
        device: torch.device,
        model_dtype: torch.dtype,
        max_graph_tokens: int,  # the most tokens a CUDA graph runs
    ) -> None:
        self.config, self.hf, self.device = config, hf, device
        self.dtype = model_dtype if config.lora_dtype == "auto" else _DTYPES[config.lora_dtype]
        self.batch = LoRABatch(device)
        self.layers: dict[tuple[int, str], LoRASlots] = {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in TARGETS or not isinstance(module, LinearBase):
                continue
            start, size = module.lora_in_shard()
            module.lora = LoRASlots(
                module.lora_parts(), size, (start, size), config.max_loras,
                config.max_lora_rank, self.dtype, device, self.batch,
            )  # fmt: skip
            self.layers[(int(name.split(".")[2]), leaf)] = module.lora
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()  # LRU first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.free_slots = list(range(config.max_loras - 1, -1, -1))
        self.lora_of: dict[str, LoRARequest] = {}  # req_id -> its adapter, requests in the batch
        self.num_loads = 0
        self.num_evictions = 0
        # CUDA graphs (decode and mixed) hold the LoRA pair over one static buffer in
        # `group_layout`'s form, written before every replay (`stage_graph`): the grid is the
        # graph's token count over `max_loras` groups, unused groups at slot -1 (the kernels
        # skip them). Only where lora_apply takes the Triton pair: the reference's row groups
        # are host data, which a graph would bake in.
        self.in_graphs = (
            device.type == "cuda"
            and triton_available()
            and self.dtype in (torch.float16, torch.bfloat16)
        )
        self.graph_rows = max_graph_tokens
        if self.in_graphs:
            size = max_graph_tokens + 2 * config.max_loras + 1
            self.graph_buf = torch.zeros(size, dtype=torch.int32, device=device)
            self.graph_empty = False  # whether it holds no rows (every group at slot -1)

    def track(self, plan: StepPlan) -> None:
        """Follow the persistent batch: who leaves, who joins with which adapter."""
        for req_id in plan.finished_ids:
            self.lora_of.pop(req_id, None)
        for new in plan.new_requests:
            if new.lora is not None:
                self.lora_of[new.req_id] = new.lora

    def prepare(self, scheduled_ids: list[str], query_start_loc: np.ndarray) -> None:
        """Slots for this step's adapters, and which rows use which (`batch`)."""
        loras = [self.lora_of.get(req_id) for req_id in scheduled_ids]
        needed = {lora.lora_int_id for lora in loras if lora is not None}
        if not needed:
            self.batch.set()
            return
        assert len(needed) <= self.config.max_loras, "the core schedules within max_loras"
        seg_slots = [-1 if lora is None else self._slot(lora, needed) for lora in loras]
        self.batch.set(segments=(query_start_loc, seg_slots))

    def capture_rows(self, num_tokens: int) -> None:
        """Before a CUDA graph's capture: its LoRA reads the static buffer (none without it)."""
        self.batch.set()
        if self.in_graphs:
            rows = SlotRows(self.graph_buf, self.graph_rows, self.config.max_loras, num_tokens)
            self.batch.set(static=rows)

    def stage_graph(self) -> None:
        """Before a graph's replay: this step's groups into the static buffer (one copy)."""
        if self.batch.segments is None and self.graph_empty:
            return
        segments = self.batch.segments or ([0], [])
        host, _, _ = group_layout(*segments, self.graph_rows, self.config.max_loras)
        self.graph_buf.copy_(torch.from_numpy(host), non_blocking=True)
        self.graph_empty = self.batch.segments is None

    def _slot(self, lora: LoRARequest, needed: set[int]) -> int:
        held = self.host.get(lora.lora_int_id)
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is not None and held is not None and held.request == lora:
            self.slot_of.move_to_end(lora.lora_int_id)
            return slot
        adapter = self._load(lora)
        if slot is None:
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                victim = next(i for i in self.slot_of if i not in needed)
                slot = self.slot_of.pop(victim)
                self.num_evictions += 1
        self.slot_of[lora.lora_int_id] = slot
        self.slot_of.move_to_end(lora.lora_int_id)
        for layer in self.layers.values():
            layer.clear(slot)
        for (layer_idx, module), (a, b) in adapter.weights.items():
            target = self._target(layer_idx, module)
            if target is None:
                continue  # a layer of another pipeline stage
            slots, part, parts = target
            slots.set_part(slot, part, a.to(self.device), b.to(self.device), parts)
        self._trim_host()
        return slot

    def _target(self, layer_idx: int, module: str) -> tuple[LoRASlots, int, list[int]] | None:
        """(the layer's slots, the part whose A columns it uses, the output parts B fills)."""
        for ours, (modules, fused) in TARGETS.items():
            slots = self.layers.get((layer_idx, ours))
            if module == fused:
                return None if slots is None else (slots, 0, list(range(len(modules))))
            if module in modules:
                i = modules.index(module)
                return None if slots is None else (slots, i, [i])
        raise AssertionError(f"lora_checkpoint admitted module {module!r}")

    def _load(self, lora: LoRARequest) -> HostAdapter:
        """The adapter in the host pool (read from disk unless it is there already)."""
        held = self.host.get(lora.lora_int_id)
        if held is not None and held.request == lora:
            self.host.move_to_end(lora.lora_int_id)
            return held
        if held is not None:  # the same id now names another adapter: forget the old one
            self.host.pop(lora.lora_int_id)
            self.slot_of.pop(lora.lora_int_id, None)
        from safetensors.torch import load_file

        spec = read_adapter(lora.lora_name, lora.lora_path, self.hf, self.config.max_lora_rank)
        tensors = load_file(spec.weights_file)
        weights = {}
        for key, (a_name, b_name) in spec.tensors.items():
            a = tensors[a_name].to(self.dtype)
            b = (tensors[b_name].float() * spec.scaling).to(self.dtype)
            weights[key] = (a, b)
        adapter = HostAdapter(lora, spec, weights)
        self.host[lora.lora_int_id] = adapter
        self.num_loads += 1
        return adapter

    def _trim_host(self) -> None:
        """Drop least recently used adapters beyond `max_cpu_loras`, never one in a slot or one
        a request in the batch uses (it may need it again after its slot went to another: an
        adapter unloaded from the API, its files since gone, must not break its requests); so
        the pool may run over while more adapters than that are in use."""
        in_use = set(self.slot_of) | {lora.lora_int_id for lora in self.lora_of.values()}
        for victim in [i for i in self.host if i not in in_use]:
            if len(self.host) <= self.config.max_cpu_loras:
                break
            self.host.pop(victim)
