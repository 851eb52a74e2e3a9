"""The compiled CPU forward: a small model's step on a CPU is interpreter and dispatch time (the
embedded model's decode step is ~1,000 aten calls for 4 layers whose matmuls take microseconds),
so, as vLLM's CPU build does with inductor, the stage's forward is compiled ahead of time into
C++ (AOTInductor): norms, rotary, residual adds and the activation fuse into loops, and a step
runs without Python between them.

Attention stays eager. Each layer's `Attention.attend` (the cache write and the batched SDPA
backend, whose layout changes every step) is one opaque op, `pagedserve::attention`, that the
compiled code calls back; it finds the step's KV caches and metadata in the `StepContext` the
runner opens around the call (per-step state behind a context manager, not graph inputs). Its
decode rows run the C++ kernel of kernels/cpu_native.py, which reads the paged cache in place.

Start-up stays a few seconds. The package holds no weights: they are bound at load time to the
live model's own tensors (`user_managed`; constants derived from them are folded then), so one
package serves every checkpoint of a shape, and it is cached on disk under a key of everything
that shapes the code (torch, our sources, the model's config, dtype, the CPU's vector ISA). When
the package is missing, a niced child process (`python -m pagedserve.worker.cpu_compile`) builds
it from a dummy-weight copy of the model while the worker serves eagerly; the worker switches at
its first step after the child is done.

Used on a CPU with one rank (no collectives inside the graph), for dense float32 models (MoE
routing has data-dependent shapes; a bfloat16 package failed at run time with float and bfloat16
operands in one addmm, not investigated yet) where no weight of the stage is packed for oneDNN
(kernels/cpu_linear.py: such a model is matmul-bound, and binding the package's weights needs
them plain), unless `--enforce-eager` or `PAGEDSERVE_CPU_COMPILE=off`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

import pagedserve
from pagedserve import settings
from pagedserve.config import EngineConfig
from pagedserve.hf_config import MOE_MODEL_TYPES, has_recurrent_state
from pagedserve.ipc.process import Child, die_with_parent, spawn
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.worker.layers.attention import Attention

logger = logging.getLogger("pagedserve.worker")

MAX_TOKENS = 1 << 16  # the largest step the package takes; larger ones run eagerly
_FORMAT = 3  # bump when what a package holds changes
INDUCTOR_CONFIGS = {
    "aot_inductor.package_constants_in_so": False,  # weights come from the live model
    "aot_inductor.use_runtime_constant_folding": True,  # so nothing derived from them is baked in
    "compile_threads": 1,
}


@dataclass
class StepContext:
    """What `pagedserve::attention` needs that the compiled graph does not carry."""

    layers: list[Attention]
    kv_caches: list[torch.Tensor]
    meta: AttentionMetadata | None = None


_current: StepContext | None = None


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[None]:
    global _current
    _current = ctx
    try:
        yield
    finally:
        _current = None


_LIB = torch.library.Library("pagedserve", "DEF")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    ctx = _current
    assert ctx is not None and ctx.meta is not None, "the compiled forward runs in a step_context"
    return ctx.layers[layer].attend(q, k, v, ctx.kv_caches[layer], ctx.meta)


_LIB.impl("attention", _attention, "CPU")
torch.library.register_fake("pagedserve::attention", lambda q, k, v, layer: torch.empty_like(q))


class Stage(nn.Module):
    """The stage's forward as the package sees it: token ids and positions in, hidden out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model  # LlamaModel or a variant: embedding, layers, final norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        placeholders = [torch.empty(0)] * len(self.model.layers)  # attention reads the context
        return self.model(input_ids, positions, placeholders, None)


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def eligible(config: EngineConfig, device: torch.device, model: nn.Module) -> bool:
    """Whether this stage gets a compiled forward (see the module docstring)."""
    parallel = config.parallel
    return (
        device.type == "cpu"
        and compile_setting() == "auto"
        and not config.model.enforce_eager
        and parallel.tensor_parallel_size == 1
        and parallel.pipeline_parallel_size == 1
        and config.model.hf.get("model_type") not in MOE_MODEL_TYPES  # routing: data-dependent
        and not has_recurrent_state(config.model.hf)  # per-row state loops: data-dependent
        and config.model.resolved_dtype == "float32"  # a bfloat16 package mixed dtypes in addmm
        and all(getattr(m, "packed", None) is None for m in model.model.modules())
    )


def compile_setting() -> str:
    return settings.current().cpu_compile


@functools.cache
def _sources_digest() -> str:
    root = pathlib.Path(pagedserve.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "tests" not in path.parts:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def package_path(config: EngineConfig) -> str:
    """Where the forward's package for this model lives (it may not exist yet)."""
    return _cache_path("forward", hf=config.model.hf, dtype=config.model.resolved_dtype)


def _cache_path(kind: str, **key: object) -> str:
    code = {
        "format": _FORMAT,
        "torch": torch.__version__,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "sources": _sources_digest(),
    }
    digest = hashlib.sha256(json.dumps(code | key, sort_keys=True).encode()).hexdigest()
    return os.path.join(settings.current().cache_dir, "cpu_compiled", f"{kind}-{digest[:24]}.pt2")


def build_package(config: EngineConfig) -> None:
    """Export the model's forward (dummy weights: the package keeps none) and compile it."""
    from pagedserve.worker.models import build_model

    dtype = getattr(torch, config.model.resolved_dtype)
    model_config = dataclasses.replace(config.model, load_format="dummy")
    model = build_model(model_config, dtype, torch.device("cpu"))
    path = package_path(config)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for i, layer in enumerate(attention_layers(model.model)):
        layer.opaque_index = i
    # Two tensors: export traces one example tensor passed twice as one input.
    example = (torch.zeros(4, dtype=torch.long), torch.arange(4))
    tokens = torch.export.Dim("num_tokens", min=1, max=MAX_TOKENS)
    with torch.no_grad():
        program = torch.export.export(
            Stage(model.model), example, dynamic_shapes=({0: tokens}, {0: tokens})
        )
    _compile(program, path)


def _compile(program: torch.export.ExportedProgram, path: str) -> None:
    partial = f"{path.removesuffix('.pt2')}.{os.getpid()}.partial.pt2"
    torch._inductor.aoti_compile_and_package(
        program, package_path=partial, inductor_configs=INDUCTOR_CONFIGS
    )
    os.replace(partial, path)  # whole or absent, for a worker polling for it


class CompiledForward:
    """The stage's forward from a package, bound to the live model's weights and KV caches."""

    def __init__(self, path: str, model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
        # The C++ loader itself: `torch._inductor.aoti_load_package` would import inductor
        # (~1 s of start-up) and parse the call spec on every call; our inputs and output are
        # two tensors and one.
        self.loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        stage = Stage(model.model)
        # Every name a tensor goes by: the layers share one rotary table (and a model may tie
        # its embeddings), and the package may name a shared tensor by any of its owners.
        tensors = dict(stage.named_parameters(remove_duplicate=False))
        tensors |= dict(stage.named_buffers(remove_duplicate=False))
        wanted = [n for n in self.loader.get_constant_fqns() if not n.startswith("_FOLDED")]
        missing = [n for n in wanted if n not in tensors]
        if missing:
            raise ValueError(f"the compiled package wants tensors the model lacks: {missing[:3]}")
        # (constants, use the inactive buffer, check full update, user managed, allow h2d copy)
        self.loader.load_constants({n: tensors[n] for n in wanted}, False, False, True, False)
        self.context = StepContext(attention_layers(model.model), kv_caches)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [T, H]
        self.context.meta = meta
        with step_context(self.context):
            return self.loader.boxed_run([input_ids, positions])[0]


class CpuCompiler:
    """The runner's handle: `forward()` is the compiled forward once it exists, else None."""

    def __init__(self, config: EngineConfig, model: nn.Module, kv_caches: list[torch.Tensor]):
        self.model, self.kv_caches = model, kv_caches
        self.path = package_path(config)
        self.child: Child | None = None
        self.compiled: CompiledForward | None = None
        self.started = time.perf_counter()
        if os.path.exists(self.path):
            self._load()
        else:
            self.child = spawn("pagedserve.worker.cpu_compile", ["--config", config.to_json()],
                               "CPU compile")  # fmt: skip
            _say("compiling the CPU forward in the background (once per model shape, ~20 s); "
                 "serving eagerly meanwhile")  # fmt: skip

    def forward(self) -> CompiledForward | None:
        if self.child is not None and self.child.proc.poll() is not None:
            ended, self.child = self.child, None
            if os.path.exists(self.path):
                self._load()
            else:
                logger.warning("%s: staying eager", ended.death_message())
        return self.compiled

    def _load(self) -> None:
        try:
            self.compiled = CompiledForward(self.path, self.model, self.kv_caches)
        except Exception as e:  # a package this torch cannot load: serve eagerly, say why
            logger.warning("compiled CPU forward %s not used: %s", self.path, e)
            return
        seconds = time.perf_counter() - self.started
        _say(f"compiled CPU forward in use after {seconds:.1f} s ({self.path})")


def _say(text: str) -> None:
    print(f"pagedserve: {text}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    die_with_parent(args.parent_pid)
    os.nice(10)  # serving comes first
    torch.set_num_threads(1)
    config = EngineConfig.from_json(args.config)
    settings.activate(config.settings)
    build_package(config)


if __name__ == "__main__":
    sys.exit(main())
