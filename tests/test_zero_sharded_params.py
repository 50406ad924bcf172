"""ZeRO-3's parameters outside the training step's own reads, at 2 gloo ranks, against emulated DDP.

Between steps a rank holds only its shard of most chunks: a read there raises ``ShardedParamError`` (never the
absent views' NaN), ``with sched.gathered_params():`` makes them whole on every rank (reads exact, writes
followed), a loss term computed outside the forward gathers what it reads, an evaluation forward under
``no_grad`` reads exact values, and ``close()`` gives back a whole model. The reference is plain torch
averaging the per-rank gradients and stepping ``torch.optim.AdamW(fused=True)``, with the same loss term and
the same write.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memsched
from memsched.distributed.sharded_params import ShardedParamError
from tests._dist_utils import run_ranks
from tests._numerics import same
from tests.test_zero_sharded_grads import LR, SIM, WD, Net, _average, data, make_model, rows

pytestmark = pytest.mark.slow  # several processes per test: started first (tests/conftest.py)

STEPS, PENALTY = 4, 1e-3


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dev = next(model.parameters()).device  # the stand-in's for memsched, the CPU for references
    x, y = x.to(dev), y.to(dev)
    out = model(x)
    # a loss term computed after the forward, outside any module: the embedding is away by then
    return F.cross_entropy(out.flatten(0, 1), y.flatten()) + PENALTY * model.emb.weight.square().sum()


def write(model: nn.Module) -> None:
    """What the test writes into the parameters between steps 1 and 2 (on every rank)."""
    with torch.no_grad():
        model.block[0].weight.mul_(0.5)
        model.emb.weight[3].fill_(0.25)


def reference(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """Emulated DDP: the parameters after step 1 and at the end, and the evaluation's output at the end."""
    model = make_model().to("sim")  # on the stand-in, as memsched: its backward runs where memsched's does
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD,
                            fused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    after_1: dict[str, torch.Tensor] = {}
    for step, ((x, y, _aux),) in enumerate(data(1)[:1] * STEPS):
        per_rank = []
        for r in range(world):
            model.zero_grad()
            loss_of(model, rows(x, r, world), rows(y, r, world)).backward()
            per_rank.append({n: params[n].grad.clone() for n in names})
        avg = _average(per_rank)
        for n in names:
            params[n].grad = avg[n]
        opt.step()
        opt.zero_grad()
        if step == 0:
            after_1 = {n: p.detach().clone() for n, p in model.named_parameters()}
            write(model)
    with torch.no_grad():
        out = model(data(1)[1][0][0].to("sim"))
    return after_1, {n: p.detach().clone() for n, p in model.named_parameters()}, out


def _in_thread(read) -> list:
    """``read()`` in a thread of its own: ``[its value]``, or ``[its error's message]``."""
    out: list = []

    def run() -> None:
        try:
            out.append(read())
        except RuntimeError as e:
            out.append(str(e))
    t = threading.Thread(target=run, name="eval-thread")
    t.start()
    t.join()
    return out


def _run(rank: int, world: int) -> dict:
    model = make_model()
    x, y, _ = data(1)[0][0]
    got: dict = {"refusals": []}
    with memsched.attach(model, lr=LR, weight_decay=WD, zero_stage=3, chunk_numel=400, **SIM) as sched:
        for step in range(STEPS):
            loss = loss_of(model, rows(x, rank, world), rows(y, rank, world))
            if step == 2:  # between a forward and its backward: refused, the reads gather themselves
                with pytest.raises(RuntimeError, match="gathered_params\\(\\) is for between steps"):
                    with sched.gathered_params():
                        pass
            sched.backward(loss)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if step == 0:
                away = [n for n, p in model.named_parameters()
                        if id(p) in sched.store.param_chunk and sched.store.param_chunk[id(p)].data is None]
                got["away"] = away
                one = model.get_parameter(away[0]) if away else None
                for read in (lambda one=one: one.sum(), lambda: model.state_dict(),
                             lambda: [p.detach().clone() for p in model.parameters()]):
                    with pytest.raises(ShardedParamError, match="sharded over 2 ranks") as e:
                        read()
                    got["refusals"].append(str(e.value))
                got["thread_refusals"] = _in_thread(lambda one=one: one.sum())  # NaN before: refused now
                model.zero_grad()  # p.grad = None reads nothing: allowed
                with sched.gathered_params():
                    got["after_1"] = {n: p.detach().clone() for n, p in model.named_parameters()}
                    got["thread_read"] = _in_thread(lambda one=one: one.detach().clone())  # whole: exact
                    with sched.gathered_params():  # nested: gathered once
                        pass
                    write(model)
                got["away_again"] = all(sched.store.param_chunk[id(p)].data is None for n, p in
                                        model.named_parameters() if n in away)
        with torch.no_grad():  # an evaluation between steps: exact, chunks gathered as read and let go
            got["eval"] = model(data(1)[1][0][0].to(sched.device.torch_device))
        got["whole_after_eval"] = sum(c.data is not None for c in sched.store.chunks)
        got["n_chunks"] = len(sched.store.chunks)
    got["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}  # after close(): whole
    return got


def test_zero_3_parameters_between_steps_are_refused_gathered_exact_and_written() -> None:
    got = run_ranks(_run, 2, timeout=180)
    after_1, final, out = reference(2)
    for r in range(2):
        g = got[r]
        assert g["away"], "no chunk is sharded between steps"
        assert g["away_again"]
        assert len(g["refusals"]) == 3 and all("gathered_params()" in m for m in g["refusals"])
        # [Note: foreign reads] in memsched.chunks.binding: another thread's read of a sharded parameter
        [refusal] = g["thread_refusals"]
        assert "from thread 'eval-thread'" in refusal and "sched.gathered_params()" in refusal, refusal
        assert same(g["thread_read"][0], g["after_1"][g["away"][0]])
        for n, want in after_1.items():
            assert same(g["after_1"][n], want), (r, n)
        for n, want in final.items():
            assert same(g["final"][n], want), (r, n)
        assert same(g["eval"], out)
        assert g["whole_after_eval"] < g["n_chunks"]


def test_gathered_params_is_a_no_op_below_stage_3() -> None:
    model = Net()
    with memsched.attach(model, device="cpu") as sched, sched.gathered_params():
        assert model.emb.weight.sum().isfinite()


# ---- mixed precision: ZeRO-3 computes what ZeRO-2 computes, bit for bit -----------------------------------
def _mixed(rank: int, world: int, stage: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = make_model()
    model.frozen.to(dtype)  # memsched computes the trainable ones in dtype (fp32 masters)
    x, y, _ = data(1)[0][0]
    with memsched.attach(model, lr=LR, weight_decay=WD, zero_stage=stage, chunk_numel=400, dtype=dtype,
                         **SIM) as sched:
        for _ in range(STEPS):
            sched.backward(loss_of(model, rows(x, rank, world), rows(y, rank, world)))
            sched.clip_grad_norm_(0.05)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zero_3_equals_zero_2_bit_for_bit_in_mixed_precision(dtype: torch.dtype) -> None:
    two, three = (run_ranks(_mixed, 2, stage, dtype, timeout=120) for stage in (2, 3))
    for r in range(2):
        for n, want in two[r].items():
            assert want.dtype == dtype and same(three[r][n], want), (r, n)
        assert not same(two[r]["emb.weight"], make_model().emb.weight.to(dtype))  # it trained


# ---- a re-plan that moves sharded chunks' state between host and device -----------------------------------
def _replanned(rank: int, world: int, stage: int) -> dict:
    model = make_model()
    x, y, _ = data(1)[0][0]
    places = []
    with memsched.attach(model, lr=LR, weight_decay=WD, zero_stage=stage, chunk_numel=400, **SIM) as sched:
        for step in range(STEPS + 2):
            if step in (2, 3):  # everything to the host (as elastic placement does for a step that did not
                # fit), then the plan for the measured peak again: chunks away move both ways
                peak = None if step == 2 else sched.planner.problem.peak_non_model_bytes
                sched.planner.replan(peak, "test", sched.steps)
            places.append(sorted(c.placement for c in sched.store.chunks))
            sched.backward(loss_of(model, rows(x, rank, world), rows(y, rank, world)))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "places": places}


def test_zero_3_follows_a_re_plan_bit_for_bit() -> None:
    two, three = (run_ranks(_replanned, 2, stage, timeout=120) for stage in (2, 3))
    for r in range(2):
        assert three[r]["places"][2] == ["host"] * len(three[r]["places"][2])  # every chunk moved
        assert "device" in three[r]["places"][3] and three[r]["places"] == two[r]["places"]
        for n, want in two[r]["params"].items():
            assert same(three[r]["params"][n], want), (r, n)


# ---- ranks that gather different chunks are stopped before the step ---------------------------------------
class Deep(nn.Module):
    """Eight one-chunk layers; ``extra``: the index of a layer whose weight the forward reads again at its end
    (its chunk is sharded by then: gathered on demand), or None."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(8))
        self.extra: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x if self.extra is None else x + self.layers[self.extra].weight.sum()


def _diverging(rank: int, world: int) -> dict:
    model = Deep()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).to("sim")
    with memsched.attach(model, device="sim:64MiB", policy="cpu", zero_stage=3, chunk_numel=256) as sched:
        for step in range(4):
            # the last step: each rank reads another layer again, so they gather as many chunks, not the same
            model.extra = rank if step == 3 else None
            try:
                sched.backward(model(x).square().mean())
            except ShardedParamError as e:
                return {"step": step, "error": str(e), "updates": sched.steps}
            sched.optimizer.step()
            sched.optimizer.zero_grad()
    return {"step": None}


def test_ranks_that_gather_different_chunks_are_refused_before_the_step() -> None:
    for r in run_ranks(_diverging, 2, timeout=120):
        assert r["step"] == 3 and "all-gathered different parameter chunks" in r["error"], r
        assert r["updates"] == 3  # the diverging step was not taken


def _one_rank_branches(rank: int, world: int) -> dict:
    """Rank 0 alone reads a layer again at the forward's end (a rank-dependent branch): its extra gather
    meets no peer. Each rank must raise within the collective timeout, not wait for the group's."""
    import time

    from memsched.distributed import ZeroCommError

    model = Deep()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).to("sim")
    with memsched.attach(model, device="sim:64MiB", policy="cpu", zero_stage=3, chunk_numel=256,
                         collective_timeout=3) as sched:
        for step in range(3):
            model.extra = 0 if step == 2 and rank == 0 else None
            t0 = time.monotonic()
            try:
                sched.backward(model(x).square().mean())
                sched.optimizer.step()
            except (ZeroCommError, ShardedParamError) as e:
                return {"step": step, "error": f"{type(e).__name__}: {e}", "waited_s": time.monotonic() - t0,
                        "updates": sched.steps}
            sched.optimizer.zero_grad()
    return {"step": None}


def test_a_branch_on_one_rank_is_refused_within_the_collective_timeout() -> None:
    """issue 28, item 9: the group's timeout here is 8 s (in production 30 minutes); attach's
    collective_timeout (3 s here, 60 s by default) bounds the wait, and the error names the cause."""
    for r in run_ranks(_one_rank_branches, 2, timeout=120, pg_timeout_s=8):
        assert r["step"] == 2 and r["updates"] == 2, r
        assert r["waited_s"] < 7, r
        assert "collective_timeout=3 s" in r["error"] and "branch taken on some ranks only" in r["error"], r


# ---- two forwards before one backward, and the optimizer's state dict: as ZeRO-2, bit for bit -------------
def _two_forwards(rank: int, world: int, stage: int) -> dict:
    model = make_model()
    (x1, y1, _), (x2, y2, _) = data(1)[0][0], data(1)[1][0]
    out: dict = {}
    with memsched.attach(model, lr=LR, weight_decay=WD, zero_stage=stage, chunk_numel=400, **SIM) as sched:
        for step in range(STEPS):
            first = loss_of(model, rows(x1, rank, world), rows(y1, rank, world))
            sched.backward(first + loss_of(model, rows(x2, rank, world), rows(y2, rank, world)))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if step == 1:  # the torch-format state, gathered whole, and loaded back
                sd = sched.optimizer.state_dict()
                out["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
                sched.optimizer.load_state_dict(sd)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def test_two_forwards_and_an_optimizer_state_round_trip_match_zero_2() -> None:
    two, three = (run_ranks(_two_forwards, 2, stage, timeout=120) for stage in (2, 3))
    for r in range(2):
        for n, want in two[r]["params"].items():
            assert same(three[r]["params"][n], want), (r, n)
        for i, st in two[r]["state"].items():
            for k, v in st.items():
                assert same(three[r]["state"][i][k], v), (r, i, k)


# ---- issue 28, item 8: an evaluation on rank 0 only, inside gathered_params() ---------------------------
def _rank0_eval(rank: int, world: int, evaluate: bool) -> dict:
    model = Deep()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).to("sim")
    probe = torch.randn(2, 16, generator=torch.Generator().manual_seed(9)).to("sim")
    out: dict = {"eval": None}
    with memsched.attach(model, device="sim:64MiB", policy="cpu", zero_stage=3, chunk_numel=256,
                         collective_timeout=5) as sched:
        for step in range(4):
            sched.backward(model(x).square().mean())
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if evaluate and step == 1:
                with sched.gathered_params():
                    if rank == 0:  # the DDP habit, inside gathered_params(): no collective may be needed
                        with torch.no_grad():
                            out["eval"] = model(probe).cpu()
        with sched.gathered_params():
            out["params"] = [p.detach().cpu().clone() for p in model.parameters()]
    return out


def test_an_evaluation_on_rank_0_only_inside_gathered_params_needs_no_collective() -> None:
    """``with sched.gathered_params(): if rank == 0: model(x)`` under ``no_grad``: every chunk is whole on
    every rank, so the forward issues no collective; training goes on bit for bit as without it."""
    with_eval = run_ranks(_rank0_eval, 2, True, timeout=120, pg_timeout_s=20)
    without = run_ranks(_rank0_eval, 2, False, timeout=120, pg_timeout_s=20)
    assert with_eval[0]["eval"] is not None and with_eval[1]["eval"] is None
    for a, b in zip(with_eval, without, strict=True):
        for p, q in zip(a["params"], b["params"], strict=True):
            assert torch.equal(p, q)
