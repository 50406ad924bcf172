"""A parameter read before its module's wait waits at the read itself.

The forward pre-hooks of :mod:`memsched.runtime.waits` wait for each host chunk at the first traced module
that may read its parameters (:mod:`memsched.planning.first_use`, from the warmup trace). Code can read a
parameter before that module runs: a parent reads a child's weight and then calls the child, a tied weight is
read first by the other module on some steps, a module's weight is read directly on steps where the module is
not called. That read would see the previous step's values (the chunk's overlapped CPU update, or its H2D copy
on CUDA, still in flight): a silently wrong model. So while the root module's forward runs with host chunks
not yet waited for in it, a ``TorchFunctionMode`` (``torch.overrides``) looks at the tensors each torch
function receives (also inside list and tuple arguments: ``torch.cat``, the flat weights of ``nn.LSTM``) and
waits for the chunk of any such parameter before the function runs. It is entered at the root's forward
pre-hook, left at the first module wait after which every guarded chunk was waited for, else at the root's
forward hook.

Between an overlapped ``step()`` and the next forward a guard of its own waits for the chunks still being
updated (:meth:`memsched.runtime.waits.H2DWaits.guard_between_steps`). Not covered: reads from another thread
(call ``sched.synchronize()`` first, :meth:`memsched.Scheduler.synchronize`). Not in compiled
code: there the root (or each compiled region) waits for every chunk before it starts
(:mod:`memsched.runtime.waits`). DeepSpeed ZeRO-3 meets the same problem with ``register_external_parameter``,
declared by the user; here the reads find themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tracer.ops import is_metadata


class ReadGuard(TorchFunctionMode):
    """Waits for the chunk of a parameter a torch function reads, while that chunk is in ``unwaited``.

    Args:
        wait_chunk: ``wait_chunk(chunk_index, what)``: block (overlapped CPU update) and make the compute
            stream wait (H2D copy) for one chunk; ``what`` names the read for the step timeline.
        grouped: call ``wait_chunk([(chunk_index, parameter), ...], what)`` instead, once per torch function
            with every guarded parameter it receives (they must all be ready together).
    """

    def __init__(self, wait_chunk: Callable[..., None], *, grouped: bool = False) -> None:
        super().__init__()
        self.wait_chunk = wait_chunk
        # grouped: wait_chunk([(chunk, parameter), ...], what) once per call, with every parameter it reads
        self.grouped = grouped
        self.unwaited: dict[int, int] = {}  # id(parameter) -> its chunk, not yet waited for in this forward

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.unwaited and not torch.compiler.is_compiling():
            found: list[tuple[int, Any]] = []
            self._find(args, found)
            self._find(kwargs.values(), found)
            if found and not is_metadata(func):
                what = getattr(func, "__name__", str(func))
                if self.grouped:
                    self.wait_chunk(found, what)
                else:
                    for i, a in found:
                        if id(a) in self.unwaited:  # wait_chunk drops chunk i's parameters from unwaited
                            self.wait_chunk(i, what)
        return func(*args, **kwargs)

    def _find(self, values: Iterable[Any], found: list[tuple[int, Any]]) -> None:
        for a in values:
            if type(a) in (list, tuple):
                self._find(a, found)
                continue
            i = self.unwaited.get(id(a))
            if i is not None:
                found.append((i, a))

    def push(self, unwaited: dict[int, int]) -> None:
        """Enter the mode (the root's forward pre-hook), guarding ``unwaited``: ``id(parameter) -> chunk``."""
        self.unwaited = dict(unwaited)
        self.__enter__()

    def watch(self, params: Iterable[Any], chunk: int) -> None:
        """``params`` (of ``chunk``) need their wait again (their chunk left the device)."""
        for p in params:
            self.unwaited[id(p)] = chunk

    def waited(self, params: Iterable[Any]) -> None:
        """``params`` were waited for: their reads need no wait any more."""
        for p in params:
            self.unwaited.pop(id(p), None)

    def waited_all(self) -> None:
        """Every chunk was waited for."""
        self.unwaited.clear()

    @property
    def guarding(self) -> bool:
        """Some parameter read still needs a wait."""
        return bool(self.unwaited)

    def on_top(self) -> bool:
        """Whether the mode is the innermost torch function mode of this thread (it can be left now)."""
        n = torch._C._len_torch_function_stack()
        return n > 0 and torch._C._get_function_stack_at(n - 1) is self

    def pop(self) -> None:
        """Leave the mode (the root's forward hook). If a mode entered in the forward was not left (ours is no
        longer on top of the stack), the guard stays there but only forwards calls from then on."""
        self.unwaited.clear()
        if self.on_top():
            self.__exit__(None, None, None)
