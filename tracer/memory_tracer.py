"""``MemoryTracer``: model and non-model data of an ``nn.Module`` around every forward, backward and optimizer
step, as a :class:`tracer.MemoryTimeline`.

The split into model data (parameters, buffers, gradients, optimizer states) and non-model data
(activations, temporaries, other) and the idea of measuring non-model data at module granularity during a
warmup step come from PatrickStar (arXiv 2108.05818, section 4) and ColossalAI Gemini's memory tracer.

Category rule: storages created during forward are ``activation``; during backward or the optimizer step
(and not a gradient or an optimizer state) ``temporary``; anything else created inside the ``with`` block is
``other``. Parameters and buffers of the model are ``parameter`` / ``buffer``; ``.grad`` of the parameters
(post-accumulate-grad hooks) is ``gradient``; tensors in ``optimizer.state`` are ``optimizer_state``. A
gradient or optimizer state counts as model data from its allocation (see :mod:`tracer.accounting`), so the
non-model peak is the memory a device must hold besides model data.
"""

from __future__ import annotations

import platform
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tracer.accounting import _CAT_NAMES, StorageAccountant, device_name
from tracer.categories import Category
from tracer.cuda_probe import CudaProbe
from tracer.hook_handles import Detachable
from tracer.module_hooks import ModuleHooks
from tracer.timeline import MemoryTimeline, Sample

__all__ = ["MemoryTracer", "BACKENDS"]

BACKENDS = ("auto", "tensor", "cuda")

# Models with a tracer attached right now (one tracer per model).
_ATTACHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _is_fake(t: torch.Tensor | None) -> bool:
    if t is None:
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _fake_mode_active() -> bool:
    active = getattr(torch._guards, "active_fake_mode", None)
    return active is not None and active() is not None


class MemoryTracer:
    """Trace memory of ``model`` while the ``with`` block runs.

    Example::

        with MemoryTracer(model, optimizer=opt) as t:
            for _ in range(2):
                loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
        t.timeline.peak_non_model_bytes()  # bytes, traced device

    Args:
        model: the ``nn.Module`` to trace; hooks go on every module of ``model.named_modules()`` (qualified
            names, root ``""``) and are all removed on exit, also when the block raises.
        optimizer: hook this optimizer's steps (``register_step_pre_hook`` / ``post_hook``). ``None``:
            discover steps of any optimizer holding a parameter of ``model`` (global optimizer hooks).
        device: the traced device (``"cpu"``, ``"cuda:0"``, ``torch.device``); default: the device of the
            model's first parameter (or buffer), else ``"cpu"``.
        ignore: ``ignore(tensor) -> bool``: model tensors (parameters, gradients) for which it is true are not
            classified: memory that is not on the traced device although its device type says so (a
            stand-in device's host memory, whose tensors are CPU tensors as its device's are). ``None``: none.
        backend: ``"tensor"``: exact tensor accounting on any device (CPU, CUDA, ``FakeTensorMode``);
            ``"cuda"``: tensor accounting plus, on a real CUDA device, the caching allocator's view and
            NVML's device-level used memory in ``Sample.cuda`` (the probe resets torch's CUDA peak statistics
            at every sample); ``"auto"``: ``"cuda"`` when the traced device is a real (not fake) CUDA
            device, else ``"tensor"``.

    Steps end when an optimizer step ends; while no optimizer step has happened, a step also ends when a new
    outermost forward starts after a backward.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``optimizer`` not a ``torch.optim.Optimizer``.
        ValueError: unknown ``backend`` (lists the allowed ones), a device torch does not know, or
            ``backend="cuda"`` without a real CUDA device.
        RuntimeError: on ``__enter__``, when a tracer is already attached to ``model``.
    """

    def __init__(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                 device: str | torch.device | None = None, backend: str = "auto",
                 ignore: Callable[[torch.Tensor], bool] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer or None, "
                            f"got {type(optimizer).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(map(repr, BACKENDS))}")
        first = next(model.parameters(), None)
        if first is None:
            first = next(model.buffers(), None)
        if device is None:
            dev = first.device if first is not None else torch.device("cpu")
        else:
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"invalid device {device!r}: {e}") from None
        self.device = device_name(dev)
        self.fake = _is_fake(first) or _fake_mode_active()
        real_cuda = dev.type == "cuda" and not self.fake and torch.cuda.is_available()
        if backend == "auto":
            backend = "cuda" if real_cuda else "tensor"
        elif backend == "cuda" and not real_cuda:
            raise ValueError("backend 'cuda' needs a real CUDA device, but the traced device is "
                             f"{self.device}{' (fake)' if self.fake else ''}; use backend='tensor' or 'auto'")
        self.backend = backend
        self.model = model
        self.optimizer = optimizer
        self._ignore = ignore or (lambda t: False)
        self._timeline = MemoryTimeline()
        self._raw: list[tuple] = []
        self._last_step = 0
        self._active = False
        self._acc: StorageAccountant | None = None
        self._hooks: ModuleHooks | None = None
        self._handles: list[Any] = []
        self._probe: CudaProbe | None = None
        self._mode_entered = False
        self._param_ids: set[int] = set()
        self._opt_signatures: dict[int, tuple[int, int]] = {}
        self._owned: dict[int, bool] = {}

    # ---- public ----------------------------------------------------------------------------------------
    @property
    def timeline(self) -> MemoryTimeline:
        """The samples so far (complete after the ``with`` block), a :class:`tracer.MemoryTimeline`."""
        self._flush()
        return self._timeline

    def _flush(self) -> None:
        # Samples are kept as tuples while tracing (cheaper in the hooks) and become Sample objects here.
        raw = self._raw
        if raw:
            self._raw = []
            self._timeline.samples.extend(
                Sample(t, step, phase, module, event, dev, dict(zip(_CAT_NAMES, counts, strict=True)), peak,
                       peak_nm, cuda, peak_nmg)
                for t, step, phase, module, event, dev, counts, peak, peak_nm, peak_nmg, cuda in raw)

    @property
    def sample_count(self) -> int:
        """Samples taken so far (the index the next one gets), across devices."""
        return len(self._timeline.samples) + len(self._raw)

    @property
    def accountant(self) -> StorageAccountant | None:
        """The storage accountant while the tracer is active (``None`` before the first ``with``)."""
        return self._acc

    def mark(self, name: str) -> None:
        """Record a free-standing ``event="mark"`` sample named ``name`` (in the current phase).

        Raises:
            TypeError: ``name`` is not a string.
            RuntimeError: the tracer is not active (outside its ``with`` block).
        """
        if not isinstance(name, str):
            raise TypeError(f"mark name must be a str, got {type(name).__name__}")
        if not self._active:
            raise RuntimeError("MemoryTracer.mark() needs an active tracer (call it inside the with block)")
        self._sample(self._phase, name, "mark")

    # ---- context manager -------------------------------------------------------------------------------
    def __enter__(self) -> MemoryTracer:
        if self._active:
            raise RuntimeError("this MemoryTracer is already active")
        if self.model in _ATTACHED:
            raise RuntimeError("a MemoryTracer is already attached to this model "
                               f"({type(self.model).__name__}); exit it before entering another one")
        self._timeline = MemoryTimeline(meta=self._base_meta())
        self._raw = []
        self._last_step = 0
        self._step = 0
        self._optimizer_steps = 0
        self._phase = "other"
        self._fw_depth = 0
        self._backward_since_step = False
        self._opt_signatures = {}
        self._owned = {}
        self._t0 = time.perf_counter_ns()
        try:
            self._acc = StorageAccountant(category=Category.OTHER)
            params = list(self.model.parameters())
            self._param_ids = {id(p) for p in params}
            self._scan_model()
            if self.optimizer is not None:
                self._scan_optimizer(self.optimizer)
            self._hooks = ModuleHooks(self.model, self)
            self._hooks.attach()
            for p in params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(Detachable(self._on_grad)))
            self._attach_optimizer_hooks()
            if self.backend == "cuda":
                self._probe = CudaProbe(torch.device(self.device))
                self._timeline.meta["nvml"] = self._probe.nvml_error or "ok"
            _ATTACHED.add(self.model)
            self._active = True
            self._acc.__enter__()
            self._mode_entered = True
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self._mode_entered:
                self._mode_entered = False
                self._acc.__exit__(exc_type, exc, tb)
            # The closing mark belongs to the last step that had any activity, not to the next one.
            self._sample(self._phase, "exit", "mark", step=self._last_step)
        finally:
            self._teardown()
        return None

    # ---- setup / teardown ------------------------------------------------------------------------------
    def _base_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "device": self.device,
            "backend": self.backend,
            "fake": self.fake,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "model": type(self.model).__name__,
            "optimizer": type(self.optimizer).__name__ if self.optimizer is not None else None,
            "optimizer_discovery": "given" if self.optimizer is not None else "global hooks",
            "bytes": "storage bytes (UntypedStorage.nbytes), rounded up to 512 B blocks off the CPU",
            "rank": 0,
            "world_size": 1,
        }
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            meta["rank"] = torch.distributed.get_rank()
            meta["world_size"] = torch.distributed.get_world_size()
        return meta

    def _attach_optimizer_hooks(self) -> None:
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._opt_pre))
            self._handles.append(self.optimizer.register_step_post_hook(self._opt_post))
        else:
            from torch.optim import optimizer as optim_module

            self._handles.append(optim_module.register_optimizer_step_pre_hook(self._opt_pre))
            self._handles.append(optim_module.register_optimizer_step_post_hook(self._opt_post))

    def _teardown(self) -> None:
        self._active = False
        errors: list[BaseException] = []
        if self._mode_entered:
            self._mode_entered = False
            try:
                self._acc.__exit__(None, None, None)
            except BaseException as e:  # keep removing the rest
                errors.append(e)
        if self._hooks is not None:
            self._hooks.detach()
            self._hooks = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._acc is not None:
            self._acc.close()
        _ATTACHED.discard(self.model)
        meta = self._timeline.meta
        meta["steps"] = self._step + (1 if self._backward_since_step and self._optimizer_steps == 0 else 0)
        meta["optimizer_steps"] = self._optimizer_steps
        if self._acc is not None:
            meta["flops"] = int(self._acc.flops)  # over every traced step (tracer.accounting)
        meta["duration_ns"] = time.perf_counter_ns() - self._t0
        self._flush()
        if errors:
            raise errors[0]

    # ---- classification --------------------------------------------------------------------------------
    def _scan_model(self) -> None:
        acc, ignore = self._acc, self._ignore
        for p in self.model.parameters():
            if not ignore(p):
                acc.classify(p, Category.PARAMETER)
            if p.grad is not None and not ignore(p.grad):
                acc.classify(p.grad, Category.GRADIENT)
        for b in self.model.buffers():
            acc.classify(b, Category.BUFFER)

    def _scan_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # Standard optimizers create their states once and then update them in place, so an unchanged
        # number of state entries means nothing new to classify (this runs twice per step).
        states = optimizer.state
        signature = (len(states), sum(map(len, states.values())))
        if self._opt_signatures.get(id(optimizer)) == signature:
            return
        self._opt_signatures[id(optimizer)] = signature
        acc = self._acc
        for state in states.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    acc.classify(value, Category.OPTIMIZER_STATE)

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._active and param.grad is not None and not self._ignore(param.grad):
            self._acc.classify(param.grad, Category.GRADIENT)

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        if optimizer is self.optimizer:
            return True
        owned = self._owned.get(id(optimizer))
        if owned is None:  # checked once per optimizer: its hooks run twice per step
            ids = self._param_ids
            owned = self._owned[id(optimizer)] = any(
                id(p) in ids for group in optimizer.param_groups for p in group["params"])
        return owned

    # ---- events ----------------------------------------------------------------------------------------
    def module_event(self, phase: str, event: str, name: str) -> None:
        """Called by :class:`tracer.module_hooks.ModuleHooks` (not for users)."""
        if phase == "forward":
            if event == "pre":
                if self._fw_depth == 0:
                    self._begin_forward()
                self._fw_depth += 1
                self._sample("forward", name, "pre")
            else:
                self._sample("forward", name, "post")
                self._fw_depth = max(0, self._fw_depth - 1)
                if self._fw_depth == 0:
                    self._set_phase("other", Category.OTHER)
        else:
            self._sample("backward", name, event)

    def backward_begin(self) -> None:
        self._set_phase("backward", Category.TEMPORARY)

    def backward_end(self) -> None:
        self._set_phase("other", Category.OTHER)
        self._backward_since_step = True

    def _begin_forward(self) -> None:
        if self._optimizer_steps == 0 and self._backward_since_step:
            self._step += 1  # no optimizer: a new forward after a backward starts a new step
            self._backward_since_step = False
        self._scan_model()  # parameters or buffers replaced since enter
        self._set_phase("forward", Category.ACTIVATION)

    def _set_phase(self, phase: str, category: Category) -> None:
        self._phase = phase
        self._acc.category = category

    def _opt_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active or not self._owns(optimizer):
            return
        self._set_phase("optimizer", Category.TEMPORARY)
        self._scan_optimizer(optimizer)
        self._sample("optimizer", type(optimizer).__name__, "pre")

    def _opt_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active or not self._owns(optimizer):
            return
        self._scan_optimizer(optimizer)  # states created lazily in this step count as model data throughout
        self._sample("optimizer", type(optimizer).__name__, "post")
        self._step += 1
        self._optimizer_steps += 1
        self._backward_since_step = False
        self._set_phase("other", Category.OTHER)

    def _sample(self, phase: str, module: str, event: str, step: int | None = None) -> None:
        acc = self._acc
        if step is None:
            step = self._last_step = self._step
        t_ns = time.perf_counter_ns() - self._t0
        traced = self.device
        raw = self._raw
        names = acc._device_names()
        if len(names) != 1 or names[0] != traced:  # the traced device first, even before it has data
            names = [traced, *(d for d in names if d != traced)]
        for dev in names:
            counts, peak, peak_nm, peak_nmg = acc._snapshot(dev)
            cuda = self._probe.read() if self._probe is not None and dev == traced else None
            raw.append((t_ns, step, phase, module, event, dev, counts, peak, peak_nm, peak_nmg, cuda))
