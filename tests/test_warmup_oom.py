"""A warmup step that runs out of memory says what is too big, and gives the hint only where it would help
(issue 31): the frozen base, the activations, or the trainable parameters kept on the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memsched
from memsched.runtime.elastic_hooks import oom_bytes
from memsched.runtime.warmup_oom import warmup_oom_message
from tests._numerics import SIM

MiB = 2**20


def test_the_failed_allocation_is_read_from_the_stand_ins_and_cudas_messages() -> None:
    sim = torch.OutOfMemoryError("sim out of memory: tried to allocate 7.6 KiB (7812 bytes) on the stand-in "
                                 "device sim:0 with 1.0 KiB (1024 bytes) allocated of a capacity of 8 KiB")
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has a total")
    assert oom_bytes(sim)[0] == 7812 and oom_bytes(cuda)[0] == 12 * MiB
    assert oom_bytes(RuntimeError("something else"))[0] is None


@pytest.mark.parametrize("case", ["params", "frozen", "activations", "gradients", "already"])
def test_each_cause_gets_its_own_message(case: str) -> None:
    base = {"capacity": 100 * MiB, "requested": 10 * MiB, "largest_chunk": 5 * MiB, "policy": "auto",
            "params_on_host": False}
    if case == "params":  # 60 MiB of chunks on the device: with them on the host 10 + 40 + 10 + 10 fits
        m = warmup_oom_message(in_use=110 * MiB, chunk_params_on_device=60 * MiB, frozen_and_buffers=10 * MiB,
                               **base)
        assert "warmup_non_model_share': 1.0" in m and "every parameter on the device" in m
    elif case == "frozen":
        m = warmup_oom_message(in_use=98 * MiB, chunk_params_on_device=2 * MiB, frozen_and_buffers=80 * MiB,
                               **base)
        assert "would not make room" in m and "frozen parameters and buffers take 80.0 MiB" in m
        assert "warmup_non_model_share" not in m
    elif case == "activations":
        m = warmup_oom_message(in_use=98 * MiB, chunk_params_on_device=2 * MiB, frozen_and_buffers=1 * MiB,
                               **base)
        assert "activations and temporaries take at least 105.0 MiB" in m and "Reduce the batch size" in m
        assert "warmup_non_model_share" not in m
    elif case == "gradients":  # whole-chunk gradient buffers, not activations (GPT-2 124M's 147 MiB chunks)
        m = warmup_oom_message(in_use=98 * MiB, chunk_params_on_device=2 * MiB, frozen_and_buffers=1 * MiB,
                               chunk_grads_on_device=80 * MiB, **base)
        assert "gradient buffers take 80.0 MiB" in m and "activations and temporaries take 25.0 MiB" in m
        assert "Reduce the batch size" not in m and "warmup_non_model_share" not in m
    else:  # the parameters are on the host already and that would fit: nothing more to say
        m = warmup_oom_message(in_use=85 * MiB, chunk_params_on_device=0, frozen_and_buffers=1 * MiB,
                               **{**base, "params_on_host": True, "requested": 1 * MiB})
        assert m is None


class FrozenBase(nn.Module):
    """A manual LoRA: a frozen 2048 x 2048 base (16 MiB fp32) and a rank-8 trainable delta."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(2048, 2048, bias=False).requires_grad_(False)
        self.down = nn.Linear(2048, 8, bias=False)
        self.up = nn.Linear(8, 2048, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _warmup_error(model: nn.Module, device: str, x: torch.Tensor, **kw) -> str:
    with memsched.attach(model.to(SIM), device=device, **kw) as sched, \
            pytest.raises(torch.OutOfMemoryError) as info:
        sched.backward(model(x).square().mean())
    text = str(info.value)
    del info
    return text


def test_a_frozen_base_too_large_is_named_without_the_hint_that_cannot_help() -> None:
    text = _warmup_error(FrozenBase(), "sim:22MiB", torch.randn(512, 2048).to(SIM))
    assert "keeping the trainable parameters on the host would not make room" in text
    assert "frozen parameters and buffers take 16.0 MiB" in text and "warmup_non_model_share" not in text


def test_activations_too_large_are_named_with_what_helps() -> None:
    model = nn.Sequential(nn.Linear(256, 4096), nn.GELU(), nn.Linear(4096, 256))
    text = _warmup_error(model, "sim:24MiB", torch.randn(2048, 256).to(SIM))
    assert "activations and temporaries take at least" in text and "Reduce the batch size" in text
    assert "warmup_non_model_share" not in text


def test_parameters_on_the_device_get_the_hint_that_helps() -> None:
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(6)))  # 24 MiB of parameters
    text = _warmup_error(model, "sim:32MiB", torch.randn(64, 1024).to(SIM), chunk_numel=1024 * 1024 + 1024,
                         policy="static")
    assert "ran out of memory with every parameter on the device" in text
    assert "policy_options={'offload_param_frac': F} with F > 0" in text
