"""The real-device path on CUDA: pinned host buffers, side streams and events, parity with torch.optim.AdamW.

Skipped without CUDA (CI and the development machine have none); run on a GPU machine with
``python -m pytest -q -m cuda``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memsched
from memsched.devices.spec import parse_device
from policies.types import DEVICE, HOST
from tests._numerics import same

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64),
                         nn.LayerNorm(64), nn.Linear(64, 8))


def attach(m: nn.Module, **kw) -> memsched.Scheduler:
    kw.setdefault("policy", "static")
    if kw["policy"] == "static":
        kw.setdefault("policy_options", {"offload_optim_frac": 0.5})
    return memsched.attach(m, device="cuda", lr=1e-3, weight_decay=0.1, chunk_numel=70_000, **kw)


def rel_err(a: nn.Module, b: nn.Module) -> float:
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
               for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_capacity_is_the_device_memory():
    d = parse_device("cuda")
    assert d.kind == "cuda" and d.torch_device.index is not None
    assert 0 < d.capacity_bytes <= torch.cuda.mem_get_info(d.torch_device)[1]


@pytest.mark.parametrize("policy", ["static", "auto", "cpu", "cuda"])
def test_parity_with_adamw_on_cuda(policy):
    m = make_model()
    ref = copy.deepcopy(m).cuda()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    xs = [torch.randn(32, 64, device="cuda") for _ in range(5)]
    with attach(m, policy=policy) as sched:
        for x in xs:
            sched.backward(m(x).pow(2).mean())
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            loss = ref(x).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
            ropt.step()
            ropt.zero_grad()
        sched.synchronize()
        torch.cuda.synchronize()
        assert all(p.is_cuda for p in m.parameters())
    # CUDA's fused kernel and the foreach reference round differently in the last bits.
    assert rel_err(m, ref) < 1e-5


def test_pinned_host_buffers_streams_and_events():
    m = make_model()
    with attach(m) as sched:
        x = torch.randn(32, 64, device="cuda")
        for _ in range(2):
            sched.backward(m(x).pow(2).mean())
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        host = [c for c in sched.store.chunks if c.placement == HOST]
        dev = [c for c in sched.store.chunks if c.placement == DEVICE]
        assert host and dev
        for c in host:
            assert c.master.is_pinned() and c.host_grad.is_pinned() and c.exp_avg.is_pinned()
            assert isinstance(c.h2d_event, torch.cuda.Event)  # the H2D of its updated parameters
        for c in dev:
            assert c.exp_avg.is_cuda and c.steps.is_cuda and c.master is None
        # Each host chunk's gradients go D2H on the side stream during backward; clipping writes them after
        # that copy, so the step copies them again (the fingerprint differs): the clipped values are used.
        sched.backward(m(x).pow(2).mean())
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
        assert sched.streams.d2h is not None and sched.streams.h2d is not None
        numel = sum(c.numel for c in host)
        assert sched.transfers.last_h2d_bytes == numel * 4
        sched.optimizer.step()
        assert sched.transfers.last_d2h_bytes == 2 * numel * 4
        for c in host:
            assert same(c.host_grad, c.grad.cpu())  # the clipped gradients reached the host
        # Without a write after backward, the copy made during backward is the one used.
        sched.optimizer.zero_grad()
        sched.backward(m(x).pow(2).mean())
        sched.optimizer.step()
        assert sched.transfers.last_d2h_bytes == numel * 4


def test_bf16_on_cuda_keeps_fp32_masters():
    m = make_model()
    with attach(m, dtype=torch.bfloat16) as sched:
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
        losses = []
        for _ in range(5):
            loss = m(x).float().pow(2).mean()
            losses.append(loss.item())
            sched.backward(loss)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        sched.synchronize()
        for c in sched.store.chunks:
            assert c.data.dtype == torch.bfloat16 and c.master.dtype == torch.float32
            assert same(c.data[: c.numel].float(), c.master.to(c.data.device).bfloat16().float())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("overlap", [True, "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlap_on_cuda_bit_exact(dtype, overlap):
    """overlap=True on a GPU: host chunks updated by the worker thread (CPU kernel), H2D on the side stream
    after the step's backward; each parameter equals torch's fused AdamW run where memsched runs it.
    overlap="backward": the updates start during backward from the early D2H copies and are committed."""
    from tests._numerics import LR, WD, Reference, gpt_batches, gpt_loss, same, tiny_gpt

    model = tiny_gpt().cuda()
    ref = Reference(model, dtype)
    batches = [(x.cuda(), y.cuda()) for x, y in gpt_batches(6)]
    with memsched.attach(model, policy="static", policy_options={"offload_optim_frac": 0.5}, device="cuda",
                         dtype=dtype, lr=LR, weight_decay=WD, chunk_numel=8192, overlap=overlap) as sched:
        for b in batches:
            chunk_of = sched.store.param_chunk
            on_host = {k for k, p in enumerate(model.parameters()) if chunk_of[id(p)].placement == "host"}
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            ref.step(b, gpt_loss, None, on_host=on_host)
        sched.synchronize()
        for (name, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
            assert same(p, q), name
        assert {c.placement for c in sched.store.chunks} == {"device", "host"}
        assert len(sched.step_timeline.records) == 5
        if overlap == "backward":
            assert sched.optimizer.early_updates.committed > 0


def test_torch_zero_grad_in_place_right_after_an_overlapped_step():
    """``model.zero_grad(set_to_none=False)`` (torch's, not memsched's) right after an overlapped step zeroes
    the gradients on the compute stream while their D2H copies may still run on the side stream: the step
    makes the compute stream wait for those copies, so the update reads the gradients of the backward."""
    from tests._numerics import LR, WD, Reference, gpt_batches, gpt_loss, tiny_gpt

    model = tiny_gpt().cuda()
    ref = Reference(model)
    batches = [(x.cuda(), y.cuda()) for x, y in gpt_batches(5)]
    with memsched.attach(model, policy="cpu", device="cuda", lr=LR, weight_decay=WD, chunk_numel=8192,
                         overlap=True) as sched:
        for b in batches:
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            model.zero_grad(set_to_none=False)
            ref.step(b, gpt_loss, None, on_host=set(range(len(list(model.parameters())))))
        sched.synchronize()
        for (name, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
            assert same(p, q), name


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6: no stance")
@pytest.mark.parametrize("overlap", [False, True])
def test_compiled_on_cuda_bit_exact_with_one_graph_break(overlap):
    """torch.compile on CUDA with host chunks: the per-module H2D waits compile to nothing and the root waits
    for every chunk once, eagerly (memsched.runtime.waits): one graph break, one graph per side of it,
    bit-exact."""
    from torch._dynamo.utils import counters

    from tests._numerics import LR, WD, Reference, gpt_batches, gpt_loss, tiny_gpt

    torch._dynamo.reset()
    counters.clear()
    model = tiny_gpt().cuda()
    ref = Reference(model)
    batches = [(x.cuda(), y.cuda()) for x, y in gpt_batches(5)]
    with memsched.attach(model, policy="static", policy_options={"offload_optim_frac": 0.5}, device="cuda",
                         lr=LR, weight_decay=WD, chunk_numel=8192, overlap=overlap) as sched:
        compiled = torch.compile(model, backend="aot_eager")
        for b in batches:
            on_host = {k for k, p in enumerate(model.parameters())
                       if sched.store.param_chunk[id(p)].placement == "host"}
            sched.backward(gpt_loss(compiled, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            ref.step(b, gpt_loss, None, on_host=on_host)
        sched.synchronize()
        breaks = dict(counters["graph_break"])
    for (name, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
        assert same(p, q), name
    assert sum(breaks.values()) == 1 and any("disable" in k for k in breaks), breaks
