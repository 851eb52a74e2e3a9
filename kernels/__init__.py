"""Ops as functions with their torch references and fast paths (Triton, C++ on CPU): attention
(kernels/attention/), KV-cache writes, norms, rotary, activations, matmuls, FP8, experts. No
nn.Module here: the layers are worker/layers/."""
