"""The gradients of :class:`memsched.optim.hybrid_adamw.HybridAdamW`: the checks of its step, before anything
is written (the gradients are the chunk views or are copied back into them, fp16 gradients come from
``sched.backward``, user writes to parameters refresh the fp32 masters, the fp16 inf/NaN check), and gradient
clipping. A mixin: the optimizer's state is its state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from memsched.chunks import Chunk


class GradientChecksMixin:
    """See the module docstring."""

    # The optimizer's attributes this mixin reads and writes (set in HybridAdamW.__init__).
    store: Any
    dp: Any
    scaler: Any
    _scaled_versions: list[int] | None
    _spec_inv: torch.Tensor | None
    _param_versions: dict[int, int]
    _name: Callable[[torch.Tensor], str]
    _clip_coefs: list[torch.Tensor]
    _fp32_grad: Callable[..., torch.Tensor]

    def note_scaled_backward(self) -> None:
        """fp16: :meth:`memsched.Scheduler.backward` ran a backward of the scaled loss; the gradients as they
        are now hold the loss scale, and the step checks that nothing changed them since."""
        self._scaled_versions = [c.grad._version for c in self.store.chunks]

    def scaled_grads_unchanged(self) -> bool:
        """fp16: nothing wrote the gradient buffers since the last :meth:`note_scaled_backward`."""
        return self._scaled_versions == [c.grad._version for c in self.store.chunks]

    def _check_scaled_grads(self) -> None:
        """fp16: refuse a step whose gradients changed after the last ``sched.backward``: a backward outside
        it adds unscaled gradients, and a clip that does not know the scale (``torch.nn.utils.
        clip_grad_norm_``, ``accelerator.clip_grad_norm_``) clips by the scaled norm. Either would silently
        apply a wrong update (the step divides by the scale)."""
        if self.scaled_grads_unchanged():
            return
        sums = torch.stack([c.grad.sum(dtype=torch.float32) for c in self.store.chunks])
        if not bool(torch.isfinite(sums).all()):  # an overflow: the step is skipped, nothing is applied
            return
        raise RuntimeError(
            "memsched: under fp16 the gradients hold the loss scale, and they changed after the last "
            "sched.backward() (a backward outside it, e.g. loss.backward() or accelerator.backward(), or a "
            "clip "
            "that does not unscale, e.g. torch.nn.utils.clip_grad_norm_ or accelerator.clip_grad_norm_). Use "
            "sched.backward(loss) and sched.clip_grad_norm_(max_norm); nothing was updated")

    def _validate_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        """Gradients that are not (or no longer) the chunk views: ``(param, tensor or None)`` to fix up."""
        fixes = []
        for p in self.store.params():
            g = p.grad
            view = self.store.grad_view(p)
            if g is None:
                fixes.append((p, None))
                continue
            if g.data_ptr() == view.data_ptr() and g.shape == view.shape and g.dtype == view.dtype:
                continue
            if g.shape != p.shape or g.device != view.device or g.dtype != view.dtype or g.is_sparse:
                raise ValueError(
                    f"gradient of parameter {self._name(p)} has shape {tuple(g.shape)}, dtype {g.dtype}, "
                    f"device {g.device}{' (sparse)' if g.is_sparse else ''}; expected a dense gradient of "
                    f"shape {tuple(p.shape)}, dtype {view.dtype}, device {view.device}"
                )
            fixes.append((p, g))
        return fixes

    def _sync_user_param_writes(self) -> None:
        """Refresh master weights from parameters the user wrote in place since the last step
        (``model.load_state_dict``, ``nn.init``, ``with torch.no_grad(): p.copy_(...)``: their version
        counters moved). Only elements whose value differs from the master as the compute dtype rounds it
        are taken: loading a model state dict after the optimizer's (whose fp32 ``master_weight`` it rounds
        to) keeps the full-precision masters, in either order."""
        for c in self.store.chunks:
            changed = [(p, r) for p, r in zip(c.params, c.ranges, strict=True)
                       if p._version != self._param_versions.get(id(p), p._version)]
            if not changed or c.master is None:
                continue  # fp32 on the device: the compute buffer is the master already
            with self.store.alloc.host_context():
                c.wait_h2d()
                for _p, (off, n) in changed:
                    a, b = max(off, c.lo), min(off + n, c.hi)
                    if a >= b:
                        continue
                    master = c.master[a - c.lo:b - c.lo]
                    new = c.data[a:b].to(master.device)
                    written = new != master.to(new.dtype)
                    master.copy_(torch.where(written, new.float(), master))

    def _found_inf(self, chunks: list[Chunk]) -> bool:
        """fp16: True when any gradient in the (device-resident) gradient buffers is inf/NaN, on any rank; the
        loss scale backs off (True) or may grow (False). Whole buffers, not only this rank's shards: an inf
        anywhere skips the step."""
        scaler = self.scaler
        assert scaler is not None
        # A float32 sum of fp16 values is finite iff every value is (|sum| <= 65504 * numel << fp32 max).
        sums = torch.stack([c.grad.sum(dtype=torch.float32) for c in chunks])
        found = self.dp.reduce_found_inf((~torch.isfinite(sums).all()).float().reshape(1).cpu())
        scaler.update(found)
        with self.store.alloc.host_context():  # the host has waited for the device already (found)
            self._spec_inv = scaler.inv_scale("cpu")  # of the next backward, for its updates during it
        return bool(found.item() > 0)

    # ---- clipping -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, params: Sequence[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of ``params`` (the model's trainable parameters, in the model's order) to a
        total norm of ``max_norm``; returns the total norm before clipping (a float32 scalar on the device).

        Without a loss scale this is ``torch.nn.utils.clip_grad_norm_`` on the gradients in place, so the
        result is the one the user would get from torch. With fp16 loss scaling it is what GradScaler users
        get from ``scaler.unscale_(opt); clip_grad_norm_(...)`` on fp32 master gradients: the norms are those
        of the fp32 unscaled gradients (computed one chunk at a time, never in fp16, so a scaled norm above
        65504 is no overflow), and the coefficient is applied in fp32 inside :meth:`step` after unscaling
        (``p.grad`` keeps the scaled fp16 values). Call it after backward and before :meth:`step`.
        """
        if self.scaler is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        from memsched.optim.clipping import clip_coefficient, total_norm

        inv = self.scaler.inv_scale(self.store.alloc.device)
        by_chunk: dict[int, list[torch.nn.Parameter]] = {}
        for p in params:
            by_chunk.setdefault(self.store.param_chunk[id(p)].index, []).append(p)
        norms: dict[int, torch.Tensor] = {}
        for ps in by_chunk.values():  # fp32 temporaries of one chunk at a time
            grads = [self._fp32_grad(p.grad, None, inv, self._clip_coefs) for p in ps]
            norms.update(zip((id(p) for p in ps), total_norm(grads, norm_type, per_tensor=True), strict=True))
        total = total_norm([norms[id(p)] for p in params], norm_type, of_norms=True)
        self._clip_coefs.append(clip_coefficient(total, max_norm))
        return total
