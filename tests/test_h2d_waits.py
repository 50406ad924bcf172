"""Every parameter of a host chunk is covered by an H2D wait that runs before anything reads it, and close()
waits for copies in flight.

On CUDA the next forward reads parameters whose H2D copy (issued at the step) may still be running: a module's
forward pre-hook makes the compute stream wait for the copies of the chunks it may read. These tests check the
structure on the CPU: fake events stand in for the copies, a ``TorchFunctionMode`` sees every parameter an op
reads, and a read of a parameter whose chunk was not waited for is a failure. The models read parameters
outside their module's forward: ``nn.MultiheadAttention`` reads ``out_proj``'s parameters without calling it,
a loss reads a weight directly, a module calls ``F.linear`` on a sibling's weight, a weight is tied.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import memsched
from tests._numerics import gpt_batches, gpt_loss, tiny_gpt, to_dev


class ReadsOutside(nn.Module):
    """``proj`` is used through ``F.linear`` by ``mix``'s caller; ``head`` is read only by the loss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 16)  # never called
        self.head = nn.Linear(16, 50, bias=False)  # never called: the loss reads head.weight

    def forward(self, idx):
        h = torch.tanh(self.mix(self.emb(idx)))
        return F.linear(h, self.proj.weight, self.proj.bias)


def reads_outside_loss(model, batch):
    x, y = batch
    logits = F.linear(model(x), model.head.weight)
    return F.cross_entropy(logits.reshape(-1, 50), y.reshape(-1) % 50)


class ReadChecker(TorchFunctionMode):
    """Records every chunk parameter an op reads whose chunk's H2D wait has not run yet."""

    def __init__(self, sched, waited: set[int]):
        super().__init__()
        self.chunk_of = {id(p): c.index for c in sched.store.chunks for p in c.params}
        self.names = {id(p): n for n, p in sched.model.named_parameters()}
        self.waited = waited
        self.unwaited: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor) and self.chunk_of.get(id(t)) not in (None, *self.waited):
                self.unwaited.append(self.names[id(t)])
        return func(*args, **(kwargs or {}))


class _PendingCopy:
    """A CUDA event of an H2D copy that is still running."""

    def __init__(self, index: int) -> None:
        self.index = index

    def query(self) -> bool:
        return False


def check_reads(sched, loss_fn, batch) -> list[str]:
    """Run forward + loss with fake pending H2D copies on every chunk; return the parameters read unwaited."""
    waited: set[int] = set()
    for c in sched.store.chunks:
        c.h2d_event = _PendingCopy(c.index)
    sched.streams.wait = lambda events, *_: waited.update(e.index for e in events if e is not None)
    try:
        with ReadChecker(sched, waited) as checker:
            loss_fn(sched.model, batch)
    finally:
        for c in sched.store.chunks:
            c.h2d_event = None
    return checker.unwaited


@pytest.mark.parametrize("warmup_done", [False, True])
@pytest.mark.parametrize("case", ["gpt", "reads-outside"])
def test_every_read_of_a_host_chunk_is_waited_for(case, warmup_done):
    if case == "gpt":  # MultiheadAttention reads out_proj; tied embeddings
        model, loss_fn, batches = tiny_gpt(), gpt_loss, gpt_batches(2)
    else:
        torch.manual_seed(0)
        model, loss_fn = ReadsOutside(), reads_outside_loss
        batches = [to_dev((torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)))) for _ in range(2)]
    numel = 8192 if case == "gpt" else 800
    with memsched.attach(model, policy="cpu", device="sim:64MiB", chunk_numel=numel) as sched:
        if warmup_done:
            sched.backward(loss_fn(model, batches[0]))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            assert not sched.in_warmup
        assert len(sched.store.chunks) > 2 and {c.placement for c in sched.store.chunks} == {"host"}
        sched._install_h2d_waits()  # on CUDA attach installs them; here the copies are synchronous
        assert check_reads(sched, loss_fn, batches[1]) == []
        if warmup_done:  # and the waits are not all at the root: a chunk read late is waited for late
            owners = {name for name, m in model.named_modules() if m._forward_pre_hooks}
            assert owners - {""}


def test_first_use_order_places_parameters_read_without_a_call_where_they_are_read():
    model = tiny_gpt()
    with memsched.attach(model, policy="cpu", device="sim:64MiB", chunk_numel=8192) as sched:
        sched.backward(gpt_loss(model, gpt_batches(1)[0]))
        sched.optimizer.step()
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for p in sched.first_use_order()]
    attn = order.index("blocks.0.self_attn.in_proj_weight")
    assert order[attn:attn + 4] == ["blocks.0.self_attn.in_proj_weight", "blocks.0.self_attn.in_proj_bias",
                                    "blocks.0.self_attn.out_proj.weight", "blocks.0.self_attn.out_proj.bias"]
    assert order.index("blocks.0.self_attn.out_proj.weight") < order.index("blocks.1.norm1.weight")


class _Event:
    def __init__(self, log: list[int], i: int):
        self.log, self.i = log, i

    def synchronize(self) -> None:
        self.log.append(self.i)


def test_close_waits_for_copies_in_flight():
    model = tiny_gpt()
    sched = memsched.attach(model, policy="cpu", device="sim:64MiB", chunk_numel=8192)
    sched.backward(gpt_loss(model, gpt_batches(1)[0]))
    sched.optimizer.step()
    log: list[int] = []
    for c in sched.store.chunks:
        c.h2d_event = _Event(log, c.index)
    sched.close()
    assert sorted(log) == [c.index for c in sched.store.chunks]
    assert all(c.h2d_event is None for c in sched.store.chunks)

