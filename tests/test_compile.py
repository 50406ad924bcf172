"""torch.compile with memsched, in both orders: warmup runs eagerly (traced), then the model compiles, and
training equals the same compiled model with torch.optim.AdamW(fused=True) whose first step ran eagerly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import memsched

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6: no stance")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 1))


@pytest.mark.parametrize("order", ["attach-then-compile", "compile-then-attach"])
def test_compiles_after_warmup_and_stays_exact(order):
    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    ref = copy.deepcopy(model)
    ref_compiled = torch.compile(ref, backend="aot_eager")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    if order == "compile-then-attach":
        compiled = torch.compile(model, backend="aot_eager")
        sched = memsched.attach(model, device="cpu", lr=1e-3, weight_decay=0.1)
    else:
        sched = memsched.attach(model, device="cpu", lr=1e-3, weight_decay=0.1)
        compiled = torch.compile(model, backend="aot_eager")
    xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with sched:
        for i, x in enumerate(xs):
            frames_before = counters["frames"]["ok"]
            sched.backward(compiled(x).pow(2).mean())
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if i == 0:  # the traced warmup step ran eagerly: nothing compiled, nothing given up on
                assert frames_before == counters["frames"]["ok"] == 0
                with torch.compiler.set_stance("force_eager"):
                    ref_compiled(x).pow(2).mean().backward()
            else:
                ref_compiled(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert counters["frames"]["ok"] > 0 and counters["stats"]["unique_graphs"] >= 1
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert torch._dynamo.eval_frame._stance.stance == "default"  # the stance is restored


def test_close_during_warmup_restores_the_stance():
    sched = memsched.attach(mlp(), device="cpu")
    assert torch._dynamo.eval_frame._stance.stance == "force_eager"
    sched.close()
    assert torch._dynamo.eval_frame._stance.stance == "default"
