"""Parameters read where they compute (issue 43, items 2 and 3): with optimizer state and parameters on the
host, every parameter and gradient reads as the compute device before the first step and between steps
([Note: parameters read where they compute] in memsched.devices.host_alias), so the code users write around
a training loop runs as on a GPU: ``generate(prompt.to(model.device))``, ``AveragedModel`` built after
attach, an EMA over ``state_dict()``, PEFT's ``merge_and_unload()``; a custom autograd Function that keeps a
weight on ``ctx`` is refused loudly (never NaN); ``attach(dtype=torch.bfloat16)`` converts frozen parameters
and buffers as ``model.to`` would. Each result is checked against plain torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memsched
from tests._numerics import LR, SIM, WD, Reference, assert_same, uncounted

transformers = pytest.importorskip("transformers")

CLIP = 0.05


def _gpt2(frozen_block: bool = False) -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=4, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    if frozen_block:
        model.transformer.h[1].requires_grad_(False)
    return model


def _lm(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, labels=ids).loss


def _data(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def _auto_capacity(model: nn.Module) -> int:
    """Bytes: the peak of non-model data of a plain torch step of a copy of ``model`` on the stand-in
    (traced), plus a quarter of its parameters and gradients: auto then keeps some chunks' parameters on the
    host."""
    from tracer import MemoryTracer

    with uncounted():
        probe = copy.deepcopy(model).to(SIM)
        with MemoryTracer(probe) as tracer:
            _lm(probe, _data(1)[0].to(SIM)).backward()
    params = sum(p.numel() for p in model.parameters()) * 4
    return tracer.timeline.peak_non_model_bytes() + (2 * params) // 4


def _attach(model: nn.Module, placement: str, **kw) -> memsched.Scheduler:
    if placement == "static":  # half the parameters (and all optimizer state) on the host
        opts = {"policy": "static", "device": "sim:256MiB",
                "policy_options": {"offload_optim_frac": 1.0, "offload_param_frac": 0.5}}
    else:  # auto on a device that holds a quarter of the model data beside the activations
        opts = {"policy": "auto", "device": f"sim:{_auto_capacity(model)}B",
                "policy_options": {"warmup_non_model_share": 1.0}}
    return memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=4096, **opts, **kw)


def _train(sched: memsched.Scheduler, model: nn.Module, ref: Reference, batches: list, loss_fn) -> None:
    """A step per batch (on the stand-in) with memsched and with ``ref``, parameters equal after each."""
    for step, batch in enumerate(batches):
        batch = batch.to(SIM)
        sched.backward(loss_fn(model, batch))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        with sched.sim.paused():
            ref.step(batch, loss_fn, None)
            assert_same(model, ref, f"step {step}")


def _all_on(model: nn.Module, device: torch.device) -> None:
    for name, p in model.named_parameters():
        assert p.device == device, f"{name} reads as {p.device}"
        assert p.grad is None or p.grad.device == device, f"{name}'s gradient reads as {p.grad.device}"


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "frozen-block"])
@pytest.mark.parametrize("placement", ["static", "auto"])
def test_generate_with_the_prompt_on_model_device_between_steps(placement: str, frozen: bool) -> None:
    """The Hugging Face pattern on the feature that makes big models trainable: ``model.device`` is the
    compute device right after attach and between steps with half the parameters on the host, and
    ``generate(prompt.to(model.device))`` of several tokens gives the reference's tokens; training with
    torch's clip stays bit-exact (the reference trains on the stand-in too: the same attention kernels)."""
    model = _gpt2(frozen)
    with uncounted():
        ref = Reference(model)
    prompt = torch.tensor([[3, 14, 15, 92]])
    with _attach(model, placement) as sched:
        assert model.device == SIM  # before the first step: the prompt goes where the model computes
        _all_on(model, SIM)
        for step, ids in enumerate(_data(4)):
            ids = ids.to(model.device)
            sched.backward(_lm(model, ids))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            assert norm > CLIP
            _all_on(model, SIM)  # gradients on the host read as the device too
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(ids, _lm, CLIP)
                assert_same(model, ref, f"step {step}")
            assert model.device == SIM
            with torch.no_grad():
                out = model.generate(prompt.to(model.device), max_new_tokens=5, do_sample=False,
                                     pad_token_id=0)
            with sched.sim.paused(), torch.no_grad():
                want = ref.model.generate(prompt.to(SIM), max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert out.device == SIM and torch.equal(out.cpu(), want.cpu()), step
        assert sched.plan.param_host_chunks  # parameters really lived on the host
        _all_on(model, SIM)


def test_averaged_model_and_an_ema_over_state_dict_built_after_attach() -> None:
    """``AveragedModel(model)`` and an EMA that lerps ``state_dict()`` tensors, both made after attach with
    parameters on the host: every tensor stays on the device across steps, and both equal the same averages
    of plain torch's model."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = _gpt2()
    with uncounted():
        ref = Reference(model)
    with _attach(model, "static") as sched:
        swa = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        ema = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        with sched.sim.paused():
            ref_swa = AveragedModel(ref.model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
            ref_ema = {k: v.detach().clone() for k, v in ref.model.state_dict().items()
                       if v.is_floating_point()}
        for step, ids in enumerate(_data(3)):
            ids = ids.to(SIM)
            sched.backward(_lm(model, ids))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            swa.update_parameters(model)
            for k, v in model.state_dict().items():
                if k in ema:
                    assert v.device == SIM, k
                    ema[k].lerp_(v, 0.1)
            with sched.sim.paused():
                ref.step(ids, _lm, None)
                ref_swa.update_parameters(ref.model)
                for k, v in ref.model.state_dict().items():
                    if k in ref_ema:
                        ref_ema[k].lerp_(v, 0.1)
                assert_same(model, ref, f"step {step}")
        assert sched.plan.param_host_chunks
        for (n, a), b in zip(swa.module.named_parameters(), ref_swa.module.parameters(), strict=True):
            assert a.device == SIM and torch.equal(a.cpu(), b.cpu()), n
        for k in ema:
            assert torch.equal(ema[k].cpu(), ref_ema[k].cpu()), k


def test_peft_merge_and_unload_with_the_base_on_the_host() -> None:
    """PEFT's ``merge_and_unload()`` adds each adapter's delta (computed on the device) to its base weight,
    which lives on the host: the merged model equals plain torch's merged model."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                           fan_in_fan_out=True)
    torch.manual_seed(0)
    model = peft.get_peft_model(_gpt2(), lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    with uncounted():
        ref = Reference(model)
    with _attach(model, "static") as sched:
        _train(sched, model, ref, _data(2), _lm)
        assert any(sched.store.chunks[i].frozen for i in sched.plan.param_host_chunks)  # a base on the host
        merged = model.merge_and_unload()
        with sched.sim.paused():
            ref_merged = ref.model.merge_and_unload()
        for (n, a), b in zip(merged.named_parameters(), ref_merged.parameters(), strict=True):
            assert a.device == SIM and torch.equal(a.detach().cpu(), b.detach().cpu()), n


class _KeepOnCtx(torch.autograd.Function):
    """``x @ w.T`` that keeps ``w`` on ``ctx`` (not ``save_for_backward``), as some custom kernels do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w = w
        return x @ w.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (x,) = ctx.saved_tensors
        return g @ ctx.w, g.t() @ x


class _SaveForBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class _CustomNet(nn.Module):
    def __init__(self, fn: type[torch.autograd.Function]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fn = fn
        self.layers = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(self.fn.apply(x, layer.weight))
        return x


def _custom_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean()


@pytest.mark.parametrize("fn", [_KeepOnCtx, _SaveForBackward], ids=["ctx-attribute", "save_for_backward"])
def test_a_custom_function_reading_a_weight_in_backward(fn) -> None:
    """With the weights' chunks on the host, a custom Function that keeps its weight as ``ctx.w`` is refused
    in backward with memsched's error naming the fix (before, it read NaN and the step was silently wrong);
    the ``save_for_backward`` form trains bit-exact."""
    model = _CustomNet(fn)
    with uncounted():
        ref = Reference(model)
    xs = [torch.randn(4, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with memsched.attach(model, policy="static", device="sim:64MiB", lr=LR, weight_decay=WD, chunk_numel=4096,
                         policy_options={"offload_optim_frac": 1.0, "offload_param_frac": 1.0}) as sched:
        if fn is _KeepOnCtx:
            before = [p.detach().cpu().clone() for p in model.parameters()]
            with pytest.raises(RuntimeError, match=r"ctx\.save_for_backward\(w\)"):
                sched.backward(_custom_loss(model, xs[0].to(SIM)))
            for p, q in zip(model.parameters(), before, strict=True):  # nothing was lost
                assert torch.equal(p.detach().cpu(), q)
            return
        _train(sched, model, ref, xs, _custom_loss)
        assert sched.plan.param_host_chunks


class _FrozenBlockNet(nn.Module):
    """A trainable stem and head around a frozen block, with a floating-point buffer the forward mixes in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(32, 64)
        self.frozen = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64))
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(64, 8)
        self.register_buffer("shift", torch.linspace(-1, 1, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.stem(x) + self.shift))


def _frozen_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().pow(2).mean()


@pytest.mark.parametrize("policy", ["cuda", "cpu"])
def test_dtype_bf16_converts_a_frozen_block_and_buffers_as_model_to_would(policy: str) -> None:
    """``attach(dtype=torch.bfloat16)`` on a model with a frozen block and an fp32 buffer: both take bf16
    (before, the forward failed with torch's "expected scalar type"), and training with torch's clip equals
    the reference of ``model.to(torch.bfloat16)`` with fp32 masters updated by fused AdamW."""
    model = _FrozenBlockNet()
    with uncounted():
        ref_model = copy.deepcopy(model).to(SIM)
        trainable = [p for p in ref_model.parameters() if p.requires_grad]
        masters = [p.detach().clone().requires_grad_(True) for p in trainable]  # fp32, before the rounding
        ref_model.to(torch.bfloat16)
        ref_opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)
    xs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with memsched.attach(model, policy=policy, device="sim:64MiB", dtype=torch.bfloat16, lr=LR,
                         weight_decay=WD) as sched:
        assert model.shift.dtype == torch.bfloat16 and model.frozen[0].weight.dtype == torch.bfloat16
        for step, x in enumerate(xs):
            x = x.to(SIM).to(torch.bfloat16)
            sched.backward(_frozen_loss(model, x))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused(), uncounted():
                _frozen_loss(ref_model, x).backward()
                torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
                for m, p in zip(masters, trainable, strict=True):
                    m.grad = p.grad.float()
                    p.grad = None
                ref_opt.step()
                ref_opt.zero_grad()
                with torch.no_grad():
                    for m, p in zip(masters, trainable, strict=True):
                        p.copy_(m)
                for (n, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
                    assert a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu()), (step, n)


def test_a_refused_attach_leaves_the_dtypes_as_they_were() -> None:
    """A refused attach (an unknown policy) converts nothing: the frozen block and the buffer stay fp32."""
    model = _FrozenBlockNet().to(SIM)
    with pytest.raises((ValueError, KeyError)):
        memsched.attach(model, policy="no-such-policy", device="sim:64MiB", dtype=torch.bfloat16)
    assert model.shift.dtype == torch.float32 and model.frozen[0].weight.dtype == torch.float32
    assert model.stem.weight.dtype == torch.float32
    F.linear(torch.randn(2, 32, device=SIM), model.stem.weight)  # still a plain fp32 model


@pytest.mark.parametrize("move", ["root-cpu", "child-cpu", "child-half", "root-double"])
def test_a_module_moved_after_attach_is_refused_at_the_move(move: str) -> None:
    """Lightning moves the module after ``fit`` (``.cpu()``) and calls children next: the move itself is
    refused with memsched's error, whichever module moves, and nothing moved; a no-op move goes through;
    after ``close()`` the model moves freely and nothing of memsched's stays on ``nn.Module``."""
    original = nn.Module._apply
    model = _gpt2()
    with _attach(model, "static") as sched:
        sched.backward(_lm(model, _data(1)[0].to(SIM)))
        sched.optimizer.step()
        target = model if move.startswith("root") else model.transformer.h[2]
        call = {"cpu": target.cpu, "half": target.half, "double": target.double}[move.split("-")[1]]
        before = [(p.device, p.dtype, p.data_ptr()) for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"memsched: moving or converting module .* close\(\)"):
            call()
        assert [(p.device, p.dtype, p.data_ptr()) for p in model.parameters()] == before
        model.to(model.device)  # already there: nothing to refuse
        model.float()
        assert nn.Module._apply is not original
    assert nn.Module._apply is original
    model.cpu()
    assert model.device == torch.device("cpu")


def test_an_input_left_on_the_host_gets_memsched_s_explanation() -> None:
    """A prompt left on the CPU fails inside the forward as on a GPU, with memsched's message naming the
    device to move it to (the same RuntimeError torch raised)."""
    model = _gpt2()
    with _attach(model, "static") as sched:
        sched.backward(_lm(model, _data(1)[0].to(SIM)))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        with pytest.raises(RuntimeError, match=r"the model computes on sim:0.*x\.to\(model\.device\)"):
            model(torch.tensor([[1, 2, 3]]))
        with torch.no_grad():
            assert model(torch.tensor([[1, 2, 3]]).to(model.device)).logits.device == SIM


def test_a_write_through_host_gradients_is_seen_by_the_fp16_check():
    """fp16 with every chunk on the host: torch's clip (which does not know the loss scale) writes the host
    gradients through their device-typed views; the step still sees the write and refuses, as it does for
    device gradients, and nothing is updated."""
    from tests._numerics import gpt_batches, gpt_loss, tiny_gpt

    model = tiny_gpt()
    with memsched.attach(model, policy="cpu", device="sim:64MiB", dtype=torch.float16, lr=LR,
                         weight_decay=WD, chunk_numel=8192) as sched:
        batches = gpt_batches(3)
        for b in batches[:2]:
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        sched.backward(gpt_loss(model, batches[2]))
        assert all(sched.store.in_host_memory(p.grad) for p in model.parameters() if p.grad is not None)
        before = [p.detach().cpu().clone() for p in model.parameters()]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # scales the scaled gradients
        with pytest.raises(RuntimeError, match="sched.clip_grad_norm_"):
            sched.optimizer.step()
        for p, q in zip(model.parameters(), before, strict=True):
            assert torch.equal(p.detach().cpu(), q)


def test_saving_the_model_writes_each_host_buffer_once():
    """``torch.save(model.state_dict(keep_vars=True))`` between steps, every chunk on the host: the
    parameters' device-typed views of one host buffer share one storage (the buffer's), as its host views
    do, so the file holds each host buffer once, not once per parameter."""
    import io

    model = _gpt2()
    with memsched.attach(model, policy="cpu", device="sim:256MiB", lr=LR, weight_decay=WD,
                         chunk_numel=4096) as sched:
        sched.backward(_lm(model, _data(1)[0].to(SIM)))
        sched.optimizer.step()
        assert all(sched.store.in_host_memory(p) for p in model.parameters())
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        assert len(storages) < len(list(model.parameters()))  # shared
        buf = io.BytesIO()
        torch.save(model.state_dict(keep_vars=True), buf)
        assert buf.tell() < 1.1 * sum(storages.values()) + 2**16


def test_a_gradient_held_across_zero_grad_keeps_its_values_in_host_memory():
    """A host gradient the user holds (``g = p.grad``) across ``zero_grad()`` keeps its values, as in torch,
    in host memory of its own that reads as the device: no device memory is taken for it."""
    from memsched.devices import sim_backend

    model = _gpt2()
    with _attach(model, "static") as sched:
        ids = _data(1)[0].to(SIM)
        sched.backward(_lm(model, ids))
        p = next(p for p in model.parameters() if sched.store.in_host_memory(p.grad) and p.numel() > 1000)
        g = p.grad
        values = g.detach().cpu().clone()
        sched.optimizer.step()
        before = sim_backend.memory_allocated()
        sched.optimizer.zero_grad()
        assert g.device == SIM and torch.equal(g.detach().cpu(), values)
        assert sim_backend.memory_allocated() <= before
        assert not sched.store.in_host_memory(g)  # its own memory, not the chunk's
        sched.backward(_lm(model, ids))  # the next backward writes the chunk's gradients, not g
        assert torch.equal(g.detach().cpu(), values)
