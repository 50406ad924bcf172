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

[Note: one stance for every scheduler]
The stance is the process's. ``set_stance`` returns what restores the stance before it, so stances entered
by two schedulers whose warmups overlap (two models, a bench's interleaved runs) and left out of order would
restore the first one's ``force_eager`` last: every later compiled call of the process would run eagerly,
silently. So the schedulers share one hold: the first to start enters ``force_eager``, the last to stop
restores the stance from before the first.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_lock = threading.Lock()
_holders: set[int] = set()  # ids of the EagerDuringWarmup objects holding the stance now
_restore: list[Any] = []  # what restores the stance from before the first holder (while there are holders)


class EagerDuringWarmup:
    """Holds the ``force_eager`` stance from :meth:`start` to :meth:`stop` (idempotent; see the module
    docstring and [Note: one stance for every scheduler])."""

    def start(self) -> None:
        set_stance = getattr(torch.compiler, "set_stance", None)
        with _lock:
            if set_stance is None or id(self) in _holders:
                return
            if not _holders:
                _restore.append(set_stance("force_eager"))  # sets it now; keeps the previous stance
            _holders.add(id(self))

    def stop(self) -> None:
        with _lock:
            if id(self) not in _holders:
                return
            _holders.discard(id(self))
            if not _holders:
                _restore.pop().__exit__(None, None, None)  # the stance in force before the first start()

