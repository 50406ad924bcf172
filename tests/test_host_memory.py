"""The plan's machine inputs: the host memory budget (memsched.devices.host_memory, the stand-in's
``host=SIZE``, the check at the end of warmup) and the allocator fragmentation measured from CUDA samples
(memsched.planning.problem)."""

from __future__ import annotations

import gc
import resource
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import memsched
import policies
from memsched.devices.host_memory import host_budget, local_world_size, memlock_limit_bytes
from memsched.devices.spec import parse_device
from memsched.distributed.base import DataParallel
from memsched.planning.problem import machine_inputs, measured_fragmentation_bytes
from policies.types import DEVICE, HOST
from tracer.timeline import MemoryTimeline, Sample

KiB, MiB, GiB = 2**10, 2**20, 2**30


# ---- host_budget: every source injected --------------------------------------------------------------------
def test_budget_is_available_memory_plus_what_memsched_holds() -> None:
    b = host_budget(pinned=False, held_bytes=3 * MiB, read_available=lambda: 10 * GiB)
    assert b.capacity_bytes == 10 * GiB + 3 * MiB
    assert "available host memory: 10.0 GiB free" in b.source and "3.0 MiB memsched already holds" in b.source


def test_ranks_on_one_machine_share_its_available_memory() -> None:
    b = host_budget(pinned=False, local_ranks=4, read_available=lambda: 10 * GiB + 3)
    assert b.capacity_bytes == (10 * GiB + 3) // 4
    assert "shared by 4 ranks" in b.source
    assert local_world_size({"LOCAL_WORLD_SIZE": "8"}) == 8
    assert local_world_size({}) == local_world_size({"LOCAL_WORLD_SIZE": "zero"}) == 1
    assert local_world_size({"LOCAL_WORLD_SIZE": "0"}) == 1


def test_locked_memory_limit_binds_only_for_pinned_memory_it_applies_to() -> None:
    small_lock = {"read_available": lambda: 10 * GiB, "read_memlock": lambda: 64 * KiB}
    b = host_budget(pinned=True, memlock_applies=True, **small_lock)
    assert b.capacity_bytes == 64 * KiB and "RLIMIT_MEMLOCK" in b.source and "64.0 KiB" in b.source
    # Unpinned memory (CPU, stand-in) is never locked; the default follows the measurement (not charged).
    assert host_budget(pinned=False, memlock_applies=True, **small_lock).capacity_bytes == 10 * GiB
    assert host_budget(pinned=True, **small_lock).capacity_bytes == 10 * GiB
    # RLIM_INFINITY reads as None: no limit.
    unlimited = host_budget(pinned=True, memlock_applies=True, read_available=lambda: 10 * GiB,
                            read_memlock=lambda: None)
    assert unlimited.capacity_bytes == 10 * GiB and "available host memory" in unlimited.source


def test_memlock_reader_maps_rlim_infinity_to_none(monkeypatch: pytest.MonkeyPatch) -> None:
    inf = resource.RLIM_INFINITY
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (inf, inf))
    assert memlock_limit_bytes() is None
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (8 * MiB, inf))
    assert memlock_limit_bytes() == 8 * MiB  # the soft limit is the one enforced


def test_stand_in_host_memory_caps_the_budget() -> None:
    b = host_budget(pinned=False, stand_in_bytes=5 * MiB, read_available=lambda: 10 * GiB)
    assert b.capacity_bytes == 5 * MiB and "host=5.0 MiB in the device string" in b.source
    roomy = host_budget(pinned=False, stand_in_bytes=20 * GiB, read_available=lambda: 10 * GiB)
    assert roomy.capacity_bytes == 10 * GiB  # the real machine still binds


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"held_bytes": -1}, "held_bytes must be a whole number of bytes >= 0, got -1"),
    ({"local_ranks": 0}, "local_ranks must be an integer >= 1, got 0"),
    ({"stand_in_bytes": 1.5}, "stand_in_bytes must be a whole number of bytes >= 0 or None, got 1.5"),
    ({"read_available": lambda: -5}, "the available host memory must be a whole number of bytes >= 0"),
])
def test_budget_rejects_bad_numbers(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        host_budget(pinned=False, **{"read_available": lambda: GiB, **kwargs})


def test_budget_reads_the_machine_by_default() -> None:
    b = host_budget(pinned=False)
    assert 0 < b.capacity_bytes and "psutil.virtual_memory().available" in b.source


# ---- the stand-in's host=SIZE ------------------------------------------------------------------------------
def test_stand_in_device_string_takes_a_host_size() -> None:
    spec = parse_device("sim:8GiB,host=2GiB")
    assert (spec.kind, spec.capacity_bytes, spec.host_capacity_bytes) == ("sim", 8 * GiB, 2 * GiB)
    assert parse_device("sim:8GiB").host_capacity_bytes is None


@pytest.mark.parametrize(("device", "match"), [
    ("sim:8GiB,cores=1", r"takes only 'host=SIZE'.*got 'cores=1'"),
    ("sim:8GiB,gpu=1", r"unknown GPU '1' in gpu=NAME; known GPUs: .*h200"),
    ("sim:8GiB,", r"takes only 'host=SIZE'.*got ''"),
    ("sim:8GiB,host=", r"lacks a size for the host memory"),
    ("sim:8GiB,host=0", r"the host memory \(host=SIZE\): size must be > 0 bytes"),
    ("sim:8GiB,host=lots", r"cannot parse size 'lots'"),
])
def test_stand_in_host_size_errors_name_the_value(device: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_device(device)


# ---- the check at the end of warmup ------------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _warmup(sched: memsched.Scheduler) -> None:
    sched.backward(sched.model(torch.randn(4, 64).to(sched.device.torch_device)).sum())
    sched.optimizer.step()


@pytest.mark.parametrize("how", ["device string", "host_memory="])
def test_attach_over_the_host_memory_is_refused_with_the_numbers_before_pinning_anything(how) -> None:
    """The optimizer state starts pinned on the host: attach checks the budget before pinning a byte, and
    the model keeps its values (two chunks of 4,160 fp32 elements: master, moments, gradient and step
    counts, each chunk's arena rounded up to the page)."""
    from memsched.devices import sim_backend
    from memsched.devices.pinned import pinned_bytes

    gc.collect()  # what earlier tests left in reference cycles goes first: `live` is this test's baseline
    model = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pinned, live = sim_backend.pinned_bytes(), sim_backend.memory_allocated()
    device, kw = (("sim:64MiB,host=8KiB", {}) if how == "device string"
                  else ("sim:64MiB", {"host_memory": "8KiB"}))
    with pytest.raises(policies.PlacementError) as e:
        memsched.attach(model, policy="cpu", device=device, chunk_numel=64 * 65, **kw)
    need = 2 * pinned_bytes(4160 * 4 * 4 + 2 * 8)
    msg = str(e.value)
    assert msg.startswith("memsched.attach: does not fit host memory") and f"needs {need:,} bytes" in msg
    assert "the host budget is 8,192 bytes (8.0 KiB)" in msg and "Nothing was pinned" in msg
    assert ("host=8.0 KiB in the device string" if how == "device string" else "host_memory=8.0 KiB") in msg
    assert sim_backend.pinned_bytes() == pinned
    for n, p in model.named_parameters():
        assert torch.equal(p.detach().cpu(), before[n]), n
    # nothing of the refused scheduler stays installed: without the model, its device memory is free again
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    del model, p, e
    gc.collect()
    assert sim_backend.memory_allocated() == live


def test_bad_host_memory_is_refused_naming_it() -> None:
    for bad in ("lots", -1, 0):
        with pytest.raises(ValueError, match="host_memory must be"):
            memsched.attach(_mlp(), device="sim:64MiB", host_memory=bad)


def test_plan_within_the_host_memory_is_applied_and_says_where_the_budget_comes_from() -> None:
    with memsched.attach(_mlp(), policy="cpu", device="sim:64MiB,host=1MiB", chunk_numel=64 * 65) as sched:
        _warmup(sched)
        p = sched.problem
        assert p.host_capacity_bytes == MiB and "host=1.0 MiB" in p.host_capacity_source
        assert sched.plan.placement == (HOST, HOST) and sched.plan.host_bytes <= MiB
    # auto keeps these chunks on the device: its host part is 0 B (the state starts on the host in warmup)
    with memsched.attach(_mlp(), policy="auto", device="sim:64MiB,host=1MiB", chunk_numel=64 * 65) as sched:
        _warmup(sched)
        assert sched.plan.placement == (DEVICE, DEVICE) and sched.plan.host_bytes == 0


def test_without_host_size_the_real_machine_sets_the_budget() -> None:
    with memsched.attach(_mlp(), policy="cpu", device="sim:64MiB", chunk_numel=64 * 65) as sched:
        _warmup(sched)
        p = sched.problem
        assert p.host_capacity_bytes >= sum(c.host_bytes for c in p.chunks)  # what memsched holds counts
        assert "available host memory" in p.host_capacity_source
        assert "memsched already holds on the host" in p.host_capacity_source
        assert p.fragmentation_bytes is None  # the stand-in has no caching allocator
    with memsched.attach(_mlp(), device="cpu") as sched:
        _warmup(sched)
        assert sched.problem.host_capacity_bytes is None  # nothing is ever placed on the host


# ---- measured fragmentation --------------------------------------------------------------------------------
def _sample(i: int, peak_non_model: int, cuda: dict | None, device: str = "cuda:0") -> Sample:
    return Sample(t_ns=i, step=0, phase="backward", module=f"m{i}", event="post", device=device,
                  bytes={"activation": peak_non_model}, peak_bytes=peak_non_model,
                  peak_non_model_bytes=peak_non_model, cuda=cuda)


def _cuda(allocated: int, peak_allocated: int, reserved: int) -> dict:
    return {"allocated": allocated, "peak_allocated": peak_allocated, "reserved": reserved, "nvml_used": None}


def _cuda_timeline() -> MemoryTimeline:
    return MemoryTimeline(samples=[
        _sample(0, 10 * MiB, _cuda(40 * MiB, 60 * MiB, 64 * MiB)),
        # the peak: read after its temporaries were freed (allocated 50 MiB), 96 MiB reserved, 90 MiB at most
        _sample(1, 30 * MiB, _cuda(50 * MiB, 90 * MiB, 96 * MiB)),
        _sample(2, 20 * MiB, _cuda(45 * MiB, 90 * MiB, 128 * MiB)),
    ], meta={"device": "cuda:0"})


def test_fragmentation_is_reserved_minus_peak_allocated_at_the_non_model_peak() -> None:
    assert measured_fragmentation_bytes(_cuda_timeline()) == 6 * MiB  # not 46 MiB (allocated), not 128 MiB
    # an earlier, higher high-water mark cannot make it negative
    low = MemoryTimeline(samples=[_sample(0, MiB, _cuda(MiB, 200 * MiB, 100 * MiB))],
                         meta={"device": "cuda:0"})
    assert measured_fragmentation_bytes(low) == 0


def test_no_cuda_figures_means_not_measured() -> None:
    cpu = MemoryTimeline(samples=[_sample(0, MiB, None, device="cpu")], meta={"device": "cpu"})
    assert measured_fragmentation_bytes(cpu) is None
    assert measured_fragmentation_bytes(None) is None
    assert measured_fragmentation_bytes(MemoryTimeline(meta={"device": "cuda:0"})) is None
    partial = {"allocated": 1, "peak_allocated": None, "reserved": 5, "nvml_used": None}
    assert measured_fragmentation_bytes(MemoryTimeline(samples=[_sample(0, 1, partial)])) is None


def test_machine_inputs_carry_fragmentation_and_budget_into_the_auto_plan() -> None:
    store = SimpleNamespace(alloc=SimpleNamespace(pin=True), chunks=[])
    seen = {}

    def budget(**kwargs):
        seen.update(kwargs)
        return host_budget(read_available=lambda: 4 * GiB, **kwargs)

    inputs = machine_inputs(_cuda_timeline(), parse_device("sim:1GiB,host=2GiB"), store, DataParallel(),
                            budget=budget)
    assert seen == {"pinned": True, "held_bytes": 0, "local_ranks": 1, "stand_in_bytes": 2 * GiB,
                    "user_bytes": None}
    assert inputs == {"host_capacity_bytes": 2 * GiB,
                      "host_capacity_source": "the stand-in's host memory, host=2.0 GiB in the device string",
                      "fragmentation_bytes": 6 * MiB}
    chunks = tuple(policies.ChunkSpec(i, 64 * MiB, 128 * MiB) for i in range(8))
    problem = policies.PlacementProblem(4 * GiB, GiB, GiB, chunks, 0.8, **inputs)
    plan = policies.get("auto").plan(problem)
    # reserve = max(5 % of 4 GiB, 6 MiB measured): the measurement is shown, and can only raise the reserve
    assert any("measured in warmup, 6.0 MiB" in r and "Fragmentation reserve 204.8 MiB" in r
               for r in plan.reasons)


# ---- data parallel: every rank plans with the smallest budget ----------------------------------------------
def _host_budget_rank(rank: int, world: int) -> dict:
    host = "1GiB" if rank == 0 else "160KiB"  # rank 1's host memory is the smaller
    with memsched.attach(_mlp(), policy="cpu", device=f"sim:64MiB,host={host}", zero_stage=1) as sched:
        try:
            _warmup(sched)
            error = None
        except policies.PlacementError as e:
            error = str(e)
        return {"error": error, "cap": sched.problem.host_capacity_bytes,
                "source": sched.problem.host_capacity_source}


def test_machine_inputs_take_the_largest_fragmentation_over_ranks() -> None:
    # Another rank, simulated: its budget is 1 GiB and it measured 20 MiB of fragmentation (this one 6 MiB).
    other = [GiB, -20 * MiB]
    seen = []

    def reduce_ints(values, op, *, what):
        seen.append((list(values), op))
        return [min(a, b) for a, b in zip(values, other, strict=True)]

    dp = SimpleNamespace(world=2, comm=SimpleNamespace(reduce_ints=reduce_ints))
    store = SimpleNamespace(alloc=SimpleNamespace(pin=False), chunks=[])
    inputs = machine_inputs(_cuda_timeline(), parse_device("sim:1GiB,host=2GiB"), store, dp,
                            budget=lambda **kw: host_budget(read_available=lambda: 4 * GiB, **kw))
    assert seen == [([2 * GiB, -6 * MiB], "min")]  # one collective for both figures
    assert inputs == {"host_capacity_bytes": GiB, "fragmentation_bytes": 20 * MiB,
                      "host_capacity_source": "the smallest host budget over 2 ranks"}
    other[:] = [4 * GiB, 1]  # neither rank measured fragmentation; this rank has the smaller budget
    inputs = machine_inputs(None, parse_device("sim:1GiB,host=2GiB"), store, dp,
                            budget=lambda **kw: host_budget(read_available=lambda: 4 * GiB, **kw))
    assert inputs["host_capacity_bytes"] == 2 * GiB and "host=2.0 GiB" in inputs["host_capacity_source"]
    assert inputs["fragmentation_bytes"] is None


def test_ranks_agree_on_the_smallest_host_budget_and_refuse_together() -> None:
    from tests._dist_utils import run_ranks

    # A rank refusing alone would leave the other waiting in the plan's collective until the timeout.
    r0, r1 = run_ranks(_host_budget_rank, 2, timeout=120)
    assert r0["cap"] == r1["cap"] == 160 * KiB
    assert r0["source"] == "the smallest host budget over 2 ranks" and "host=160.0 KiB" in r1["source"]
    assert r0["error"] is None and r1["error"] is None


def test_initial_host_state_over_the_budget_is_refused_with_the_numbers():
    """On CUDA all optimizer state is pinned at attach, before any plan: the scheduler checks it first
    (memsched.devices.host_memory.check_initial_host_state; the CUDA path itself needs a GPU)."""
    from memsched.devices.host_memory import check_initial_host_state

    budget = host_budget(pinned=True, read_available=lambda: 3 * GiB)
    check_initial_host_state(3 * GiB, budget)  # fits: nothing raised
    want = r"needs 4,294,967,296 bytes \(4\.0 GiB\); the host budget is 3,221,225,472 bytes \(3\.0 GiB\)"
    with pytest.raises(policies.PlacementError, match=want):
        check_initial_host_state(4 * GiB, budget)


def test_training_from_a_model_built_on_the_cpu_holds_no_second_copy_of_the_state() -> None:
    """GPT ``demo`` built on the CPU, policy ``cpu`` (its whole optimizer state pinned on the host), two steps
    in a process of its own (``bench/host_memory.py``): the pinned bytes are the plan's, at 16 B per
    parameter (exact chunks: alignment gaps only), and the process's peak RSS, over what torch and memsched's
    code take, stays within the plan: the pinned bytes, the stand-in's device peak (host memory too) and one
    chunk in flight while the chunks are re-packed at the end of warmup. Before the re-pack staged the state
    by reference, freeing each old chunk as the new ones were built, the peak was twice the plan."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "bench" / "host_memory.py"), "--one", "demo", "cpu"],
                          capture_output=True, text=True, check=True, cwd=root, timeout=600)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["pinned_bytes"] == r["max_pinned_bytes"] == r["planned_pinned_bytes"]
    assert 16 <= r["pinned_bytes_per_param"] <= 16.5  # exact chunks: alignment gaps only (issue 29: <= 16.5)
    # Issue 29's bound: the plan's pinned bytes, the stand-in's device peak (host memory here) and at most one
    # chunk in flight, plus 32 MiB for what no plan holds: the malloc arenas of the autograd and copy threads
    # and the C library's free lists (4 MiB beyond the chunk on this VM, about 14 MiB more on CI's machine). A
    # second copy of the state (167 MiB here) or of the parameters (42 MiB) fails it.
    bound = (r["planned_pinned_bytes"] + r["device_peak_bytes"] + r["largest_chunk_host_bytes"] + 32 * 2**20)
    grown = r["rss_train_peak_bytes"] - r["rss_start_bytes"]
    assert grown <= bound, (grown, bound, r)


def test_the_report_shows_host_memory_beside_the_plan() -> None:
    """``Scheduler.host_usage()``: the pinned bytes planned, held and at their peak (the stand-in's pinned
    allocator), per parameter, and the process's resident set; the report prints them as a table."""
    import io

    from rich.console import Console

    from memsched.devices import sim_backend
    from memsched.report.text import render_report

    with memsched.attach(_mlp(), policy="cpu", device="sim:64MiB", chunk_numel=64 * 65) as sched:
        before = sched.host_usage()
        assert before.planned_pinned_bytes is None and before.pinned_bytes == sim_backend.pinned_bytes()
        _warmup(sched)
        usage = sched.host_usage()
        assert usage.parameters == 2 * (64 * 64 + 64)
        assert usage.planned_pinned_bytes == sched.plan.host_bytes == usage.pinned_bytes
        assert usage.max_pinned_bytes >= usage.pinned_bytes and usage.max_rss_bytes >= usage.rss_bytes > 0
        assert usage.pinned_bytes_per_param == usage.pinned_bytes / usage.parameters
        out = io.StringIO()
        render_report(sched.timeline, plan=sched.plan, problem=sched.problem, host_usage=usage,
                      console=Console(file=out, width=120))
    text = out.getvalue()
    assert "Host memory" in text and "pinned, planned" in text and "process peak (resident set)" in text
    assert f"{usage.pinned_bytes / usage.parameters:.2f} B" in text


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_bf16_host_state_keeps_no_fp32_gradients_per_chunk_in_serial_steps(overlap: bool) -> None:
    """[Note: one fp32 gradient scratch] and [Note: lean host chunks]: bf16 with fp32 masters, every chunk on
    the host. Serial steps keep master, moments and the bf16 gradients per chunk (14 bytes per parameter, step
    counts aside), the fp32 gradients the update reads in one scratch and the bf16 values it sends to the
    device in one pinned staging buffer; with overlap each chunk keeps its own fp32 copy and its bf16 values
    (20 bytes). The plan's pinned bytes are those held, and training stays bit-exact (checked against the bf16
    reference with fp32 masters)."""
    from tests._numerics import LR, WD, Reference, assert_same, gpt_batches, gpt_loss, tiny_gpt, uncounted

    model = tiny_gpt()
    with uncounted():
        ref = Reference(model, torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    with memsched.attach(model, policy="cpu", device="sim:64MiB", dtype=torch.bfloat16, overlap=overlap,
                         lr=LR, weight_decay=WD, chunk_numel=8192) as sched:
        for step, b in enumerate(gpt_batches(3)):
            sched.backward(gpt_loss(model, b))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(b, gpt_loss, 0.05)
            sched.synchronize()
            with sched.sim.paused():
                assert_same(model, ref, f"step {step}", optimizer=sched.optimizer)
        chunks = sched.store.chunks
        assert all((c.host_grad is None) != overlap for c in chunks)
        assert all((c.staging is None) != overlap for c in chunks)
        usage = sched.host_usage()
        assert usage.pinned_bytes == usage.planned_pinned_bytes
        per_param = 14 if not overlap else 20
        padding = sum(c.shard_numel for c in chunks) - n  # exact chunks end on an aligned element
        pages = 4096 * 2 * (len(chunks) + 1)  # each chunk's arena (and the staging buffer) rounded to pages
        staging = 0 if overlap else 2 * max(c.shard_numel for c in chunks)
        assert per_param * n + staging <= usage.pinned_bytes
        assert usage.pinned_bytes <= per_param * (n + padding) + 4 * n // 10 + staging + pages
