"""Load the user's training workload from a ``TARGET`` string.

The TARGET contract (shared by ``memsched trace`` and ``memsched plan``):

``TARGET`` is ``path/to/file.py:function`` or ``package.module:function`` (``function`` may be a dotted
attribute path such as ``Factory.build``). memsched calls it as ``function(device: torch.device)``; it must
return ``(model, loss_fn)`` or a :class:`Workload` ``(model, loss_fn)`` where

* ``model`` is an ``nn.Module`` whose parameters are on ``device``;
* ``loss_fn(model) -> torch.Tensor`` builds one batch on ``device``, runs the model and returns a scalar loss
  (a tensor with one element that requires grad).

memsched then runs ``loss.backward()`` and the optimizer step itself. ``device`` may be a fake CUDA device
under ``FakeTensorMode`` (``memsched plan``), so the function must create its tensors on ``device`` rather
than assuming real memory. Loading a file runs it as a module (its folder is put on ``sys.path`` first, like
``python file.py`` does, so it can import its neighbours).

The ``module:attribute`` form is the one of Python entry points (PEP 621 / setuptools ``console_scripts``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

EXPECTED_SPEC = "path/to/file.py:function or package.module:function"
EXPECTED_RETURN = (
    "(model, loss_fn) with model an nn.Module on the device, or memsched.target.Workload(model, loss_fn)"
)


@dataclass
class Workload:
    """A model and the function that computes one training batch's loss.

    Attributes:
        model: the ``nn.Module`` to train, on the traced device.
        loss_fn: ``loss_fn(model) -> torch.Tensor``: builds one batch on the device, returns a scalar loss.
        name: where it came from (the TARGET string), for error messages.
    """

    model: nn.Module
    loss_fn: Callable[[nn.Module], torch.Tensor]
    name: str = ""

    def loss(self) -> torch.Tensor:
        """Run ``loss_fn(model)`` once and check the result.

        Returns:
            The loss: a one-element floating-point tensor (any dtype) that requires grad.

        Raises:
            TypeError: ``loss_fn`` did not return a tensor (names what it returned).
            ValueError: the tensor has more than one element, or does not require grad.
        """
        loss = self.loss_fn(self.model)
        where = f"TARGET {self.name!r}: loss_fn(model)" if self.name else "loss_fn(model)"
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{where} returned {_describe(loss)}; expected a scalar torch.Tensor loss")
        if loss.numel() != 1:
            raise ValueError(
                f"{where} returned a tensor of shape {tuple(loss.shape)}; expected a scalar loss "
                "(reduce it, e.g. with .mean())"
            )
        if not loss.requires_grad:
            raise ValueError(
                f"{where} returned a loss that does not require grad; expected a loss computed from "
                "the model's trainable parameters (not under torch.no_grad())"
            )
        return loss


def load_target(spec: str) -> Callable[..., Any]:
    """Resolve ``spec`` (``path/to/file.py:function`` or ``package.module:function``) to the callable.

    A path (contains a path separator or ends in ``.py``) is loaded as a fresh module; anything else is
    imported with :func:`importlib.import_module`. Exceptions raised by the target's own code while it is
    imported propagate unchanged.

    Raises:
        ValueError: no colon, empty parts, the module cannot be found, or the function is missing (the message
            lists the callables the file or module defines).
        FileNotFoundError: the file does not exist.
        TypeError: ``spec`` is not a string, or the named attribute is not callable.
    """
    if not isinstance(spec, str):
        raise TypeError(f"TARGET must be a string like {EXPECTED_SPEC!r}, got {_describe(spec)}")
    where, colon, attr = spec.rpartition(":")  # rpartition: a Windows drive letter keeps its colon
    if not colon or not where or not attr:
        raise ValueError(f"TARGET {spec!r} has no ':function' part; expected {EXPECTED_SPEC}")
    module = _load_file(spec, where) if _looks_like_path(where) else _import_module(spec, where)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = module if i == 0 else obj
            raise ValueError(
                f"TARGET {spec!r}: {attr!r} not found in {where!r}; callables there: "
                f"{', '.join(_callables(owner, module)) or '(none)'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(
            f"TARGET {spec!r}: {attr!r} is {_describe(obj)}, not callable; expected a function "
            "taking a torch.device"
        )
    return obj


def build_workload(spec_or_callable: str | Callable[..., Any], device: torch.device | str) -> Workload:
    """Call the TARGET function with ``device`` and check what it returned (see the module docstring).

    Does not compute the loss (so it touches no memory beyond what the function itself allocates); use
    :meth:`Workload.loss` for that.

    Raises:
        ValueError / FileNotFoundError / TypeError: from :func:`load_target`; ``TypeError`` when the function
            returns anything but ``(model, loss_fn)`` or a :class:`Workload` (names what it returned);
            ``ValueError`` when the model's parameters are on another device type than ``device``.
    """
    device = torch.device(device)
    if isinstance(spec_or_callable, str):
        fn, name = load_target(spec_or_callable), spec_or_callable
    elif callable(spec_or_callable):
        fn = spec_or_callable
        name = getattr(spec_or_callable, "__qualname__", None) or repr(spec_or_callable)
    else:
        raise TypeError(
            f"expected a TARGET string ({EXPECTED_SPEC}) or a callable, got {_describe(spec_or_callable)}"
        )
    result = fn(device)
    if isinstance(result, Workload):
        model, loss_fn = result.model, result.loss_fn
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        model, loss_fn = result
    else:
        raise TypeError(f"TARGET {name!r} returned {_describe(result)}; expected {EXPECTED_RETURN}")
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"TARGET {name!r} returned {_describe(model)} as the model; expected {EXPECTED_RETURN}"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"TARGET {name!r} returned {_describe(loss_fn)} as loss_fn; expected a callable "
            "loss_fn(model) -> scalar torch.Tensor"
        )
    param = next(iter(model.parameters()), None)
    if param is not None and param.device.type != device.type:
        raise ValueError(
            f"TARGET {name!r}: the model's parameters are on {param.device}, expected {device} "
            "(create it there or call .to(device))"
        )
    return Workload(model, loss_fn, name)


# ---- helpers ---------------------------------------------------------------------------------------------
def _looks_like_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def _load_file(spec: str, path: str) -> ModuleType:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"TARGET {spec!r}: file {path!r} not found; expected {EXPECTED_SPEC}")
    # A name unique per path, so two targets named train.py in different folders do not collide.
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"_memsched_target_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise ValueError(f"TARGET {spec!r}: cannot load {path!r} as Python; expected {EXPECTED_SPEC}")
    module = importlib.util.module_from_spec(mod_spec)
    folder = os.path.dirname(path)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    sys.modules[name] = module  # registered first: dataclasses and pickling look the module up by name
    try:
        mod_spec.loader.exec_module(module)
    except BaseException:
        # A failed load leaves no trace behind.
        sys.modules.pop(name, None)
        if added and folder in sys.path:
            sys.path.remove(folder)
        raise
    return module


def _import_module(spec: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # Only "the module itself does not exist" is bad input; a missing dependency inside it propagates.
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ValueError(
                f"TARGET {spec!r}: no module named {e.name!r}; expected {EXPECTED_SPEC} "
                "(a file path must end in .py or contain a '/')"
            ) from None
        raise


def _callables(owner: Any, module: ModuleType) -> list[str]:
    names = [n for n in dir(owner) if not n.startswith("_") and callable(getattr(owner, n, None))]
    if owner is module:  # prefer what the module defines over what it imported
        own = [n for n in names if getattr(getattr(owner, n), "__module__", None) == module.__name__]
        names = own or names
    return sorted(names)


def _describe(obj: Any) -> str:
    if isinstance(obj, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in obj[:4]) + (", ..." if len(obj) > 4 else "")
        return f"a {type(obj).__name__} of {len(obj)} ({inner})"
    if obj is None:
        return "None"
    text = repr(obj)
    return f"{type(obj).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
