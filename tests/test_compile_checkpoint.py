"""A compiled backward through an activation-checkpointed block under memsched's warmup tracer (issue 41,
item 5): its graph calls the higher-order op ``run_with_rng_state`` to recompute the block's dropout, which
the tracer's dispatch mode had no rule for (``NotImplementedError: There was no rule registered for
HigherOrderOperator run_with_rng_state and mode StorageAccountant``). Training is bit-identical to the same
compiled model with ``torch.optim.AdamW(fused=True)``, deterministic algorithms on (docs/compile.md).

The warmup step runs eagerly (memsched holds ``force_eager``), so a compiled graph meets the tracer when its
forward ran before the tracer started: here the training loop makes its optimizer lazily, between the first
forward and its backward. The reference's first step is compiled too, as memsched's first forward is."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import memsched
import tracer.accounting
from tests._numerics import same

STEPS = 4
LR, WD = 1e-3, 0.1


class CheckpointedNet(nn.Module):
    """An MLP whose middle block (with dropout: its recompute needs the forward's random numbers) runs under
    non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.25), nn.Linear(64, 32))
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, torch.relu(self.inp(x)), use_reentrant=False)
        return self.out(h)


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_compiled_backward_through_a_checkpointed_block_in_warmup_is_bit_exact(deterministic, monkeypatch):
    torch.manual_seed(0)
    model = CheckpointedNet()
    ref = copy.deepcopy(model)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]

    torch._dynamo.reset()
    ref_compiled = torch.compile(ref, backend="aot_eager")
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    torch.manual_seed(1)
    ref_losses = []
    for x in xs:
        loss = ref_compiled(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.detach())

    met: list[str] = []  # the higher-order ops the warmup tracer ran
    run = getattr(tracer.accounting.StorageAccountant, "_higher_order", None)  # None: a tracer without rules

    def spy(self, hop, args, kwargs):
        met.append(str(getattr(hop, "_name", hop)))
        return run(self, hop, args, kwargs)

    monkeypatch.setattr(tracer.accounting.StorageAccountant, "_higher_order", spy, raising=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    torch.manual_seed(1)
    losses = []
    loss = compiled(xs[0]).pow(2).mean()  # the first forward, compiled, before the optimizer exists
    with memsched.attach(model, device="cpu", lr=LR, weight_decay=WD) as sched:
        for i, x in enumerate(xs):
            if i:
                loss = compiled(x).pow(2).mean()
            sched.backward(loss)  # step 0: the compiled backward under the warmup tracer
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            losses.append(loss.detach())
        timeline = sched.timeline  # the warmup's trace, with the recompute in it
        assert timeline.peak_non_model_bytes(timeline.device) > 0
    assert counters["frames"]["ok"] > 0
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    if torch.__version__ >= "2.13":  # what torch 2.13's aot_eager backward holds (older ones may differ)
        assert met == ["run_with_rng_state"], met
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)), (losses, ref_losses)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert same(p, q), n
