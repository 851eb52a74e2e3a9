"""Which FP8 scheme a model runs: from `--quantization` and the checkpoint's `quantization_config`.

Pure Python (the core validates configs with it). Three sources, one internal form:

- `--quantization fp8` on a bf16/fp16/fp32 checkpoint: weights are quantized at load time to
  float8_e4m3fn with one scale per output channel ("channel").
- An HF `quant_method: fp8` checkpoint with `weight_block_size: [128, 128]` (Qwen3-*-FP8,
  DeepSeek-V3): fp8 weights plus `weight_scale_inv`, one float per 128 x 128 block ("block";
  despite its name a dequantization scale: w = w_fp8 * scale).
  Without a block size it is per-tensor (`weight_scale`), as AutoFP8 wrote them ("tensor").
- A compressed-tensors `float-quantized` checkpoint (llm-compressor's FP8 / FP8-dynamic): fp8
  weights plus `weight_scale`, per channel (`[out, 1]`) or per tensor (`[]` / `[1]`).

Activations are quantized at run time: per token, or per token and 128-column group for block
weights (the layout a block GEMM wants). Static activation scales are refused by name, as are
layers left unquantized other than the LM head (we keep embeddings and the LM head in the model
dtype anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("fp8",)
_HEAD_NAMES = {"lm_head", "re:.*lm_head", "model.embed_tokens"}
# Modules we keep in the model dtype whatever the scheme (routers, the shared expert's gate, the
# hybrids' b/a projections), as published FP8 MoE / hybrid checkpoints leave them, and parts we
# never load (vision tower, MTP head): a checkpoint may list them as unquantized.
_PLAIN_SUFFIXES = (
    "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba", "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
)  # fmt: skip
_UNLOADED_PARTS = ("mtp", "visual", "model.visual", "model.language_model.mtp")


@dataclass(frozen=True)
class Fp8Scheme:
    serialized: bool  # the checkpoint holds fp8 weights (else: quantized at load time)
    strategy: str  # "channel" | "tensor" | "block": the checkpoint's weight scale layout
    block: tuple[int, int] | None = None  # (rows, cols) of a weight block for "block"
    scale_name: str = "weight_scale"  # the checkpoint's scale tensor suffix

    @property
    def act_group(self) -> int | None:
        """Columns per activation scale (None: one scale per token)."""
        return self.block[1] if self.block is not None else None


def quant_scheme(hf: dict[str, Any], requested: str | None) -> Fp8Scheme | None:
    """The scheme for a model config and the `--quantization` flag (None: no quantization)."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(
            f"--quantization {requested!r} is not supported (supported: {', '.join(QUANTIZATIONS)})"
        )
    qc = hf.get("quantization_config")
    if qc is None:
        return Fp8Scheme(serialized=False, strategy="channel") if requested else None
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "mxfp4":  # gpt-oss's experts, dequantized at load (no FP8 scheme)
        return _mxfp4(hf, requested)
    raise ValueError(
        f"the checkpoint's quantization method {method!r} is not supported "
        "(supported: fp8, compressed-tensors float-quantized FP8, mxfp4 for gpt-oss)"
    )


def _mxfp4(hf: dict[str, Any], requested: str | None) -> None:
    if hf.get("model_type") != "gpt_oss":
        raise ValueError(
            f"MXFP4 weights are supported for gpt-oss's experts only, not {hf.get('model_type')!r}"
        )
    if requested is not None:
        raise ValueError(f"--quantization {requested} does not apply to an MXFP4 checkpoint")
    return None


def _hf_fp8(qc: dict[str, Any]) -> Fp8Scheme:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"fp8 checkpoint: activation_scheme {qc['activation_scheme']!r} is not supported "
            "(only dynamic activation scales)"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 checkpoint: fmt {qc['fmt']!r} is not supported (only e4m3)")
    _check_ignored(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme(serialized=True, strategy="tensor")
    if len(block) != 2 or any(int(b) < 1 for b in block):
        raise ValueError(f"fp8 checkpoint: weight_block_size {block} must be two positive ints")
    return Fp8Scheme(
        serialized=True, strategy="block", block=(int(block[0]), int(block[1])),
        scale_name="weight_scale_inv",
    )  # fmt: skip


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    if qc.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(
            f"compressed-tensors format {qc.get('format')!r} is not supported "
            "(only float-quantized)"
        )
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: {len(groups)} config groups (only one is supported)")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
        raise ValueError(f"compressed-tensors weights {weights} are not 8-bit float")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor") or not weights.get("symmetric", True):
        raise ValueError(
            f"compressed-tensors weight strategy {strategy!r} is not supported "
            "(only symmetric channel or tensor)"
        )
    if acts is None or not acts.get("dynamic") or acts.get("type") != "float":
        raise ValueError(
            "compressed-tensors: only dynamic float input activations are supported (static "
            "input_scale and weight-only schemes are not)"
        )
    _check_ignored(qc.get("ignore") or [])
    return Fp8Scheme(serialized=True, strategy=strategy)


def _kept_plain(name: str) -> bool:
    name = name.removeprefix("re:")
    if name in _HEAD_NAMES or name.startswith(_UNLOADED_PARTS):
        return True
    return any(name == s or name.endswith("." + s) for s in _PLAIN_SUFFIXES)


def _check_ignored(names: list[str]) -> None:
    others = [n for n in names if not _kept_plain(n)]
    if others:
        raise ValueError(
            f"the checkpoint leaves layers unquantized ({', '.join(others[:3])}); only the LM "
            "head, routers and the hybrids' b/a projections may be (other mixed quantized and "
            "plain layers are not supported)"
        )


def kv_cache_is_fp8(kv_cache_dtype: str) -> bool:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return kv_cache_dtype != "auto"
