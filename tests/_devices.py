"""The devices a device-path test body runs on: the stand-in (``sim``) in CI, CUDA where a GPU exists.

One test body, two devices (issue 27): the GPU pass is the CI pass plus real streams, pinned memory through
CUDA and CUDA's kernels. Use the ``target`` fixture (``tests/conftest.py``); its ``cuda`` parameter carries
the ``cuda`` mark, so ``python -m pytest -m cuda`` on a GPU machine runs the CUDA side of these bodies.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from memsched.devices.transfers import SimEvent


@dataclass(frozen=True)
class Target:
    """``spec``: what ``memsched.attach(device=...)`` gets; ``device``: where the model and its inputs live;
    ``event``: the type of a copy's completion event (a CUDA event, or the stand-in link's ``SimEvent``)."""

    name: str
    spec: str
    device: torch.device
    event: type

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on the stand-in, whose kernels run when called)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def make_target(name: str) -> Target:
    if name == "cuda":
        return Target("cuda", "cuda", torch.device("cuda", torch.cuda.current_device()), torch.cuda.Event)
    # A modelled link: copies run on the stand-in's copy threads and complete by events, as on CUDA's streams.
    return Target("sim", "sim:1GiB,link=100GBps", torch.device("sim", 0), SimEvent)


TARGETS = [
    pytest.param("sim", id="sim"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")]),
]
