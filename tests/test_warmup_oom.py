"""A warmup step that runs out of memory says what is too big, and gives the hint only where it would help
(issue 31): the frozen parameters kept out of chunks, a chunk too large to be read whole, the activations,
or the chunks' parameters (trainable and frozen) kept on the device."""

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


@pytest.mark.parametrize("case", ["params", "frozen", "activations", "gradients", "largest", "already"])
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
        assert "would not make room" in m and "frozen parameters kept out of chunks take 80.0 MiB" in m
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
    elif case == "largest":  # one chunk larger than the rest of the device: read whole, nothing frees it
        m = warmup_oom_message(in_use=98 * MiB, chunk_params_on_device=40 * MiB, frozen_and_buffers=1 * MiB,
                               **{**base, "largest_chunk": 40 * MiB})
        assert "largest chunk holds 40.0 MiB" in m and "read needs its chunk whole" in m
        assert "warmup_non_model_share" not in m and "Reduce the batch size" not in m
    else:  # the parameters are on the host already and that would fit: nothing more to say
        m = warmup_oom_message(in_use=85 * MiB, chunk_params_on_device=0, frozen_and_buffers=1 * MiB,
                               **{**base, "params_on_host": True, "requested": 1 * MiB})
        assert m is None


class FrozenBase(nn.Module):
    """A manual LoRA: a frozen base of ``layers`` 1024 x 1024 layers (4 MiB each, fp32) and a rank-8 trainable
    delta beside each."""

    def __init__(self, layers: int = 4, width: int = 1024) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.ModuleList(nn.Linear(width, width, bias=False).requires_grad_(False)
                                  for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(width, 8, bias=False) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(8, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, down, up in zip(self.base, self.down, self.up, strict=True):
            x = base(x) + up(down(x))
        return x


def _warmup_error(model: nn.Module, device: str, x: torch.Tensor, *, on_device: bool = True, **kw) -> str:
    """The warmup step's error; ``on_device``: the model is on the stand-in before attach (else on the CPU:
    a model whose parameters do not fit the device is built on the host)."""
    with memsched.attach(model.to(SIM) if on_device else model, device=device, **kw) as sched, \
            pytest.raises(torch.OutOfMemoryError) as info:
        sched.backward(model(x).square().mean())
    text = str(info.value)
    del info
    return text


def test_a_frozen_base_larger_than_the_device_is_traced_and_trained_from_the_host() -> None:
    """The frozen base is chunked (issue 31): before, a 16 MiB base on a 12 MiB device ran out of memory in
    warmup with a hint that could not help; now auto traces with the chunks on the host and plans them."""
    x = torch.randn(64, 1024).to(SIM)
    model = FrozenBase()
    with memsched.attach(model, device="sim:12MiB") as sched:
        assert sched.warmup_params_on_host and sum(c.frozen for c in sched.store.chunks) == 4
        for _ in range(2):
            sched.backward(model(x).square().mean())
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        frozen = {c.index for c in sched.store.chunks if c.frozen}
        assert set(sched.plan.param_host_chunks) & frozen


def test_a_frozen_parameter_too_large_to_read_is_named_without_the_hint_that_cannot_help() -> None:
    text = _warmup_error(FrozenBase(1, 2048), "sim:22MiB", torch.randn(512, 2048).to(SIM), on_device=False)
    assert "keeping the chunks' parameters (trainable and frozen) on the host would not make room" in text
    assert "largest chunk holds 16.0 MiB" in text and "warmup_non_model_share" not in text


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
