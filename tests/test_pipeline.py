"""Pipeline parallelism: 2 stages x 2 data-parallel ranks (4 gloo processes, ``device="cpu"``), a small GPT
split in two (:mod:`memsched.models.gpt_stages`), ``torch.distributed.pipelining``'s ``PipelineStage`` under
``ScheduleGPipe`` and ``Schedule1F1B`` with 4 micro-batches, each stage attached with
``memsched.attach(stage, process_group=dp_group, zero_stage=...)``.

The reference is the same pipeline with ``torch.optim.AdamW(fused=True)`` and each parameter's gradient
averaged over the stage's data-parallel group after the schedule's step (all-reduce SUM, then / world), as
tests/test_zero_numerics.py defines it; ZeRO-1, 2 and 3 must equal it bit for bit after every step. One launch
runs every case. The warmup's traced peak of non-model data under 1F1B is checked against an independent
count of the live bytes of the reference's first step; ``memsched plan`` plans each stage with its
micro-batches in flight.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from tests._dist_utils import run_ranks

pytestmark = pytest.mark.slow  # several processes per test: started first (tests/conftest.py)

pipelining = pytest.importorskip("torch.distributed.pipelining")

PP, DP, MICRO, STEPS, LR, WD = 2, 2, 4, 3, 1e-2, 0.1
ROWS, SEQ = 2, 32  # one micro-batch: ROWS sequences of SEQ tokens


def _groups(rank: int):
    """Global rank ``d * PP + s`` is stage ``s`` of data-parallel replica ``d``; every rank creates every
    group, in the same order."""
    import torch.distributed as dist

    pp = [dist.new_group([d * PP + s for s in range(PP)]) for d in range(DP)]
    dp = [dist.new_group([d * PP + s for d in range(DP)]) for s in range(PP)]
    return rank % PP, rank // PP, pp[rank // PP], dp[rank % PP]


def _stage_module(stage: int) -> torch.nn.Module:
    from memsched.models.gpt import GPT, GPTConfig
    from memsched.models.gpt_stages import split_gpt

    torch.manual_seed(0)
    return split_gpt(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=SEQ)), PP)[stage]


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """An independent measurement: the bytes of the CPU storages that ops inside the mode created and that
    are alive at once, sampled after every op (storages kept afterwards as gradients excluded at the end)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[object, int]] = {}
        self._samples: list[dict[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st.data_ptr() in inputs:  # a view, or an in-place op: no new storage
                    continue
                old = self._live.get(st.data_ptr())
                if old is None or old[0].expired():
                    self._live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        self._samples.append({k: n for k, (_, n) in self._live.items()})
        return out

    def peak(self, kept: set[int]) -> int:
        return max(sum(n for k, n in s.items() if k not in kept) for s in self._samples)


def _train(stage_i: int, dp_i: int, pp_group, dp_group, schedule_name: str, zero: int | None,
           clip: bool = False) -> dict:
    """``STEPS`` steps of one stage; ``zero=None``: the torch reference. ``clip``: torch's
    ``clip_grad_norm_(module.parameters())`` before the step (after the reference's own averaging), as
    Trainer and plain loops call it; a refusal is returned as ``{"refused": message}``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import memsched
    from memsched.models.gpt_stages import stage_loss

    module = _stage_module(stage_i)
    sched = None
    if zero is None:
        opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD, fused=True)
    else:
        sched = memsched.attach(module, policy="cpu", device="cpu", zero_stage=zero, process_group=dp_group,
                                lr=LR, weight_decay=WD, collective_timeout=30)
        opt = sched.optimizer
    stage = PipelineStage(module, stage_i, PP, torch.device("cpu"), group=pp_group)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = cls(stage, n_microbatches=MICRO, loss_fn=stage_loss)
    g = torch.Generator().manual_seed(100 + dp_i)  # each data-parallel replica its own batches
    params, live = [], None
    for step in range(STEPS):
        tokens = torch.randint(0, 256, (MICRO * ROWS, SEQ + 1), generator=g)
        counter = _LiveBytes() if zero is None and step == 0 else None  # the step memsched's warmup traces
        with counter if counter is not None else contextlib.nullcontext():
            if stage_i == 0:
                schedule.step(tokens[:, :-1])
            else:
                schedule.step(target=tokens[:, 1:], losses=[])
        if counter is not None:
            live = counter.peak({p.grad.untyped_storage().data_ptr() for p in module.parameters()})
        if zero is None:
            for p in module.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(DP)
        if clip:
            try:
                torch.nn.utils.clip_grad_norm_(module.parameters(), 0.01)
            except RuntimeError as e:
                if sched is not None:
                    sched.close()
                return {"refused": str(e)}
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in module.parameters()])
    out = {"params": params, "live_peak": live}
    if sched is not None:
        out.update(traced_peak=sched.peak_non_model_bytes(), reductions=sched.dp.reducer.reductions,
                   chunks=len(sched.store.chunks), stage=sched.dp.pipeline.detected)
        sched.close()
    return out


def _rank(rank: int, world: int) -> dict:
    stage_i, dp_i, pp_group, dp_group = _groups(rank)
    out = {(name, zero): _train(stage_i, dp_i, pp_group, dp_group, name, zero)
           for name in ("gpipe", "1f1b") for zero in (None, 1, 2, 3)}
    out.update({("clip", zero): _train(stage_i, dp_i, pp_group, dp_group, "1f1b", zero, clip=True)
                for zero in (None, 1, 2)})
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_rank, PP * DP, timeout=240)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_under_pipeline_is_bit_exact(runs, schedule, zero):
    """ZeRO-1, 2 and 3 under GPipe and 1F1B equal the torch reference after every step, on every rank; each
    chunk is reduced once per step, not once per micro-batch."""
    for rank, res in enumerate(runs):
        ours, ref = res[(schedule, zero)], res[(schedule, None)]
        for step, (a, b) in enumerate(zip(ours["params"], ref["params"], strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), (rank, step, i, (x - y).abs().max().item())
        assert ours["reductions"] == STEPS * ours["chunks"]
        assert ours["stage"] is not None  # recognised as a pipeline stage


def test_traced_peak_under_1f1b_is_the_schedules_peak(runs):
    """The warmup traces the schedule's real order: a stage's traced peak of non-model data under 1F1B is the
    measured peak of the schedule's step (within 5 %, the tracer's bound in tests/test_tracer_cuda.py), and
    under GPipe stage 0 holds all 4 micro-batches where 1F1B holds 2."""
    for rank, res in enumerate(runs):
        ours, ref = res[("1f1b", 1)], res[("1f1b", None)]
        assert ours["traced_peak"] == pytest.approx(ref["live_peak"], rel=0.05), rank
        if rank % PP == 0:
            assert res[("gpipe", 1)]["traced_peak"] > 1.3 * ours["traced_peak"], rank


def _plan_json(argv: list[str], capsys) -> dict:
    from memsched.cli.main import main

    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("stage", [0, 1])
def test_plan_of_a_stage_counts_micro_batches_in_flight(stage, capsys):
    """``memsched plan --stages 2 --stage I --micro-batches 4 --schedule 1f1b``: the stage's trace holds its
    micro-batches in flight (stage 0: 2, stage 1: 1; GPipe's 4 make a larger peak), and on a device that
    holds that peak, the stage's parameters and gradients and a quarter of its optimizer state, the plan
    keeps chunks on the host."""
    base = ["--model", "tiny", "--batch-size", "8", "--seq-len", "128", "--stages", "2",
            "--stage", str(stage), "--micro-batches", "4", "--no-largest-preset"]
    roomy = _plan_json([*base, "--schedule", "1f1b", "--capacity", "1GiB"], capsys)
    gpipe = _plan_json([*base, "--schedule", "gpipe", "--capacity", "1GiB"], capsys)
    pipe = roomy["workload"]["pipeline"]
    assert pipe["in_flight"] == 2 - stage and gpipe["workload"]["pipeline"]["in_flight"] == 4
    assert gpipe["trace"]["peak_non_model_bytes"] > roomy["trace"]["peak_non_model_bytes"]
    md = roomy["model_data"]
    tight = (roomy["trace"]["peak_non_model_bytes"] + md["parameter"] + md["gradient"] + md["other"]
             + md["optimizer_state"] // 4)
    plan = _plan_json([*base, "--schedule", "1f1b", "--capacity", str(tight)], capsys)
    auto = plan["plans"]["auto"]
    assert "host" in auto["placement"], auto


def test_torch_clip_under_a_pipeline_is_exact_at_zero_1_and_refused_at_zero_2(runs):
    """[Note: gradients read before their reduction]: torch's ``clip_grad_norm_(module.parameters())`` between
    the schedule's step and the optimizer's reads gradients whose reduction waits for the step. At ZeRO-1 the
    read reduces them first and the run equals the reference (averaged, then clipped) bit for bit; at ZeRO-2
    it is refused, naming ``sched.clip_grad_norm_``."""
    for rank, r in enumerate(runs):
        ref, one, two = r[("clip", None)], r[("clip", 1)], r[("clip", 2)]
        assert "refused" not in ref and "refused" not in one, rank
        for step, (want, got) in enumerate(zip(ref["params"], one["params"], strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), (rank, step)
        assert "sched.clip_grad_norm_" in two["refused"], rank

