"""Cases of the stand-in as a PyTorch device (memsched.devices.sim_backend), run by test_sim_backend.py in
a process of their own: a distinct device with CUDA's device errors, a capacity its allocator enforces,
pinned host memory, and CPU kernels on the same memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memsched.devices import sim_backend

sim_backend.load()
SIM = torch.device("sim")
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@pytest.fixture
def capacity():
    """Set the stand-in's capacity for a test and restore it after."""
    before = sim_backend.capacity()
    yield sim_backend.set_capacity
    sim_backend.set_capacity(before)


def test_a_distinct_device():
    x = torch.randn(3, 4, device="sim")
    assert x.device == torch.device("sim", 0) and x.is_sim and not x.is_cpu
    assert x.cpu().device.type == "cpu" and x.cpu().sim().device.type == "sim"
    assert torch.sim.is_available() and torch.sim.device_count() == 1


@pytest.mark.parametrize("mix", [
    lambda d, h: d + h,
    lambda d, h: torch.stack([d, h]),
    lambda d, h: torch.zeros(4, 4, device=h.device) + d,
    lambda d, h: torch.equal(d, h),
    lambda d, h: d @ h,
])
def test_mixing_host_and_device_raises_torchs_device_error(mix):
    d, h = torch.randn(4, 4, device="sim"), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        mix(d, h)


def test_a_host_gradient_into_a_device_parameter_is_refused():
    p = nn.Parameter(torch.randn(4, device="sim"))
    with pytest.raises(RuntimeError, match="device"):
        p.grad = torch.randn(4)


def test_zero_dim_host_scalars_are_allowed_as_on_cuda():
    d = torch.ones(3, device="sim")
    assert torch.equal((d * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))


def test_capacity_is_enforced_with_torchs_out_of_memory_error(capacity):
    base = sim_backend.memory_allocated()
    capacity(base + 8192)
    a = torch.empty(1000, device="sim")  # 4000 bytes, counted as 4096
    assert sim_backend.memory_allocated() == base + 4096
    with pytest.raises(OOM, match=r"sim out of memory: tried to allocate .*\(8000 bytes\)"):
        torch.empty(2000, device="sim")
    host = torch.empty(10_000_000)  # host memory does not count against the device
    del a, host
    assert sim_backend.memory_allocated() == base


def test_outputs_of_cpu_kernels_are_counted_and_freed():
    x = torch.randn(256, 256, device="sim")
    base = sim_backend.memory_allocated()
    sim_backend.reset_peak_memory_stats()
    y = x @ x
    assert sim_backend.memory_allocated() == base + 256 * 256 * 4
    del y
    assert sim_backend.memory_allocated() == base
    assert sim_backend.max_memory_allocated() >= base + 256 * 256 * 4


def test_allocations_round_like_cudas_allocator():
    assert [sim_backend.counted_bytes(n) for n in (0, 1, 512, 513, 4000)] == [0, 512, 512, 1024, 4096]


def test_views_share_the_device_memory():
    x = torch.zeros(4, 4, device="sim")
    v = x[1:3, ::2]
    v.add_(1)
    x.view(-1)[0] = 5
    assert v.device.type == "sim" and v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert x.cpu().tolist()[0][0] == 5 and x.sum().item() == 9


def test_out_arguments_are_resized_on_the_device():
    x = torch.arange(6.0, device="sim")
    out = torch.empty(0, device="sim")
    r = torch.add(x, 1, out=out)
    assert r is out and out.shape == (6,) and out.device.type == "sim"
    assert out.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_pinned_host_memory_and_its_views_are_pinned_in_whole_pages():
    import mmap

    page = mmap.PAGESIZE  # as cudaHostRegister pins (memsched.devices.pinned), not torch's power of two
    before = sim_backend.pinned_bytes()
    p = torch.empty(1000).pin_memory()
    assert p.is_pinned() and p[10:20].is_pinned() and not torch.empty(10).is_pinned()
    assert sim_backend.pinned_bytes() == before + page
    # Where CUDA is available torch's factories pin with CUDA's allocator (the H200, torch 2.11), so memsched
    # pins through the stand-in's own function there (memsched.devices.pinned)
    if torch.cuda.is_available():
        q = sim_backend.pinned_empty(3 * page + 4).view(torch.float32)
        big = sim_backend.pinned_empty(2**20 + 1)
    else:
        q = torch.empty(3 * page // 4 + 1, pin_memory=True)  # 3 pages and 4 bytes: 4 pages, not 4 x 2 pages
        big = torch.empty(2**20 + 1, dtype=torch.uint8, pin_memory=True)  # a mapping of its own (>= 1 MiB)
    assert q.is_pinned() and q[5:].is_pinned()
    assert big.is_pinned() and big[2**20:].is_pinned()
    assert sim_backend.pinned_bytes() == before + 5 * page + 2**20 + page
    del p, q, big
    assert sim_backend.pinned_bytes() == before
    own = sim_backend.pinned_empty(3 * page + 4)  # the stand-in's own function, as memsched pins
    assert own.dtype == torch.uint8 and own.shape == (3 * page + 4,) and own.is_pinned()
    assert sim_backend.pinned_bytes() == before + 4 * page
    del own
    assert sim_backend.pinned_bytes() == before


def test_module_to_keeps_tied_weights_and_parameter_identity():
    """See [Note: the stand-in and `p.data = ...`]: moves are in place, as between the CPU and CUDA."""
    m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    m[1].weight = m[0].weight
    held = m[0].weight
    m.to("sim")
    assert m[0].weight is m[1].weight is held and held.device.type == "sim"
    held.data = held.data.cpu()  # and back, in place
    assert held.device.type == "cpu" and m[1].weight is held


def _mlp_steps(device: str, steps: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
        (model(x) - y).pow(2).mean().backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]


def test_training_on_the_device_runs_the_cpu_kernels_bit_for_bit():
    for a, b in zip(_mlp_steps("cpu"), _mlp_steps("sim"), strict=True):
        assert torch.equal(a, b)


def test_autocast_and_checkpoint_on_the_device():
    lin = nn.Linear(8, 8).to("sim")
    x = torch.randn(2, 8, device="sim", requires_grad=True)
    with torch.autocast("sim", dtype=torch.bfloat16):
        y = lin(x)
    assert y.device.type == "sim"
    out = torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False)
    out.sum().backward()
    assert x.grad is not None and x.grad.device.type == "sim"


def test_hugging_face_gpt2_trains_on_the_device():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).to("sim")
    assert model.device == torch.device("sim", 0)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 64, (2, 16)).to(model.device)
    model(ids, labels=ids).loss.backward()
    twin = copy.deepcopy(model)
    assert next(twin.parameters()).device.type == "sim"
    out = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.device.type == "sim" and out.shape == (2, 7)


def test_one_accelerator_per_process_is_said_both_ways(monkeypatch):
    """torch takes the loaded stand-in as the process's accelerator, after which a backward over CUDA tensors
    fails inside its autograd engine (pytorch/pytorch#161129): CUDA training here is refused with the reason,
    and so is loading the stand-in where CUDA is already in use."""
    if not (hasattr(torch, "accelerator") and hasattr(torch.accelerator, "current_accelerator")):
        pytest.skip("torch.accelerator.current_accelerator needs torch >= 2.6")
    assert torch.accelerator.current_accelerator().type == "sim"
    with pytest.raises(RuntimeError, match=r"takes 'sim', not CUDA.*161129"):
        sim_backend.check_cuda_autograd()
    monkeypatch.setattr(sim_backend, "_loaded", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"already uses CUDA.*161129"):
        sim_backend.load()
