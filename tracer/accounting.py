"""Exact live-storage accounting from the ops themselves.

:class:`StorageAccountant` is a ``TorchDispatchMode`` (``torch.utils._python_dispatch``) that sees every aten
op, registers each storage an op creates (``tensor.untyped_storage()``, counted once however many views or
tied parameters share it) under the current category, and subtracts its bytes when a weak reference to the
storage's Python object fires (torch keeps that object alive exactly as long as the storage, torch >= 2.1).
It works for CPU, CUDA and ``FakeTensorMode`` tensors (also fake ``cuda`` tensors on a machine with no GPU),
which is what lets memsched plan before running. The idea of tracking storages from the dispatcher follows
``torch.distributed._tools.mem_tracker.MemTracker``; the categories follow PatrickStar (arXiv 2108.05818).

Semantics (all sizes are storage bytes, ``UntypedStorage.nbytes()``; on a device other than the CPU rounded
up to the 512 B blocks CUDA's caching allocator hands out, which memsched's stand-in device counts too, so a
traced peak is the allocated bytes the device would report):

* A storage is *new* when an op outputs it and it was not seen before. Ops whose every output aliases an
  input (views, in-place and ``out=`` ops) create nothing, except that ``resize_``-like and ``out=`` ops are
  checked for storages that grew. Storages created before the mode was entered are not counted unless
  :meth:`StorageAccountant.classify` registers them (the tracer does that for parameters, buffers,
  gradients and optimizer states).
* Peaks are exact per event (every allocation, free, resize and reclassification), not only at samples.
* Reclassification is retroactive inside the current interval: a storage allocated since the last
  :meth:`~StorageAccountant.take_peaks` / :meth:`~StorageAccountant.live_bytes` and then classified counts
  under its new category from its allocation on (so a ``.grad`` or an optimizer state never inflates the
  non-model peak). A storage classified later moves its bytes at that moment. To stay lean, the hot path only
  appends events to a log (:mod:`tracer.event_log`); the per-category counters and peaks are computed when
  they are asked for.

Higher-order ops (``torch.ops.higher_order.*``, such as the ``run_with_rng_state`` of a compiled backward
through an activation-checkpointed block) are run with this mode around their body, so their ops count like
any other (the comment "Higher-order ops" below the class).

Not seen: scratch memory a kernel allocates and frees inside one op, ``UntypedStorage.resize_`` called from
Python (it bypasses the dispatcher), tensors made outside the dispatcher (``torch.from_numpy``) unless
classified, and the caching allocator's segments and fragmentation (the tracer's ``cuda`` backend reports
that side).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tracer.categories import ALL_CATEGORIES, Category
from tracer.event_log import GROW, MOVE, DeviceState, Entry, fold
from tracer.ops import (
    _COUNT,
    _HIGHER_ORDER,
    _RESIZE,
    _SKIP,
    FLOP_REGISTRY,
    AlwaysSkip,
    _op_kind,
    device_name,
    graph_task_id,
    remove_mode,
)

__all__ = ["StorageAccountant", "AllocateCallback", "device_name"]

AllocateCallback = Callable[[str, int, int], None]
"""``on_allocate(device, nbytes, live_total_bytes_on_device_after)``; may raise to fail the op."""

_CAT_INDEX: dict[Category, int] = {c: i for i, c in enumerate(ALL_CATEGORIES)}
_CAT_NAMES: tuple[str, ...] = tuple(c.value for c in ALL_CATEGORIES)
_ZEROS = (0,) * len(_CAT_NAMES)
_CPU = sys.intern("cpu")
_OTHER = _CAT_INDEX[Category.OTHER]
_TEMPORARY = _CAT_INDEX[Category.TEMPORARY]

# Replay the log once it is this long even if nobody asks, so memory stays bounded.
_LOG_LIMIT = 4096



def _in_autograd() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    task = graph_task_id()
    return task is not None and task != -1


BLOCK_BYTES = 512  # CUDA's caching allocator's smallest block (kMinBlockSize); the stand-in rounds the same


def block_bytes(nbytes: int, host: bool) -> int:
    """Bytes a storage of ``nbytes`` takes: as they are on the host, rounded up to :data:`BLOCK_BYTES` on a
    device (0 stays 0)."""
    if host or nbytes <= 0:
        return max(0, nbytes)
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


class StorageAccountant(TorchDispatchMode):
    """Live storage bytes per category per device, with exact peaks between two reads.

    Use as a context manager (it is a ``TorchDispatchMode``): ``with acc: ...``. Counting continues after
    ``__exit__`` for storages that were registered (their frees still count) until :meth:`close`.

    Args:
        category: category of storages created from now on (default ``other``); change it with
            :attr:`category` when a phase begins. While the category is ``other`` and the autograd engine
            runs a backward pass, new storages are ``temporary``.
        on_allocate: called as ``on_allocate(device, nbytes, live_total_bytes_on_device_after)`` for every new
            storage (and every growth of one), before it is counted; an exception it raises (for example
            ``torch.OutOfMemoryError``) propagates out of the op and the storage is not counted.

    Raises:
        TypeError: ``on_allocate`` is not callable.
        ValueError: ``category`` is not a category name (names the allowed ones).
    """

    # every higher-order op reaches __torch_dispatch__ (older torch: rules registered on __enter__)
    supports_higher_order_operators = True

    def __init__(self, *, category: Category | str = Category.OTHER,
                 on_allocate: AllocateCallback | None = None) -> None:
        super().__init__()
        if on_allocate is not None and not callable(on_allocate):
            raise TypeError(f"on_allocate must be callable, got {type(on_allocate).__name__}")
        self._cat = _category_index(category)
        self._on_allocate = on_allocate
        self._live: dict[int, Entry] = {}  # id(storage) -> entry; the id is stable while the storage lives
        self._log: list[Any] = []
        self._states: dict[str, DeviceState] = {}
        self._names: dict[torch.device, str] = {}
        self._kinds: dict[int, int] = {}  # id(OpOverload) -> how to handle it (OpOverload.__hash__ is Python)
        # Running total per device name, kept per event only for ``on_allocate``.
        self._totals: dict[str, int] = {}
        self._free_cb = self._freed
        #: Floating-point operations of the ops run so far (matrix products, convolutions, attention), counted
        #: with torch's own FLOP formulas (``torch.utils.flop_counter``), as ``FlopCounterMode`` counts them.
        self.flops = 0

    # ---- configuration ---------------------------------------------------------------------------------
    @property
    def category(self) -> Category:
        """Category given to storages created from now on."""
        return ALL_CATEGORIES[self._cat]

    @category.setter
    def category(self, value: Category | str) -> None:
        self._cat = _category_index(value)

    # ---- queries ---------------------------------------------------------------------------------------
    def devices(self) -> list[str]:
        """Names of the devices that had tracked storages, sorted."""
        self._replay()
        return sorted(self._states)

    def live_bytes(self, device: str | torch.device) -> dict[str, int]:
        """Live bytes per category name (all categories, zeros included) on ``device``, in bytes."""
        self._replay()
        state = self._states.get(device_name(device))
        counts = state.counts if state is not None else [0] * len(_CAT_NAMES)
        return dict(zip(_CAT_NAMES, counts, strict=True))

    def total_bytes(self, device: str | torch.device) -> int:
        """All live tracked bytes on ``device``, in bytes."""
        self._replay()
        state = self._states.get(device_name(device))
        return state.total if state is not None else 0

    def take_peaks(self, device: str | torch.device) -> tuple[int, int]:
        """``(peak_total_bytes, peak_non_model_bytes)`` on ``device`` since the previous call for it (or since
        tracking began), then start a new interval at the current values. Bytes."""
        self._replay()
        state = self._states.get(device_name(device))
        if state is None:
            return 0, 0
        return state.restart_peaks()[:2]

    def _snapshot(self, name: str) -> tuple[tuple[int, ...], int, int, int]:
        """``(live bytes per category in ALL_CATEGORIES order, peak_total, peak_non_model,
        peak_non_model_grad)`` for a canonical device name, starting a new interval: :meth:`live_bytes` +
        :meth:`take_peaks` in one cheap call."""
        if self._log:
            self._replay()
        state = self._states.get(name)
        if state is None:
            return _ZEROS, 0, 0, 0
        counts = tuple(state.counts)
        return (counts, *state.restart_peaks())

    def _device_names(self) -> list[str]:
        if self._log:
            self._replay()
        return list(self._states)

    def category_of(self, tensor: torch.Tensor) -> Category | None:
        """Current category of ``tensor``'s storage, or ``None`` if it is not tracked."""
        entry = self._live.get(id(tensor.untyped_storage()))
        return None if entry is None else ALL_CATEGORIES[entry.cat]

    # ---- registration ----------------------------------------------------------------------------------
    def classify(self, tensor: torch.Tensor, category: Category | str) -> int:
        """Put ``tensor``'s storage under ``category``; register it (live from now on) if it is not tracked.

        Returns the bytes that changed category or were registered (0 if nothing changed).

        Raises:
            TypeError: ``tensor`` is not a tensor.
            ValueError: unknown ``category``.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        cat = _category_index(category)
        st = tensor.untyped_storage()
        if not _holds_memory(tensor, st):  # a wrapper subclass (DTensor, a sharded gradient): parts tracked
            return 0
        entry = self._live.get(id(st))
        if entry is None:
            nbytes = block_bytes(st.nbytes(), tensor.is_cpu)
            if nbytes == 0:
                return 0
            dev = self._names.get(tensor.device) or self._name(tensor.device)
            self._register(st, nbytes, cat, dev)
            if self._on_allocate is not None:
                self._totals[dev] = self._totals.get(dev, 0) + nbytes
            return nbytes
        if entry.cat == cat:
            return 0
        entry.cat = cat
        if entry.counted >= 0:  # already in the counters: move the bytes now
            self._log.append((MOVE, entry, cat))
        return entry.cur

    def __enter__(self) -> StorageAccountant:
        if not _MODES_SEE_HIGHER_ORDER_OPS:
            register_higher_order_rules()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        """Leave the dispatch-mode stack by identity (:func:`tracer.ops.remove_mode`), not by popping its top.
        From another thread (a garbage collector's finalizer) the mode cannot be reached: it then stops
        tracking and passes every op through."""
        if not remove_mode(self):
            self._kinds = AlwaysSkip()
            self._on_allocate = None

    def close(self) -> None:
        """Fold pending events into the counters and stop tracking: drop every weak reference, so storages
        freed later cost nothing. The counters keep their last values."""
        self._replay()
        self._live.clear()
        self._totals.clear()

    # ---- the dispatch hook (hot path: keep it lean) ----------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kind = self._kinds.get(id(func))  # OpOverloads are cached singletons: their id is stable
        if kind is None:
            kind = self._kinds[id(func)] = _op_kind(func)
        if kind == _SKIP:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kind == _RESIZE:
            return self._resizing_op(func, args, kwargs or {})
        if kind == _HIGHER_ORDER:
            return self._higher_order(func, args, kwargs or {})
        out = func(*args, **kwargs) if kwargs else func(*args)
        if kind == _COUNT:
            self.flops += FLOP_REGISTRY[func.overloadpacket](*args, **(kwargs or {}), out_val=out)
        if isinstance(out, torch.Tensor):
            self._track(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._track(o)
                elif isinstance(o, (tuple, list)):
                    for p in o:
                        if isinstance(p, torch.Tensor):
                            self._track(p)
        return out

    def _track(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without a storage of their own
            self._track_inner(t)
            return
        key = id(st)
        if key in self._live:
            return
        nbytes = st.nbytes() if t.is_cpu else block_bytes(st.nbytes(), False)
        if not nbytes:
            return
        cat = self._cat
        if cat == _OTHER and _in_autograd():
            cat = _TEMPORARY
        dev = _CPU if t.is_cpu else (self._names.get(t.device) or self._name(t.device))
        if self._on_allocate is not None:
            self._charge(dev, nbytes)
        entry = Entry(st, self._free_cb)
        entry.key = key
        entry.nbytes = entry.cur = nbytes
        entry.cat = cat
        entry.dev = dev
        entry.counted = -1
        self._live[key] = entry
        log = self._log
        log.append(entry)
        if len(log) > _LOG_LIMIT:
            self._replay()

    def _track_inner(self, t: torch.Tensor) -> None:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            for name in attrs:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)

    def _register(self, st: Any, nbytes: int, cat: int, dev: str) -> None:
        entry = Entry(st, self._free_cb)
        entry.key = id(st)
        entry.nbytes = entry.cur = nbytes
        entry.cat = cat
        entry.dev = dev
        entry.counted = -1
        self._live[entry.key] = entry
        self._log.append(entry)

    def _charge(self, dev: str, nbytes: int) -> None:
        after = self._totals.get(dev, 0) + nbytes
        self._on_allocate(dev, nbytes, after)  # may raise: then nothing is counted
        self._totals[dev] = after

    def _freed(self, entry: Entry) -> None:
        # Runs when the storage dies (any thread, GIL held). Entries dropped by close() never get here.
        if self._live.pop(entry.key, None) is None:
            return
        self._log.append(entry)
        if self._on_allocate is not None:
            self._totals[entry.dev] = self._totals.get(entry.dev, 0) - entry.cur

    def _resizing_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # Rare ops (resize_, out=): compare storage sizes around the op.
        before: dict[int, int] = {}
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                st = a.untyped_storage()
                before[id(st)] = block_bytes(st.nbytes(), a.is_cpu)
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            nbytes = block_bytes(st.nbytes(), t.is_cpu)
            entry = self._live.get(key)
            if entry is None:
                if nbytes > before.get(key, 0):
                    # A buffer made inside the block (the old one, if any, was not tracked).
                    self._track(t)
            elif nbytes != entry.cur:
                delta = nbytes - entry.cur
                if delta > 0 and self._on_allocate is not None:
                    self._charge(entry.dev, delta)
                elif self._on_allocate is not None:
                    self._totals[entry.dev] = self._totals.get(entry.dev, 0) + delta
                entry.cur = nbytes
                self._log.append((GROW, entry, delta))
        return out

    def _higher_order(self, hop: Any, args: tuple, kwargs: dict) -> Any:
        """Run the higher-order op ``hop`` (this mode is off: the dispatcher popped it) with this mode around
        its body, then count what it returns that no op in it made (the comment "Higher-order ops")."""
        inputs = {id(st) for st in map(_storage, _tensors((args, kwargs))) if st is not None}
        key = _kernel_key(hop, args, kwargs)
        if key is None:  # a mode below this one, or a tensor subclass, takes it
            out = hop(*args, **kwargs)
        else:
            try:
                with self._pushed():
                    out = hop.dispatch(key, *args, **kwargs)
            except AssertionError as e:
                if _REFUSES_MODES not in str(e):
                    raise
                # cond, invoke_subgraph, scan...: the kernel calls its graphs with no mode on
                args = tuple(self._under_mode(a) for a in args)
                kwargs = {k: self._under_mode(v) for k, v in kwargs.items()}
                out = hop.dispatch(key, *args, **kwargs)
        for t in _tensors(out):
            st = _storage(t)
            if st is None or id(st) not in inputs:
                self._track(t)
        return out

    @contextlib.contextmanager
    def _pushed(self) -> Any:
        """This mode on the stack again (``TorchDispatchMode.__enter__``: the rules are there already)."""
        TorchDispatchMode.__enter__(self)
        try:
            yield
        finally:
            self.__exit__(None, None, None)

    def _under_mode(self, arg: Any) -> Any:
        """``arg``, or when it is a function or a graph, a function that calls it with this mode on."""
        if not isinstance(arg, _BODY_TYPES):
            return arg

        def body(*a: Any, **k: Any) -> Any:
            with self._pushed():
                return arg(*a, **k)

        return body

    # ---- folding the log into counters -----------------------------------------------------------------
    def _name(self, dev: torch.device) -> str:
        # Device names are interned here, so entries compare them by identity when replaying.
        name = self._names[dev] = sys.intern(device_name(dev))
        return name

    def _state(self, name: str) -> DeviceState:
        state = self._states.get(name)
        if state is None:
            state = self._states[name] = DeviceState()
        return state

    def _replay(self) -> None:
        log = self._log
        if log:
            self._log = []  # frees that happen while replaying land in the new log
            fold(log, self._state)


# Higher-order ops: how the accountant runs them.
# A higher-order op (HOP: ``torch.ops.higher_order.*``) takes a function or a graph and runs it: a compiled
# backward through a block under ``torch.utils.checkpoint`` calls ``run_with_rng_state(rng_state, op, *args)``
# to recompute a dropout with the forward's random numbers; ``run_and_save_rng_state``, ``invoke_subgraph``,
# ``wrap``, ``tag_activation_checkpoint``, ``cond``, ``flex_attention`` and ``auto_functionalized`` are HOPs
# too. A dispatch mode meets a HOP only if it opts in, and without a rule torch raised ``NotImplementedError:
# There was no rule registered for HigherOrderOperator run_with_rng_state and mode StorageAccountant`` (older
# torch: an AssertionError, "not registered") in memsched's warmup, whose step runs eagerly but meets the
# backward of a forward that ran compiled before the tracer started.
#
# The accountant opts in (``supports_higher_order_operators``; on older torch, without that attribute, a
# rule per HOP, :func:`register_higher_order_rules`). With itself popped, it finds the kernel torch would run
# below the Python key (``BackendSelect``, ``CPU``, ``CompositeExplicitAutograd``...) and runs it with the
# mode pushed again: the HOP's body dispatches its aten ops through the mode, which counts them as any op,
# temporaries and FLOPs included; a HOP inside the body comes back here. Kernels that run graphs (``cond``,
# ``invoke_subgraph``, ``scan``) assert that no mode is on ("Mode should never be enabled for CPU/CUDA key"):
# for them the mode is pushed around each function or graph (an ``nn.Module``) they are given instead, as
# torch's FlopCounterMode does for ``cond``. Counting only the HOP's outputs would miss the temporaries its
# body frees before returning (an invoke_subgraph's whole block): an under-counted peak of non-model data,
# and a plan that fills the device past what fits. Then the storages the HOP returns that no op in its body
# made and that no input has are counted as new. That covers a body that allocates without dispatching
# (inductor's code under ``torch._inductor.config.wrap_inductor_compiled_regions``, whose temporaries stay
# unseen as inductor's code always is), and a HOP that a mode below this one or a tensor subclass takes (the
# key is Python: a FakeTensorMode or a proxy tracer under the accountant), which runs as torch runs it.
# A HOP with no kernel for its inputs raises a NotImplementedError naming it and the key.
_REFUSES_MODES = "Mode should never be enabled"  # torch's assertion in a kernel that calls graphs
_BODY_TYPES = (types.FunctionType, types.MethodType, functools.partial, torch.nn.Module)
_MODES_SEE_HIGHER_ORDER_OPS = hasattr(TorchDispatchMode, "supports_higher_order_operators")
_compute_keyset = getattr(torch._ops, "_compute_keyset", None)
_resolve_key = getattr(torch._ops, "resolve_key", None)
_MODE_KEYS = frozenset(getattr(torch._C.DispatchKey, n)
                       for n in ("Python", "PythonTLSSnapshot", "PreDispatch")
                       if hasattr(torch._C.DispatchKey, n))


def _kernel_key(hop: Any, args: tuple, kwargs: dict) -> Any:
    """The dispatch key whose kernel of ``hop`` torch would run for these inputs now (this mode popped), or
    ``None`` when a mode or tensor subclass would take it (or this torch cannot say).

    Raises:
        NotImplementedError: ``hop`` has no kernel for that key (names the op).
    """
    if _compute_keyset is None:
        return None
    key = _compute_keyset(args, kwargs, hop.non_fallthrough_keys).highestPriorityTypeId()
    if key in _MODE_KEYS:
        return None
    if _resolve_key is not None and key != torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode:
        try:
            _resolve_key(hop, key)
        except NotImplementedError:
            raise NotImplementedError(
                "memsched's memory tracer cannot run the higher-order op "
                f"torch.ops.higher_order.{_hop_name(hop)}: torch has no kernel of it for dispatch key "
                f"{key.name} (its inputs' device)") from None
    return key


def _hop_name(hop: Any) -> str:
    return str(getattr(hop, "_name", None) or hop)


def _tensors(tree: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass
        return None


def _higher_order_rule(hop: Any, mode: StorageAccountant, *args: Any, **kwargs: Any) -> Any:
    return mode._higher_order(hop, args, kwargs)


def register_higher_order_rules(hops: Any = None) -> None:
    """Give :class:`StorageAccountant` a rule (``HigherOrderOperator.py_impl``) for each higher-order op in
    ``hops`` (default: every one torch has made so far, the RNG ops of compiled checkpointing included) that
    has none: what torch older than 2.6, whose modes do not see HOPs in ``__torch_dispatch__``, needs. Done
    on entering the accountant there; idempotent."""
    if hops is None:
        try:
            import torch._prims.rng_prims  # noqa: F401  (run_with_rng_state, run_and_save_rng_state)
        except ImportError:  # pragma: no cover - a torch without them
            pass
        hops = list(getattr(torch._ops, "_higher_order_ops", {}).values())
    for hop in hops:
        if StorageAccountant not in hop.python_key_table:
            hop.py_impl(StorageAccountant)(functools.partial(_higher_order_rule, hop))


def _category_index(category: Category | str) -> int:
    try:
        return _CAT_INDEX[Category(category)]
    except ValueError:
        allowed = ", ".join(_CAT_NAMES)
        raise ValueError(f"unknown category {category!r}: expected one of {allowed}") from None


def _holds_memory(tensor: torch.Tensor, st: torch.UntypedStorage) -> bool:
    """Whether ``tensor``'s storage ``st`` is real memory: a wrapper tensor subclass has a storage object that
    holds nothing (reading its data pointer raises). A fake tensor's storage stands for memory, and its data
    pointer is not read: torch deprecates that and will make it an error."""
    if isinstance(tensor, _fake_tensor_type()):
        return True
    try:
        st.data_ptr()
    except RuntimeError:
        return False
    return True


@functools.cache
def _fake_tensor_type() -> type:
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor
