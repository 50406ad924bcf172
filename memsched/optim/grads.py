"""The checks of a step of :class:`memsched.optim.hybrid_adamw.HybridAdamW`, made before anything is written:
the gradients are the chunk views or are copied back into them; fp16 gradients come from ``sched.backward``;
parameters the user wrote in place refresh the fp32 masters; the fp16 inf/NaN check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import increment_version

from memsched.chunks import Chunk, ChunkStore
from memsched.chunks.sharded_grad import is_sharded
from memsched.devices.host_alias import settle


class GradChecks:
    """Owns what the checks remember between steps: each parameter's version counter after the last step,
    the gradients' versions after the last scaled backward (fp16), and the inverse loss scale of the next
    backward (fp16).

    Args:
        store: the chunks.
        dp: the data parallelism (an inf/NaN on any rank skips the step everywhere).
        scaler: the fp16 loss scaler, or ``None``.
        name: ``name(param)``, the parameter's qualified name for error messages.
    """

    def __init__(self, store: ChunkStore, dp: Any, scaler: Any, name: Callable[[torch.Tensor], str]) -> None:
        self._store = store
        self._dp = dp
        self._scaler = scaler
        self._name = name
        self._param_versions: dict[int, int] = {}
        self._scaled_versions: list[Any] | None = None  # fp16: grad signatures after sched.backward
        # fp16: the next backward's inverse scale, on the host
        self.next_inv_scale: torch.Tensor | None = None
        # parameters given to attach frozen: torch's AdamW over the same groups updates them once they have a
        # gradient, memsched built no state for them (refused at the step: check_frozen_given)
        self.frozen_given: tuple[torch.nn.Parameter, ...] = ()
        self.record_param_versions()

    # ---- parameter versions -------------------------------------------------------------------------------
    def record_param_versions(self, params: Any = None) -> None:
        """Remember the version counter of ``params`` (default: every parameter): a later in-place write by
        the user (``load_state_dict`` on the model, ``nn.init``) shows as a change and refreshes the master
        weights at the next step."""
        if params is None:
            self._param_versions = {id(p): p._version for p in self._store.params()}
        else:
            self._param_versions.update((id(p), p._version) for p in params)

    def sync_user_param_writes(self) -> None:
        """Refresh master weights from parameters the user wrote in place since the last step
        (``model.load_state_dict``, ``nn.init``, ``with torch.no_grad(): p.copy_(...)``: their version
        counters moved). Only elements whose value differs from the master as the compute dtype rounds it are
        taken: loading a model state dict after the optimizer's (whose fp32 ``master_weight`` it rounds to)
        keeps the full-precision masters, in either order."""
        store = self._store
        for c in store.trainable_chunks:
            changed = [(p, r) for p, r in zip(c.params, c.ranges, strict=True)
                       if p._version != self._param_versions.get(id(p), p._version)]
            if not changed or c.master is None:
                continue  # fp32 on the device: the compute buffer is the master already
            if store.bindings.host_bound(c):  # written through the views, by device kernels on CUDA
                settle(c.device)
            if store.bindings.host_bound(c) and not c.mixed:
                # fp32 host-bound: the parameters are views of the master itself, written already; the
                # state's version counter says so (an update made during backward from the old values is
                # then not committed: memsched.optim.early_update)
                increment_version(c.master)
                continue
            with store.alloc.host_context():
                c.wait_h2d()
                values = store.values(c)  # what the parameters show (their host copy while host-bound)
                for _p, (off, n) in changed:
                    a, b = max(off, c.lo), min(off + n, c.hi)
                    if a >= b:
                        continue
                    master = c.master[a - c.lo:b - c.lo]
                    new = values[a - c.lo:b - c.lo].to(master.device)
                    written = new != master.to(new.dtype)
                    master.copy_(torch.where(written, new.float(), master))

    # ---- gradients ----------------------------------------------------------------------------------------
    def validate_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        """Gradients that are not (or no longer) the chunk views: ``(param, tensor or None)`` to fix up.

        Raises:
            ValueError: a gradient has the wrong shape, dtype or device, or is sparse (names the parameter).
            RuntimeError: a parameter given to attach frozen has a gradient (it was unfrozen after attach):
                ``torch.optim.AdamW`` would update it, memsched has no state for it (names it and the
                re-attach recipe).
        """
        for p in self.frozen_given:
            if p.grad is not None:
                raise RuntimeError(
                    f"parameter {self._name(p)} was frozen (requires_grad=False) when memsched.attach was "
                    "called and has a gradient now: torch.optim.AdamW over the same params would update it, "
                    "but memsched built no optimizer state for it, so this step would silently leave it "
                    "as it is. Nothing was updated. To unfreeze, attach again with the same groups and "
                    "carry the state over: state = sched.optimizer.state_dict(); sched.close(); "
                    "sched = memsched.attach(model, params=<the same groups>); "
                    "sched.optimizer.load_state_dict(state) (docs/training-code.md: Progressive unfreezing). "
                    "To keep it frozen, set requires_grad_(False) and its .grad to None")
        fixes = []
        store = self._store
        for p in store.params():
            g = p.grad
            if g is None:
                fixes.append((p, None))
                continue
            c = store.param_chunk[id(p)]
            if is_sharded(g) and c.grad_shard is not None:  # ZeRO-2: reduced into the chunk's shard
                continue
            host_bound = store.bindings.host_bound(c)
            if host_bound or c.grad is not None:
                view = store.host_view("grad", p, c) if host_bound else store.grads.view(p, c)
                if g.data_ptr() == view.data_ptr() and g.shape == view.shape and g.dtype == view.dtype:
                    continue
            dtype = c.dtype  # the gradient buffer's
            # a host-bound gradient reads as its user view does: the compute device (a host view where the
            # device cannot read the host buffer in place: pageable memory on CUDA)
            device = (store.user_view("grad", p, c).device if host_bound and c.grad_host is not None
                      else c.device)
            if g.shape != p.shape or g.device != device or g.dtype != dtype or g.is_sparse:
                raise ValueError(
                    f"gradient of parameter {self._name(p)} has shape {tuple(g.shape)}, dtype {g.dtype}, "
                    f"device {g.device}{' (sparse)' if g.is_sparse else ''}; expected a dense gradient of "
                    f"shape {tuple(p.shape)}, dtype {dtype}, device {device}"
                )
            fixes.append((p, g))
        for p, g in fixes:  # gradients set by hand into a chunk without a buffer: allocated before any write
            if g is not None and not store.bindings.param_host_bound(p):
                store.grads.alloc(store.param_chunk[id(p)])
        return fixes

    # ---- fp16 ---------------------------------------------------------------------------------------------
    def _signatures(self) -> list[Any]:
        """What changes whenever any gradient is written: each chunk's device buffer signature and, for host
        chunks, the version of their host gradients and of the views users write them through (``p.grad``
        reads as the device: [Note: parameters read where they compute]), and which parameters hold one."""
        store = self._store
        return [(c.grad_signature(), store.grads.host_versions(c),
                 sum(1 for p in c.params if id(p) in store.grads.host_grads)) for c in store.trainable_chunks]

    def note_scaled_backward(self) -> None:
        """fp16: :meth:`memsched.Scheduler.backward` ran a backward of the scaled loss; the gradients as they
        are now hold the loss scale, and the step checks that nothing changed them since."""
        self._scaled_versions = self._signatures()

    def scaled_grads_unchanged(self) -> bool:
        """fp16: nothing wrote the gradients since the last :meth:`note_scaled_backward`."""
        return self._scaled_versions == self._signatures()

    def check_scaled_grads(self) -> None:
        """fp16: refuse a step whose gradients changed after the last ``sched.backward``: a backward outside
        it adds unscaled gradients, and a clip that does not know the scale (``torch.nn.utils.
        clip_grad_norm_``, ``accelerator.clip_grad_norm_``) clips by the scaled norm. Either would silently
        apply a wrong update (the step divides by the scale).

        Raises:
            RuntimeError: the gradients changed and are finite (an overflow skips the step instead).
        """
        if self.scaled_grads_unchanged():
            return
        sums = _sums(self._store, [c for c in self._store.chunks if self._store.grads.has(c)])
        if not bool(torch.isfinite(sums).all()):  # an overflow: the step is skipped, nothing is applied
            return
        raise RuntimeError(
            "memsched: under fp16 the gradients hold the loss scale, and they changed after the last "
            "sched.backward() (a backward outside it, e.g. loss.backward() or accelerator.backward(), or a "
            "clip "
            "that does not unscale, e.g. torch.nn.utils.clip_grad_norm_ or accelerator.clip_grad_norm_). Use "
            "sched.backward(loss) and sched.clip_grad_norm_(max_norm); nothing was updated")

    def found_inf(self, chunks: list[Chunk]) -> bool:
        """fp16: True when any gradient in the (device-resident) gradient buffers is inf/NaN, on any rank; the
        loss scale backs off (True) or may grow (False), and :attr:`next_inv_scale` is the next backward's.
        Whole buffers, not only this rank's shards: an inf anywhere skips the step."""
        scaler = self._scaler
        assert scaler is not None
        # A float32 sum of fp16 values is finite iff every value is (|sum| <= 65504 * numel << fp32 max).
        sums = _sums(self._store, chunks)
        found = self._dp.reduce_found_inf((~torch.isfinite(sums).all()).float().reshape(1).cpu())
        scaler.update(found)
        with self._store.alloc.host_context():  # the host has waited for the device already (found)
            self.next_inv_scale = scaler.inv_scale("cpu")  # of the next backward, for its updates during it
        return bool(found.item() > 0)


def _sums(store: ChunkStore, chunks: list[Chunk]) -> torch.Tensor:
    """Each chunk's gradients summed in fp32 (``[len(chunks)]``; ``[1]`` zeros without any): the device
    buffer, and for a host chunk its host gradients too (on the CPU), on the device buffer's device."""
    if not chunks:
        return torch.zeros(1)
    out = []
    for c in chunks:
        total = c.grad.sum(dtype=torch.float32) if c.grad is not None else None
        if c.grad_shard is not None:  # ZeRO-2: the reduced shard (an inf on any rank skips everywhere)
            shard = c.grad_shard.sum(dtype=torch.float32)
            total = shard if total is None else total + shard
        held = [p for p in c.params if id(p) in store.grads.host_grads] if store.offloads(c) else []
        if held:  # only the parameters that hold a host gradient (the rest of the buffer is stale)
            with store.alloc.host_context():
                host = torch.stack([store.host_view("grad", p, c).sum(dtype=torch.float32) for p in held])
                host = host.sum().to(c.device)
            total = host if total is None else total + host
        out.append(total)
    return torch.stack(out)
