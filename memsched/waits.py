"""The next forward waits for the H2D copies of the parameters it may read (CUDA; elsewhere copies are
synchronous and nothing is installed).

Forward pre-hooks make the compute stream wait for a chunk's H2D copy at the first traced module that may read
its parameters (:mod:`memsched.first_use`). Before the trace exists (warmup) every module holding chunk
parameters, and the root, waits for all chunks. ``model.state_dict()`` waits for all chunks too. Anything else
that reads parameters outside a forward (an EMA, a functional call on a submodule) calls
:meth:`H2DWaits.synchronize` (``sched.synchronize()``) first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from memsched.chunks import ChunkStore
from memsched.first_use import first_use_owners
from memsched.transfers import Streams
from tracer.hook_handles import Detachable


class H2DWaits:
    """The wait hooks of one scheduler (see the module docstring); removed by :meth:`remove`."""

    def __init__(self, model: torch.nn.Module, store: ChunkStore, streams: Streams) -> None:
        self.model, self.store, self.streams = model, store, streams
        self._handles: list[Any] = []

    def install(self, traced: Sequence[str]) -> None:
        """(Re)install the hooks for the modules ``traced`` saw run, in first-call order (empty: warmup)."""
        self.remove()
        store = self.store
        by_module: dict[str, set[int]] = {}
        if traced:
            owners = first_use_owners(self.model, traced, list(store.params()))
            for p in store.params():
                by_module.setdefault(owners[id(p)], set()).add(store.param_chunk[id(p)].index)
        else:
            every = set(range(len(store.chunks)))
            for name, m in self.model.named_modules():
                if name == "" or any(id(p) in store.param_chunk for p in m.parameters(recurse=False)):
                    by_module[name] = every
        modules = dict(self.model.named_modules())
        for name, indices in by_module.items():
            hook = Detachable(self._hook(sorted(indices)))
            self._handles.append(modules[name].register_forward_pre_hook(hook, prepend=True))
        sync = Detachable(lambda *_a, **_k: self.synchronize())
        self._handles.append(self.model.register_state_dict_pre_hook(sync))

    def _hook(self, indices: list[int]) -> Callable[[torch.nn.Module, Any], None]:
        def wait(_module: torch.nn.Module, _args: Any) -> None:
            chunks = self.store.chunks
            self.streams.wait([chunks[i].h2d_event for i in indices])
        return wait

    def synchronize(self) -> None:
        """The current stream waits for every pending H2D copy. No-op without CUDA."""
        self.streams.wait([c.h2d_event for c in self.store.chunks])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
