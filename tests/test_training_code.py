"""Training code torch accepts, followed exactly (issue 28): hand-set gradients, post-accumulate-grad hooks,
gradients the user keeps, torch's defaults, the old optimizer's flags, sparse embeddings. Each against
``torch.optim.AdamW(fused=True)`` bit for bit, with gradients on the host (``cpu``), on the device (``cuda``)
and half the parameters on the host (``static``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memsched
from tests._numerics import SIM, same

MODES = {
    "grads-on-host": dict(policy="cpu", device="sim:64MiB"),
    "on-device": dict(policy="cuda", device="sim:64MiB"),
    "params-on-host": dict(policy="static", device="sim:64MiB", policy_options={"offload_param_frac": 0.5}),
}
LR, WD, STEPS = 1e-2, 0.1, 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch on the stand-in device, where the model trains (the reference too)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g).to(SIM), torch.randn(8, 4, generator=g).to(SIM)


def run_torch(train_step, **adamw) -> list[torch.Tensor]:
    model = mlp().to(SIM)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **({"lr": LR, "weight_decay": WD} | adamw))
    for s in range(STEPS):
        train_step(model, opt, s)
    return [p.detach().clone() for p in model.parameters()]


def run_memsched(train_step, mode: str, **kw) -> list[torch.Tensor]:
    model = mlp()
    with memsched.attach(model, chunk_numel=1200, **({"lr": LR, "weight_decay": WD} | MODES[mode] | kw)) as s:
        for step in range(STEPS):
            train_step(model, s.optimizer, step)
        return [p.detach().clone() for p in model.parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        x, y = x.cpu(), y.cpu()
        assert same(x, y), f"parameter {i} differs by {(x - y).abs().max().item()}"


def hand_set_gradients(model, opt, step):
    """SAM, PCGrad, MAML: gradients from torch.autograd.grad, set by hand, no backward."""
    x, y = data(step)
    grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters()))
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g * 0.5
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", MODES)
def test_hand_set_gradients_are_applied(mode):
    assert_same(run_torch(hand_set_gradients), run_memsched(hand_set_gradients, mode))


def replace_one_gradient_after_backward(model, opt, step):
    x, y = data(step)
    nn.functional.mse_loss(model(x), y).backward()
    model[2].weight.grad = torch.full_like(model[2].weight, 0.25)  # on the parameter's device
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_replaced_after_backward(mode):
    assert_same(run_torch(replace_one_gradient_after_backward),
                run_memsched(replace_one_gradient_after_backward, mode))


def _clamp(p: torch.Tensor) -> None:
    assert p.grad is not None, "a post-accumulate-grad hook saw p.grad None"
    p.grad.clamp_(-0.01, 0.01)


def plain_step(model, opt, step):
    x, y = data(step)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def clamped_by_hooks(model, opt, step):
    if not hasattr(model, "hooked"):
        model.hooked = [p.register_post_accumulate_grad_hook(_clamp) for p in model.parameters()]
    plain_step(model, opt, step)


@pytest.mark.parametrize("mode", MODES)
def test_post_accumulate_grad_hooks_see_and_change_every_gradient(mode):
    assert_same(run_torch(clamped_by_hooks), run_memsched(clamped_by_hooks, mode))


@pytest.mark.parametrize("mode", MODES)
def test_a_kept_gradient_keeps_its_values(mode):
    """``g = p.grad`` survives ``zero_grad()`` and the next backward unchanged, as in torch (gradient noise,
    gradient similarity)."""
    model = mlp()
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=1200, **MODES[mode]) as sched:
        for step in range(STEPS):
            x, y = data(step)
            nn.functional.mse_loss(model(x), y).backward()
            kept = [p.grad for p in model.parameters()]
            values = [g.clone() for g in kept]
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            nn.functional.mse_loss(model(x * 2), y).backward()
            for g, v in zip(kept, values, strict=True):
                assert same(g.cpu(), v.cpu())
            fresh = [p.grad.cpu() for p in model.parameters()]
            assert not all(same(f, v.cpu()) for f, v in zip(fresh, values, strict=True))
            sched.optimizer.zero_grad()


def plain_steps(model, opt, step):
    x, y = data(step)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_defaults_are_torchs():
    """``attach(model)`` in place of ``AdamW(model.parameters())`` trains the same."""
    model = mlp()
    with memsched.attach(model, policy="cpu", device="sim:64MiB") as sched:
        for step in range(STEPS):
            plain_steps(model, sched.optimizer, step)
        mine = [p.detach().clone() for p in model.parameters()]
        group = sched.optimizer.param_groups[0]
        assert (group["lr"], group["weight_decay"]) == (1e-3, 1e-2)
    ref = mlp().to(SIM)
    opt = torch.optim.AdamW(ref.parameters(), fused=True)
    for step in range(STEPS):
        plain_steps(ref, opt, step)
    assert_same([p.detach() for p in ref.parameters()], mine)


@pytest.mark.parametrize("flags", [{"foreach": True}, {"foreach": False}, {}])
def test_the_old_optimizers_flags_do_not_reach_the_state_dict(flags):
    """``attach(params=optimizer.param_groups)`` from a foreach (or default) AdamW: the state dict says what
    memsched runs (fused), so a resume in ``torch.optim.AdamW(fused=True)`` keeps the fused kernel and is
    exact."""
    model = mlp()
    old = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **flags)
    with memsched.attach(model, params=old.param_groups, policy="cpu", device="sim:64MiB") as sched:
        for step in range(2):
            plain_steps(model, sched.optimizer, step)
        state = sched.optimizer.state_dict()
        at = [p.detach().clone() for p in model.parameters()]
    assert state["param_groups"][0]["fused"] is True and state["param_groups"][0]["foreach"] is None
    resumed = mlp()
    with torch.no_grad():
        for p, v in zip(resumed.parameters(), at, strict=True):
            p.copy_(v)
    opt = torch.optim.AdamW(resumed.parameters(), lr=LR, weight_decay=WD, fused=True)
    opt.load_state_dict(state)
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is None


@pytest.mark.parametrize("cls", [nn.Embedding, nn.EmbeddingBag])
def test_sparse_embeddings_are_refused_at_attach(cls):
    model = nn.Sequential(cls(10, 4, sparse=True), nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"module '0' is a .* with sparse=True.*does not support sparse"):
        memsched.attach(model, policy="cpu", device="sim:64MiB")
    assert all(same(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model[0].weight.requires_grad_(False)  # frozen: no sparse gradient to train
    with memsched.attach(model, policy="cpu", device="sim:64MiB"):
        pass


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


@pytest.mark.parametrize("mode", MODES)
def test_safetensors_round_trip_of_tied_weights(mode, tmp_path):
    """Accelerate and Trainer save state dicts with safetensors' ``save_file`` by default: a tied model after
    attach saves (tied names share one tensor, which safetensors refuses unless it covers its storage),
    loads back exactly, and stays tied."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = Tied()
    x = torch.randint(0, 10, (4, 5)).to(SIM)
    with memsched.attach(model, lr=LR, weight_decay=WD, **MODES[mode]) as sched:
        for _ in range(2):
            model(x).pow(2).mean().backward()
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        path = str(tmp_path / "model.safetensors")
        state = model.state_dict()
        assert state["emb.weight"] is state["head.weight"]
        safetensors_torch.save_file({k: v for k, v in state.items() if k != "head.weight"}, path)
        saved = {k: v.clone() for k, v in state.items()}
        with torch.no_grad():
            model.emb.weight.zero_()
        loaded = safetensors_torch.load_file(path)
        model.load_state_dict(loaded, strict=False)  # into the attached model: in place
        assert model.head.weight is model.emb.weight
        for k, v in model.state_dict().items():
            assert same(v.cpu(), saved[k].cpu()), k
        model(x).pow(2).mean().backward()  # and training goes on
        sched.optimizer.step()
    other = Tied()
    other.load_state_dict(safetensors_torch.load_file(path), strict=False)
    assert other.head.weight is other.emb.weight
    for k, v in other.state_dict().items():
        assert same(v.cpu(), saved[k].cpu()), k


def maml(model, opt, step):
    """MAML's inner step: fast weights ``p - lr * g`` from ``torch.autograd.grad(..., create_graph=True)``,
    read outside the model's forward between its two forwards, and the outer loss through them
    (``torch.func.functional_call``). Issue 28, item 2: with parameters offloaded these reads saw the NaN of
    parameters away from the device, in warmup and after."""
    from torch.func import functional_call

    x, y = data(step)
    params = dict(model.named_parameters())
    inner = nn.functional.mse_loss(functional_call(model, params, (x,)), y)
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {k: p - 0.1 * g for (k, p), g in zip(params.items(), grads, strict=True)}
    nn.functional.mse_loss(functional_call(model, fast, (x,)), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", MODES)
def test_maml_fast_weights_from_create_graph(mode):
    """Issue 28, item 2: with parameters offloaded, a chunk sent away during ``torch.autograd.grad`` is
    fetched again when ``p - lr * g`` reads it outside the forward ([Note: reads outside the forward])."""
    assert_same(run_torch(maml), run_memsched(maml, mode))


@pytest.mark.parametrize("mode", MODES)
def test_progressive_unfreezing_by_re_attach_equals_add_param_group(mode):
    """Issue 28, item 15: memsched refuses ``add_param_group`` after attach (the chunks are built once). The
    README's recipe (every group given to attach from the start, the frozen one included; to unfreeze: save
    the optimizer state, close, unfreeze, attach again with the same groups, load the state) trains exactly
    as ``torch.optim.AdamW`` does with ``add_param_group`` at the same step, its LR scheduler rebuilt too."""
    unfreeze_at, steps = 2, 4
    ref = mlp().to(SIM)
    head = list(ref[4].parameters())
    for p in head:
        p.requires_grad_(False)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=WD, fused=True)
    lr_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for s in range(steps):
        if s == unfreeze_at:
            for p in head:
                p.requires_grad_(True)
            opt.add_param_group({"params": head, "lr": LR * 2})
        plain_step(ref, opt, s)
        lr_sched.step()

    model = mlp()
    head = list(model[4].parameters())
    body = [p for m in (model[0], model[2]) for p in m.parameters()]
    for p in head:
        p.requires_grad_(False)
    groups = [{"params": body}, {"params": head, "lr": LR * 2}]
    sched = memsched.attach(model, params=groups, lr=LR, weight_decay=WD, chunk_numel=1200, **MODES[mode])
    lr_sched = torch.optim.lr_scheduler.StepLR(sched.optimizer, step_size=1, gamma=0.5)
    try:
        for s in range(steps):
            if s == unfreeze_at:
                with pytest.raises(RuntimeError, match="re-attach|attach again|memsched.attach"):
                    sched.optimizer.add_param_group({"params": head})
                state, sched_state = sched.optimizer.state_dict(), lr_sched.state_dict()
                sched.close()
                for p in head:
                    p.requires_grad_(True)
                sched = memsched.attach(model, params=groups, lr=LR, weight_decay=WD, chunk_numel=1200,
                                        **MODES[mode])
                sched.optimizer.load_state_dict(state)
                lr_sched = torch.optim.lr_scheduler.StepLR(sched.optimizer, step_size=1, gamma=0.5)
                lr_sched.load_state_dict(sched_state)
                # torch's new group starts at its own lr, not the scheduled one: as add_param_group does
                sched.optimizer.param_groups[1]["lr"] = LR * 2
            plain_step(model, sched.optimizer, s)
            lr_sched.step()
        assert_same([p.detach().clone() for p in ref.parameters()],
                    [p.detach().clone() for p in model.parameters()])
    finally:
        sched.close()


@pytest.mark.parametrize("model_fn", [Tied, mlp], ids=["tied", "untied"])
@pytest.mark.parametrize("mode", MODES)
def test_safetensors_save_model_and_load_model_round_trip(mode, model_fn, tmp_path):
    """Issue 28, item 12: safetensors' ``save_model`` / ``load_model`` (which refuse an entry that does not
    cover its storage) save an attached model, tied or not, and load it back into it and into a plain one;
    Accelerate's cleaning for safetensors (``save_state``'s default) keeps every parameter, where it kept one
    per chunk. No entry is a copy: each aliases its parameter's bytes."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = model_fn()
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=1200, **MODES[mode]) as sched:
        dev = sched.device.torch_device
        x = torch.randint(0, 10, (4, 5)) if model_fn is Tied else torch.randn(8, 16)
        for _ in range(2):
            model(x.to(dev)).pow(2).mean().backward()
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        state = model.state_dict()
        for k, p in model.named_parameters():  # aliases, not copies
            assert state[k].data_ptr() == p.data_ptr(), k
        saved = {k: v.detach().cpu().clone() for k, v in state.items()}
        path = str(tmp_path / "model.safetensors")
        safetensors_torch.save_model(model, path)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        missing, unexpected = safetensors_torch.load_model(model, path)
        assert not missing and not unexpected
        for k, v in model.state_dict().items():
            assert same(v.cpu(), saved[k]), k
        other = model_fn()
        safetensors_torch.load_model(other, path)
        for k, v in other.state_dict().items():
            assert same(v, saved[k]), k
        # Accelerate's save_state (safetensors) keeps one name per storage, as accelerate.utils.modeling's
        # id_tensor_storage tells them: every parameter must be its own, tied names one
        modeling = pytest.importorskip("accelerate.utils.modeling")
        storages: dict = {}
        for k, v in model.state_dict().items():
            storages.setdefault(modeling.id_tensor_storage(v), set()).add(k)
        tied = {frozenset({"emb.weight", "head.weight"})} if model_fn is Tied else set()
        assert {frozenset(names) for names in storages.values() if len(names) > 1} == tied


def write_through_state_dict(model, opt, step):
    """Weight surgery through ``model.state_dict()``'s tensors (they alias the parameters, in torch)."""
    if step == 1:
        with torch.no_grad():
            model.state_dict()["2.weight"].mul_(0.5)
    plain_step(model, opt, step)


@pytest.mark.parametrize("mode", MODES)
def test_a_write_through_a_state_dict_entry_reaches_the_model(mode):
    assert_same(run_torch(write_through_state_dict), run_memsched(write_through_state_dict, mode))
