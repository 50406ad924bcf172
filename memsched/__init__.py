"""memsched: trace memory, plan placement, and run a hybrid CPU/GPU optimizer for PyTorch training.

``sched = memsched.attach(model, policy="auto", device="sim:8GiB")`` packs the trainable parameters into
chunks, traces the first step(s), plans where each optimizer-state chunk lives and trains with
``sched.optimizer`` (a :class:`HybridAdamW`); see :mod:`memsched.scheduler`.

The names below are imported on first use (PEP 562), not with the package: ``import memsched.cli.main`` (and
so ``memsched --help``) must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# torch imported already: reserve the stand-in's autograd queue before any backward (devices/sim_backend.py)
if "torch" in __import__("sys").modules:
    importlib.import_module("memsched.devices.sim_backend").reserve_autograd_queue()

if TYPE_CHECKING:
    from memsched.optim.hybrid_adamw import HybridAdamW
    from memsched.scheduler import Scheduler, attach

# Public name -> the module that defines it.
_LAZY = {"HybridAdamW": "memsched.optim.hybrid_adamw", "Scheduler": "memsched.scheduler",
         "attach": "memsched.scheduler"}

__all__ = ["HybridAdamW", "Scheduler", "attach", "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memsched' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
