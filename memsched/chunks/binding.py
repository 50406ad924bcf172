"""Where each chunk's parameters point: one owner for their ``.data`` (and, host-bound, their ``.grad``), with
an explicit lifecycle per chunk.

A trainable parameter is always a view, never storage of its own: of its chunk's compute buffer on the
device, of a stand-in that reads as NaN while that buffer is away, or of the chunk's host buffers between
steps. Which one is the chunk's :class:`Binding`; every change of it goes through :class:`ChunkBindings`,
which checks it against the lifecycle (:data:`TRANSITIONS`) and keeps what the change must carry with it
(writes made to the old views, gradients set by hand, the views' version counters). FSDP2's ``FSDPParam``
owns its sharded and unsharded views the same way.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.autograd.graph import increment_version
from torch.utils import _pytree as pytree

from memsched.chunks.chunk import Chunk
from memsched.chunks.sharded_grad import is_sharded
from memsched.chunks.sizing import TRAINABLE_DTYPES
from memsched.devices.host_alias import settle
from policies.types import HOST
from tracer.ops import is_metadata


def _bookkeeping() -> torch._C.DisableTorchFunction:
    """Re-binding a parameter (``p.data = ...``, ``p.grad = ...``) is no read of it: torch function modes (the
    read guards of :mod:`memsched.runtime.read_guard`) do not see it."""
    return torch._C.DisableTorchFunction()


class ChunkViews(Protocol):
    """What the bindings read of :class:`memsched.chunks.store.ChunkStore` (a protocol: the store owns its
    bindings): the chunks, the views of each parameter's slots, and the gradients it keeps on the host."""

    chunks: list[Chunk]
    param_chunk: dict[int, Chunk]
    alloc: Any  # memsched.chunks.buffers.Allocator
    grads: Any  # memsched.chunks.gradients.GradBuffers: its host_grads and with_grad
    closed: bool
    before_host_write: Callable[[Chunk], None]
    before_device_read: Callable[[Chunk], None]

    def host_view(self, kind: str, p: torch.nn.Parameter, c: Chunk | None = None) -> torch.Tensor: ...

    def user_view(self, kind: str, p: torch.nn.Parameter, c: Chunk | None = None) -> torch.Tensor: ...

    def data_view(self, p: torch.nn.Parameter) -> torch.Tensor: ...

    def forget_views(self, c: Chunk, kind: str) -> None: ...

    def offloads(self, c: Chunk) -> bool: ...

    def all_params(self) -> Iterator[torch.nn.Parameter]: ...


_ABSENT_KEY = "absent"
_HOST_KEY = "host"
#: (class, mark) -> the class a marked parameter takes (made once per class and mark).
_MARKED_TYPES: dict[tuple[type, str], type] = {}
#: id(parameter) -> (mark, its bindings (weak), its chunk's index, the parameter (weak)), while it is marked.
#: Kept here, not in the parameter's ``__dict__``: ``torch.save(model)`` pickles that (and a weak reference
#: cannot be pickled). An entry goes with its parameter: an id is reused only after that (see _mark_of).
_MARKS: dict[int, tuple[str, weakref.ref, int, weakref.ref]] = {}


def _mark_of(t: torch.Tensor) -> tuple[str, weakref.ref, int, weakref.ref] | None:
    """``t``'s mark, or ``None``."""
    mark = _MARKS.get(id(t))
    return mark if mark is not None and mark[3]() is t else None


def _forget(key: int, ref: weakref.ref) -> None:
    """A marked parameter was collected: its entry goes (unless its id was marked anew since)."""
    mark = _MARKS.get(key)
    if mark is not None and mark[3] is ref:
        del _MARKS[key]


def _absent_torch_function(cls: type, func: Callable, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
    """[Note: foreign reads]
    An absent parameter (see [Note: absent parameters]) holds NaN, not its values; the training thread's
    reads fetch or gather its chunk first, or are refused (the read guards are torch function modes, which
    belong to the thread that entered them). A read from any other thread (an evaluation or checkpoint
    thread, ZeRO-3 between steps) would see the NaN, silently. So an absent parameter's class is its own
    class with this ``__torch_function__`` (a subclass made once per class, swapped in when it becomes absent
    and out when it is bound to values again: no cost while it holds values): the training thread and its
    backward (autograd's device threads) call through, any other thread is refused with an error that says
    what to do. The check is Python's per call, only for absent parameters, which no forward reads."""
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():  # this function's own reads (``a.shape``) are not checked
        if torch._C._current_graph_task_id() != -1 and not is_metadata(func):
            _refuse_backward_read(func, args, kwargs)
        for a in _tensors(*args, *kwargs.values()) if torch._C._current_graph_task_id() == -1 else ():
            mark = _mark_of(a)
            if mark is None or mark[0] != _ABSENT_KEY:
                continue
            _, bindings, index, _ = mark
            b = bindings()
            if b is not None and b.owner != threading.get_ident():
                raise RuntimeError(
                    f"memsched: {getattr(func, '__name__', func)} reads a parameter of chunk {index} (shape "
                    f"{tuple(a.shape)}) from thread {threading.current_thread().name!r}, but its values are "
                    "not on this device now (parameters on the host while a step computes, or sharded by "
                    "ZeRO-3), and only the training thread's reads fetch or gather them. Read parameters in "
                    "the training thread, between steps after sched.synchronize() (ZeRO-3: inside `with "
                    "sched.gathered_params():`, entered on every rank), or from a copy made there")
        return func(*args, **kwargs)


def _refuse_backward_read(func: Callable, args: tuple, kwargs: dict) -> None:
    """[Note: parameters read in backward]
    Backward reads a parameter's values through what autograd saved (``ctx.save_for_backward``, the tensors
    an op saves): memsched's saved-tensor hooks resolve those to the chunk's device buffer, fetched for
    backward. A parameter object read in backward otherwise (a custom ``torch.autograd.Function`` that keeps
    it as ``ctx.w = w``, a gradient hook that computes with it) while its chunk is away holds NaN (see [Note:
    absent parameters]): the gradient would be silently wrong, so the read is refused.

    Raises:
        RuntimeError: ``func`` reads an absent parameter (names its chunk, shape, and the fix).
    """
    for a in _tensors(*args, *kwargs.values()):
        mark = _mark_of(a)
        if mark is None or mark[0] != _ABSENT_KEY:
            continue
        raise RuntimeError(
            f"memsched: {getattr(func, '__name__', func)} reads a parameter of chunk {mark[2]} (shape "
            f"{tuple(a.shape)}) during backward, but its values are not on the device now (its chunk lives "
            "on the host and was fetched only for the forward's reads and what autograd saved). A custom "
            "torch.autograd.Function that keeps a parameter on ctx (ctx.w = w) reads it like this: save it "
            "with ctx.save_for_backward(w) and read it from ctx.saved_tensors, which memsched fetches for "
            "backward, bit for bit. (Or keep this parameter on the device: policy='cuda', or a "
            "policy_options offload_param_frac that leaves its chunk resident.)")


def _host_torch_function(cls: type, func: Callable, types: tuple, args: tuple = (),
                         kwargs: dict | None = None) -> Any:
    """A host view's class ([Note: graph reads between steps]): a torch function of the training thread
    that may record a graph (gradients enabled, outside backward) and receives a host view that requires
    grad goes to :meth:`ChunkBindings.graph_read`; everything else calls through."""
    kwargs = kwargs or {}
    if (torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
            and not _writes_or_gets(func) and "out" not in kwargs):
        with torch._C.DisableTorchFunctionSubclass():  # this function's own reads are not checked
            marks = [_mark_of(a) for a in _tensors(*args, *kwargs.values()) if a.requires_grad]
            marked = [m for m in marks if m is not None and m[0] == _HOST_KEY]
        b = marked[0][1]() if marked else None
        if b is not None and b.owner == threading.get_ident():
            return b.graph_read(func, args, kwargs, sorted({m[2] for m in marked}))
    with torch._C.DisableTorchFunctionSubclass():  # a plain result, as the parameter's own class gives
        return func(*args, **kwargs)


def _tensors(*values: Any) -> Iterator[torch.Tensor]:
    """The tensors among ``values`` and in their lists and tuples (``torch.cat``, the ``_foreach`` ops)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and", "or",
    "xor"))


def _writes_or_gets(func: Callable) -> bool:
    """An attribute read (``p.grad``: records nothing) or an in-place op (``ema.lerp_(p, w)``, ``x += p``:
    it writes another tensor, so it is run once, where its operands are)."""
    name = getattr(func, "__name__", "")
    return name == "__get__" or name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


def _records_graph(out: Any) -> bool:
    """Whether ``out`` (a torch function's result: a tensor, or tensors in a container) has a ``grad_fn``."""
    return any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in pytree.tree_leaves(out))


def _mark(p: torch.Tensor, key: str, bindings: weakref.ref, index: int) -> None:
    """``p``'s class becomes its own class with the ``__torch_function__`` of mark ``key`` (``_ABSENT_KEY``:
    [Note: foreign reads]; ``_HOST_KEY``: [Note: graph reads between steps]), for chunk ``index``. A copy
    (``copy.deepcopy``) or a pickle (``torch.save(model)``) of it is of its own class, unmarked."""
    mark = _mark_of(p)
    if mark is None or mark[0] != key:
        present(p)
        cls = type(p)
        marked = _MARKED_TYPES.get((cls, key))
        if marked is None:
            fn = _absent_torch_function if key == _ABSENT_KEY else _host_torch_function
            marked = _MARKED_TYPES[cls, key] = type(cls.__name__, (cls,), {
                "__torch_function__": classmethod(fn), "__deepcopy__": _unmarked_deepcopy,
                "__reduce_ex__": _unmarked_reduce_ex,
                "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        p.__class__ = marked
        ref = weakref.ref(p, functools.partial(_forget, id(p)))
    else:
        ref = mark[3]
    _MARKS[id(p)] = (key, bindings, index, ref)


def present(p: torch.Tensor) -> None:
    """``p`` is bound to its chunk's device values again (or memsched lets it go): its own class back
    ([Note: foreign reads], [Note: graph reads between steps]). Idempotent."""
    if _mark_of(p) is not None:
        del _MARKS[id(p)]
    if type(p) in _MARKED_TYPES.values():
        p.__class__ = type(p).__mro__[1]


@contextlib.contextmanager
def _own_class(p: torch.Tensor) -> Iterator[None]:
    """``p`` is of its own class (its marked class's base) inside the block."""
    marked = type(p)
    p.__class__ = marked.__mro__[1]
    try:
        yield
    finally:
        p.__class__ = marked


def _unmarked_deepcopy(self: torch.Tensor, memo: dict) -> Any:
    """``copy.deepcopy`` of a marked parameter: a copy of its own class (its class's ``__deepcopy__`` makes
    an instance of ``type(self)``)."""
    with _own_class(self):
        return copy.deepcopy(self, memo)


def _unmarked_reduce_ex(self: torch.Tensor, protocol: int) -> Any:
    """Pickling a marked parameter pickles it as its own class."""
    with _own_class(self):
        return self.__reduce_ex__(protocol)


class Binding(enum.Enum):
    """What a chunk's parameters are views of now.

    * ``DEVICE``: its compute buffer on the device (``chunk.data``): built, fetched, gathered (ZeRO-3).
    * ``ABSENT``: while computing, its buffer is off the device (its values are in ``param_host``): each
      parameter is an absent view ([Note: absent parameters]) until the chunk's fetch.
    * ``HOST``: between steps (one rank): its host buffers, ``param_host`` and, for parameters with a host
      gradient, ``grad_host`` ([Note: host binding]).
    * ``SHARDED``: ZeRO-3, its buffer left the device and this rank keeps its shard: absent views, between
      steps too (nothing whole is on the host to bind to) until the chunk is gathered again.
    """

    DEVICE = "device"
    ABSENT = "absent"
    HOST = "host"
    SHARDED = "sharded"


#: The lifecycle: the bindings each one may change into (a change to itself re-binds, e.g. new buffers).
TRANSITIONS: dict[Binding, frozenset[Binding]] = {
    Binding.DEVICE: frozenset(Binding),
    Binding.ABSENT: frozenset({Binding.ABSENT, Binding.DEVICE, Binding.HOST}),
    Binding.HOST: frozenset({Binding.HOST, Binding.DEVICE, Binding.ABSENT}),
    Binding.SHARDED: frozenset({Binding.SHARDED, Binding.DEVICE}),
}


class ChunkBindings:
    """The binding of every chunk of ``store`` (:class:`Binding`), and the phase they follow: ``computing``
    from a forward's start to its backward's end (parameters on the device, present or absent), between
    steps otherwise (host chunks' parameters host-bound).

    Raises (every transition):
        RuntimeError: a change the lifecycle does not allow (an internal error: nothing was re-bound).
    """

    def __init__(self, store: ChunkViews) -> None:
        self._store = store
        self._state: dict[int, Binding] = {}  # chunk index -> binding (chunks built bound to the device)
        self._versions: dict[int, int] = {}  # each parameter's version counter when last bound
        self._absent: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # [Note: absent parameters]
        self.computing = False  # between a forward's start and its backward's end
        self.owner = threading.get_ident()  # the attaching thread, which trains ([Note: foreign reads])
        self._ref = weakref.ref(self)
        # fetches chunks whose parameters live on the host only, for a read between steps (:meth:`fetch_with`)
        self._fetch_between: Callable[[list[int]], None] | None = None

    def fetch_with(self, fetch_between: Callable[[list[int]], None]) -> None:
        """Chunks whose parameters live on the host only are fetched with ``fetch_between(indices)`` for a
        graph read between steps (:meth:`graph_read`; the parameter fetcher's, one rank)."""
        self._fetch_between = fetch_between

    # -- whether the parameters are still bound ----------------------------------------------------------
    def unbound(self, *, quick: bool = False) -> torch.nn.Parameter | None:
        """The first parameter that is no longer the view into its chunk that attach made it (new storage,
        dtype, device or memory format), or ``None`` when every parameter still is. ``quick``: compare the
        storage address and the dtype only (a conversion changes one of them; strides changed in place on the
        same storage are left to the full check), about three times cheaper: the check before each forward."""
        for p in self._store.all_params():
            view = self.expected_view(p)
            if p.data_ptr() != view.data_ptr() or p.dtype != view.dtype:
                return p
            if not quick and (p.stride() != view.stride() or p.device != view.device):
                return p
        return None

    def check_bound(self, names: dict[int, str]) -> None:
        """Every parameter is still the view into its chunk that attach made it.

        Raises:
            RuntimeError: a parameter got new storage, dtype, device, shape or memory format after attach
                (``model.double()``, ``model.half()``, ``model.to(...)``, ``p.data = ...``); the message names
                it, what changed and what to do. Updates would otherwise go to the chunk and never reach the
                model (a dtype change would first fail inside autograd with torch's ``grad_dtype`` error).
        """
        p = self.unbound()
        if p is None:
            return
        view = self.expected_view(p)
        name = names.get(id(p), f"of shape {tuple(p.shape)}")
        if p.dtype != view.dtype:
            unsupported = "" if p.dtype in TRAINABLE_DTYPES else (
                f"; {str(p.dtype).removeprefix('torch.')} is not supported: memsched trains float32, "
                "bfloat16 and float16 parameters")
            raise RuntimeError(
                f"parameter {name!r} is no longer memsched's view into its chunk: its dtype changed from "
                f"{view.dtype} to {p.dtype} after memsched.attach (model.double(), .half(), .bfloat16(), "
                ".to(dtype)); memsched cannot follow a conversion. To compute in bfloat16 or float16 with "
                "fp32 master weights, pass dtype= to memsched.attach instead; to convert the model, convert "
                f"it before memsched.attach: close() the scheduler, convert, and attach again{unsupported}")
        if p.device != view.device:
            what = f"it moved from {view.device} to {p.device}"
        elif p.stride() != view.stride():
            what = f"its memory format changed (strides {view.stride()} -> {p.stride()})"
        else:
            what = "it got new storage (p.data = ..., or a module conversion)"
        raise RuntimeError(
            f"parameter {name!r} is no longer memsched's view into its chunk: {what} after attach. "
            "memsched cannot follow that; convert the model (dtype, device, memory format) before "
            "memsched.attach (close() the scheduler, convert, and attach again), or load values in place "
            "(model.load_state_dict, or `with torch.no_grad(): param.copy_(...)`)")

    # -- the state ------------------------------------------------------------------------------------------
    def state(self, c: Chunk) -> Binding:
        return self._state.get(c.index, Binding.DEVICE)

    def host_bound(self, c: Chunk) -> bool:
        """Whether ``c``'s parameters (and their ``.grad``) are host views now."""
        return self._state.get(c.index) is Binding.HOST

    def param_host_bound(self, p: torch.nn.Parameter) -> bool:
        """Whether ``p``'s chunk is host-bound now (its ``.grad`` is a host view or None)."""
        return self.host_bound(self._store.param_chunk[id(p)])

    def host_chunks(self) -> Iterator[Chunk]:
        """The host-bound chunks."""
        return (c for c in self._store.chunks if self._state.get(c.index) is Binding.HOST)

    def reset(self) -> None:
        """The chunks are built anew (re-packing): every chunk starts bound to the device."""
        self._state.clear()

    def _check(self, c: Chunk, new: Binding) -> None:
        """Refuse a change the lifecycle does not allow, before anything is re-bound."""
        old = self.state(c)
        if new not in TRANSITIONS[old]:
            raise RuntimeError(f"memsched internal error: chunk {c.index}'s parameters cannot go from "
                               f"{old.value} views to {new.value} views")

    def _set(self, c: Chunk, new: Binding) -> None:
        self._check(c, new)
        self._state[c.index] = new

    def written(self, c: Chunk) -> bool:
        """Whether any parameter of ``c`` was written in place since it was last bound."""
        return any(p._version != self._versions.get(id(p), p._version) for p in c.params)

    def note_bound(self, p: torch.nn.Parameter) -> None:
        """``p`` was re-bound by the store itself (a new memory format): its writes count from here."""
        self._versions[id(p)] = p._version

    def _point(self, c: Chunk, view: str) -> None:
        """Every parameter of ``c`` becomes its ``view`` (``data``: its chunk view; ``absent``)."""
        store = self._store
        with torch.no_grad(), _bookkeeping():
            for p in c.params:
                if view == "data":
                    p.data = store.data_view(p)
                    present(p)
                else:
                    p.data = self.absent_view(p, c)
                    _mark(p, _ABSENT_KEY, self._ref, c.index)
                self._versions[id(p)] = p._version

    def expected_view(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The view ``p`` must be now: its host slot while its chunk is host-bound, else its chunk view (or,
        the chunk's buffer being off the device, its absent view)."""
        store = self._store
        c = store.param_chunk[id(p)]
        if self.host_bound(c):
            return self._host_param_view(p, c)
        return store.data_view(p) if c.data is not None else self.absent_view(p, c)

    def _host_param_view(self, p: torch.nn.Parameter, c: Chunk) -> torch.Tensor:
        """What a host-bound parameter is: its slot in the host copy (read as the device), or for a lean chunk
        without one its chunk view on the device ([Note: lean host chunks] in memsched.chunks.chunk)."""
        store = self._store
        return store.user_view("data", p, c) if c.param_host is not None else store.data_view(p)

    def absent_view(self, p: torch.nn.Parameter, c: Chunk | None = None) -> torch.Tensor:
        """[Note: absent parameters]
        While computing, a parameter whose chunk's buffer is off the device (its parameters live on the host,
        :mod:`memsched.runtime.param_fetch`) is a view of one NaN element of its dtype on the device, expanded
        to its shape: its device and dtype stay those of the parameter, so autograd's gradient accumulator is
        kept (it is reset when a parameter's data changes device), and its data holds nothing of the chunk.
        Every read is preceded by the chunk's fetch (module hooks, the read guard, the saved-tensor hooks); a
        read that escaped them would compute with NaN, never with stale values."""
        c = c or self._store.param_chunk[id(p)]
        key = (c.dtype, c.device)
        one = self._absent.get(key)
        if one is None:
            host = self._store.alloc.host_context() if c.device.type == "cpu" else contextlib.nullcontext()
            with host:
                one = self._absent[key] = torch.full((1,), float("nan"), dtype=c.dtype, device=c.device)
        return one.reshape(()).expand(p.shape)

    # -- between steps: host views --------------------------------------------------------------------------
    def to_host(self, c: Chunk) -> None:
        """[Note: host binding]
        One rank: a host chunk's gradients leave the device as backward completes them
        (:mod:`memsched.chunks.grad_offload`), so from backward's end to the next forward its parameters and
        their ``.grad`` are views into the chunk's host buffers (``param_host``, ``grad_host``): torch's
        ``clip_grad_norm_(model.parameters())``, ``model.state_dict()``, ``torch.save`` and anything else
        between steps see every gradient and the current values, and torch requires a gradient on its
        parameter's device. ``zero_grad(set_to_none=True)`` (no gradient left) or the next forward binds
        them to the device again (:meth:`enter_compute`), where writes made to the host views meanwhile are
        taken in; parameters whose values live on the host only (parameter offload) stay host views until
        the forward that fetches them. FSDP2's ``CPUOffloadPolicy`` keeps its sharded
        parameters and their gradients on the host between steps in the same way."""
        store = self._store
        self._check(c, Binding.HOST)
        with torch.no_grad(), _bookkeeping():
            if c.data is not None and c.param_host is not None and not self.host_bound(c) and any(
                    p._version != self._versions.get(id(p), -1) for p in c.params):
                # Written on the device since it was device-bound (or never bound before): the host values
                # take the device's (the fp32 master itself in fp32; under mixed precision the master follows
                # at the step, GradChecks.sync_user_param_writes).
                store.before_host_write(c)
                c.wait_h2d()
                with store.alloc.host_context():
                    c.param_host.copy_(c.data[c.lo:c.hi])
                if not c.mixed and c.master is not None:
                    increment_version(c.master)  # the state changed (memsched.optim.early_update)
            for p in c.params:
                present(p)
                if c.frozen:  # values only: a frozen parameter's .grad is not memsched's
                    p.data = store.user_view("data", p, c)
                    continue
                self._take_hand_set_grad(p, c)
                p.data = self._host_param_view(p, c)
                kept = id(p) in store.grads.host_grads and c.grad_host is not None
                p.grad = store.user_view("grad", p, c) if kept else None
                self._versions[id(p)] = p._version
                _mark(p, _HOST_KEY, self._ref, c.index)  # [Note: graph reads between steps]
        self._set(c, Binding.HOST)

    def graph_read(self, func: Callable, args: tuple, kwargs: dict, indices: list[int]) -> Any:
        """[Note: graph reads between steps]
        A loss term computed between steps, before the forward (an L2 penalty, a regulariser over
        ``model.parameters()``, a second micro-batch's term while the first one's gradients are on the
        host), reads host views, and autograd would tie its graph to each parameter as a host tensor: the
        forward then binds the parameter to the device, and backward meets a host gradient beside device
        ones (torch's device error when they are added), or the term's op fails at once on a device input.
        So a torch function of the training thread that records a graph from a host view (its result has a
        ``grad_fn``, or it failed on mixed devices) is run again after the chunks left the host, as
        ``zero_grad()`` and the forward would make them leave (every chunk with a device copy, once its H2D
        copy of the updated values has landed, so that what is read next is on one device too; host
        gradients stay, and the step makes such chunks host-bound again): from then on the term and its
        gradients are on the device, as in torch, bit for bit (the host's random generator is set back for
        the second run). A chunk read whose parameters live on the host only (parameter offload) is
        fetched first, off the schedule, as a prefetch the forward's reads then find
        (:meth:`memsched.runtime.param_fetch.ParamFetcher.fetch_between`); the parameters autograd saves from
        it are tokens that backward resolves like the forward's. A function that records no graph (a norm
        under ``no_grad``, ``detach``, ``state_dict``) keeps reading the host views.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): such a fetch finds no room on the device.
        """
        store = self._store
        chunks = [store.chunks[i] for i in indices]
        rng = torch.get_rng_state()
        failed: RuntimeError | None = None
        try:
            with torch._C.DisableTorchFunctionSubclass():  # a plain result; nested reads are this one's
                out = func(*args, **kwargs)
        except RuntimeError as e:
            if "same device" not in str(e):
                raise
            out, failed = None, e
        if failed is None and not _records_graph(out):
            return out
        away = [c.index for c in chunks if c.data is None]
        if away:  # parameters that live on the host only: fetched first (one rank has a fetcher for them)
            if self._fetch_between is None:
                raise RuntimeError(f"memsched internal error: chunks {away} have no device copy to read")
            with torch._C.DisableTorchFunction():
                self._fetch_between(away)  # their parameters are bound below, with the other chunks'
        del out, failed  # the host graph goes (and with it the accumulators it made for host tensors)
        torch.set_rng_state(rng)
        with torch._C.DisableTorchFunction():
            # every chunk with a device copy, as zero_grad() moves them: the parameters read next (the rest
            # of a sum over model.parameters()) are on one device, as in torch
            for c in [c for c in self.host_chunks() if c.data is not None]:
                store.before_host_write(c)  # its overlapped update is done (its H2D copy then issued)
                store.before_device_read(c)
                self.leave_host(c)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _take_hand_set_grad(self, p: torch.nn.Parameter, c: Chunk) -> None:
        """A gradient set by hand on ``p`` (``p.grad = g`` after ``torch.autograd.grad``: SAM, PCGrad, MAML)
        replaces its host gradient, as torch's ``p.grad = g`` replaces the gradient; it is not a view of the
        chunk's device or host gradients.

        Raises:
            ValueError: ``g`` is sparse or not shaped like ``p`` (names the shapes); nothing was written.
        """
        store = self._store
        g = p.grad
        if g is None or is_sharded(g) or c.grad_host is None:  # (ZeRO: no whole host gradients to take it)
            return
        if g.data_ptr() == store.host_view("grad", p, c).data_ptr():
            return
        if c.grad is not None and g.untyped_storage().data_ptr() == c.grad.untyped_storage().data_ptr():
            return  # the chunk's own device gradients (offloaded by the store's observers)
        settle(c.device)  # a device gradient set by hand, computed by kernels still in flight
        if g.is_sparse or g.shape != p.shape:
            raise ValueError(f"a gradient set by hand on a parameter of shape {tuple(p.shape)} in chunk "
                             f"{c.index} has shape {tuple(g.shape)}{' (sparse)' if g.is_sparse else ''}; "
                             "expected a dense gradient shaped like the parameter")
        with torch.no_grad(), _bookkeeping(), store.alloc.host_context():
            store.host_view("grad", p, c).copy_(g)
        store.grads.host_grads.add(id(p))
        store.grads.with_grad.add(id(p))

    def refresh_host(self, c: Chunk) -> None:
        """``c``'s host buffers were replaced (an update made during backward was swapped in): host-bound
        parameters and gradients point at the new ones."""
        if self.host_bound(c):
            self.to_host(c)

    def leave_host(self, c: Chunk) -> None:
        """``c`` stops being host-bound: its parameters become their device views (absent views when its
        buffer is away); host gradients stay where they are, one dropped by the user is dropped, one set by
        hand is taken in, and writes to the host views reach the master and the device copy first."""
        store = self._store
        self._check(c, Binding.DEVICE if c.data is not None else Binding.ABSENT)
        written = False
        with torch.no_grad(), _bookkeeping():
            for p in c.params:
                g = p.grad
                if c.frozen:
                    written |= p._version != self._versions.get(id(p), p._version)
                    continue
                if g is None:
                    if id(p) in store.grads.host_grads:  # dropped by the user
                        store.grads.host_grads.discard(id(p))
                        store.grads.with_grad.discard(id(p))
                elif g.data_ptr() != store.host_view("grad", p, c).data_ptr():  # set by hand
                    with store.alloc.host_context():
                        store.host_view("grad", p, c).copy_(g)
                    store.grads.host_grads.add(id(p))
                    store.grads.with_grad.add(id(p))
                    p.grad = store.user_view("grad", p, c)
                written |= p._version != self._versions.get(id(p), p._version)
            if written:
                self.take_host_writes(c)
        self._point(c, "data" if c.data is not None else "absent")
        self._set(c, Binding.DEVICE if c.data is not None else Binding.ABSENT)

    def take_host_writes(self, c: Chunk) -> None:
        """The host values of ``c`` were written since it was host-bound: the fp32 master takes them (under
        mixed precision where they differ from the master's rounding, as
        :meth:`memsched.optim.grads.GradChecks.sync_user_param_writes` does), and the device copy is
        refreshed."""
        store = self._store
        settle(c.device)  # writes made through the user views by device kernels have landed
        store.before_host_write(c)
        c.wait_h2d()
        with store.alloc.host_context():
            if c.mixed and c.master is not None:  # a frozen chunk has no master
                # the host copy, or a lean chunk's device buffer, which the writes reached
                new = c.staging if c.staging is not None else c.data[c.lo:c.hi].to(c.master.device)
                c.master.copy_(torch.where(new != c.master.to(new.dtype), new.float(), c.master))
        if c.data is not None and c.param_host is not None:  # else its next fetch copies the host values
            c.data[c.lo:c.hi].copy_(c.param_host)

    # -- the phases ---------------------------------------------------------------------------------------
    def enter_compute(self) -> None:
        """Before a forward (or a backward that finds parameters host-bound): every parameter becomes its
        chunk view on the device again. Host-bound gradients stay where they are (backward adds a new
        micro-batch's on the host); a gradient set to None meanwhile (``model.zero_grad()``) is dropped, and
        one set by hand is taken into the host gradients. Writes to the host views (``load_state_dict``,
        ``nn.init``, ``p.copy_(...)``: their version counters moved) reach the fp32 master and the device
        copy first. Idempotent."""
        if self.computing:
            return
        self.computing = True
        for c in list(self.host_chunks()):
            if self._store.closed and c.data is None:
                continue
            self.leave_host(c)

    def leave_compute(self) -> None:
        """Backward's end (or a step with none): the host chunks become host-bound (their gradients were
        offloaded first by the store's observers). Idempotent."""
        if not self.computing:
            return
        self.computing = False
        for c in self._store.chunks:
            away = c.frozen and c.data is None and c.placement is not None  # its values are on the host only
            if (self._store.offloads(c) or away) and not self.host_bound(c):
                self.to_host(c)

    # -- while computing: the device ------------------------------------------------------------------------
    def to_device(self, c: Chunk) -> None:
        """``c``'s parameters become their chunk views (its buffer is on the device; a chunk host-bound
        since the forward's end takes in writes made to its host views first)."""
        self._check(c, Binding.DEVICE)
        if self.host_bound(c) and self.written(c):
            self.take_host_writes(c)
        self._point(c, "data")
        self._set(c, Binding.DEVICE)

    def to_absent(self, c: Chunk) -> None:
        """While computing: ``c``'s parameters (its buffer off the device) become absent views, on the device
        (see [Note: absent parameters]): backward's gradients need them there."""
        self._check(c, Binding.ABSENT)
        self._point(c, "absent")
        self._set(c, Binding.ABSENT)

    def data_arrived(self, c: Chunk, data: torch.Tensor) -> None:
        """``c``'s compute buffer is ``data`` again (a fetch allocated it; the caller copies the values in,
        and binds the parameters at their read: :meth:`to_device`)."""
        c.set_data(data)
        self._store.forget_views(c, "data")

    def data_leaves(self, c: Chunk) -> None:
        """``c``'s compute buffer leaves the device: while computing its parameters become absent views (see
        [Note: absent parameters]), between steps host views. A device write to them since they were bound
        goes to the host first. The buffer is freed once nothing else holds it (an op still reading it, a
        copy in flight: on CUDA their streams are recorded on it)."""
        if c.data is None:
            return
        store = self._store
        if c.param_host is None and c.lean and c.placement == HOST:  # the host copy is made now, from the
            # only values there are ([Note: lean host chunks] in memsched.chunks.chunk)
            store.before_host_write(c)
            c.wait_h2d()
            with torch.no_grad(), _bookkeeping(), store.alloc.host_context():
                c.add_param_host(store.alloc).copy_(c.data[c.lo:c.hi])
            if self.host_bound(c):  # its parameters were device views: now views of the host copy
                self.to_host(c)
        elif not self.host_bound(c) and self.written(c):
            store.before_host_write(c)
            c.wait_h2d()
            with torch.no_grad(), _bookkeeping(), store.alloc.host_context():
                c.param_host.copy_(c.data[c.lo:c.hi])
        if not self.host_bound(c) and not self.computing:
            self.to_host(c)  # between steps parameters whose buffer is away are host views
        elif not self.host_bound(c):
            self.to_absent(c)
        store.forget_views(c, "data")
        c.drop_data()
        c.forget_h2d()

    def drop_param_host(self, c: Chunk) -> None:
        """A lean chunk whose parameters stay on the device from now on (a plan keeps them there): its host
        copy of them goes ([Note: lean host chunks] in memsched.chunks.chunk). Host-bound, its parameters
        become their device views, writes made to the host views taken in first."""
        if not (c.lean and c.staging is not None and c.data is not None):
            return
        store = self._store
        bound = self.host_bound(c)
        if bound and self.written(c):
            self.take_host_writes(c)
        store.before_host_write(c)
        c.wait_h2d()
        settle(c.device)  # device kernels reading the host copy through the user views are done
        c.drop_param_host()
        store.forget_host_views(c)
        if bound:
            self.to_host(c)  # the parameters are device views now; their gradients stay host views

    def to_sharded(self, c: Chunk) -> None:
        """ZeRO-3: ``c``'s compute buffer leaves the device (this rank's shard was kept,
        :mod:`memsched.distributed.sharded_params`); its parameters become absent views (see [Note: absent
        parameters]), while computing and between steps alike. The buffer is freed once nothing else holds
        it (an op still reading it, a saved tensor's token resolved to it)."""
        self._check(c, Binding.SHARDED)
        self._point(c, "absent")
        self._store.forget_views(c, "data")
        c.drop_data()
        self._set(c, Binding.SHARDED)
