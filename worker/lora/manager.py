"""Adapters on a worker: a host pool of loaded adapters and the layers' device slots.

`--max-cpu-loras` adapters stay loaded in host memory (least recently used first out);
`--max-loras` of them sit in device slots, which every wrapped layer holds (worker/lora/layer.py).
The core schedules at most `max_loras` distinct adapters per step, so `prepare` always finds
slots: an adapter of the step that has none takes a free slot, else the least recently used one
that this step does not need. Requests learn their adapter from `NewRequest.lora`.

The host pool holds what the core's LoRA gate says (core/lora_gate.py): a `LoadLoRA` drops the
adapters it names, then this reads the new one on a thread of its own (lora_checkpoint.py again to
find the tensors, then the safetensors file into CPU tensors in the LoRA dtype, B scaled; pinned
on CUDA), and `poll` puts it in the pool on the step loop's thread and reports it. The core
schedules no request of an adapter before every rank has it, so a step only ever copies an
adapter from the pool into a slot, never reads a file.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedserve.ipc.messages import LoRARequest, StepPlan
from pagedserve.kernels.backend import triton_available
from pagedserve.kernels.lora import SlotRows, group_layout, packed_offsets
from pagedserve.lora_checkpoint import AdapterSpec, LoRAAdapterError, read_adapter
from pagedserve.lora_config import LoRAConfig
from pagedserve.worker.grammar import _yield_cpu
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
        # one reader thread, at a lower CPU priority than the step loop (torch's copies and
        # safetensors' reads release the GIL)
        self._reader = ThreadPoolExecutor(1, "lora-read", initializer=_yield_cpu)
        self._reads: list[tuple[LoRARequest, Future[HostAdapter]]] = []
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
            size = packed_offsets(max_graph_tokens, config.max_loras)[2] + max_graph_tokens
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
        self.batch.ring.copy(host, out=self.graph_buf)  # pinned: it does not wait for the GPU
        self.graph_empty = self.batch.segments is None

    def _slot(self, lora: LoRARequest, needed: set[int]) -> int:
        """The adapter's slot; a slot holds its pool entry's tensors (a pool entry that leaves
        or changes frees its slot)."""
        adapter = self.host.get(lora.lora_int_id)
        assert adapter is not None and adapter.request == lora, "the core's gate loads it first"
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(lora.lora_int_id)
            return slot
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

    # ------------------------------------------------------------------ the host pool
    @property
    def loading(self) -> bool:
        return bool(self._reads)

    def submit(self, lora: LoRARequest, drop_ids: list[int]) -> None:
        """The core's `LoadLoRA`: drop `drop_ids` from the pool (no request uses them), then
        read `lora` on the reader thread (`poll` reports it)."""
        for lora_id in drop_ids:
            if self.host.pop(lora_id, None) is not None:
                self._free_slot(lora_id)
        self._reads.append((lora, self._reader.submit(self._read, lora)))

    def poll(self) -> list[tuple[int, str | None]]:
        """Reads that ended, in the pool now: (lora_int_id, None or why it failed) each."""
        done = [(lora, f) for lora, f in self._reads if f.done()]
        self._reads = [(lora, f) for lora, f in self._reads if not f.done()]
        answers = []
        for lora, future in done:
            error = future.exception()
            if error is None:
                self._install(future.result())
            elif not isinstance(error, LoRAAdapterError):
                error = f"LoRA adapter {lora.lora_name!r}: {type(error).__name__}: {error}"
            answers.append((lora.lora_int_id, None if error is None else str(error)))
        return answers

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _install(self, adapter: HostAdapter) -> None:
        lora_id = adapter.request.lora_int_id
        old = self.host.pop(lora_id, None)
        if old is not None and old.request != adapter.request:  # the id names another adapter
            self._free_slot(lora_id)
        self.host[lora_id] = adapter
        self.num_loads += 1

    def _free_slot(self, lora_id: int) -> None:
        """The adapter leaves its device slot with its pool entry (an eviction too)."""
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.num_evictions += 1

    def _read(self, lora: LoRARequest) -> HostAdapter:
        """On the reader thread: the adapter's tensors, ready for a slot's copy (A [r, in],
        B [out, r] times the scaling, in the LoRA dtype; pinned for an asynchronous copy)."""
        from safetensors.torch import load_file

        spec = read_adapter(lora.lora_name, lora.lora_path, self.hf, self.config.max_lora_rank)
        tensors = load_file(spec.weights_file)
        pin = self.device.type == "cuda"
        weights = {}
        for key, (a_name, b_name) in spec.tensors.items():
            a = tensors[a_name].to(self.dtype, copy=True)  # off the file's pages now
            b = (tensors[b_name].float() * spec.scaling).to(self.dtype)
            weights[key] = (a.pin_memory(), b.pin_memory()) if pin else (a, b)
        return HostAdapter(lora, spec, weights)
