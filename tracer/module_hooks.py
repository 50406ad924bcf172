"""Forward and backward pre/post events for every submodule of ONE model.

Same idea as ``torch.distributed._tools.mod_tracker.ModTracker`` (forward hooks, plus gradient hooks for
backward), but with per-model hooks so modules of other models cost nothing and are not recorded:

* forward pre / post: ``register_forward_pre_hook`` / ``register_forward_hook(always_call=True)`` on each
  module of ``model.named_modules()`` (qualified names; the root is ``""``).
* backward pre: fires when the first gradient of the call's outputs that require grad is ready, i.e. before
  the module's own backward ops run; backward post: when the gradients of all its inputs that require grad
  are ready (the last thing its backward produces). Both use a pre-hook on the autograd node that made those
  tensors when there is one such node (the common case, and cheap), else
  ``torch.autograd.graph.register_multi_grad_hook`` (mode ``any`` / ``all``).
* Calls whose inputs need no grad (the first layer, integer ids) and calls whose hook never fires are closed
  at the end of the backward pass, found with the autograd engine's ``queue_callback``; a call's backward
  begins no later than that of any call inside it and ends no earlier.

Forward hooks that fire while the autograd engine runs (activation-checkpoint recomputation) are not
reported: that memory belongs to the backward pass.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.hooks import RemovableHandle

from tracer.accounting import _in_autograd
from tracer.hook_handles import Detachable

__all__ = ["ModuleEventListener", "ModuleHooks", "grad_tensors"]


class ModuleEventListener(Protocol):
    def module_event(self, phase: str, event: str, name: str) -> None:
        """``phase`` in {forward, backward}, ``event`` in {pre, post}, ``name`` the qualified module name."""

    def backward_begin(self) -> None:
        """The first backward hook of a backward pass is about to be reported."""

    def backward_end(self) -> None:
        """The backward pass finished (after the remaining post events were reported)."""


class _Call:
    """One forward call of one module, so backward events pair with the right call."""

    __slots__ = ("name", "parent", "pre_pass", "post_pass")

    def __init__(self, name: str, parent: _Call | None) -> None:
        self.name = name
        self.parent = parent  # the call this one ran inside (its backward encloses ours)
        self.pre_pass = 0  # id of the backward pass that reported our backward pre (0: none yet)
        self.post_pass = 0


def grad_tensors(obj: Any, _depth: int = 0) -> list[torch.Tensor]:
    """Tensors that require grad inside ``obj``: a tensor, (named) tuples, lists, dicts and dataclass
    instances, nested up to 8 levels."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if _depth > 8:
        return []
    if isinstance(obj, (tuple, list)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    else:
        return []
    found: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif item is not None and not isinstance(item, (int, float, str, bool)):
            found.extend(grad_tensors(item, _depth + 1))
    return found


class ModuleHooks:
    """Reports module events of ``model`` to ``listener`` between :meth:`attach` and :meth:`detach`."""

    def __init__(self, model: nn.Module, listener: ModuleEventListener) -> None:
        self._model = model
        self._listener = listener
        self._handles: list[RemovableHandle] = []
        self._grad_handles: list[Any] = []
        self._calls: list[_Call] = []  # forward calls running now, innermost last
        self._open: dict[_Call, None] = {}  # backward pre reported, post not yet (insertion ordered)
        self._in_backward_pass = False
        self._pass = 0  # backward passes begun
        self._depth = 0  # forward nesting depth
        self.active = False

    def attach(self) -> None:
        """Register forward hooks on every module; undone completely if it fails."""
        try:
            for name, module in self._model.named_modules():
                self._handles.append(module.register_forward_pre_hook(
                    Detachable(functools.partial(self._fw_pre, name)), with_kwargs=True))
                hook = Detachable(functools.partial(self._fw_post, name))
                try:
                    self._handles.append(module.register_forward_hook(hook, always_call=True))
                except TypeError:  # pragma: no cover - torch without always_call
                    self._handles.append(module.register_forward_hook(hook))
        except BaseException:
            self.detach()
            raise
        self.active = True

    def detach(self) -> None:
        """Remove every hook, including multi-grad hooks of graphs that are still alive."""
        self.active = False
        for h in self._handles:
            h.remove()
        for h in self._grad_handles:
            h.remove()
        self._handles.clear()
        self._grad_handles.clear()
        self._calls.clear()
        self._open.clear()
        self._depth = 0
        self._in_backward_pass = False

    # ---- forward ---------------------------------------------------------------------------------------
    def _fw_pre(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.active or _in_autograd():
            return None
        if self._depth == 0 and not self._in_backward_pass:
            # A new outermost forward: hooks of older graphs go (a hook on a leaf input, such as a
            # parametrization's original parameter, would otherwise stay on that tensor for good)
            self._drop_grad_handles()
        self._depth += 1
        calls = self._calls
        call = _Call(name, calls[-1] if calls else None)
        calls.append(call)
        self._listener.module_event("forward", "pre", name)
        if torch.is_grad_enabled():
            if len(args) == 1 and isinstance(args[0], torch.Tensor):  # the common case, without recursion
                inputs = [args[0]] if args[0].requires_grad else []
            else:
                inputs = grad_tensors(args)
            if kwargs:
                inputs += grad_tensors(kwargs)
            # A leaf input (a pipeline stage's received activations) has no node to hook, and torch refuses
            # a multi-grad hook over a leaf inside autograd.grad (the pipeline schedules' input gradients):
            # the call's backward then ends at the end of the backward pass, as one whose hook never fires.
            inputs = [t for t in inputs if t.grad_fn is not None]
            if inputs:
                self._grad_handles.append(_on_grads(inputs, functools.partial(self._bw_post, call), "all"))
        return None

    def _fw_post(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.active or _in_autograd():
            return None
        self._depth = max(0, self._depth - 1)
        call = self._pop_call(name)
        self._listener.module_event("forward", "post", name)
        if torch.is_grad_enabled():
            if isinstance(output, torch.Tensor):
                outputs = [output] if output.requires_grad else []
            else:
                outputs = grad_tensors(output)
            if outputs:
                self._grad_handles.append(_on_grads(outputs, functools.partial(self._bw_pre, call), "any"))
        return None

    def _pop_call(self, name: str) -> _Call:
        calls = self._calls
        for i in range(len(calls) - 1, -1, -1):  # normally the last one
            if calls[i].name == name:
                call = calls[i]
                del calls[i:]
                return call
        return _Call(name, calls[-1] if calls else None)

    # ---- backward ----------------------------------------------------------------------------------------
    def _bw_pre(self, call: _Call, grads: Any) -> None:
        if not self.active:
            return
        if not self._in_backward_pass:
            self._in_backward_pass = True
            self._pass += 1
            self._listener.backward_begin()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        current = self._pass
        if call.pre_pass == current:
            return
        # A module's backward begins no later than that of any call inside it (they may share the output
        # tensor, whose hooks fire in registration order: inner first): report enclosing calls first.
        chain = [call]
        parent = call.parent
        while parent is not None and parent.pre_pass != current:
            chain.append(parent)
            parent = parent.parent
        for c in reversed(chain):
            c.pre_pass = current
            self._open[c] = None
            self._listener.module_event("backward", "pre", c.name)

    def _bw_post(self, call: _Call, grads: Any) -> None:
        current = self._pass
        if not self.active or call.pre_pass != current or call.post_pass == current:
            return
        # Calls inside this one whose own post never fired (inputs without grad) end before it.
        for c in reversed(list(self._open)):
            if c is not call and _is_inside(c, call):
                self._close(c)
        self._close(call)

    def _close(self, call: _Call) -> None:
        call.post_pass = self._pass
        self._open.pop(call, None)
        self._listener.module_event("backward", "post", call.name)

    def _end_of_backward(self) -> None:
        if not self.active:
            return
        # Innermost first, the root last, like a normal backward would close them.
        for call in reversed(list(self._open)):
            self._close(call)
        self._in_backward_pass = False
        # Hooks of finished passes go (see _fw_pre)
        self._drop_grad_handles()
        self._listener.backward_end()

    def _drop_grad_handles(self) -> None:
        for h in self._grad_handles:
            h.remove()
        self._grad_handles.clear()


def _on_grads(tensors: list[torch.Tensor], fn: Any, mode: str) -> Any:
    """Call ``fn(grads)`` when the gradients of ``tensors`` are ready: ``mode="all"`` once all of them are,
    ``"any"`` at the first one. Common case, all produced by one autograd node: a pre-hook on that node
    (it runs right before the node, exactly when tensor hooks would), much cheaper than a multi-grad hook."""
    node = tensors[0].grad_fn
    if node is not None and (len(tensors) == 1 or all(t.grad_fn is node for t in tensors[1:])):
        return node.register_prehook(fn)
    try:
        return register_multi_grad_hook(tensors, fn, mode=mode)
    except TypeError:  # pragma: no cover - torch without mode="any"
        return register_multi_grad_hook(tensors, fn)


def _is_inside(call: _Call, outer: _Call) -> bool:
    parent = call.parent
    while parent is not None:
        if parent is outer:
            return True
        parent = parent.parent
    return False
