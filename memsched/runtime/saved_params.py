"""The saved tensors of the parameter fetcher: autograd's saved parameters replaced by tokens.

:class:`SavedParams` owns the ``torch.autograd.graph.saved_tensors_hooks`` of one
:class:`memsched.runtime.param_fetch.ParamFetcher` and what they need: the storages they replace (every
chunk's device buffer, :meth:`SavedParams.watch`), the forward's hooks (:meth:`SavedParams.enter_forward` at
the root's forward begin, :meth:`SavedParams.exit_forward` at its end) and the same hooks between steps
(:meth:`SavedParams.push_between` from a forward's end or attach, :meth:`SavedParams.pop_between` at the next
forward's begin: [Note: saved tensors between steps]). Its lifecycle: live from the fetcher's construction,
inert from :meth:`SavedParams.remove` (``close()``): hooks another context pushed over then pass every tensor
through and come off as soon as they are on top again (:func:`_drain_removed`).

While a forward runs, a saved parameter, or a saved view of one, is packed as a :class:`_Saved` token naming
its parameter and its place in it ([Note: saved tensors across a re-plan]); the unpack hands the parameter to
the fetcher's backward read (``read``), which fetches its chunk, and rebuilds the view from where the
parameter is then. So autograd never holds a chunk's device buffer between forward and backward, and a
parameter swapped meanwhile cannot break a saved tensor (the failure of in-place parameter swaps in
transformers #47254 and DeepSpeed #8148). A saved tensor that modified its parameter in place since is
refused, as autograd refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memsched.chunks import Chunk, ChunkStore


@dataclass
class _Saved:
    """What a saved tensor in a chunk's buffer is replaced by while backward has not read it yet: resolved at
    the unpack through the parameter (its chunk then, which a re-plan or a re-pack since may have changed)."""

    param: torch.nn.Parameter  # the parameter itself (``view`` None), or the one whose slot the view is in
    version: int  # the parameter's version counter when it was saved
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None  # size, stride, offset in the parameter's slot
    values: torch.Tensor | None = None  # saved between steps from the chunk's host buffer: those values


@dataclass
class _Plain:
    """A saved tensor outside the chunks, with its version counter when saved (checked at the unpack).
    Detached (its storage and version counter shared): an output saved by its own node would otherwise hold
    that node, a reference cycle only the garbage collector frees; autograd gives an unpacked output its node
    back."""

    tensor: torch.Tensor
    version: int


class SavedParams:
    """The fetcher's saved-tensor hooks (see the module docstring).

    Args:
        store: the chunks.
        read: ``f(parameter)``: backward reads a saved parameter now (its chunk is made ready on the device).

    Attributes:
        removed: the hooks are inert (``close()``): they pass every tensor through.
    """

    def __init__(self, store: ChunkStore, read: Callable[[torch.nn.Parameter], None]) -> None:
        self._store = store
        self._read = read
        self._storage: dict[int, Chunk] = {}  # id(untyped storage) of a watched chunk's buffer -> chunk
        self._forward: Any = None  # the forward's saved-tensor hooks
        self._between: Any = None  # the same hooks from a forward's end to the next one's begin
        self.removed = False

    # ---- the storages replaced ----------------------------------------------------------------------------
    def watch(self) -> None:
        """The storages the hooks replace: every chunk's device buffer ([Note: saved tensors across a
        re-plan])."""
        self._storage = {id(c.data.untyped_storage()): c for c in self._store.chunks if c.data is not None}

    def watch_buffer(self, c: Chunk, data: torch.Tensor) -> None:
        """``data`` is ``c``'s device buffer now (fetched)."""
        self._storage[id(data.untyped_storage())] = c

    def unwatch(self, c: Chunk) -> None:
        """``c``'s device buffer leaves (evicted)."""
        self._storage.pop(id(c.data.untyped_storage()), None)

    # ---- the hooks on this thread's stack -----------------------------------------------------------------
    def enter_forward(self) -> None:
        """The root's forward begins (recording a graph): chunks fetched during the forward are saved through
        these hooks too."""
        self._forward = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._forward.__enter__()

    def exit_forward(self) -> None:
        """The root's forward ends (or ``close()``)."""
        if self._forward is not None:
            hooks, self._forward = self._forward, None
            hooks.__exit__(None, None, None)

    def push_between(self) -> None:
        """[Note: saved tensors between steps]
        A loss term computed outside the forward (an L2 penalty before or after ``model(x)``) reads the
        parameters between steps, where those of host chunks are host views; autograd saves the parameter
        itself, and by backward the forward has bound it to its device buffer or, its chunk being away, to
        its absent view. So from a forward's end (and from attach) to the next forward's begin the same
        saved-tensor hooks are on this thread's stack: such a parameter is saved as a token of its host
        values, which nothing changes before the step. Pushed and popped in stack order: the hooks come off at
        the next forward's begin only when they are on top (a user's own hooks pushed since stay above
        them, and ours wait)."""
        if self._between is None and not self.removed:
            self._between = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self._between.__enter__()

    def pop_between(self) -> None:
        if self._between is None:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] == self.pack:  # ours on top: leaving them keeps the stack in order
            hooks, self._between = self._between, None
            hooks.__exit__(None, None, None)
            _drain_removed()

    def remove(self) -> None:
        """The hooks become inert (``close()``, after :meth:`exit_forward` and :meth:`pop_between`): those
        left under another context's pass every tensor through until they come off."""
        self.removed = True
        _drain_removed()

    # ---- pack and unpack ----------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        """[Note: saved tensors across a re-plan]
        Autograd saves a parameter (or a view of it) as the tensor itself, and reads it back in backward. By
        then the parameter may be bound elsewhere: its chunk left the device (an offloaded chunk, evicted
        after its forward reads), or a re-plan at a forward's begin (an input that grew, an out-of-memory
        retry) moved it to the host after a loss term read it on the device, or a re-pack changed its chunk.
        So a saved tensor in any chunk's device buffer is replaced by a token resolved at the unpack through
        the parameter: its chunk then is fetched if away, and the slot read where it is now. Between steps a
        host-bound parameter is saved as its host values ([Note: saved tensors between steps]), which no
        re-plan changes (a buffer freed by one stays alive through the token). Any other tensor is saved with
        its version: under saved-tensor hooks autograd no longer checks that nothing modified it in place
        before backward, so the unpack does, as torch would."""
        if self.removed or not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor,
                                                                              torch.nn.Parameter):
            return t
        store = self._store
        sid = id(t.untyped_storage())
        c, host = self._storage.get(sid), False
        if c is not None and (c.data is None or id(c.data.untyped_storage()) != sid):
            c = None  # a buffer that has left since: not a chunk's any more
        if c is None:  # between steps: a host view ([Note: saved tensors between steps]), read as the device
            ptr = t.untyped_storage().data_ptr()  # its user view: another storage object over the same bytes
            c = next((h for h in store.bindings.host_chunks() if h.param_host is not None
                      and h.param_host.untyped_storage().data_ptr() == ptr), None)
            host = c is not None
        if c is None:
            return _Plain(t.detach(), t._version)
        if id(t) in store.param_chunk and store.param_chunk[id(t)] is c:
            return _Saved(t, t._version, None, t.detach() if host else None)
        if t.dtype != c.dtype:
            # a reinterpreting view: kept as it is (its buffer stays alive until backward reads it)
            return _Plain(t.detach(), t._version)
        off = t.storage_offset() + (c.lo if host else 0)  # an offset in the chunk
        found = next(((q, o) for q, (o, n) in zip(c.params, c.ranges, strict=True) if o <= off < o + n), None)
        if found is None:
            return _Plain(t.detach(), t._version)
        p, start = found
        return _Saved(p, p._version, (tuple(t.shape), tuple(t.stride()), off - start),
                      t.detach() if host else None)

    def unpack(self, saved: Any) -> Any:
        if isinstance(saved, _Plain):
            t = saved.tensor
            if t._version != saved.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: tensor of shape {tuple(t.shape)} is at version {t._version}; expected "
                    f"version {saved.version} instead")
            return t
        if not isinstance(saved, _Saved):
            return saved
        p = saved.param
        if p._version != saved.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: parameter of shape {tuple(p.shape)} is at version {p._version}; expected "
                f"version {saved.version} instead (memsched saved it for backward while its chunk's "
                "parameters live on the host)")
        if saved.values is not None:  # its host values when saved (nothing writes them before the step)
            return saved.values
        store = self._store
        if not store.bindings.computing:  # a backward with no forward since the last one ended
            store.bindings.enter_compute()  # (retain_graph)
        store.backward.note_running()  # should it raise before its end ([Note: a backward that raised])
        self._read(p)
        if saved.view is None:
            return p
        c = store.param_chunk[id(p)]
        size, stride, off = saved.view
        return c.data.as_strided(size, stride, store.param_range[id(p)][0] + off)


def _drain_removed() -> None:
    """Take off the top of this thread's saved-tensor hooks those of removed fetchers (left under another
    context's when their scheduler closed), down to the first that is not."""
    while True:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        owner = getattr(top[0], "__self__", None) if top is not None else None
        if not isinstance(owner, SavedParams) or not owner.removed or owner._between is None:
            return
        hooks, owner._between = owner._between, None
        hooks.__exit__(None, None, None)
