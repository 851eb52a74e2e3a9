"""GGUF weights, dequantized once per file and dtype.

The first load of a GGUF file dequantizes it (`loader.iter_gguf`: tens of seconds for a 135M
model on 2 cores, most of it parsing the file) and streams each tensor, in the serving dtype, to a
temporary data file while the model takes it. Only after the last tensor is the safetensors file
(header, then that data) assembled under a temporary name and renamed into place
(`gguf_checkpoint.weights_cache_file`), so a crashed or interrupted start leaves no half cache.
Later loads memory-map that file as any safetensors checkpoint and import neither gguf nor
transformers. Ranks that race on a first start write the same bytes; the last rename wins. A
cache that cannot be written (read-only or full disk) costs a warning, not the start.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from pagedserve.gguf_checkpoint import weights_cache_file
from pagedserve.worker.loader import iter_gguf

logger = logging.getLogger(__name__)
ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def gguf_weights(gguf_file: str, hf_dir: str, dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    """(HF checkpoint name, tensor or lazy slice in `dtype`) for every tensor of `gguf_file`:
    from the cache when it holds them, else dequantized and written to the cache on the way."""
    try:
        path = weights_cache_file(gguf_file, hf_dir, str(dtype).removeprefix("torch."))
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as e:  # the metadata directory is read-only: no cache, no SHA-256 record
        logger.warning("GGUF weights cache unusable (%s); dequantizing %s", e, gguf_file)
        yield from ((n, t.to(dtype)) for n, t in iter_gguf(gguf_file, hf_dir))
        return
    cached = _open(path)
    if cached is None:
        yield from _write_through(iter_gguf(gguf_file, hf_dir), path, dtype)
        return
    with cached as f:
        for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
            yield name, f.get_slice(name)


def _open(path: str) -> Any:
    """The cache file, opened (memory-mapped) and its header checked; None if absent or damaged
    (a damaged one is written again)."""
    if not os.path.isfile(path):
        return None
    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as e:
        logger.warning("GGUF weights cache %s is damaged (%s); writing it again", path, e)
        return None


def _write_through(
    weights: Iterator[tuple[str, torch.Tensor]], path: str, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` converted to `dtype`, each also appended to a data file (unlinked: it is gone
    when closed, whatever happens); once all have passed, the safetensors file at `path`.
    Caching stops (with a warning) at the first OSError; the weights keep coming."""
    header: dict[str, Any] = {}
    offset = 0
    with tempfile.TemporaryFile(dir=os.path.dirname(path)) as data:
        writing = True
        for name, tensor in weights:
            tensor = tensor.to(dtype).contiguous()
            if writing:
                nbytes = tensor.numel() * tensor.element_size()
                meta = {"dtype": ST_DTYPES[dtype], "shape": list(tensor.shape)}
                header[name] = {**meta, "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
                writing = _append(data, tensor, path)
            yield name, tensor
        if writing:
            _assemble(header, data, path)


def _append(data: BinaryIO, tensor: torch.Tensor, path: str) -> bool:
    """Write the tensor's bytes; False (and a warning) if that fails: no cache this time."""
    try:
        data.write(tensor.view(-1).view(torch.uint8).numpy().data)
        return True
    except OSError as e:
        logger.warning("cannot cache GGUF weights at %s (%s); serving without", path, e)
        return False


def _assemble(header: dict[str, Any], data: BinaryIO, path: str) -> None:
    """safetensors' layout: the header's length (u64, little-endian), the JSON header (padded
    with spaces to 8 bytes), the data; written beside `path` and renamed onto it."""
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    fd, staging = tempfile.mkstemp(prefix=".weights-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text.encode())
            data.seek(0)
            while chunk := data.read(64 << 20):
                out.write(chunk)
        os.replace(staging, path)
    except OSError as e:
        os.unlink(staging)
        logger.warning("cannot cache GGUF weights at %s (%s); serving without", path, e)
