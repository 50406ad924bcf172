"""The device path, one body per test on the stand-in (``sim``, in CI) and on CUDA (on a GPU machine): pinned
host buffers, side streams and their events, parity with ``torch.optim.AdamW(fused=True)`` bit for bit.

Run the CUDA side with ``python -m pytest -q -m cuda`` (``tests/_devices.py``). The reference runs each
parameter's update where memsched runs it: host chunks' on the CPU (``Reference.step(on_host=...)``), since
CUDA's fused kernel rounds differently from the CPU's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memsched
from memsched.devices.spec import parse_device
from policies.types import DEVICE, HOST
from tests._devices import Target
from tests._numerics import LR, WD, Reference, assert_same, gpt_batches, gpt_loss, same, tiny_gpt


def make_model(odd: bool = False) -> nn.Module:
    """An MLP of 64 inputs; ``odd``: 61 inputs and sizes that are multiples of nothing, so that parameters
    packed densely would start at any 4-byte offset in their chunk ([Note: parameter alignment in chunks])."""
    torch.manual_seed(0)
    d, h, o = (61, 253, 7) if odd else (64, 256, 8)
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, d),
                         nn.LayerNorm(d), nn.Linear(d, o))


def mlp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def attach(m: nn.Module, target: Target, **kw) -> memsched.Scheduler:
    kw.setdefault("policy", "static")
    if kw["policy"] == "static":
        kw.setdefault("policy_options", {"offload_optim_frac": 0.5})
    kw.setdefault("chunk_numel", 70_000)
    return memsched.attach(m, device=target.spec, lr=LR, weight_decay=WD, **kw)


def on_host(sched: memsched.Scheduler, model: nn.Module) -> set[int]:
    """Indices (in ``model.parameters()`` order) of the parameters whose chunk the plan keeps on the host."""
    chunk_of = sched.store.param_chunk
    return {k for k, p in enumerate(model.parameters()) if chunk_of[id(p)].placement == HOST}


def train_gpt(sched: memsched.Scheduler, model: nn.Module, ref: Reference, batches: list,
              forward: nn.Module | None = None) -> None:
    """Steps over ``batches`` with memsched and with ``ref``, each update where memsched runs it;
    ``forward``: what computes the loss (default ``model``; a compiled wrapper of it)."""
    for b in batches:
        host = on_host(sched, model)
        sched.backward(gpt_loss(model if forward is None else forward, b))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        ref.step(b, gpt_loss, None, on_host=host)
    sched.synchronize()


def grad_devices(model: nn.Module) -> list[str | None]:
    """Where torch's ``clip_grad_norm_`` finds each gradient (it groups them by device)."""
    return [p.grad.device.type if p.grad is not None else None for p in model.parameters()]


def test_capacity_is_the_device_memory(target):
    d = parse_device(target.spec)
    assert d.kind == target.name and d.torch_device == target.device
    if target.is_cuda:
        assert 0 < d.capacity_bytes <= torch.cuda.mem_get_info(d.torch_device)[1]
    else:
        assert d.capacity_bytes == 2**30 and d.link_bytes_per_s == 100e9


@pytest.mark.parametrize("odd", [False, True], ids=["even", "odd"])
@pytest.mark.parametrize("policy", ["static", "auto", "cpu", "cuda"])
def test_parity_with_adamw(target, policy, odd):
    """torch's ``clip_grad_norm_(model.parameters())`` that triggers, between memsched's backward and step;
    bit for bit; between steps every parameter is a tensor of the device, as after ``model.to(device)``.
    ``odd`` sizes: on CUDA, ``_foreach_norm`` sums an unaligned gradient in another order than an aligned one
    ([Note: parameter alignment in chunks])."""
    m = make_model(odd).to(target.device)
    ref = Reference(m, device=target.device)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(32, m[0].in_features, generator=g).to(target.device) for _ in range(5)]
    norms = []
    with attach(m, target, policy=policy) as sched:
        for x in xs:
            host = on_host(sched, m)
            sched.backward(mlp_loss(m, x))
            devices = grad_devices(m)
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            ref.step(x, mlp_loss, 0.05, on_host=host, clip_devices=devices)
            assert_same(m, ref, f"{policy} step {len(norms)}")
            assert all(p.device == target.device for p in m.parameters())
        sched.synchronize()
        target.synchronize()
        if policy in ("static", "cpu"):  # auto keeps everything on a device this large
            assert any(c.placement == HOST for c in sched.store.chunks)
    assert min(norms) > 0.05, norms  # the clip triggered in every step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters_and_gradients_start_where_torch_would_allocate_them(target, dtype):
    """Every parameter and gradient memsched puts on the device starts on a 512-byte boundary in fp32 (256 in
    bf16; torch's kernels look at 256 at most), as a tensor torch allocates there does: kernels choose their
    code by the address ([Note: parameter alignment in chunks]). Half the chunks live on the host: their
    parameters and gradients visit the device in each step. The sizes are odd: packed densely, most would
    start at a 4-byte offset."""
    m = make_model(odd=True).to(target.device)
    assert torch.empty(3, device=target.device).data_ptr() % 512 == 0  # the device's own allocations
    x = torch.randn(32, m[0].in_features).to(target.device, dtype)
    align = 512 if dtype == torch.float32 else 256
    with attach(m, target, dtype=dtype) as sched:
        seen = {}

        def look(module, _args, _out):
            for name, p in module.named_parameters(recurse=False):
                seen[f"{module.name}.{name}"] = p.data_ptr() % align

        for i, mod in enumerate(m):
            mod.name = str(i)
        handles = [mod.register_forward_hook(look) for mod in m]
        grads = {}  # (step, name): the address of a gradient on the device, modulo align
        for step in range(3):
            seen.clear()
            sched.backward(m(x).float().pow(2).mean())
            assert len(seen) == 10 and set(seen.values()) == {0}, seen
            grads.update({(step, n): p.grad.data_ptr() % align for n, p in m.named_parameters()
                          if not sched.store.in_host_memory(p.grad)})  # those in device memory
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        for h in handles:
            h.remove()
        assert grads and set(grads.values()) == {0}, grads
        assert {c.placement for c in sched.store.chunks} == {HOST, DEVICE}
        assert all(p.data_ptr() % align == 0 for p in m.parameters())


def test_pinned_host_buffers_streams_and_events(target):
    """Host chunks' buffers are pinned, their copies complete by events of the device's kind, and each step
    moves a host chunk's gradients D2H once and its updated parameters H2D once, whether or not torch's clip
    wrote the gradients between backward and step (it writes them where they are, on the host)."""
    m = make_model().to(target.device)
    x = torch.randn(32, 64).to(target.device)
    with attach(m, target) as sched:
        for _ in range(2):
            sched.backward(mlp_loss(m, x))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        host = [c for c in sched.store.chunks if c.placement == HOST]
        dev = [c for c in sched.store.chunks if c.placement == DEVICE]
        assert host and dev
        for c in host:
            assert c.master.is_pinned() and c.host_grad.is_pinned() and c.exp_avg.is_pinned()
            assert isinstance(c.h2d_event, target.event)  # the H2D copy of its updated parameters
        for c in dev:
            assert c.exp_avg.device == target.device and c.steps.device == target.device and c.master is None
        assert sched.streams.d2h is not None and sched.streams.h2d is not None
        numel = sum(c.numel for c in host)
        for clip in (1e-3, None):
            sched.backward(mlp_loss(m, x))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            assert sched.transfers.last_d2h_bytes == numel * 4
            sched.optimizer.step()
            assert sched.transfers.last_h2d_bytes == numel * 4
            for c in host:
                assert c.grad is None or same(c.host_grad, c.grad)  # the (clipped) gradients reached the host
            sched.optimizer.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_memscheds_clip_takes_every_norm_on_the_device(target, dtype, monkeypatch):
    """``sched.clip_grad_norm_`` computes each per-tensor norm with the device's kernel, as a torch run with
    every gradient on the GPU does (the CPU's rounds differently: [Note: norms on the device]): the host
    chunks' gradients come to the device for it, and those bytes count as H2D."""
    from memsched.optim import clipping

    seen: list[torch.device] = []
    real = clipping.total_norm

    def recording(tensors, *args, **kwargs):
        if kwargs.get("per_tensor"):
            seen.extend(t.device for t in tensors)
        return real(tensors, *args, **kwargs)

    m = make_model().to(target.device)
    x = torch.randn(32, 64).to(target.device, dtype)
    with attach(m, target, policy="cpu", dtype=dtype) as sched:
        for _ in range(2):  # past warmup: every chunk on the host
            sched.backward(mlp_loss(m, x))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        host = [c for c in sched.store.chunks if c.placement == HOST]
        assert host and len(host) == len(sched.store.chunks)
        monkeypatch.setattr(clipping, "total_norm", recording)
        sched.backward(mlp_loss(m, x))
        # where backward left them: host buffers, read as the device ([Note: parameters read where they
        # compute] in memsched.devices.host_alias)
        assert all(p.grad.device == target.device and sched.store.in_host_memory(p.grad)
                   for p in m.parameters())
        sched.clip_grad_norm_(1e-3)
        assert len(seen) == len(list(m.parameters())) and set(seen) == {target.device}
        sched.optimizer.step()
        size = torch.tensor([], dtype=dtype).element_size()  # parameters and gradients in the compute dtype
        # each host chunk's updated parameters (its buffer) and, for the clip, the span of its host gradients
        # from its first parameter's to its last one's end (alignment gaps between them too)
        spans = sum(max(off + n for off, n in c.ranges) - min(off for off, _n in c.ranges) for c in host)
        assert sched.transfers.last_h2d_bytes == (sum(c.numel for c in host) + spans) * size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memscheds_clip_takes_the_norms_from_backward(target, dtype):
    """Once ``sched.clip_grad_norm_`` ran, the host chunks' norms are taken on the device in backward
    ([Note: norms taken in backward]): later clips bring no gradients back, and training with a clip that
    triggers is bit for bit the reference's, whose clip runs on the device with every gradient there."""
    model = tiny_gpt().to(target.device)
    ref = Reference(model, dtype, device=target.device)
    clip = 0.05  # the tiny GPT's norm is ~1-3: it triggers every step
    with attach(model, target, policy="cpu", dtype=dtype, chunk_numel=8192) as sched:
        for i, b in enumerate(gpt_batches(5, device=target.device)):
            host = on_host(sched, model)
            sched.backward(gpt_loss(model, b))
            before = sched.transfers_dict["h2d_bytes"]
            sched.clip_grad_norm_(clip)
            if i >= 2:  # after warmup and a first clip
                assert sched.transfers_dict["h2d_bytes"] == before
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            ref.step(b, gpt_loss, clip, on_host=host)
        sched.synchronize()
        assert sched.optimizer.clipper.backward_norm_hits >= 3 * len(sched.plan.host_chunks)
    assert_same(model, ref, f"{target} {dtype}")


def test_bf16_keeps_fp32_masters(target):
    m = make_model().to(target.device)
    x = torch.randn(32, 64).to(target.device, torch.bfloat16)
    with attach(m, target, dtype=torch.bfloat16) as sched:
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
def test_overlap_bit_exact(target, dtype, overlap, slow_early_worker):
    """overlap=True: host chunks updated by the worker thread (CPU kernel), H2D after the step's backward;
    overlap="backward": the updates start during backward from the gradients copied D2H and are committed.
    The worker runs late (``slow_early_worker``), so a read that does not wait shows as a wrong number."""
    model = tiny_gpt().to(target.device)
    ref = Reference(model, dtype, device=target.device)
    batches = gpt_batches(6, device=target.device)
    with attach(model, target, dtype=dtype, chunk_numel=8192, overlap=overlap) as sched:
        train_gpt(sched, model, ref, batches)
        assert_same(model, ref, f"{dtype} overlap={overlap}", sched.optimizer)
        assert {c.placement for c in sched.store.chunks} == {DEVICE, HOST}
        assert len(sched.step_timeline.records) == 5
        if overlap == "backward":
            assert sched.optimizer.early_updates.committed > 0


def test_torch_zero_grad_in_place_right_after_an_overlapped_step(target):
    """``model.zero_grad(set_to_none=False)`` (torch's, not memsched's) right after an overlapped step zeroes
    the gradients while their D2H copies may still run: the step makes the compute stream wait for those
    copies, so the update reads the gradients of the backward."""
    model = tiny_gpt().to(target.device)
    ref = Reference(model, device=target.device)
    batches = gpt_batches(5, device=target.device)
    with attach(model, target, policy="cpu", chunk_numel=8192, overlap=True) as sched:
        for b in batches:
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            model.zero_grad(set_to_none=False)
            ref.step(b, gpt_loss, None, on_host=set(range(len(list(model.parameters())))))
        sched.synchronize()
        assert_same(model, ref, "zero_grad(set_to_none=False)")


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6: no stance")
@pytest.mark.parametrize("overlap", [False, True])
def test_compiled_bit_exact_and_its_graph_breaks(target, overlap):
    """torch.compile with host chunks: the per-module H2D waits compile to nothing and the root waits for
    every chunk once, eagerly (``memsched.runtime.waits``). Bit-exact, and that wait makes the only graph
    break, once, on every device."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_gpt().to(target.device)
    ref = Reference(model, device=target.device)
    batches = gpt_batches(5, device=target.device)
    with attach(model, target, chunk_numel=8192, overlap=overlap) as sched:
        train_gpt(sched, model, ref, batches, torch.compile(model, backend="aot_eager"))
        breaks = dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
    assert_same(model, ref, f"compiled, overlap={overlap}")
    # [Note: the root hook's graph break] in memsched.runtime.waits: one break (the hook wrapper's frame is
    # not compiled on its own: 6 breaks on CUDA on 2026-11-26, bench/results/gpu_pytest_cuda.log), one graph
    assert sum(breaks.values()) == 1 and all("disable" in k for k in breaks), breaks
    assert graphs == 1, graphs


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6: no stance")
def test_compiled_with_every_chunk_on_the_device_is_torchs_own_graph(target):
    """policy ``cuda`` (every chunk on the device), no overlap: no copy can be in flight when a forward
    starts, so after warmup no module waits ([Note: waits only where a copy can be in flight]): the compiled
    forward has no graph break and no memsched hook inside it (Dynamo guards it as a model without them),
    bit-exact. A plan that moves chunks to the host later installs the waits before the next forward."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_gpt().to(target.device)
    ref = Reference(model, device=target.device)
    batches = gpt_batches(5, device=target.device)
    with attach(model, target, policy="cuda", chunk_numel=8192) as sched:
        assert sched.waits.needed  # warmup: every chunk starts on the host
        train_gpt(sched, model, ref, batches, torch.compile(model, backend="aot_eager"))
        breaks = dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
        assert not sched.waits.needed and {c.placement for c in sched.store.chunks} == {DEVICE}
        assert not any(m._forward_pre_hooks for name, m in model.named_modules() if name)
        sched.planner.replan(None, "test: every chunk on the host", sched.steps)  # as elastic placement does
        assert HOST in {c.placement for c in sched.store.chunks} and not sched.waits.needed
        train_gpt(sched, model, ref, batches[:2], torch.compile(model, backend="aot_eager"))
        assert sched.waits.needed  # from the end of the first step with host chunks
    assert_same(model, ref, "compiled, every chunk on the device, then on the host")
    assert breaks == {} and graphs == 1, (breaks, graphs)


def test_a_host_tensor_in_a_device_op_raises_torchs_device_error(target):
    x = torch.ones(4, device=target.device)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.stack([x, torch.ones(4)])
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(4)


def penalised(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An L2 penalty over ``model.parameters()`` computed before the forward, as a user's loss term may."""
    return 1e-3 * sum(p.pow(2).sum() for p in model.parameters()) + mlp_loss(model, x)


def test_a_loss_term_before_a_second_micro_batchs_forward_is_exact(target):
    """Policy ``cpu``, two micro-batches: after the first backward the parameters are host tensors, and the
    second micro-batch's penalty reads them before its forward ([Note: graph reads between steps]): its first
    graph-recording read takes the chunks to the device (after their H2D copy: on CUDA a stream wait), so the
    term and its gradients are computed on the device, bit for bit as torch computes them; torch's clip over
    ``model.parameters()`` triggers."""
    m = make_model().to(target.device)
    ref = Reference(m, device=target.device)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(32, 64, generator=g).to(target.device) for _ in range(6)]
    with attach(m, target, policy="cpu") as sched:
        for i in range(3):
            micro = xs[2 * i:2 * i + 2]
            host = on_host(sched, m)
            for x in micro:
                sched.backward(penalised(m, x))
            devices = grad_devices(m)
            assert float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)) > 0.05
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            ref.step(micro, penalised, 0.05, on_host=host, clip_devices=devices)
            assert_same(m, ref, f"step {i}")
        sched.synchronize()
        target.synchronize()
        assert all(c.placement == HOST for c in sched.store.chunks)


def test_between_steps_parameters_and_gradients_read_as_the_device(target):
    """[Note: parameters read where they compute]: with all optimizer state and half the parameters on the
    host, every parameter and gradient reads as the device between backward and step and after it (on CUDA:
    CUDA tensors over mapped pinned memory), an evaluation forward there gives the reference's output, and
    torch's clip over them is bit-exact."""
    m = make_model().to(target.device)
    ref = Reference(m, device=target.device)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(32, 64, generator=g).to(target.device) for _ in range(4)]
    with attach(m, target, policy_options={"offload_optim_frac": 1.0, "offload_param_frac": 0.5}) as sched:
        for i, x in enumerate(xs):
            host = on_host(sched, m)
            sched.backward(mlp_loss(m, x))
            assert all(p.device == target.device and p.grad.device == target.device for p in m.parameters())
            assert any(sched.store.in_host_memory(p.grad) for p in m.parameters())
            devices = grad_devices(m)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            ref.step(x, mlp_loss, 0.05, on_host=host, clip_devices=devices)
            assert_same(m, ref, f"step {i}")
            with torch.no_grad():
                out = m(xs[0])
                want = ref.model(xs[0])
            target.synchronize()
            assert torch.equal(out.cpu(), want.cpu()), i
            assert all(p.device == target.device for p in m.parameters())
        assert sched.plan.param_host_chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_update_matches_adamw_on_the_device(target, dtype, monkeypatch):
    """host_update="device": every host chunk's state is streamed to the device, updated there by the device's
    fused AdamW and streamed back (memsched.optim.streamed_update); with torch's clip triggering in every step
    the parameters equal the reference's updated on the device (where memsched runs the update), step by
    step, and the host state read back through ``state_dict()`` equals the reference's optimizer state."""
    from memsched.chunks import sizing

    monkeypatch.setattr(sizing, "STREAM_PIECE_NUMEL", 4096)  # several pieces per chunk, both sets
    m = make_model(odd=True).to(target.device)
    ref = Reference(m, dtype, device=target.device)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(32, m[0].in_features, generator=g).to(target.device, dtype) for _ in range(5)]
    with attach(m, target, policy="cpu", dtype=dtype, host_update="device") as sched:
        for i, x in enumerate(xs):
            sched.backward(mlp_loss(m, x))
            devices = grad_devices(m)
            assert float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)) > 0.05
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            ref.step(x, mlp_loss, 0.05, clip_devices=devices)  # the update on the device, as memsched's
            assert_same(m, ref, f"{dtype} step {i}")
        plan = sched.plan
        state = sched.optimizer.state_dict()["state"]  # waits for the D2H copies of the state
        target.synchronize()
    assert plan.streamed and plan.streamed == tuple(plan.host_chunks)
    masters = ref.masters if dtype != torch.float32 else list(ref.model.parameters())
    ref_state = [ref.opt.state[q] for q in masters]
    for k, s in enumerate(ref_state):
        assert same(state[k]["exp_avg"].cpu(), s["exp_avg"].cpu()), f"exp_avg {k}"
        assert same(state[k]["exp_avg_sq"].cpu(), s["exp_avg_sq"].cpu()), f"exp_avg_sq {k}"
