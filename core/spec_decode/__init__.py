"""Speculative decoding's core side: proposers that draft from token ids, and the per-row rules
that decide when a row speculates (decoder.py)."""
