"""[Note: lean host chunks] (memsched/chunks/chunk.py): under mixed precision a host chunk whose parameters
stay on the device keeps no bf16 copy of them on the host; a plan that keeps a chunk's parameters on the host
pays for that copy, and nothing else does."""

from __future__ import annotations

import torch

import memsched
from tests._numerics import LR, WD, Reference, assert_same, gpt_batches, gpt_loss, tiny_gpt


def test_values_sent_in_pieces_through_the_staging_buffer_are_exact(monkeypatch) -> None:
    """Chunks larger than a piece send their values in several pieces through the one staging buffer, whose
    size (a piece) the plan counts: the pinned bytes held are the plan's, and training is bit-exact."""
    import memsched.optim.hybrid_adamw as hybrid
    import memsched.planning.problem as problem

    for module in (hybrid, problem):
        monkeypatch.setattr(module, "H2D_PIECE_NUMEL", 1000)
    model = tiny_gpt()
    ref = Reference(model, torch.bfloat16)
    with memsched.attach(model, policy="cpu", device="sim:64MiB", dtype=torch.bfloat16, lr=LR,
                         weight_decay=WD, chunk_numel=8192) as sched:
        assert max(c.shard_numel for c in sched.store.chunks) > 3 * 1000
        for step, b in enumerate(gpt_batches(3)):
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(b, gpt_loss, None)
                assert_same(model, ref, f"step {step}", optimizer=sched.optimizer)
        assert sched.optimizer._h2d_staging.numel() == 1000
        usage = sched.host_usage()
        assert usage.pinned_bytes == usage.planned_pinned_bytes


def test_only_chunks_whose_parameters_live_on_the_host_keep_a_copy_of_them() -> None:
    """bf16 with fp32 masters, every chunk's state on the host and half the chunks' parameters too: those
    chunks hold the parameters' bf16 copy, the others none; between steps a lean chunk's parameters are its
    device buffer and their gradients the host's; the pinned bytes held are the plan's; training is
    bit-exact against the bf16 reference with fp32 masters, with a clip that triggers."""
    model = tiny_gpt()
    ref = Reference(model, torch.bfloat16)
    with memsched.attach(model, policy="static", device="sim:64MiB", dtype=torch.bfloat16, lr=LR,
                         weight_decay=WD, chunk_numel=8192,
                         policy_options={"offload_optim_frac": 1.0, "offload_param_frac": 0.5}) as sched:
        for step, b in enumerate(gpt_batches(3)):
            sched.backward(gpt_loss(model, b))
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) > 0.05
            if step == 2:  # between backward and the step: where parameters and gradients are
                store = sched.store
                for c in store.trainable_chunks:
                    lean = c.index not in sched.plan.param_host_chunks
                    assert (c.staging is None) == lean, c.index
                    for p in c.params:
                        assert store.in_host_memory(p) != lean
                        assert p.grad is None or store.in_host_memory(p.grad)
                        assert p.device.type == "sim"
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(b, gpt_loss, 0.05)
                assert_same(model, ref, f"step {step}", optimizer=sched.optimizer)
        assert sched.plan.param_host_chunks and len(sched.plan.param_host_chunks) < len(sched.store.chunks)
        usage = sched.host_usage()
        assert usage.pinned_bytes == usage.planned_pinned_bytes


def test_writes_between_steps_take_the_same_effect_as_with_a_host_copy(monkeypatch) -> None:
    """Writes to the parameters between backward and the step, after the step, and after ``zero_grad()``
    reach a lean chunk's device buffer (it has no host copy) and the fp32 masters take them, exactly as they
    take writes made to a host copy: the run equals, bit for bit, the same run where every host chunk keeps
    its copy (as on a GPU that cannot read host memory in place)."""
    import memsched.chunks.store as store_module

    def run(lean: bool) -> list[torch.Tensor]:
        if not lean:
            monkeypatch.setattr(store_module, "reads_host_memory", lambda device, pinned: False)
        model = tiny_gpt()
        with memsched.attach(model, policy="cpu", device="sim:64MiB", dtype=torch.bfloat16, lr=LR,
                             weight_decay=WD) as sched:
            assert all((c.staging is None) == lean for c in sched.store.trainable_chunks)
            for step, b in enumerate(gpt_batches(3)):
                sched.backward(gpt_loss(model, b))
                with torch.no_grad():  # between backward and the step: gradients on the host
                    for p in list(model.parameters())[::3]:
                        p.add_(1e-3 * (step + 1))
                sched.optimizer.step()
                with torch.no_grad():  # after the step, gradients still held
                    for p in list(model.parameters())[2::5]:
                        p.sub_(2e-3)
                sched.optimizer.zero_grad()
                with torch.no_grad():  # after zero_grad: every parameter bound to the device
                    for p in list(model.parameters())[1::2]:
                        p.mul_(0.5)
            masters = [s["master_weight"].cpu() for s in sched.optimizer.state_dict()["state"].values()]
            return [p.detach().cpu() for p in model.parameters()] + masters

    monkeypatch.undo()
    lean, kept = run(True), run(False)
    assert len(lean) == len(kept)
    assert all(torch.equal(a, b) for a, b in zip(lean, kept, strict=True))
