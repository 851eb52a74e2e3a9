"""Where pagedserve keeps what it derives once and reuses across starts (GGUF metadata,
FlashAttention's compiled kernels, compiled CPU forwards): `$PAGEDSERVE_CACHE`, else
`$XDG_CACHE_HOME/pagedserve`, else `~/.cache/pagedserve`."""

from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("PAGEDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve"
    )
