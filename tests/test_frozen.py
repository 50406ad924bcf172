"""Frozen parameters are model data too (issue 31): with one rank they are packed into chunks of their own (no
gradients, no optimizer state), placed by the plan and fetched for their reads like any chunk, and ``auto``
keeps them on the host before any trainable parameter. A LoRA whose frozen base does not fit the stand-in
trains bit for bit against ``torch.optim.AdamW(fused=True)``; a frozen parameter given to attach and unfrozen
later is refused at the step; one memsched was not given follows another optimizer's writes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memsched
from memsched.chunks import chunk_bytes
from memsched.models.lora import LoRALinear, add_lora
from policies import PlacementProblem, get
from policies.builtin import param_offload_order
from policies.types import DEVICE, HOST, ChunkAccess, ChunkSpec
from tests._numerics import LR, SIM, Reference, assert_same, to_dev
from tracer import MemoryTracer

CLIP, ACCUM, STEPS, VOCAB = 0.05, 2, 4, 64


class LoRANet(nn.Module):
    """An embedding, ``depth`` linear blocks and a head, all frozen, with rank-4 LoRA adapters on the blocks
    and the head (their ``B`` random, so that every adapter has a gradient from the first step)."""

    def __init__(self, width: int = 128, depth: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)
        add_lora(self, 4, skip=())
        for m in self.modules():
            if isinstance(m, LoRALinear):
                nn.init.normal_(m.lora_b, std=0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def batches(n: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g))
            for _ in range(n)]


def frozen_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def test_a_lora_whose_frozen_base_is_three_times_the_free_device_trains_bit_exactly() -> None:
    """The done-when of issue 31: the frozen base is 3x what the stand-in has beside the activations; auto
    keeps the base on the host (before any adapter), fetches it for its reads, and the adapters train as
    torch trains them, with torch's clip over ``model.parameters()`` (it triggers) and accumulation 2."""
    data = batches(STEPS * ACCUM)
    traced = LoRANet().to(SIM)
    with MemoryTracer(traced) as tracer:
        for micro in data[:ACCUM]:
            loss_fn(traced, to_dev(micro)).backward()
    peak = tracer.timeline.peak_non_model_bytes()
    del tracer, traced
    model = LoRANet()
    base = frozen_bytes(model)
    capacity = peak + base // 3
    ref = Reference(model)
    with memsched.attach(model, policy="auto", device=f"sim:{capacity}B", lr=LR, weight_decay=0.1) as sched:
        store = sched.store
        assert {id(p) for c in store.chunks if c.frozen for p in c.params} == \
            {id(p) for p in model.parameters() if not p.requires_grad}
        assert all(c.grad is None and c.exp_avg is None for c in store.chunks if c.frozen)
        for step in range(STEPS):
            micro = to_dev(data[step * ACCUM:(step + 1) * ACCUM])
            sched.backward(loss_fn(model, micro[0]))
            sched.backward(loss_fn(model, micro[1]))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            assert norm > CLIP  # the clip triggers
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(micro, loss_fn, CLIP)
                assert_same(model, ref, f"step {step}")
        plan = sched.plan
        frozen = [c.index for c in store.chunks if c.frozen]
        on_host = plan.param_host_chunks
        # the frozen chunks go first: a trainable chunk's parameters are on the host only once every frozen
        # chunk's are
        assert on_host and (set(frozen) <= set(on_host) or set(on_host) <= set(frozen))
        # a frozen chunk lives where its parameters do, and holds their values only (no pinned state)
        for c in store.chunks:
            if c.frozen:
                assert c.placement == (HOST if c.index in on_host else DEVICE)
                assert c.state_nbytes() == (c.numel * 4 if c.placement == HOST else 0)
        assert base > 3 * (capacity - peak) - 4
        # between steps: the model's state dict holds the frozen base's values (from the host copies)
        sd = model.state_dict()
        for name, p in ref.model.named_parameters():
            assert torch.equal(sd[name].cpu(), p.detach().cpu()), name


def _problem(frozen: tuple[bool, ...], capacity: int) -> PlacementProblem:
    chunks = tuple(ChunkSpec(index=i, device_bytes=0 if f else 300, host_bytes=100 if f else 500, numel=25,
                             param_bytes=100, frozen=f) for i, f in enumerate(frozen))
    reads = tuple(ChunkAccess(i, "forward", 50) for i in range(len(chunks))) + tuple(
        ChunkAccess(i, "backward", 50) for i in reversed(range(len(chunks))) if not chunks[i].frozen)
    return PlacementProblem(capacity_bytes=capacity, peak_non_model_bytes=50,
                            resident_model_bytes=100 * len(chunks), chunks=chunks, accesses=reads,
                            host_grad_working_bytes=40)


def test_auto_keeps_frozen_parameters_on_the_host_before_any_trainable_one() -> None:
    # two trainable chunks used first, then three frozen ones: room for about half of the parameters
    problem = _problem((False, False, True, True, True), 420)
    plan = get("auto", reserve_frac=0.0).plan(problem)
    assert param_offload_order(problem) == [2, 3, 4, 0, 1]
    host = plan.param_host_chunks
    assert host == sorted(param_offload_order(problem)[:len(host)]) == [0, 2, 3, 4]  # 4 do not fit
    assert "frozen parameters first" in " ".join(plan.reasons)
    # frozen chunks: where their parameters are; no pinned bytes for those kept on the device
    for i in (2, 3, 4):
        assert plan.placement[i] == (HOST if plan.params_on_host(i) else DEVICE)
    assert plan.host_bytes == sum(problem.chunks[i].host_bytes for i in plan.host_chunks)


def test_cpu_keeps_frozen_chunks_beside_their_parameters_without_pinned_copies() -> None:
    problem = _problem((False, True), 10_000)
    plan = get("cpu").plan(problem)
    assert plan.placement == (HOST, DEVICE) and plan.host_bytes == 500
    # only a trainable chunk on the host brings its gradients in flight
    assert problem.device_bytes_of([DEVICE, HOST]) == 300 and problem.device_bytes_of([HOST, DEVICE]) == 40


def test_frozen_chunks_weigh_their_values_only() -> None:
    cb = chunk_bytes(1000, compute_dtype=torch.bfloat16, frozen=True, n_params=3)
    assert (cb.compute_bytes, cb.grad_bytes, cb.device_state_bytes, cb.host_state_bytes) == (2000, 0, 0, 2000)


def test_bf16_frozen_chunks_hold_the_compute_copy_only() -> None:
    model = LoRANet().to(torch.bfloat16)
    with memsched.attach(model, policy="cpu", device="sim:64MiB", dtype=torch.bfloat16) as sched:
        for b in batches(2):
            sched.backward(loss_fn(model, to_dev(b)).float())
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        frozen = [c for c in sched.store.chunks if c.frozen]
        assert frozen and all(c.dtype == torch.bfloat16 and c.master is None and c.staging is None
                              for c in frozen)  # on the device: the compute buffer alone


def test_a_given_parameter_unfrozen_after_attach_is_refused_at_the_step() -> None:
    model = LoRANet()
    with memsched.attach(model, policy="cpu", device="sim:64MiB", lr=LR) as sched:
        b = to_dev(batches(1)[0])
        sched.backward(loss_fn(model, b))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        model.blocks[0].base.weight.requires_grad_(True)  # torch.optim.AdamW(model.parameters()) updates it
        before = {n: p.detach().cpu() for n, p in model.named_parameters()}
        sched.backward(loss_fn(model, b))
        with pytest.raises(RuntimeError, match=r"blocks\.0\.base\.weight.*frozen.*attach again"):
            sched.optimizer.step()
        for n, p in model.named_parameters():
            assert torch.equal(p.detach().cpu(), before[n]), n


def test_frozen_parameters_not_given_follow_another_optimizer() -> None:
    """A GAN-style split: memsched trains the adapters, a torch SGD the head's frozen-at-attach bias (not
    given to memsched): its in-place updates reach the chunk, and the model computes with them."""
    torch.manual_seed(0)
    model, ref = LoRANet(), LoRANet()
    adapters = [p for p in model.parameters() if p.requires_grad]
    bias, rbias = model.head.base.bias, ref.head.base.bias
    with memsched.attach(model, policy="cpu", device="sim:64MiB", lr=LR, weight_decay=0.0,
                         params=adapters) as sched:
        ref.to(SIM)
        ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.0,
                                 fused=True)
        for b in batches(3):
            b = to_dev(b)
            for m, p in ((model, bias), (ref, rbias)):
                p.requires_grad_(True)
                loss_fn(m, b).backward(inputs=[p])
                with torch.no_grad():
                    p.add_(p.grad, alpha=-0.1)
                p.grad = None
                p.requires_grad_(False)
            sched.backward(loss_fn(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            loss_fn(ref, b).backward()
            ropt.step()
            ropt.zero_grad()
            for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.detach().cpu(), q.detach().cpu()), n


def test_memsched_plan_counts_a_lora_base_as_frozen_model_data(capsys) -> None:
    from memsched.cli.main import main
    from memsched.cli.plan import render
    from memsched.report.console import make_console

    argv = ["plan", "--model", "tiny", "--lora", "4", "--batch-size", "2", "--seq-len", "32",
            "--capacity", "64MiB"]
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    md = r["model_data"]
    assert r["workload"]["lora_rank"] == 4
    assert md["frozen"] > 10 * md["parameter"] > 0  # the base, and the adapters
    assert md["gradient"] == md["parameter"]  # the adapters' only
    assert r["largest_preset"]["any"] is not None
    # the table of the same result (the command's table path itself: tests/test_plan.py), without tracing the
    # model and the presets of the ladder again (issue 43: ~10 s)
    render(r, make_console())
    out = capsys.readouterr().out
    assert "frozen parameters" in out and "Largest preset" in out
    assert main(["plan", "tests/_targets.py:small", "--lora", "4", "--capacity", "1GiB"]) == 2
    assert "--lora applies to --model only" in capsys.readouterr().err


def _peft_gpt2():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=4, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                           fan_in_fan_out=True)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)  # every adapter has a gradient from the first step
    return model


def _lm(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, labels=ids).loss


def test_a_peft_lora_on_gpt2_trains_bit_exactly_and_saves_its_adapters(tmp_path) -> None:
    """PEFT as users write it: ``get_peft_model`` on a Hugging Face GPT-2 built from a config, attached whole
    on a stand-in that cannot hold its frozen base beside the activations: the base stays on the host, the
    adapters train bit for bit with torch's clip, and ``save_pretrained`` writes the trained adapters."""
    from safetensors.torch import load_file

    from tests._numerics import uncounted

    model = _peft_gpt2()
    with uncounted():
        ref = Reference(model)
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(3)]
    base = frozen_bytes(model)
    device = f"sim:{base + 2**20}B"
    with memsched.attach(model, policy="auto", device=device, lr=LR, weight_decay=0.1) as sched:
        for step, ids in enumerate(data):
            ids = ids.to(SIM)
            sched.backward(_lm(model, ids))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(ids, _lm, 0.5)
                assert_same(model, ref, f"step {step}")
        frozen = {c.index for c in sched.store.chunks if c.frozen}
        assert sched.plan.param_host_chunks and set(sched.plan.param_host_chunks) <= frozen  # the base first
        model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    trained = {n.replace(".default", ""): p for n, p in ref.model.named_parameters() if "lora_" in n}
    assert saved and saved.keys() == trained.keys()
    for name, t in saved.items():
        assert torch.equal(t, trained[name].detach().cpu()), name


@pytest.mark.parametrize(("base", "root"), [("on-device", "peft_model"), ("offloaded", "peft_model"),
                                           ("offloaded", "base_model")])
def test_peft_generate_between_steps_gives_the_reference_tokens(base, root) -> None:
    """``generate()`` right after a step: the chunk of the model's first parameter stays on the device (auto
    keeps it there when a plan allows), so Hugging Face's ``model.device`` is the device; and memsched,
    attached to a ``PeftModel``, hooks the model it wraps (:func:`memsched.scheduler.forward_root`), whose
    forward ``generate()`` runs too, so the chunks away are fetched for it."""
    from tests._numerics import uncounted

    model = _peft_gpt2()
    with uncounted():
        ref = Reference(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5)).to(SIM)
    size = frozen_bytes(model) + (64 * 2**20 if base == "on-device" else 2**20)
    attached = model.get_base_model() if root == "base_model" else model
    with memsched.attach(attached, policy="cpu" if base == "on-device" else "auto", device=f"sim:{size}B",
                         lr=LR, weight_decay=0.1) as sched:
        for _ in range(2):
            sched.backward(_lm(model, ids))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(ids, _lm, None)
            with torch.no_grad():
                out = model.generate(input_ids=ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
            with sched.sim.paused(), torch.no_grad():
                want = ref.model.generate(input_ids=ids[:1, :4], max_new_tokens=4, do_sample=False,
                                          pad_token_id=0)
            assert torch.equal(out.cpu(), want.cpu())
            assert model.device == SIM
        if base == "offloaded":
            assert sched.plan.param_host_chunks
        assert sched.model is model.get_base_model()
