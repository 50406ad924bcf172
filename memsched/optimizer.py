"""HybridAdamW: AdamW over chunks whose optimizer state lives on the device or in (pinned) host memory.

Idea: DeepSpeed ZeRO-Offload (arXiv 2101.06840: CPU Adam on offloaded state, D2H of gradients, H2D of updated
parameters) with PatrickStar's chunk-wise placement (arXiv 2108.05818): a placement plan decides per chunk
whether its update runs on the device or on the CPU. Every update is :func:`memsched.adam.fused_adamw_`, one
tensor per parameter as in ``torch.optim.AdamW(fused=True)``, whose results it matches bit for bit.

Host chunks' gradients are copied D2H at :meth:`HybridAdamW.step`, not during backward: between backward and
the step anything may write the gradients (``clip_grad_norm_``, ``p.grad.data.mul_()``, an unscale), and no
signal says so reliably (version counters do not move under a dispatch mode or through ``.data``). Copying
once, after all of it, is exact and moves the same bytes with or without clipping; the copies of later chunks
overlap the CPU update of earlier ones.

One difference by design: the parameters' ``.grad`` are views into the chunks and never ``None``, so a
parameter that received no gradient is updated with a zero gradient (as ``torch.optim.AdamW`` does after
``zero_grad(set_to_none=False)``): weight decay and momentum still apply.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from memsched.adam import fused_adamw_
from memsched.chunks import Chunk, ChunkStore, param_pieces
from memsched.precision import LossScaler
from memsched.transfers import Streams, TransferStats
from policies.types import DEVICE, HOST


@functools.cache
def _adamw_default_keys() -> dict[str, Any]:
    """The keys of ``torch.optim.AdamW`` groups in this torch (so our state_dict loads there)."""
    d = dict(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults)
    for k in ("lr", "betas", "eps", "weight_decay"):
        d.pop(k, None)
    return d


def _real(x: Any) -> float | None:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    return float(x)


def check_hyperparameters(group: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate one group's AdamW hyper-parameters; return them as floats.

    Raises:
        ValueError: lr, eps or weight_decay not a finite number >= 0, betas not two numbers in [0, 1),
            amsgrad set (unsupported), or maximize not a bool; the message names the group and the value.
    """
    out: dict[str, Any] = {}
    for key in ("lr", "eps", "weight_decay"):
        v = _real(group.get(key))
        if v is None or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {key} must be a finite number >= 0, got {group.get(key)!r}")
        out[key] = v
    betas = group.get("betas")
    try:
        b1, b2 = (_real(b) for b in betas)
    except (TypeError, ValueError):
        b1 = b2 = None
    if b1 is None or b2 is None or not (0 <= b1 < 1) or not (0 <= b2 < 1):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    out["beta1"], out["beta2"] = b1, b2
    if group.get("amsgrad", False):
        raise ValueError(f"{where}: amsgrad=True is not supported by memsched (allowed: False)")
    maximize = group.get("maximize", False)
    if not isinstance(maximize, bool):
        raise ValueError(f"{where}: maximize must be True or False, got {maximize!r}")
    out["maximize"] = maximize
    return out


def indexed_param_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups as ``torch.optim.Optimizer.state_dict()`` writes them: hyper-parameters plus the
    parameters' indices, numbered across groups in order."""
    groups, idx = [], 0
    for g in param_groups:
        d = {k: v for k, v in g.items() if k != "params"}
        d["params"] = list(range(idx, idx + len(g["params"])))
        idx += len(g["params"])
        groups.append(d)
    return groups


class HybridAdamW(torch.optim.Optimizer):
    """AdamW whose state lives in chunks placed on the device or the host (see the module docstring).

    ``param_groups`` mirror the user's groups (``lr``, ``betas``, ``eps``, ``weight_decay`` per group, read at
    every step, so LR schedulers work). ``state_dict()`` has the format of ``torch.optim.AdamW``.

    Not built directly: :func:`memsched.attach` builds it (it needs the chunks the scheduler made).

    Args:
        store: the chunks.
        groups: the user's param groups (dicts with ``"params"`` and optional hyper-parameters).
        defaults: ``lr``, ``betas``, ``eps``, ``weight_decay``.
        streams: side streams for H2D/D2H (CUDA) or synchronous copies.
        transfers: byte counters updated by every copy.
        scaler: fp16 loss scaler, or ``None``.
        capacity_check: ``f(extra_bytes, what)`` raising when the device cannot hold ``extra_bytes`` more
            (the stand-in device's capacity check), or ``None``.
        names: ``id(param) -> qualified name`` for error messages.
    """

    def __init__(self, store: ChunkStore, groups: Sequence[dict[str, Any]], *, defaults: dict[str, Any],
                 streams: Streams, transfers: TransferStats, scaler: LossScaler | None = None,
                 capacity_check: Callable[[int, str], None] | None = None,
                 names: dict[int, str] | None = None) -> None:
        full = {**_adamw_default_keys(), **defaults}
        super().__init__([dict(g) for g in groups], full)
        for i, g in enumerate(self.param_groups):
            check_hyperparameters(g, f"param group {i}")
        self.store = store
        self.streams = streams
        self.transfers = transfers
        self.scaler = scaler
        self.capacity_check = capacity_check
        self.names = names or {}
        self.step_end_callbacks: list[Callable[[], None]] = []
        # [zero] memsched.distributed hook points (empty / None in a single process): callbacks run before the
        # update (gradient reductions finish there); ``sharding`` gives whole state dicts and a global fp16
        # overflow check.
        self.before_update_callbacks: list[Callable[[], None]] = []
        self.sharding: Any = None
        self._clip_coefs: list[torch.Tensor] = []  # fp16: clip coefficients applied at the next step
        self._param_versions: dict[int, int] = {}
        self.record_param_versions()

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def _name(self, p: torch.Tensor) -> str:
        return self.names.get(id(p), f"of shape {tuple(p.shape)}")

    def record_param_versions(self) -> None:
        """Remember each parameter's version counter: a later in-place write by the user (``load_state_dict``
        on the model, ``nn.init``) shows as a change and refreshes the master weights at the next step."""
        self._param_versions = {id(p): p._version for p in self.store.params()}

    def _start_d2h(self, c: Chunk) -> None:
        """Copy the gradients of host chunk ``c`` (its shard) to host memory, after all work queued so far on
        the compute stream: everything that may have written them (backward, gradient reductions, clipping)
        comes first. Mixed precision copies in the compute dtype into ``staging`` (upcast on the CPU
        later)."""
        dst = c.staging if c.staging is not None else c.host_grad
        with self.store.alloc.host_context():
            c.wait_h2d()  # the previous step's H2D may still read ``staging``
            c.wait_d2h()
            c.d2h_event = self.streams.copy_d2h(dst, c.grad[c.lo:c.hi])
        self.transfers.add_d2h(c.shard_numel * c.grad.element_size())

    # ---- step ----------------------------------------------------------------------------------------------
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

    def _step_temporary_bytes(self, device_chunks: list[Chunk]) -> int:
        # Mixed precision updates each device chunk from an fp32 copy of its gradients, one chunk at a time.
        mixed = [c for c in device_chunks if c.mixed]
        return max((c.shard_numel * 4 for c in mixed), default=0)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One AdamW step over all chunks.

        Order (each host chunk's gradients are read once, after everything that may write them):
        gradient reductions finish (data parallel); fp16 only: one inf/NaN check over the gradients on the
        device (the loss scale updates, a step with inf/NaN is skipped); the D2H copies of the host chunks'
        gradients start on the side stream; the device chunks are updated; each host chunk is updated on the
        CPU as soon as its gradients arrived, and its parameters go back H2D. fp16 gradients are unscaled with
        the scale of the backward that made them (captured before the scale updates, as
        ``torch.amp.GradScaler`` does), then clipped by the coefficient of :meth:`clip_grad_norm_`, in fp32,
        on whichever side updates them.

        Everything that can fail is checked before the first in-place write, so a step that raises leaves
        parameters and optimizer state exactly as before it.

        Raises:
            ValueError: a group's hyper-parameter is invalid (names the group and value), or a gradient
                has the wrong shape/dtype/device (names the parameter).
            memsched.simdevice.SimOutOfMemoryError: the stand-in device cannot hold the step's temporaries.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hps = [check_hyperparameters(g, f"param group {i}") for i, g in enumerate(self.param_groups)]
        fixes = self._validate_grads()
        chunks = self.store.chunks
        device_chunks = [c for c in chunks if c.placement == DEVICE]
        host_chunks = [c for c in chunks if c.placement == HOST]
        if self.capacity_check is not None:
            self.capacity_check(self._step_temporary_bytes(device_chunks), "optimizer step temporaries")
        # ---- no failure expected below this line: in-place writes start -----------------------------------
        for p, g in fixes:
            view = self.store.grad_view(p)
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view
        self._sync_user_param_writes()
        for cb in list(self.before_update_callbacks):  # [zero]
            cb()
        coefs, self._clip_coefs = self._clip_coefs, []
        inv_scale = None
        if self.scaler is not None:
            inv_scale = self.scaler.inv_scale(self.store.alloc.device)  # before the scale updates
            if self._found_inf(chunks):
                self.scaler.skipped_steps += 1
                self._finish_step()
                return loss
        for c in host_chunks:
            self._start_d2h(c)
        # Device chunks first (the device works while the CPU updates the host chunks).
        for gi, hp in enumerate(hps):
            self._update_device(gi, hp, [c for c in device_chunks if c.group == gi], inv_scale, coefs)
        if host_chunks:
            with self.store.alloc.host_context():
                inv_host = inv_scale.cpu() if inv_scale is not None else None
                coefs_host = [k.cpu() for k in coefs]
            for c in host_chunks:
                self._update_host(c, hps[c.group], inv_host, coefs_host)
        self._finish_step()
        return loss

    def _finish_step(self) -> None:
        self.record_param_versions()
        self.transfers.end_step()
        for cb in list(self.step_end_callbacks):
            cb()

    def _sync_user_param_writes(self) -> None:
        """Refresh master weights from parameters the user wrote in place since the last step."""
        for c in self.store.chunks:
            changed = [(p, r) for p, r in zip(c.params, c.ranges, strict=True)
                       if p._version != self._param_versions.get(id(p), p._version)]
            if not changed or c.master is None:
                continue  # fp32 on the device: the compute buffer is the master already
            with self.store.alloc.host_context():
                c.wait_h2d()
                for _p, (off, n) in changed:
                    a, b = max(off, c.lo), min(off + n, c.hi)
                    if a < b:
                        c.master[a - c.lo:b - c.lo].copy_(c.data[a:b])

    def _found_inf(self, chunks: list[Chunk]) -> bool:
        """fp16: True when any gradient in the (device-resident) gradient buffers is inf/NaN, on any rank; the
        loss scale backs off (True) or may grow (False). Whole buffers, not only this rank's shards: an inf
        anywhere skips the step."""
        scaler = self.scaler
        assert scaler is not None
        # A float32 sum of fp16 values is finite iff every value is (|sum| <= 65504 * numel << fp32 max).
        sums = torch.stack([c.grad.sum(dtype=torch.float32) for c in chunks])
        found = (~torch.isfinite(sums).all()).float().reshape(1).cpu()
        if self.sharding is not None:  # [zero] skip on every rank when any rank overflowed
            found = self.sharding.reduce_found_inf(found)
        scaler.update(found)
        return bool(found.item() > 0)

    @staticmethod
    def _fp32_grad(g: torch.Tensor, out: torch.Tensor | None, inv_scale: torch.Tensor | None,
                   coefs: list[torch.Tensor]) -> torch.Tensor:
        """``g`` as fp32 (into ``out`` when given), unscaled then clipped: the same IEEE operations, in the
        same order, as GradScaler's unscale and ``clip_grad_norm_`` on fp32 master gradients."""
        if out is None:
            out = g.float() if g.dtype != torch.float32 else g
        elif out is not g:
            out.copy_(g)
        if inv_scale is not None:
            out.mul_(inv_scale)
        for k in coefs:
            out.mul_(k)
        return out

    @staticmethod
    def _adamw(chunks: list[Chunk], masters: list[torch.Tensor], grads: list[torch.Tensor],
               hp: dict[str, Any]) -> None:
        """One fused AdamW call over ``chunks``, given each chunk's fp32 master and gradient of its shard
        (``[hi - lo]``). The kernel gets one tensor per parameter (per parameter piece of the shard), as
        ``torch.optim.AdamW`` does: torch's CPU kernel computes the last ``numel % vector width`` elements of
        each tensor on a scalar path whose rounding differs, so flat chunk-sized tensors would not be
        bit-exact. The chunks' step counts are incremented once each."""
        ps, gs, ms, vs, steps = [], [], [], [], []
        for c, master, grad in zip(chunks, masters, grads, strict=True):
            for piece in param_pieces(c.ranges, c.lo, c.hi):
                if piece is None:
                    continue
                sl = slice(piece.shard_start, piece.shard_start + piece.numel)
                ps.append(master[sl])
                gs.append(grad[sl])
                ms.append(c.exp_avg[sl])
                vs.append(c.exp_avg_sq[sl])
                steps.append(c.step)
        torch._foreach_add_([c.step for c in chunks], 1)
        fused_adamw_(ps, gs, ms, vs, steps, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                     weight_decay=hp["weight_decay"], maximize=hp["maximize"], increment_steps=False)

    def _update_device(self, gi: int, hp: dict[str, Any], chunks: list[Chunk],
                       inv_scale: torch.Tensor | None, coefs: list[torch.Tensor]) -> None:
        if not chunks:
            return
        fp32 = [c for c in chunks if not c.mixed]
        if fp32:  # one fused call over all fp32 device chunks of the group
            self._adamw(fp32, [c.data[c.lo:c.hi] for c in fp32], [c.grad[c.lo:c.hi] for c in fp32], hp)
            for c in fp32:
                self.store.after_update(c)
        for c in chunks:
            if not c.mixed:
                continue
            # One chunk at a time: the fp32 gradient copy is a temporary of one chunk, not of all of them.
            g = self._fp32_grad(c.grad[c.lo:c.hi], None, inv_scale, coefs)
            self._adamw([c], [c.master], [g], hp)
            del g
            c.data[c.lo:c.hi].copy_(c.master)
            self.store.after_update(c)

    def _update_host(self, c: Chunk, hp: dict[str, Any], inv_scale: torch.Tensor | None,
                     coefs: list[torch.Tensor]) -> None:
        with self.store.alloc.host_context():
            c.wait_d2h()
            src = c.staging if c.staging is not None else c.host_grad
            self._fp32_grad(src, c.host_grad, inv_scale, coefs)  # upcast on the CPU
            self._adamw([c], [c.master], [c.host_grad], hp)
            src = c.master
            if c.staging is not None:  # cast on the CPU, so the H2D copy is a plain pinned copy
                c.staging.copy_(c.master)
                src = c.staging
            c.h2d_event = self.streams.copy_h2d(c.data[c.lo:c.hi], src)
        self.transfers.add_h2d(c.shard_numel * c.data.element_size())
        self.store.after_update(c)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (the ``.grad`` views stay: they are never set to ``None``), reset
        the per-chunk readiness and drop a pending fp16 clip coefficient."""
        self._clip_coefs = []
        self.store.zero_grad()

    # ---- clipping ------------------------------------------------------------------------------------------
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
        from memsched.clipping import clip_coefficient, total_norm

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

    # ---- state_dict ----------------------------------------------------------------------------------------
    def _param_index(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """The format of ``torch.optim.AdamW.state_dict()``: ``state`` maps the parameter index (in
        param-group order) to ``step`` (float32 scalar), ``exp_avg`` and ``exp_avg_sq`` (fp32, shaped like the
        parameter), all CPU copies; under mixed precision also ``master_weight`` (fp32, shaped like the
        parameter). ``param_groups`` hold the hyper-parameters and parameter indices."""
        if self.sharding is not None:  # [zero] gathered whole from the ranks' pieces (a collective)
            return self.sharding.state_dict(self)
        state: dict[int, dict[str, torch.Tensor]] = {}
        params = self._param_index()
        with torch.no_grad(), self.store.alloc.host_context():  # host copies: never device memory
            for i, p in enumerate(params):
                c = self.store.param_chunk[id(p)]
                off, n = self.store.param_range[id(p)]
                sl = slice(off - c.lo, off - c.lo + n)
                st = {
                    "step": c.step.detach().to("cpu", copy=True).reshape(()),
                    "exp_avg": c.exp_avg[sl].to("cpu", copy=True).view(p.shape),
                    "exp_avg_sq": c.exp_avg_sq[sl].to("cpu", copy=True).view(p.shape),
                }
                if c.mixed:
                    st["master_weight"] = c.master_view()[sl].to("cpu", copy=True).view(p.shape)
                state[i] = st
        return {"state": state, "param_groups": indexed_param_groups(self.param_groups)}

    def validate_state_dict(
        self, state_dict: dict[str, Any]
    ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, float]]:
        """Check a state dict against this optimizer without writing anything.

        Returns:
            the saved state per parameter (keyed by ``id(param)``; parameters without state are absent)
            and the step count per chunk index.

        Raises:
            ValueError: as :meth:`load_state_dict`.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("optimizer state dict must be a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, this optimizer has "
                             f"{len(self.param_groups)}")
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"param group {i} of the state dict has {len(sg['params'])} parameters, "
                                 f"this optimizer's has {len(g['params'])}")
            check_hyperparameters({**g, **{k: v for k, v in sg.items() if k != "params"}}, f"param group {i}")
        saved_state = state_dict["state"]
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for sg, g in zip(saved_groups, self.param_groups, strict=True):
            for key, p in zip(sg["params"], g["params"], strict=True):
                st = saved_state.get(key)
                if st is None or len(st) == 0:
                    continue
                for k in ("step", "exp_avg", "exp_avg_sq"):
                    if k not in st:
                        raise ValueError(f"state of parameter {self._name(p)} lacks {k!r}")
                for k in ("exp_avg", "exp_avg_sq", "master_weight"):
                    if k in st and tuple(st[k].shape) != tuple(p.shape):
                        raise ValueError(f"state {k!r} of parameter {self._name(p)} has shape "
                                         f"{tuple(st[k].shape)}, expected {tuple(p.shape)}")
                per_param[id(p)] = st
        steps: dict[int, float] = {}
        for c in self.store.chunks:
            vals = {float(per_param[id(p)]["step"]) if id(p) in per_param else 0.0 for p in c.params}
            if len(vals) > 1:
                raise ValueError(f"parameters of chunk {c.index} have different step counts {sorted(vals)}; "
                                 "memsched keeps one step count per chunk")
            steps[c.index] = vals.pop()
        return per_param, steps

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of :meth:`state_dict` or ``torch.optim.AdamW`` (same parameter order).

        Parameters without state get zero moments and step 0. All checks run before anything is written.

        Raises:
            ValueError: the group count or sizes differ, a tensor has the wrong shape, a state lacks a key, or
                parameters of one chunk have different step counts (memsched keeps one per chunk).
        """
        if self.sharding is not None:  # [zero] each rank keeps its pieces of the whole state dict
            return self.sharding.load_state_dict(self, state_dict)
        per_param, steps = self.validate_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        # ---- write ---------------------------------------------------------------------------------------
        with torch.no_grad(), self.store.alloc.host_context():
            for c in self.store.chunks:
                c.wait_h2d()
                for p, (off, n) in zip(c.params, c.ranges, strict=True):
                    st = per_param.get(id(p))
                    sl = slice(off - c.lo, off - c.lo + n)
                    for k, dst in (("exp_avg", c.exp_avg), ("exp_avg_sq", c.exp_avg_sq)):
                        if st is None:
                            dst[sl].zero_()
                        else:
                            dst[sl].copy_(st[k].reshape(-1))
                    if c.master is not None:
                        if st is not None and "master_weight" in st:
                            c.master[sl].copy_(st["master_weight"].reshape(-1))
                        else:
                            c.master[sl].copy_(c.data[off:off + n])
                c.step.fill_(steps[c.index])
        for sg, g in zip(saved_groups, self.param_groups, strict=True):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        self.record_param_versions()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: chunks are built once for the parameters given to
        :func:`memsched.attach`.

        Raises:
            RuntimeError: called after construction.
        """
        if getattr(self, "store", None) is not None:
            raise RuntimeError("HybridAdamW cannot take new param groups after attach; pass all groups to "
                               "memsched.attach(params=[...])")
        super().add_param_group(param_group)


def hyperparameter_groups(params: Iterable[Any] | None, model: torch.nn.Module) -> list[dict[str, Any]]:
    """Normalise ``params`` (None, an iterable of parameters, or of group dicts) into group dicts with
    trainable parameters only (frozen ones dropped; tied ones once).

    Raises:
        ValueError: a group has no ``"params"``, a parameter appears in two groups, or nothing is trainable.
    """
    if params is None:
        raw: list[dict[str, Any]] = [{"params": list(model.parameters())}]
    else:
        items = list(params)
        if items and all(isinstance(x, dict) for x in items):
            raw = [dict(x) for x in items]
        elif any(isinstance(x, dict) for x in items):
            raise ValueError("params must be all parameters or all param-group dicts, not a mix")
        else:
            raw = [{"params": items}]
    seen: set[int] = set()
    groups = []
    for i, g in enumerate(raw):
        if "params" not in g:
            raise ValueError(f"param group {i} has no 'params' key")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        kept = []
        for p in ps:
            if not isinstance(p, torch.nn.Parameter):
                raise ValueError(f"param group {i} holds a {type(p).__name__}, expected nn.Parameter")
            if id(p) in seen:
                if any(p is q for q in kept):
                    continue  # tied twice in one group: once is enough
                raise ValueError(f"a parameter of shape {tuple(p.shape)} appears in two param groups")
            if p.requires_grad:
                seen.add(id(p))
                kept.append(p)
        if kept:
            groups.append({**g, "params": kept})
    if not groups:
        raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to optimize")
    return groups
