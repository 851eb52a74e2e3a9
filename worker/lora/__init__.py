"""Multi-LoRA serving on the workers: per-layer adapter slots (layer.py) and the manager that
loads PEFT adapters into a host pool and device slots (manager.py)."""
