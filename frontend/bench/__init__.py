"""`pagedserve bench ...`: offline throughput/latency/startup (offline.py) and online serving
(serve.py), flags shaped like `vllm bench`."""
