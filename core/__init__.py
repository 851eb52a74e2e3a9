"""EngineCore: scheduler, request state, KV block pool, prefix cache.

Pure Python (stdlib + msgspec): no torch, no zmq, no numpy; tests/test_core_pure.py asserts it.
"""
