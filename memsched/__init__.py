"""memsched: trace memory, plan placement, and run a hybrid CPU/GPU optimizer for PyTorch training.

``sched = memsched.attach(model, policy="auto", device="sim:8GiB")`` packs the trainable parameters into
chunks, traces the first step(s), plans where each optimizer-state chunk lives and trains with
``sched.optimizer`` (a :class:`HybridAdamW`); see :mod:`memsched.scheduler`.
"""

__version__ = "0.1.0"

from memsched.optimizer import HybridAdamW  # noqa: E402
from memsched.scheduler import Scheduler, attach  # noqa: E402

__all__ = ["HybridAdamW", "Scheduler", "attach", "__version__"]
