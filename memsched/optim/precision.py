"""Mixed precision: the compute dtype and fp16 dynamic loss scaling.

Parameters are computed in bf16/fp16 with fp32 master weights in the chunks (mixed-precision training,
Micikevicius et al. 2017; DeepSpeed/PatrickStar keep the fp32 master next to the optimizer state). fp16 needs
dynamic loss scaling; the scale update is torch's own ``torch._amp_update_scale_`` (the kernel behind
``torch.amp.GradScaler``), so the growth/backoff semantics are GradScaler's.
"""

from __future__ import annotations

import math

import torch

ALLOWED_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def check_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """Return the compute dtype (``None`` -> float32).

    Raises:
        ValueError: ``dtype`` is not one of None, torch.float32, torch.bfloat16, torch.float16.
    """
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"dtype must be one of None, torch.float32, torch.bfloat16, torch.float16; "
                         f"got {dtype!r}")
    return torch.float32 if dtype is None else dtype


class LossScaler:
    """fp16 dynamic loss scale (GradScaler semantics: grow by ``growth_factor`` after ``growth_interval``
    steps without inf/NaN, multiply by ``backoff_factor`` on a step with inf/NaN, which is skipped).

    Tensors: ``scale`` and ``growth_tracker`` are 1-element tensors (float32 / int32) on ``device``.
    """

    def __init__(self, device: torch.device, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale = torch.full((1,), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((1,), dtype=torch.int32, device=device)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.skipped_steps = 0

    def skip_step(self) -> None:
        """Count a step skipped for inf/NaN gradients."""
        self.skipped_steps += 1

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in fp32 (an fp16 product could overflow before backward even starts)."""
        return loss.float() * self.scale.to(loss.device)

    def inv_scale(self, device: torch.device | str) -> torch.Tensor:
        """``1 / scale`` as a float32 1-element tensor on ``device`` (for unscaling fp32 gradient copies)."""
        return self.scale.double().reciprocal().float().to(device)

    def update(self, found_inf: torch.Tensor) -> None:
        """Update the scale after a step; ``found_inf`` is a float32 1-element tensor (1.0 = inf/NaN seen)."""
        found = found_inf.to(self.scale.device, torch.float32).reshape(1)
        torch._amp_update_scale_(self.scale, self.growth_tracker, found, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    KEYS = ("scale", "growth_tracker", "growth_factor", "backoff_factor", "growth_interval", "skipped_steps")

    def state_dict(self) -> dict:
        """The scale, growth tracker, settings and skipped-step count (GradScaler's state, plain numbers)."""
        return {"scale": float(self.scale.item()), "growth_tracker": int(self.growth_tracker.item()),
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "skipped_steps": self.skipped_steps}

    @classmethod
    def check_state_dict(cls, state: object) -> dict:
        """``state`` as :meth:`state_dict` writes it, checked (nothing is written).

        Raises:
            ValueError: not a dict with :attr:`KEYS`, or a value that is not a finite number (names it).
        """
        if not isinstance(state, dict) or set(cls.KEYS) - set(state):
            raise ValueError(f"loss scaler state must be a dict with keys {cls.KEYS}, got {state!r}")
        out = {}
        for k in cls.KEYS:
            v = state[k]
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"loss scaler state {k!r} must be a finite number, got {v!r}")
            out[k] = v
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (checked first: :meth:`check_state_dict`)."""
        st = self.check_state_dict(state)
        self.scale.fill_(float(st["scale"]))
        self.growth_tracker.fill_(int(st["growth_tracker"]))
        self.growth_factor, self.backoff_factor = float(st["growth_factor"]), float(st["backoff_factor"])
        self.growth_interval, self.skipped_steps = int(st["growth_interval"]), int(st["skipped_steps"])
