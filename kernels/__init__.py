"""Attention, KV-cache writes, norms, rotary, activations: torch references and fast paths."""
