"""Paged attention: the backend interface and its one registry, the per-step metadata, the torch
reference, the backends (Triton, FlashAttention 4, CPU) and the choice among them.

Bottom to top, with no circle: `metadata` and `interface`; `reference`; the backends (`triton`,
`flash`, `cpu`) and the host-side `cascade`; `registry` (imports backends lazily, by name);
`cache_write`, `dispatch` (per step kind) and `selection` (start-up choice). This module imports
nothing, so config validation can read the registry without torch.
"""
