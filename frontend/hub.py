"""Models by Hugging Face hub id (`ORG/NAME`), as vLLM takes them: a local directory is used as
is; anything else is a hub id that huggingface_hub's `snapshot_download` resolves to a directory
of its cache (downloading what is missing, with a progress bar). It honours HF_HOME, HF_TOKEN and
HF_HUB_OFFLINE; `download_dir` is the cache directory (vLLM's `--download-dir`).

Only what serving reads is fetched (configs, safetensors, tokenizer and template files), not the
`.bin` / `.gguf` copies many repositories also carry. Every failure is one ValueError line.
"""

from __future__ import annotations

import os

from pagedserve.gguf_checkpoint import PACKAGED_MODELS

# The files a checkpoint directory needs here (config, weights, tokenizer, chat template).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
# The embedded tiny model (frontend/default_model/) that `launch` serves when given no --model.
DEFAULT_MODEL_NAME = "pagedserve-default"


def default_model_dir() -> str:
    return os.path.join(os.path.dirname(__file__), "default_model")


def resolve_model(
    name: str, revision: str | None = None, download_dir: str | None = None, flag: str = "--model"
) -> str:
    """The local directory of `name` (a directory, or a hub id fetched into the cache); a GGUF
    file or a packaged model (`smollm2`) is returned as it is, for `ModelConfig` to open."""
    if name in PACKAGED_MODELS or (os.path.isfile(name) and name.endswith(".gguf")):
        return name
    if os.path.isdir(name):
        if revision is not None:
            raise ValueError(f"--revision {revision!r} applies to hub ids; {name!r} is a directory")
        return name
    if name.count("/") > 1 or name.startswith((".", "/", "~")):
        raise ValueError(f"{flag} {name!r}: no such directory (and not a hub id like ORG/NAME)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    what = f"{flag} {name!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        return snapshot_download(
            name, revision=revision, cache_dir=download_dir, allow_patterns=ALLOW_PATTERNS
        )
    except LocalEntryNotFoundError:
        where = download_dir or _default_cache()
        raise ValueError(
            f"{what}: not in the local cache ({where}) and the hub cannot be reached"
            f"{' (HF_HUB_OFFLINE is set)' if _offline() else ''}"
        ) from None
    except HFValidationError:
        raise ValueError(f"{flag} {name!r}: no such directory (and not a hub id)") from None
    except Exception as e:  # repository or revision not found, gated, HTTP errors
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{what}: {first_line}") from None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _default_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
