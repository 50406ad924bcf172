"""Probes of unusual training-loop patterns, bit for bit against ``torch.optim.AdamW(fused=True)``.

Each probe trains the tiny GPT (or a small branchy model) with memsched and a deepcopy of it with torch's
fused AdamW, runs the same loop pattern on both sides, and compares every parameter with ``torch.equal``
after every step (the first step is the traced warmup), across policies with host chunks (cpu, static, auto)
and the three overlap modes (``False``, ``True``, ``"backward"``):

1. ``zero_grad`` before the forward; ``model.zero_grad()`` (both ``set_to_none``) instead of the optimizer's;
2. ``loss.backward()`` instead of ``sched.backward(loss)``, and other backward calls memsched does not make
   (``retain_graph`` twice, two roots, ``inputs=``, ``torch.autograd.grad``, ``step(closure)``);
3. evaluation between steps (``no_grad``, ``inference_mode``, ``eval()``/``train()`` with dropout), right
   after an overlapped step, through submodules, and before the first (warmup) step;
4. LR schedulers that move other hyper-parameters (OneCycleLR cycles beta1), CosineAnnealingWarmRestarts,
   a LambdaLR with a zero LR; hand edits of ``param_groups`` (between steps and between backward and step,
   one of them invalid: refused, nothing changes); ``add_param_group`` after attach (refused);
5. ``step()`` with no gradient since ``zero_grad``, before any backward, and twice in a row;
6. gradient accumulation with a varying number of micro-batches, gradients read (norms, ``p.grad is None``)
   between backward and step.

The reference side always runs inside ``paused(sched)``: the stand-in device counts memory on the training
thread. Host-chunk updates on worker threads are slowed (``slow_early_worker``) where a missing wait would
show as a wrong number.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import nn

import memsched
from memsched.models.gpt import GPT, GPTConfig
from policies.types import DEVICE, HOST
from tests._numerics import (
    BRANCHY_CHUNK_NUMEL,
    LR,
    SIM,
    WD,
    Branchy,
    gpt_batches,
    gpt_loss,
    same,
    tiny_gpt,
    uncounted,
)
from tests.test_overlap import PLACEMENTS, paused

POLICIES = ["cpu", "static", "auto"]
MODES = [False, True, "backward"]
MODE_IDS = ["serial", "overlap", "backward"]


# ---- helpers -----------------------------------------------------------------------------------------------

class Pair:
    """memsched on ``model`` and torch's fused AdamW on a deepcopy of it (made before attach)."""

    def __init__(self, placement: str, overlap, model: nn.Module | None = None, **kw) -> None:
        self.model = model if model is not None else tiny_gpt()
        with uncounted():
            self.ref = copy.deepcopy(self.model).to(SIM)
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), lr=LR, weight_decay=WD, fused=True)
        opts = {"chunk_numel": 8192, **PLACEMENTS[placement], **kw}
        self.sched = memsched.attach(self.model, lr=LR, weight_decay=WD, overlap=overlap, **opts)
        self.opt = self.sched.optimizer
        self.placement = placement

    def ref_side(self):
        return paused(self.sched)

    def check(self, what: str) -> None:
        """Every parameter equal bit for bit (after waiting for the overlapped update)."""
        self.sched.synchronize()
        with paused(self.sched):
            for (n, p), q in zip(self.model.named_parameters(), self.ref.parameters(), strict=True):
                p, q = p.detach().cpu(), q.detach().cpu()
                if not same(p, q):
                    d = (p - q).abs().max().item()
                    raise AssertionError(f"{what}: {n} differs from torch (max diff {d:.3g})")

    def check_state(self, what: str) -> None:
        """Moments and step counts equal; a parameter torch keeps no state for has step 0 here."""
        self.sched.synchronize()
        with paused(self.sched):
            ours = self.opt.state_dict()["state"]
            theirs = self.ref_opt.state_dict()["state"]
            for i, st in theirs.items():
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    assert same(ours[i][k].float().cpu(), st[k].float().cpu()), f"{what}: state {i} {k}"
            for i, st in ours.items():
                if i not in theirs:
                    assert float(st["step"]) == 0 and not st["exp_avg"].any(), f"{what}: state {i} moved"

    def assert_mixed(self) -> None:
        """The placement really has host chunks (and device chunks, for static and auto)."""
        places = {c.placement for c in self.sched.store.chunks}
        assert HOST in places, places
        if self.placement != "cpu":
            assert DEVICE in places, places

    def close(self) -> None:
        self.sched.close()


# Every policy and every overlap mode, in 5 runs (all 9 would cost twice the time for little more).
COMBOS = [("cpu", "backward"), ("static", False), ("static", True), ("auto", True), ("auto", "backward")]
# Each mode once, each policy once.
ONE_EACH = [("static", False), ("auto", True), ("cpu", "backward")]


def pairs(combos=COMBOS):
    ids = {False: "serial", True: "overlap", "backward": "backward"}
    return pytest.mark.parametrize("placement, overlap", combos, ids=[f"{p}-{ids[m]}" for p, m in combos])


def train_ref(pair: Pair, batches, *, zero_first=False) -> None:
    with pair.ref_side():
        if zero_first:
            pair.ref_opt.zero_grad()
        for b in batches:
            (gpt_loss(pair.ref, b) / len(batches)).backward()
        pair.ref_opt.step()
        if not zero_first:
            pair.ref_opt.zero_grad()


# ---- 1. zero_grad before the forward; model.zero_grad() instead of the optimizer's -----------------------

@pairs()
def test_zero_grad_before_forward(placement, overlap):
    """zero_grad(); forward; backward; step() (no zero_grad after the step): the common order."""
    pair = Pair(placement, overlap)
    with pair.sched:
        for i, b in enumerate(gpt_batches(5)):
            pair.opt.zero_grad()
            pair.sched.backward(gpt_loss(pair.model, b))
            pair.opt.step()
            train_ref(pair, [b], zero_first=True)
            pair.check(f"step {i}")
        pair.check_state("end")
        pair.assert_mixed()


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zeros", "none"])
@pairs(ONE_EACH)
def test_module_zero_grad_right_after_step(placement, overlap, set_to_none, slow_early_worker):
    """``model.zero_grad(set_to_none=...)`` (torch's nn.Module method, not the optimizer's) right after step,
    on both sides."""
    pair = Pair(placement, overlap)
    with pair.sched:
        for i, b in enumerate(gpt_batches(5)):
            pair.sched.backward(gpt_loss(pair.model, b))
            pair.opt.step()
            pair.model.zero_grad(set_to_none=set_to_none)
            with pair.ref_side():
                gpt_loss(pair.ref, b).backward()
                pair.ref_opt.step()
                pair.ref.zero_grad(set_to_none=set_to_none)
            pair.check(f"step {i}")
        pair.check_state("end")


@pytest.mark.parametrize("zero", ["module-zeros", "module-none", "opt-zeros", "opt-none"])
@pytest.mark.parametrize("overlap", MODES, ids=MODE_IDS)
def test_unused_branch_with_each_zero_grad(overlap, zero):
    """``b`` gets no gradient in the first step and in odd steps after it. torch: never-used parameters keep
    ``.grad`` None under ``set_to_none=False`` (not updated); once used, zeroed gradients (not None) update
    them with a zero gradient every step; with ``set_to_none=True`` they are skipped whenever unused."""
    model = Branchy()
    pair = Pair("cpu", overlap, model=model, chunk_numel=BRANCHY_CHUNK_NUMEL)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 8, generator=g).to(SIM) for _ in range(6)]
    with pair.sched:
        for i, x in enumerate(xs):
            use = i % 2 == 0 and i > 0
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    m.use_b = use
                    m(x).square().mean().backward()
                    opt.step()
                    where, how = zero.split("-")
                    target = m if where == "module" else opt
                    target.zero_grad(set_to_none=how == "none")
            pair.check(f"step {i} (b used: {use})")
        pair.check_state("end")


# ---- 2. loss.backward() instead of sched.backward(loss) ----------------------------------------------------

@pairs()
def test_plain_loss_backward(placement, overlap):
    """``loss.backward()`` directly (fp32: sched.backward adds nothing but the loss scale under fp16), with
    one step of two micro-batches."""
    pair = Pair(placement, overlap)
    batches = gpt_batches(6)
    plan = [[batches[0]], [batches[1]], [batches[2], batches[3]], [batches[4]], [batches[5]]]
    with pair.sched:
        for i, micro in enumerate(plan):
            for b in micro:
                (gpt_loss(pair.model, b) / len(micro)).backward()
            pair.opt.step()
            pair.opt.zero_grad()
            train_ref(pair, micro)
            pair.check(f"step {i}")
        pair.check_state("end")
        if overlap == "backward":
            assert pair.opt.early_updates.committed > 0  # the updates made during backward were used


BACKWARDS = ["retain-graph-twice", "autograd-backward-two-roots", "backward-inputs-subset",
             "autograd-grad-read", "closure", "zero-grad-between-micro-batches"]


def variant_backward(how: str, m: nn.Module, opt, b, b2) -> None:
    """One step's backward(s) and step, the way ``how`` says (the same calls on both sides)."""
    if how == "retain-graph-twice":  # the gradients are added twice, in two backward passes
        loss = gpt_loss(m, b)
        loss.backward(retain_graph=True)
        loss.backward()
    elif how == "autograd-backward-two-roots":  # one backward pass over two losses
        torch.autograd.backward([gpt_loss(m, b), 0.5 * gpt_loss(m, b2)])
    elif how == "backward-inputs-subset":  # only the blocks' parameters get gradients (torch skips the rest)
        torch.autograd.backward(gpt_loss(m, b), inputs=list(m.blocks.parameters()))
    elif how == "zero-grad-between-micro-batches":  # the first micro-batch is thrown away
        (gpt_loss(m, b) / 2).backward()
        opt.zero_grad()
        (gpt_loss(m, b2) / 2).backward()
    elif how == "autograd-grad-read":  # torch.autograd.grad (no .grad accumulation) after backward
        gpt_loss(m, b).backward()
        g = torch.autograd.grad(gpt_loss(m, b2), list(m.ln_f.parameters()))
        assert all(torch.isfinite(t).all() for t in g)
    else:
        assert how == "closure"

        def closure():
            opt.zero_grad()
            loss = gpt_loss(m, b)
            loss.backward()
            return loss

        opt.step(closure)
        return
    opt.step()


@pytest.mark.parametrize("how", BACKWARDS)
@pytest.mark.parametrize("overlap", MODES, ids=MODE_IDS)
def test_backward_variants(overlap, how):
    """Backward passes memsched does not run itself: ``retain_graph`` and a second backward of the same loss,
    ``torch.autograd.backward`` of two losses in one pass, ``backward(inputs=...)`` over a subset of the
    parameters, a ``torch.autograd.grad`` between backward and step, ``optimizer.step(closure)``."""
    # Two forwards before one backward need about twice auto's activation room on sim:800KiB: static there.
    pair = Pair("static" if how == "autograd-backward-two-roots" else "auto", overlap)
    batches = gpt_batches(10)
    with pair.sched:
        for i in range(5):
            b, b2 = batches[2 * i], batches[2 * i + 1]
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    variant_backward(how, m, opt, b, b2)
                    opt.zero_grad()
            pair.check(f"step {i}")
        pair.check_state("end")
        pair.assert_mixed()


@pytest.mark.parametrize("placement, offload_params", [("cpu", False), ("static", True)],
                         ids=["cpu", "static-params-on-host"])
@pytest.mark.parametrize("between", ["nothing", "zero_grad"])
def test_a_retained_graph_backs_up_again_after_the_first_backward_ended(placement, offload_params, between):
    """Found by the stand-in (issue 27): after the first backward's end the host chunks' parameters are host
    views, and the second backward of a retained graph read the parameters autograd saved as host tensors
    (torch's device error in ``native_layer_norm_backward``). Now it binds them to the device first, and
    the two backwards (with or without a ``zero_grad()`` between them) train exactly as torch, in warmup
    and planned steps, with the parameters kept on the host too."""
    kw = {"policy_options": {"offload_optim_frac": 1.0, "offload_param_frac": 0.5}} if offload_params else {}
    pair = Pair(placement, False, **kw)
    batches = gpt_batches(4)
    with pair.sched:
        for i, b in enumerate(batches):
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    loss = gpt_loss(m, b)
                    loss.backward(retain_graph=True)
                    if between == "zero_grad":
                        opt.zero_grad()  # the first backward's gradients are thrown away
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
            pair.check(f"step {i}")
        pair.check_state("end")
        assert HOST in {c.placement for c in pair.sched.store.chunks}
        if offload_params:
            assert pair.sched.plan.param_host_chunks


def test_plain_loss_backward_under_fp16_is_refused():
    """Under fp16 the gradients must hold the loss scale: a plain ``loss.backward()`` is refused at the step
    with an error naming it, and nothing changes."""
    model = tiny_gpt()
    b = gpt_batches(2)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, dtype=torch.float16,
                         **PLACEMENTS["static"]) as sched:
        sched.backward(gpt_loss(model, b[0]))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        gpt_loss(model, b[1]).backward()
        with paused(sched):
            before = [p.detach().clone() for p in model.parameters()]
            state = copy.deepcopy(sched.optimizer.state_dict()["state"])
        with pytest.raises(RuntimeError, match=r"loss\.backward\(\).*sched\.backward\(loss\)"):
            sched.optimizer.step()
        with paused(sched):
            assert all(same(p, q) for p, q in zip(model.parameters(), before, strict=True))
            after = sched.optimizer.state_dict()["state"]
            for i, st in state.items():
                for k, v in st.items():
                    assert same(after[i][k], v), (i, k)


# ---- 3. evaluation between steps ---------------------------------------------------------------------------

def dropout_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1))


@pytest.fixture
def no_fastpath():
    """TransformerEncoderLayer's inference fast path off on both sides (see
    test_eval_mode_logits_equal_torch for why it matters)."""
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(was)


def eval_logits(pair: Pair, m: nn.Module, xs) -> list[torch.Tensor]:
    """``m.eval()``, one forward under ``no_grad`` and one under ``inference_mode``, ``m.train()``."""
    with (pair.ref_side() if m is pair.ref else contextlib.nullcontext()):
        m.eval()
        with torch.no_grad():
            a = m(xs[0])
        with torch.inference_mode():
            c = m(xs[1])
        m.train()
        return [a.clone(), c.clone()]


@pytest.mark.parametrize("zero", ["optimizer", "module"])
@pairs(ONE_EACH)
def test_eval_right_after_step(placement, overlap, zero, slow_early_worker, no_fastpath):
    """After each step (no synchronize): ``model.eval()``, a forward under ``no_grad`` (a smaller, new input
    shape) and one under ``inference_mode``, ``model.train()``; the logits equal torch's. Dropout is on in
    training (the same seed on both sides). ``zero="module"``: ``model.zero_grad()`` (gradients None) before
    the evaluation."""
    pair = Pair(placement, overlap, model=dropout_gpt())
    batches = gpt_batches(5)
    evals = [x for x, _ in gpt_batches(2, seed=7, batch=1, seq=8)]
    with pair.sched:
        for i, b in enumerate(batches):
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    torch.manual_seed(100 + i)
                    gpt_loss(m, b).backward()
                    opt.step()
                    if zero == "module":
                        m.zero_grad()
                    else:
                        opt.zero_grad()
            ours, theirs = eval_logits(pair, pair.model, evals), eval_logits(pair, pair.ref, evals)
            with pair.ref_side():
                assert same(ours[0], theirs[0]), f"step {i}: no_grad logits"
                assert same(ours[1], theirs[1]), f"step {i}: inference_mode logits"
            pair.check(f"step {i}")
        pair.check_state("end")


@pytest.mark.parametrize("overlap", MODES, ids=MODE_IDS)
def test_eval_mode_logits_equal_torch(overlap):
    """One warmup step, then an eval-mode forward under ``no_grad`` and ``inference_mode``, torch's defaults
    otherwise. Plain torch may run nn.TransformerEncoderLayer's inference fast path
    (``torch._transformer_encoder_layer_fwd``), which torch skips when a forward (pre-)hook is attached to the
    layer or its submodules; memsched's wait hooks (overlap=True/"backward", and on CUDA) are such hooks, so
    memsched's model evaluates through torch's standard path: its logits equal torch's with the fast path
    off, bit for bit (a documented difference; the parameters are equal either way)."""
    pair = Pair("cpu", overlap)
    b = gpt_batches(1)[0]
    x = gpt_batches(1, seed=7, batch=1, seq=8)[0][0]
    with pair.sched:
        pair.sched.backward(gpt_loss(pair.model, b))
        pair.opt.step()
        pair.opt.zero_grad()
        train_ref(pair, [b])
        pair.check("warmup step")
        hooked = pair.sched.waits.needed
        ours = eval_logits(pair, pair.model, [x, x])
        was = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(not hooked)  # the path memsched's model takes
        try:
            theirs = eval_logits(pair, pair.ref, [x, x])
        finally:
            torch.backends.mha.set_fastpath_enabled(was)
        with pair.ref_side():
            for k, what in enumerate(("no_grad", "inference_mode")):
                d = (ours[k] - theirs[k]).abs().max().item()
                assert same(ours[k], theirs[k]), f"eval-mode {what} logits differ (max diff {d:.3g})"


@pairs(ONE_EACH)
def test_eval_before_the_first_step(placement, overlap):
    """Evaluation forwards (no_grad and inference_mode, eval mode) before the warmup step and between its
    backward and step, then training: the warmup is traced around them and training stays exact."""
    pair = Pair(placement, overlap)
    batches = gpt_batches(4)
    ev = gpt_batches(1, seed=9)[0]
    with pair.sched:
        for i, b in enumerate(batches):
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    if i == 0:
                        m.eval()
                        with torch.inference_mode():
                            m(ev[0])
                        m.train()
                    loss = gpt_loss(m, b)
                    loss.backward()
                    if i <= 1:
                        with torch.no_grad():
                            m(ev[0])
                    opt.step()
                    opt.zero_grad()
            pair.check(f"step {i}")
        assert pair.sched.plan is not None


# ---- 4. LR schedulers and hand edits of param_groups -------------------------------------------------------

def make_lr_sched(name: str, opt):
    if name == "onecycle":  # cycle_momentum=True: beta1 moves between 0.85 and 0.95 with the LR
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=6, pct_start=0.4)
    if name == "cosine-restarts":
        return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2, eta_min=1e-4)
    assert name == "lambda"  # a zero LR step: weight decay and moments still move their own way
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: [1.0, 0.0, 0.5, 3.0, 1.0, 0.25][s % 6])


@pytest.mark.parametrize("overlap, name", [
    (False, "onecycle"), (True, "onecycle"), ("backward", "onecycle"), (True, "cosine-restarts"),
    ("backward", "lambda")], ids=["serial-onecycle", "overlap-onecycle", "backward-onecycle",
                                  "overlap-cosine-restarts", "backward-lambda"])
def test_lr_schedulers(overlap, name):
    pair = Pair("auto", overlap)
    sch = make_lr_sched(name, pair.opt)
    with pair.ref_side():
        ref_sch = make_lr_sched(name, pair.ref_opt)
    seen_betas = set()
    with pair.sched:
        for i, b in enumerate(gpt_batches(6)):
            pair.sched.backward(gpt_loss(pair.model, b))
            pair.opt.step()
            pair.opt.zero_grad()
            sch.step()
            train_ref(pair, [b])
            with pair.ref_side():
                ref_sch.step()
            for k in ("lr", "betas", "weight_decay", "eps"):
                assert pair.opt.param_groups[0][k] == pair.ref_opt.param_groups[0][k], (i, k)
            seen_betas.add(pair.opt.param_groups[0]["betas"][0])
            pair.check(f"step {i}")
        pair.check_state("end")
        pair.assert_mixed()
    if name == "onecycle":
        assert len(seen_betas) > 2  # beta1 really moved


EDITS = {  # step -> hyper-parameters set between steps
    1: {"weight_decay": 0.0},
    2: {"lr": LR * 5, "betas": (0.8, 0.99)},
    3: {"eps": 1e-3, "weight_decay": 0.3},
    4: {"maximize": True},
    5: {"maximize": False, "lr": LR / 3},
}
LATE_EDITS = {  # step -> hyper-parameters set between backward and step
    2: {"weight_decay": 0.05},
    3: {"betas": (0.5, 0.9)},
    4: {"lr": LR * 2, "eps": 1e-6},
}


@pairs(ONE_EACH)
def test_param_group_edits(placement, overlap, slow_early_worker):
    """lr, betas, eps, weight_decay and maximize written into ``param_groups`` by hand, between steps and
    between backward and step (after the updates made during backward started)."""
    pair = Pair(placement, overlap)
    with pair.sched:
        for i, b in enumerate(gpt_batches(6)):
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    opt.param_groups[0].update(EDITS.get(i, {}))
                    gpt_loss(m, b).backward()
                    if side == "ours" and overlap == "backward" and i in LATE_EDITS:
                        pair.opt.early_updates.wait()  # the updates with the old values are done
                    opt.param_groups[0].update(LATE_EDITS.get(i, {}))
                    if side == "ours" and i == 3:  # a bad value: refused, nothing changes, then fixed
                        good = opt.param_groups[0]["lr"]
                        opt.param_groups[0]["lr"] = -1.0
                        with pytest.raises(ValueError, match=r"param group 0: lr must be a finite number"):
                            opt.step()
                        pair.check(f"step {i}, refused step")
                        opt.param_groups[0]["lr"] = good
                    opt.step()
                    opt.zero_grad()
            pair.check(f"step {i}")
        pair.check_state("end")


@pytest.mark.parametrize("overlap", [True], ids=["overlap"])
def test_add_param_group_after_attach_is_refused_and_changes_nothing(overlap, slow_early_worker):
    """``add_param_group`` mid-training (right after an overlapped step, and between backward and step) is
    refused with an error that says what to do; the groups are unchanged and training stays exact."""
    pair = Pair("static", overlap)
    extra = nn.Parameter(torch.zeros(3))
    with pair.sched:
        for i, b in enumerate(gpt_batches(4)):
            pair.sched.backward(gpt_loss(pair.model, b))
            if i == 2:
                with pytest.raises(RuntimeError, match=r"cannot take new param groups after attach.*"
                                                       r"memsched\.attach\(params="):
                    pair.opt.add_param_group({"params": [extra], "lr": 1.0})
            pair.opt.step()
            if i == 1:
                with pytest.raises(RuntimeError, match="cannot take new param groups after attach"):
                    pair.opt.add_param_group({"params": [extra]})
            pair.opt.zero_grad()
            assert len(pair.opt.param_groups) == 1
            train_ref(pair, [b])
            pair.check(f"step {i}")
        pair.check_state("end")


# ---- 5. step() without gradients, before any backward, twice in a row --------------------------------------

@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeros"])
@pairs(ONE_EACH)
def test_step_without_backward_since_zero_grad(placement, overlap, set_to_none):
    """Steps 2 and 3 call zero_grad(set_to_none=...) then step() with no backward: torch updates nothing
    (None gradients: no step count moves) or every parameter with a zero gradient (zeroed gradients)."""
    pair = Pair(placement, overlap)
    with pair.sched:
        for i, b in enumerate(gpt_batches(6)):
            empty = i in (2, 3)
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    if not empty:
                        gpt_loss(m, b).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=set_to_none)
            pair.check(f"step {i} ({'no backward' if empty else 'backward'})")
            if empty:
                pair.check_state(f"step {i}")
        pair.check_state("end")


@pytest.mark.parametrize("overlap", MODES, ids=MODE_IDS)
def test_step_before_any_backward(overlap):
    """optimizer.step() (and zero_grad) right after attach, before any forward: torch does nothing; memsched
    must do nothing too (or refuse clearly), and training afterwards stays exact."""
    pair = Pair("auto", overlap)
    with pair.sched:
        pair.opt.step()
        pair.opt.zero_grad()
        with pair.ref_side():
            pair.ref_opt.step()
            pair.ref_opt.zero_grad()
        pair.check("empty first step")
        for i, b in enumerate(gpt_batches(4)):
            pair.sched.backward(gpt_loss(pair.model, b))
            pair.opt.step()
            pair.opt.zero_grad()
            train_ref(pair, [b])
            pair.check(f"step {i}")
        pair.check_state("end")
        assert pair.sched.plan is not None
        pair.assert_mixed()  # the plan was made from a real trace (all-device would not fit the activations)


@pairs(ONE_EACH)
def test_step_twice_in_a_row(placement, overlap, slow_early_worker):
    """step(); step() on the same gradients (step 0, the warmup step, and step 2): torch applies two updates
    with the same gradient."""
    pair = Pair(placement, overlap)
    with pair.sched:
        for i, b in enumerate(gpt_batches(5)):
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    gpt_loss(m, b).backward()
                    opt.step()
                    if i in (0, 2):
                        opt.step()
                    opt.zero_grad()
            pair.check(f"step {i}")
        pair.check_state("end")


# ---- 6. accumulation with a varying number of micro-batches; gradients read --------------------------------

MICRO = [1, 3, 2, 1, 4]


def grad_norms(model) -> list[torch.Tensor]:
    # between backward and step, host chunks' gradients are on the host (their parameters too)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads).cpu()
    return [total, *(g.norm().cpu() for g in grads), torch.stack([g.abs().max().cpu() for g in grads]).max()]


@pairs()
def test_varying_accumulation_with_gradient_reads(placement, overlap, slow_early_worker):
    """1, 3, 2, 1, 4 micro-batches per step; after every micro-batch's backward the gradients are read
    (torch.nn.utils.get_total_norm, per-parameter p.grad.norm(), a max): the reads equal torch's and do not
    change the update."""
    pair = Pair(placement, overlap)
    batches = gpt_batches(sum(MICRO))
    k = 0
    with pair.sched:
        for i, n in enumerate(MICRO):
            micro = batches[k:k + n]
            k += n
            read = {}
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    read[side] = []
                    for b in micro:
                        (gpt_loss(m, b) / n).backward()
                        read[side].append([t.clone() for t in grad_norms(m)])
                    opt.step()
                    opt.zero_grad()
            with pair.ref_side():
                for j, (ours, theirs) in enumerate(zip(read["ours"], read["ref"], strict=True)):
                    assert len(ours) == len(theirs)
                    for q, (a, c) in enumerate(zip(ours, theirs, strict=True)):
                        # the total norm sums per-device partial norms (torch's get_total_norm), and between
                        # backward and step host chunks' gradients are on the host: the order can differ
                        exact = q > 0 or placement == "cuda"
                        assert same(a, c) if exact else torch.allclose(a, c, rtol=1e-6, atol=0), \
                            f"step {i} micro {j}: norm {q} {a.item()} != {c.item()}"
                    assert math.isfinite(ours[0].item())
            pair.check(f"step {i} ({n} micro-batches)")
        pair.check_state("end")
        if overlap == "backward":
            assert pair.opt.early_updates.committed > 0


# ---- p.grad is None: what user code sees, and what it does with it -----------------------------------------

def branchy_pair(overlap) -> tuple[Pair, list[torch.Tensor]]:
    pair = Pair("cpu", overlap, model=Branchy(), chunk_numel=BRANCHY_CHUNK_NUMEL)
    g = torch.Generator().manual_seed(3)
    return pair, [torch.randn(4, 8, generator=g).to(SIM) for _ in range(5)]


@pytest.mark.parametrize("zero", ["optimizer", "module"])
@pytest.mark.parametrize("overlap", MODES, ids=MODE_IDS)
def test_grad_is_none_for_unused_parameters_as_in_torch(overlap, zero):
    """After ``zero_grad()`` (set_to_none=True, torch's default), a parameter that the next backward does not
    reach has ``.grad`` None in torch. Loops read that (skip parameters without a gradient, count them, fill
    them): memsched's ``p.grad is None`` must say the same after backward."""
    pair, xs = branchy_pair(overlap)
    with pair.sched:
        for i, x in enumerate(xs):
            none = {}
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    m.use_b = i % 2 == 0
                    m(x).square().mean().backward()
                    none[side] = [n for n, p in m.named_parameters() if p.grad is None]
                    opt.step()
                    (m if zero == "module" else opt).zero_grad()
            assert none["ours"] == none["ref"], f"step {i}: parameters whose .grad is None"
            pair.check(f"step {i}")


@pytest.mark.parametrize("overlap", MODES, ids=MODE_IDS)
def test_missing_gradients_filled_with_zeros(overlap):
    """A common loop (e.g. before an all-reduce of every gradient): ``if p.grad is None: p.grad =
    torch.zeros_like(p)`` after backward. torch then updates the unused ``b`` with a zero gradient (weight
    decay, moments); memsched must update it the same way."""
    pair, xs = branchy_pair(overlap)
    with pair.sched:
        for i, x in enumerate(xs):
            for side, m, opt in (("ours", pair.model, pair.opt), ("ref", pair.ref, pair.ref_opt)):
                with (pair.ref_side() if side == "ref" else contextlib.nullcontext()):
                    m.use_b = i % 2 == 0
                    m(x).square().mean().backward()
                    for p in m.parameters():
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                    opt.step()
                    opt.zero_grad()
            pair.check(f"step {i} (b used: {i % 2 == 0})")
        pair.check_state("end")


# ---- a submodule's own forward right after an overlapped step ----------------------------------------------

@pytest.mark.parametrize("overlap", [True, "backward"], ids=["overlap", "backward"])
def test_submodule_forward_right_after_step(overlap, slow_early_worker, no_fastpath):
    """Evaluation through submodules (``wte``, ``blocks[1]``, ``ln_f``, ``lm_head``) right after the step,
    without sched.synchronize(): each module's forward waits for its own chunks."""
    pair = Pair("cpu", overlap)
    x = gpt_batches(1, seed=5)[0][0]
    with pair.sched:
        for i, b in enumerate(gpt_batches(4)):
            pair.sched.backward(gpt_loss(pair.model, b))
            pair.opt.step()
            pair.opt.zero_grad()
            train_ref(pair, [b])
            outs = []
            for m in (pair.model, pair.ref):
                with (pair.ref_side() if m is pair.ref else contextlib.nullcontext()), torch.no_grad():
                    h = m.blocks[1](m.wte(x))
                    outs.append(m.lm_head(m.ln_f(h)).clone())
            with pair.ref_side():
                assert same(outs[0], outs[1]), f"step {i}: submodule logits"
            pair.check(f"step {i}")
