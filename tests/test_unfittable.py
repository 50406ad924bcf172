"""An input that cannot fit even with every optimizer-state chunk on the host: the out-of-memory error says
so, with the bytes needed and the capacity, and stays an out-of-memory error (retry loops still catch it)."""

from __future__ import annotations

import re

import pytest
import torch

import memsched
from memsched.models import build_gpt
from memsched.models.gpt import lm_loss
from policies.types import HOST
from tests._numerics import SIM, same


def batch(b: int, s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (b, s + 1), generator=g).to(SIM)
    return x[:, :-1], x[:, 1:]


def test_an_input_too_large_for_the_device_says_everything_is_already_on_the_host():
    torch.manual_seed(0)
    model = build_gpt("tiny")
    with memsched.attach(model, device="sim:40MiB") as sched:
        for i in range(2):  # warmup and one planned step at 2 x 32
            sched.backward(lm_loss(model, *batch(2, 32, i)))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(torch.OutOfMemoryError) as info:
            sched.backward(lm_loss(model, *batch(16, 256, 5)))
        assert set(sched.plan.placement) == {HOST}  # the re-plan had moved everything to the host already
        text = str(info.value)
        assert "memsched: inputs 16x256 do not fit" in text
        assert "every optimizer-state chunk on the host, where all of them already are" in text
        need = int(re.search(r"need at least (\d+) bytes", text).group(1))
        assert need > 40 * 2**20 and "the device has 41943040 bytes" in text
        assert "Reduce the batch size or the sequence length" in text
        del info  # its traceback holds the failed forward's activations
        sched.optimizer.zero_grad()
        assert all(same(p, q) for p, q in zip(model.parameters(), before, strict=True))  # nothing lost
        sched.backward(lm_loss(model, *batch(2, 32, 9)))  # a batch that fits still trains
        sched.optimizer.step()


def test_an_out_of_memory_error_that_a_re_plan_can_fix_is_not_called_unfittable():
    torch.manual_seed(0)
    model = build_gpt("tiny")
    # 8 x 256 fits once the optimizer state is on the host, but not with the plan made for 2 x 32
    with memsched.attach(model, device="sim:40MiB", policy="cuda") as sched:
        sched.backward(lm_loss(model, *batch(2, 32, 0)))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        assert HOST not in sched.plan.placement
        note = sched._explain_oom(torch.OutOfMemoryError("probe"))
        assert note is None  # chunks are still on the device: re-planning can make room
