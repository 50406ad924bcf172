"""References for the bit-exact numerics tests: what a memsched-wrapped run must equal, step for step.

``Reference`` is plain PyTorch: ``torch.optim.AdamW(fused=True)`` over fp32 parameters (fp32), or over fp32
master weights copied into a low-precision model before each forward (bf16, fp16), with gradient clipping by
``torch.nn.utils.clip_grad_norm_`` and, for fp16, GradScaler's semantics (the scale multiplies the loss, the
gradients are unscaled in fp32 before clipping, a step with inf/NaN is skipped, ``torch._amp_update_scale_``
grows and backs off the scale).

On CUDA, memsched updates host-resident chunks with torch's CPU fused AdamW kernel, which rounds differently
from the CUDA kernel (fused multiply-adds), so ``Reference.step(..., on_host=...)`` runs the update of those
parameters on the CPU: the reference is ``torch.optim.AdamW(fused=True)`` on the device where memsched runs
each parameter's update.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Iterator

import torch
from torch import nn

from memsched.chunks import PARAM_ALIGN
from memsched.models.gpt import GPT, GPTConfig, lm_loss

LR, WD = 1e-2, 0.1
SIM = torch.device("privateuseone", 0)  # the stand-in, sim:0 once loaded (tests/conftest.py)


def to_dev(obj, device: torch.device | str = SIM):
    """``obj`` with every tensor in it (tuples and lists too) on ``device``."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_dev(x, device) for x in obj)
    return obj


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` wherever each tensor lives (host views and device tensors alike)."""
    return torch.equal(a.detach().cpu(), b.detach().cpu())


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """A reference's work beside a scheduler: its allocations on the stand-in are not counted against the
    capacity, and the warmup tracer (a dispatch mode of this thread) does not see it."""
    from torch.utils._python_dispatch import _disable_current_modes

    from memsched.devices import sim_backend

    with sim_backend.uncounted(), _disable_current_modes():
        yield


def tiny_gpt(seed: int = 0) -> GPT:
    """Tied embeddings, nn.MultiheadAttention (reads out_proj's parameters without calling it)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))


def gpt_batches(n: int, seed: int = 1, batch: int = 2, seq: int = 16, device: torch.device | str = SIM,
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (inputs, targets) token batches on ``device`` (default the stand-in, where the models train)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 256, (batch, seq + 1), generator=g).to(device)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return lm_loss(model, *batch)


class Reference:
    """Plain-PyTorch training of a copy of ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float32, *, lr: float = LR,
                 weight_decay: float = WD, growth_interval: int = 2000,
                 device: torch.device | str | None = SIM) -> None:
        self.dtype = dtype
        self.device = device
        with uncounted():  # beside the scheduler's data on the stand-in, not counted against its capacity
            self._init(model, dtype, lr, weight_decay, growth_interval)

    def _init(self, model: nn.Module, dtype: torch.dtype, lr: float, weight_decay: float,
              growth_interval: int) -> None:
        device = self.device
        self.model = copy.deepcopy(model) if device is None else copy.deepcopy(model).to(device)
        params = list(self.model.parameters())
        if dtype == torch.float32:
            self.masters = params
        else:
            self.masters = [p.detach().clone().requires_grad_(True) for p in params]
            self.model.to(dtype)
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay, fused=True)
        dev = params[0].device
        self.scale = torch.full((1,), 2.0**16, device=dev) if dtype == torch.float16 else None
        self.tracker = torch.zeros((1,), dtype=torch.int32, device=dev)
        self.growth_interval = growth_interval
        self.skipped = 0
        self._on_host: Collection[int] = ()
        self._clip_on_host = False
        self._clip_devices: list[str | None] | None = None

    def sync(self) -> None:
        """The low-precision model takes the masters' values (rounded)."""
        if self.dtype != torch.float32:
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.masters, strict=True):
                    p.copy_(m)

    def step(self, batch, loss_fn: Callable, clip: float | None, on_host: Collection[int] = (), *,
             clip_on_host: bool = False, clip_devices: list[str | None] | None = None) -> None:
        """One training step over ``batch`` (a list: micro-batches whose gradients accumulate, one backward
        each); ``on_host``: indices (in ``model.parameters()`` order) whose AdamW update runs on the CPU
        (where memsched keeps their chunk); ``clip_on_host``: the clip's norm is computed over CPU copies of
        the gradients (where torch's clip finds them between memsched's steps when every chunk's gradients
        are on the host)."""
        self._on_host = on_host
        self._clip_on_host = clip_on_host
        self._clip_devices = clip_devices
        with uncounted():
            self._step(batch if self.device is None else to_dev(batch, self.device), loss_fn, clip)
            self.sync()

    @contextlib.contextmanager
    def _update_on_host(self) -> Iterator[None]:
        """The masters in ``self._on_host``, their gradients and AdamW state are on the CPU for the update."""
        moved = [m for i, m in enumerate(self.masters) if i in self._on_host and m.device.type != "cpu"]

        def move(m: torch.Tensor, dev: torch.device) -> None:
            m.data = m.data.to(dev)
            if m.grad is not None:
                m.grad = m.grad.to(dev)
            state = self.opt.state.get(m, {})
            for k, v in state.items():
                if torch.is_tensor(v):
                    state[k] = v.to(dev)

        home = moved[0].device if moved else None
        for m in moved:
            move(m, torch.device("cpu"))
        try:
            yield
        finally:
            for m in moved:
                move(m, home)

    def _clip(self, params: list[torch.Tensor], clip: float) -> None:
        if self._clip_devices is not None:
            # torch's clip_grad_norm_ over memsched's model, whose gradients were on these devices: the
            # per-tensor norms stacked grouped by device (first-seen device first), as torch groups them
            # (the same gradients on the same devices: torch groups and orders them itself)
            placed = [p.grad.to(d) for p, d in zip(params, self._clip_devices, strict=True)
                      if p.grad is not None and d is not None]
            total = torch.nn.utils.get_total_norm(placed).to(params[0].device)
            torch.nn.utils.clip_grads_with_norm_(params, clip, total)
            return
        if not self._clip_on_host:
            torch.nn.utils.clip_grad_norm_(params, clip)
            return
        norm = torch.nn.utils.get_total_norm([p.grad.cpu() for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)

    def _adamw_step(self) -> None:
        with self._update_on_host():
            self.opt.step()

    def _step(self, batch, loss_fn: Callable, clip: float | None) -> None:
        params = list(self.model.parameters())
        for micro in batch if isinstance(batch, list) else [batch]:
            loss = loss_fn(self.model, micro)
            (loss.float() * self.scale if self.scale is not None else loss).backward()
        if self.dtype == torch.float32:
            if clip is not None:
                self._clip(params, clip)
            self._adamw_step()
            self.opt.zero_grad()
            return
        if self.dtype == torch.bfloat16 and clip is not None:  # clipped in the compute dtype, as users do
            self._clip(params, clip)
        grads = [p.grad.float() for p in params]
        self.model.zero_grad()
        if self.scale is not None:  # GradScaler: unscale in fp32, skip on inf/NaN, then clip
            found = torch.zeros(1, device=self.scale.device)
            inv = self.scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            torch._amp_update_scale_(self.scale, self.tracker, found, 2.0, 0.5, self.growth_interval)
            if found.item():
                self.skipped += 1
                return
        for m, g in zip(self.masters, grads, strict=True):
            m.grad = g
        if self.dtype == torch.float16 and clip is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, clip)
        self._adamw_step()
        self.opt.zero_grad()


def assert_same(model: nn.Module, ref: Reference, what: str = "", optimizer=None) -> None:
    """Parameters (and, given memsched's optimizer in mixed precision, the fp32 masters) equal bit for bit."""
    pairs = [(n, p, q) for (n, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True)]
    if optimizer is not None and ref.dtype != torch.float32:
        state = optimizer.state_dict()["state"]
        pairs += [(f"master of {n}", state[i]["master_weight"], m)
                  for i, ((n, _), m) in enumerate(zip(model.named_parameters(), ref.masters, strict=True))]
    for name, p, q in pairs:
        assert p.dtype == q.dtype, name
        p, q = p.detach().cpu(), q.detach().cpu()  # host views and device tensors alike
        if not torch.equal(p, q):
            d = (p.detach().float() - q.detach().float()).abs().max().item()
            raise AssertionError(f"{what}: {name} differs from the reference (max diff {d:.3g})")


def count_grad_copies(monkeypatch, copies: list) -> None:
    """Record in ``copies`` (shapes) every gradient that autograd allocated outside its chunk view and
    memsched had to copy in (``GradBuffers.rebind``); an empty list means gradients stayed in the
    chunks."""
    from memsched.chunks.gradients import GradBuffers

    original = GradBuffers.rebind

    def counted(self, p, c=None):
        if p.grad is not None and p.grad.data_ptr() != self.view(p, c).data_ptr():
            copies.append(tuple(p.shape))
        return original(self, p, c)

    monkeypatch.setattr(GradBuffers, "rebind", counted)


# Branchy's chunks (one rank): inp.weight, inp.bias, a.weight, a.bias | b.weight, b.bias, out.weight,
# out.bias, each parameter at a multiple of PARAM_ALIGN elements ([Note: parameter alignment in chunks]).
BRANCHY_CHUNK_NUMEL = 5 * PARAM_ALIGN + 4


class Branchy(nn.Module):
    """``b`` runs only when ``use_b``: its parameters get no gradient in some steps. With the default sizes
    and ``chunk_numel=BRANCHY_CHUNK_NUMEL`` chunk 0 holds inp and a (always used), chunk 1 b (sometimes) and
    out (always used)."""

    def __init__(self, d_in: int = 8, width: int = 16, d_out: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(d_in, width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.out = nn.Linear(width, d_out)
        self.use_b = True

    def forward(self, x):
        h = torch.tanh(self.a(torch.tanh(self.inp(x))))
        if self.use_b:
            h = h + torch.tanh(self.b(h))
        return self.out(h)
