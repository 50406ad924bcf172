"""The fetch schedule of parameters kept on the host (``policies.schedule``) and the plans that use it
(``auto`` and ``static`` when the parameters do not all fit, the post-conditions of ``check_plan``). Pure
Python: no torch."""

from __future__ import annotations

import dataclasses
import math

import pytest

import policies
from policies.plans import PlacementError, check_plan, make_plan, schedule_for, schedule_peak_bytes
from policies.schedule import ScheduleError, schedule_params
from policies.types import BACKWARD, DEVICE, FORWARD, HOST, ChunkAccess, ChunkSpec, PlacementProblem

MiB = 2**20


def step(n: int, fwd: list[int] | None = None, bwd: list[int] | None = None) -> list[ChunkAccess]:
    """A step reading chunks ``0..n-1`` forward and back (or the given orders)."""
    fwd = list(range(n)) if fwd is None else fwd
    bwd = list(reversed(range(n))) if bwd is None else bwd
    return [ChunkAccess(c, FORWARD) for c in fwd] + [ChunkAccess(c, BACKWARD) for c in bwd]


def check_schedule(accesses: list[ChunkAccess], offloaded: list[int], slots: list[int], sched) -> None:
    """What every schedule must satisfy: each scheduled read has its chunk, the resident set fits the room
    all the way to the next scheduled read, the kept set is the last read's, and the fetches count the
    chunks that (re)enter a target."""
    n = len(accesses)
    picks = [i for i, a in enumerate(accesses) if a.chunk in offloaded]
    merged = [i for k, i in enumerate(picks)
              if k == 0 or (accesses[picks[k - 1]].chunk, accesses[picks[k - 1]].phase)
              != (accesses[i].chunk, accesses[i].phase)]
    assert [accesses[i] for i in merged] == list(sched.accesses)
    for k, i in enumerate(merged):
        target = set(sched.targets[k])
        assert accesses[i].chunk in target
        assert target <= set(offloaded)
        end = merged[k + 1] if k + 1 < len(merged) else merged[0] + n
        assert len(target) <= min(slots[j % n] for j in range(i, max(end, i + 1)))
    assert sched.keep == sched.targets[-1]
    m = len(sched.targets)
    entering = [x for k in range(m) for x in sched.targets[k] if x not in sched.targets[k - 1]]
    assert sched.fetches == len(entering)
    assert sched.max_resident == max(len(t) for t in sched.targets)
    assert 0 <= sched.prefetched <= sched.fetches


def test_with_room_for_everything_every_chunk_stays_and_nothing_is_fetched() -> None:
    acc = step(4)
    sched = schedule_params(acc, [0, 1, 2, 3], [10] * len(acc))
    check_schedule(acc, [0, 1, 2, 3], [10] * len(acc), sched)
    assert sched.fetches == 0 and sched.keep == (0, 1, 2, 3)  # cached across steps: never refetched
    assert sched.h2d_copies == 4  # each kept chunk still receives its update once per step


@pytest.mark.parametrize("room", [2, 3, 4])
@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_tight_room_is_respected_at_every_read(room: int, depth: int) -> None:
    acc = step(8)
    slots = [room] * len(acc)
    sched = schedule_params(acc, list(range(8)), slots, max_prefetch=depth)
    check_schedule(acc, list(range(8)), slots, sched)
    assert sched.max_resident <= room
    if depth == 0 or room == 2:  # room 2: the chunk read and the one read before it fill it
        assert sched.prefetched == 0
    else:
        assert sched.prefetched > 0  # with room beyond the read and the one before, fetches go ahead


def test_prefetch_is_bounded_by_its_depth_and_by_the_room_in_between() -> None:
    acc = step(8)
    wide = schedule_params(acc, list(range(8)), [8] * 8 + [3] * 8, max_prefetch=1)
    deep = schedule_params(acc, list(range(8)), [8] * 8 + [3] * 8, max_prefetch=4)
    assert deep.prefetched >= wide.prefetched
    # where the room is 3, no target holds more than 3 (the prefetch stops at the room)
    for k, a in enumerate(deep.accesses):
        if a.phase == BACKWARD:
            assert len(deep.targets[k]) <= 3


def test_eviction_keeps_the_chunk_read_soonest() -> None:
    """Belady/OPT: with room for three, reading 0 1 2 and then 0 again soon, 1 never again before 2's
    re-read, the chunk that leaves at chunk 3's read is the one read farthest ahead."""
    acc = [ChunkAccess(c, FORWARD) for c in (0, 1, 2, 3, 0, 2)] + [ChunkAccess(1, BACKWARD)]
    sched = schedule_params(acc, [0, 1, 2, 3], [3] * len(acc), max_prefetch=0)
    check_schedule(acc, [0, 1, 2, 3], [3] * len(acc), sched)
    at_3 = set(sched.targets[3])
    assert at_3 == {0, 2, 3}  # 1 (next read last) left; 0 and 2 (read next) stayed


def test_only_offloaded_chunks_are_scheduled_and_a_resident_read_in_between_frees_the_previous() -> None:
    acc = step(6)
    offloaded = [0, 2, 4]
    sched = schedule_params(acc, offloaded, [1] * len(acc))  # room for one offloaded chunk at a time
    check_schedule(acc, offloaded, [1] * len(acc), sched)
    assert {a.chunk for a in sched.accesses} == {0, 2, 4}
    # two offloaded chunks read back to back need room for both (the previous may still be read)
    with pytest.raises(ScheduleError, match=r"offloaded chunk 1 at its forward read .* 2 chunks' parameters"):
        schedule_params(acc, [0, 1], [1] * len(acc))


def test_bad_arguments_are_refused() -> None:
    acc = step(2)
    with pytest.raises(ValueError, match="slots has 3 entries, accesses 4"):
        schedule_params(acc, [0], [1, 1, 1])
    with pytest.raises(ValueError, match="max_prefetch must be >= 0, got -1"):
        schedule_params(acc, [0], [1] * 4, max_prefetch=-1)
    with pytest.raises(ValueError, match="phase must be 'forward' or 'backward'"):
        ChunkAccess(0, "sideways")
    with pytest.raises(ValueError, match="accesses\\[0\\] must be a ChunkAccess of one of the 1 chunks"):
        PlacementProblem(10, 1, 1, (ChunkSpec(0, 1, 1),), accesses=(ChunkAccess(3, FORWARD),))


# ---- plans with parameters on the host -------------------------------------------------------------------
def problem(capacity: int, *, n: int = 8, peak: int = 6 * MiB, accesses: bool = True) -> PlacementProblem:
    """``n`` chunks of 1 MiB of parameters (2 MiB of optimizer state and gradients each); the non-model data
    grows through forward to ``peak`` at the turn and falls through backward."""
    fwd = [ChunkAccess(c, FORWARD, peak * (c + 1) // n) for c in range(n)]
    bwd = [ChunkAccess(c, BACKWARD, peak * (c + 1) // n) for c in reversed(range(n))]
    return PlacementProblem(
        capacity_bytes=capacity, peak_non_model_bytes=peak, resident_model_bytes=n * MiB,
        chunks=tuple(ChunkSpec(i, 2 * MiB, 4 * MiB, numel=MiB // 4, param_bytes=MiB) for i in range(n)),
        host_grad_working_bytes=MiB // 2, accesses=tuple(fwd + bwd) if accesses else ())


def test_auto_keeps_the_fewest_first_used_parameters_on_the_host_that_fit() -> None:
    plans = {cap: policies.get("auto").plan(problem(cap * MiB)) for cap in (10, 11, 12, 13)}
    counts = [len(p.param_host_chunks) for p in plans.values()]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] > 0  # more room, fewer away
    for cap, plan in plans.items():
        k = len(plan.param_host_chunks)
        assert plan.param_host_chunks == list(range(k))  # the first used go first
        assert set(plan.placement) == {HOST}  # optimizer state and gradients went first
        assert plan.peak_bytes <= cap * MiB
        p = problem(cap * MiB)
        assert plan.peak_bytes == schedule_peak_bytes(p, plan.placement, plan.param_placement, plan.schedule)
        assert any("Parameters do not all fit" in r for r in plan.reasons)
        # one chunk fewer on the host finds no room at some read (auto takes the fewest that fit)
        if k > 1:
            fewer = [HOST] * (k - 1) + [DEVICE] * (8 - k + 1)
            limit = cap * MiB - math.ceil(0.05 * cap * MiB)  # auto's default reserve
            try:
                sched = schedule_for(p, [HOST] * 8, fewer, limit, share=p.gpu_margin_mem_ratio)
            except PlacementError:
                continue
            assert schedule_peak_bytes(p, [HOST] * 8, fewer, sched) > cap * MiB
    # with room for everything, parameters stay on the device: today's fast path
    roomy = policies.get("auto").plan(problem(64 * MiB))
    assert not roomy.param_host_chunks and roomy.schedule is None


def test_auto_without_a_trace_of_reads_cannot_move_parameters() -> None:
    with pytest.raises(PlacementError, match="before any optimizer state is placed"):
        policies.get("auto").plan(problem(10 * MiB, accesses=False))
    with pytest.raises(PlacementError, match="even with every chunk's parameters on the host"):
        policies.get("auto").plan(problem(5 * MiB))  # below the non-model peak itself


@pytest.mark.parametrize("name", ["cpu", "cuda", "static"])
def test_policies_that_keep_every_parameter_on_the_device_say_which_one_does_not(name: str) -> None:
    with pytest.raises(PlacementError, match="keeps every parameter on the device.*use policy 'auto'"):
        policies.get(name).plan(problem(10 * MiB))


def test_static_offload_param_frac() -> None:
    plan = policies.get("static", offload_param_frac=0.5).plan(problem(12 * MiB))
    assert plan.param_host_chunks == [0, 1, 2, 3] and set(plan.placement) == {HOST}
    with pytest.raises(PlacementError, match="needs offload_optim_frac=1"):
        policies.get("static", offload_param_frac=0.5, offload_optim_frac=0.5).plan(problem(12 * MiB))
    with pytest.raises(PlacementError, match="needs the chunk reads of a traced step"):
        policies.get("static", offload_param_frac=0.5).plan(problem(64 * MiB, accesses=False))


def test_check_plan_refuses_plans_that_cannot_run() -> None:
    p = problem(12 * MiB)
    good = policies.get("auto").plan(p)
    k = len(good.param_host_chunks)
    state_on_device = make_plan(p, (DEVICE,) + good.placement[1:], budget_bytes=0,
                                param_placement=good.param_placement, schedule=good.schedule)
    with pytest.raises(ValueError, match="parameters on the host but its optimizer state on the device"):
        check_plan("mine", p, state_on_device)
    without = dataclasses.replace(good, schedule=None)
    with pytest.raises(ValueError, match="without their fetch schedule"):
        check_plan("mine", p, without)
    # a schedule that fits nowhere: every offloaded chunk kept at every read
    sched = good.schedule
    greedy = dataclasses.replace(sched, targets=tuple(tuple(range(k)) for _ in sched.targets))
    too_much = make_plan(p, good.placement, budget_bytes=0, param_placement=good.param_placement,
                         schedule=greedy)
    if too_much.peak_bytes > p.capacity_bytes:
        with pytest.raises(PlacementError, match="schedule still needs"):
            check_plan("mine", p, too_much)
    lying = dataclasses.replace(good, peak_bytes=1)
    with pytest.raises(ValueError, match="returned peak_bytes=1"):
        check_plan("mine", p, lying)


# ---- ZeRO-3: the window of sharded parameter chunks -------------------------------------------------------
def test_schedule_sharded_keeps_a_chunk_whole_only_around_its_reads() -> None:
    from policies.schedule import schedule_sharded

    reads = step(6)
    s = schedule_sharded(reads, 6, prefetch=1)
    assert s.offloaded == tuple(range(6)) and len(s.targets) == len(s.accesses) == 12
    for j, a in enumerate(s.accesses):
        # the chunk read, the one read right before, the one read next: never more
        assert a.chunk in s.targets[j] and s.accesses[j - 1].chunk in s.targets[j]
        assert set(s.targets[j]) <= {a.chunk, s.accesses[j - 1].chunk, s.accesses[(j + 1) % 12].chunk}
    assert s.max_resident == 3 and set(s.keep) == {0, 1}  # between steps: what the next forward reads first
    # a chunk leaves once read: chunk 0 is gone from the third forward read until backward nears it
    assert all(0 not in s.targets[j] for j in range(2, 10))
    with pytest.raises(ValueError, match="beyond the 6 chunks"):
        schedule_sharded([ChunkAccess(6, FORWARD)], 6)
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        schedule_sharded(reads, 6, prefetch=-1)
    assert schedule_sharded([], 3).accesses == ()
