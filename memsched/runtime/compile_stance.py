"""torch.compile and the warmup: compiled code runs eagerly while memsched traces, and compiles after.

Dynamo refuses to compile a frame it first meets under a Python dispatch mode (the warmup tracer is one:
"non-infra torch dispatch mode present") and does not try that frame again, so a model compiled before or
after ``attach`` would run eagerly for the whole run. During warmup memsched sets torch's compiler stance
to ``"force_eager"`` (``torch.compiler.set_stance``, torch >= 2.6): compiled code runs eagerly, and Dynamo
neither compiles nor gives up on anything. At the end of warmup (or at ``close()``) the previous stance comes
back and the next call compiles. Older torch has no stance: nothing is done there. The step timeline's hooks
on the root module read ``time.perf_counter``, which Dynamo cannot trace: they break the graph before and
after the model's forward (the forward itself stays one graph).

The stand-in device (``sim:``) is a real PyTorch device whose capacity is enforced by its allocator, not by a
dispatch mode, so compiled code compiles there after warmup too (Dynamo's ``eager`` and ``aot_eager``
backends; Inductor does not support the stand-in's PrivateUse1 device).
"""

from __future__ import annotations

from typing import Any

import torch


class EagerDuringWarmup:
    """Holds the ``force_eager`` stance from :meth:`start` to :meth:`stop` (idempotent; see the module
    docstring)."""

    def __init__(self) -> None:
        self._stance: Any = None

    def start(self) -> None:
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is not None and self._stance is None:
            self._stance = set_stance("force_eager")  # sets it now; keeps the previous stance to restore

    def stop(self) -> None:
        stance, self._stance = self._stance, None
        if stance is not None:
            stance.__exit__(None, None, None)  # the stance in force before start()

