"""Kernel benchmarks and launch-config sweeps, run as `python -m pagedserve.benchmarks.kernels.X`
on a GPU (tests/gpu/device_run.sh names each step)."""
