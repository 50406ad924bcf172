"""A tiny example TARGET for ``memsched trace`` (and ``memsched plan``).

Run it with::

    memsched trace examples/trace_target.py:build --steps 2

``build(device)`` follows the TARGET contract (see :mod:`memsched.target`): it returns ``(model, loss_fn)``,
the model on ``device`` and ``loss_fn(model)`` building one batch on ``device`` and returning a scalar loss.
The model is a small MLP classifier; its ``shared`` block is called twice per forward, so the trace shows a
module with several calls per step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

BATCH, FEATURES, HIDDEN, CLASSES = 64, 128, 256, 10


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, HIDDEN)
        self.block = Block(HIDDEN)
        self.shared = Block(HIDDEN)  # applied twice: one module, two forward calls per step
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.shared(self.block(self.embed(x))))
        return self.head(h)


def build(device: torch.device) -> tuple[nn.Module, object]:
    """Return ``(model, loss_fn)`` on ``device`` (the TARGET contract)."""
    model = TinyNet().to(device)

    def loss_fn(m: nn.Module) -> torch.Tensor:
        x = torch.randn(BATCH, FEATURES, device=device)
        y = torch.randint(0, CLASSES, (BATCH,), device=device)
        return F.cross_entropy(m(x), y)

    return model, loss_fn
