"""memsched: trace memory, plan placement, and run a hybrid CPU/GPU optimizer for PyTorch training."""

__version__ = "0.1.0"
