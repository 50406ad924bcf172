"""torch.compile and the warmup: compiled code runs eagerly while memsched traces, and compiles after.

Dynamo refuses to compile a frame it first meets under a Python dispatch mode (the warmup tracer is one:
"non-infra torch dispatch mode present") and does not try that frame again, so a model compiled before or
after ``attach`` would run eagerly for the whole run. During warmup memsched sets torch's compiler stance
to ``"force_eager"`` (``torch.compiler.set_stance``, torch >= 2.6): compiled code runs eagerly, and Dynamo
neither compiles nor gives up on anything. At the end of warmup (or at ``close()``) the previous stance comes
back and the next call compiles. Older torch has no stance: nothing is done there. The step timeline's hooks
on the root module read ``time.perf_counter``, which Dynamo cannot trace: they break the graph before and
after the model's forward (the forward itself stays one graph).

The stand-in device keeps a dispatch mode (its accounting) after warmup, so on ``sim:`` compiled code stays
eager (also after ``close()``: Dynamo does not try again a frame it gave up on); on CUDA and the CPU it
compiles. That cannot be lifted: the accounting must see every allocation, and code Inductor compiles
allocates its buffers without the dispatcher (a mode that lets Dynamo compile, with
``ignore_compile_internals``, sees only the ``out=`` kernels of compiled code). So the first compiled call
after warmup on the stand-in warns once per scheduler (:class:`StandInCompileWarning`, from
:class:`StandInCompileCheck`, a root forward pre-hook): a compiled model, ``model.compile()`` or a compiled
function that calls the model. It tells a compiled call by Dynamo's eval-frame callback being set (what
``torch.compiler.set_stance`` itself checks to refuse a change inside a compiled region); with a torch that
does not expose it, nothing is said.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch

import tracer
from policies.units import format_bytes
from tracer.hook_handles import Detachable


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


class StandInCompileWarning(UserWarning):
    """``torch.compile``'d code runs eagerly on the stand-in device (see the module docstring)."""


def _in_compiled_call() -> bool:
    """Inside a call of ``torch.compile``'d code that may compile (Dynamo's eval-frame callback is set; not
    under the ``force_eager`` stance, nor while Dynamo traces). ``False`` where this torch cannot tell."""
    get = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
    return get is not None and get() not in (None, False)


# Frames of torch, memsched and the tracer (the hooks' wrappers) between the user's call and the warning.
_MEMSCHED_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # not `import memsched`: a cycle
_SKIP_DIRS = (*(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, tracer)),
              _MEMSCHED_DIR + os.sep)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside torch and memsched (the user's call), for
    ``warnings.warn`` called from the frame that calls this."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_DIRS):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


class StandInCompileCheck:
    """A root forward pre-hook while the stand-in's accounting is active: the first forward run from
    ``torch.compile``'d code warns (:class:`StandInCompileWarning`), once.

    Args:
        capacity_bytes: the stand-in's capacity, bytes (named in the warning).
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.label = f"sim:{format_bytes(capacity_bytes)}"
        self.warned = False

    def __call__(self, _module: torch.nn.Module, _args: Any) -> None:
        if self.warned or torch.compiler.is_compiling() or not _in_compiled_call():
            return
        self.warned = True
        warnings.warn(
            f"memsched: torch.compile does not compile on the stand-in device {self.label}: its memory "
            "accounting is a torch dispatch mode, under which Dynamo compiles nothing, so compiled code runs "
            "eagerly on the stand-in (step times and memory are those of eager mode). device=\"cpu\" or a "
            "GPU (device=\"cuda\") compiles after the warmup steps.",
            StandInCompileWarning, stacklevel=_caller_stacklevel())


def warn_compiled_on_stand_in(model: torch.nn.Module, capacity_bytes: int) -> Any:
    """Install :class:`StandInCompileCheck` on ``model`` (the stand-in's capacity ``capacity_bytes``, bytes);
    returns the hook's handle (``.remove()``; the scheduler removes it at ``close()``). A copy of the model
    (``copy.deepcopy``, ``pickle``) gets an inert hook."""
    return model.register_forward_pre_hook(Detachable(StandInCompileCheck(capacity_bytes)))
