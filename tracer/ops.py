"""How the storage accountant handles each aten op, decided once per ``OpOverload`` from its schema; device
names as samples write them."""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import HigherOrderOperator

# How an op is handled, decided once per OpOverload from its schema. _COUNT: tracked, and its floating-point
# operations counted (a matrix product, a convolution, attention: torch.utils.flop_counter's registry).
# _HIGHER_ORDER: a higher-order op (``torch.ops.higher_order.*``: a compiled graph's ``run_with_rng_state``),
# which has no schema: the accountant runs its body through itself (tracer.accounting, "Higher-order ops").
_SKIP, _TRACK, _RESIZE, _COUNT, _HIGHER_ORDER = 0, 1, 2, 3, 4

try:
    from torch.utils.flop_counter import flop_registry as FLOP_REGISTRY
except ImportError:  # pragma: no cover - torch without the registry: no FLOPs counted
    FLOP_REGISTRY = {}

_aten = torch.ops.aten
_RESIZING_PACKETS = {_aten.resize_, _aten.resize_as_}
if hasattr(_aten, "_resize_output_"):
    _RESIZING_PACKETS.add(_aten._resize_output_)
# These alias their input in the schema, but the input was made inside the op (``torch.tensor(...)``).
_FRESH_PACKETS = {getattr(_aten, n) for n in ("lift_fresh", "lift_fresh_copy") if hasattr(_aten, n)}


def _op_kind(func: Any) -> int:
    if isinstance(func, HigherOrderOperator):
        return _HIGHER_ORDER
    schema = func._schema
    if func.overloadpacket in _FRESH_PACKETS:
        return _TRACK
    if not any("Tensor" in str(r.type) for r in schema.returns):
        return _SKIP  # no tensor output (``item``, in-place foreach ops returning ``()``)
    if func.overloadpacket in _RESIZING_PACKETS or any(getattr(a, "is_out", False) for a in schema.arguments):
        return _RESIZE
    if all(r.alias_info is not None for r in schema.returns):
        return _SKIP  # views and in-place ops: no new storage
    return _COUNT if func.overloadpacket in FLOP_REGISTRY else _TRACK


def device_name(device: str | torch.device) -> str:
    """Canonical device name as used in samples: ``"cpu"``, ``"cuda:0"``; a bare ``"cuda"`` gets the current
    index (0 when CUDA is not really available, e.g. under ``FakeTensorMode``). Names torch does not know
    (a stand-in ``"sim"`` device) are returned unchanged.

    Raises:
        TypeError: ``device`` is neither a string nor a ``torch.device``.
    """
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError:
            return device
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    if dev.type == "cuda" and dev.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        dev = torch.device("cuda", index)
    return str(dev)




_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def graph_task_id() -> int | None:
    """The id of the autograd graph task (backward pass) running on this thread (-1 outside backward);
    ``None`` where this torch does not expose it."""
    return _current_graph_task_id() if _current_graph_task_id is not None else None


class AlwaysSkip(dict):
    """An op-kind table that says "not tracked" for every op: what a dispatch mode uses once it is removed
    but could not be popped (it sits on another thread's stack), so it costs a lookup and does nothing."""

    def get(self, key: Any, default: Any = None) -> int:  # type: ignore[override]
        return _SKIP


def remove_mode(mode: Any) -> bool:
    """Take ``mode`` (a ``TorchDispatchMode`` that was entered) off this thread's Python dispatch-mode stack
    by identity. Returns False when it is not on this thread's stack.

    ``TorchDispatchMode.__exit__`` pops the top of the stack, which is another mode whenever two users of
    dispatch modes (two schedulers, a tracer and a profiler) do not exit in reverse order of entry. When
    ``mode`` is on top, torch's own ``__exit__`` runs; otherwise the modes above it are popped and pushed back
    in order, and torch's "a mode is active" flags are recomputed from what is left.
    """
    from torch.utils import _python_dispatch as pd

    stack = pd._get_current_dispatch_mode_stack()
    if not any(m is mode for m in stack):
        return False
    if stack[-1] is mode:
        _torch_exit(mode)
        return True
    above = []
    while True:
        top = pd._pop_mode()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        pd._push_mode(m)
    for name in ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
                 "old_without_ignore_compile_internals_dispatch_mode_flags"):
        saved = getattr(mode, name, None)
        if saved:
            saved.pop()
    left = pd._get_current_dispatch_mode_stack()
    if hasattr(pd, "_is_in_non_infra_torch_dispatch_mode"):
        pd._is_in_non_infra_torch_dispatch_mode = any(not m.is_infra_mode() for m in left)
    if hasattr(pd, "_is_in_any_mode_without_ignore_compile_internals"):
        flag = any(not getattr(m, "ignore_compile_internals", lambda: False)() for m in left)
        pd._is_in_any_mode_without_ignore_compile_internals = flag
        if hasattr(pd, "set_is_in_mode_without_ignore_compile_internals"):
            pd.set_is_in_mode_without_ignore_compile_internals(flag)
    return True


def _torch_exit(mode: Any) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    TorchDispatchMode.__exit__(mode, None, None, None)


# Torch functions that look at a tensor without reading its elements: bookkeeping (a tracer's accounting, a
# saved-tensor hook, ``p.grad``) is no read. Properties arrive as their getter (``__get__``), named by the
# descriptor; ``.data``, ``.T`` and the like are views of the elements: reads.
_METADATA_METHODS = frozenset({
    "untyped_storage", "data_ptr", "numel", "nelement", "size", "dim", "ndimension", "stride",
    "storage_offset", "element_size", "is_contiguous", "is_pinned", "is_shared", "get_device", "_is_view",
    "is_floating_point", "is_complex", "has_names", "__hash__", "__len__", "__sizeof__", "__repr__",
    "__format__", "__reduce_ex__", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_",
})
_METADATA_PROPERTIES = frozenset({
    "grad", "_grad", "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "_version", "layout",
    "ndim", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "names", "_base", "itemsize",
    "nbytes", "_grad_fn", "output_nr", "_backward_hooks", "_post_accumulate_grad_hooks", "__dict__",
    "__class__", "is_nested", "retains_grad", "_cdata",
})


_SETTABLE = frozenset({"grad", "_grad", "requires_grad"})


def is_metadata(func: Any) -> bool:
    """Whether the torch function ``func`` only looks at a tensor's metadata (no element is read)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_PROPERTIES
    if name in ("__set__", "__delete__"):  # ``p.grad = None``, ``del p.grad``: the parameter is not read
        return getattr(getattr(func, "__self__", None), "__name__", "") in _SETTABLE
    return name in _METADATA_METHODS
