"""Benchmarks, above everything they measure (they may import any layer): `pagedserve bench ...`
(cli.py: offline throughput/latency/startup in offline.py, online serving in serve.py, structured
outputs in structured.py; flags shaped like `vllm bench`), the FP8 accuracy check
(fp8_accuracy.py) and the kernel benchmarks (kernels/). Helpers they share are in common.py."""
