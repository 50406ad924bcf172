"""policies.speculation: which host chunks may start their update during backward (overlap="backward"), as a
pure function of the plan, the update times and backward's length, and the host memory left. No torch."""

from __future__ import annotations

import dataclasses

import pytest

from policies import ChunkSpec, PlacementProblem, make_plan
from policies.plans import check_plan
from policies.speculation import speculate
from policies.types import DEVICE, HOST

MiB = 2**20


def _problem(n: int = 6, host_capacity: int | None = None, frozen: tuple[int, ...] = ()) -> PlacementProblem:
    chunks = tuple(ChunkSpec(i, 8 * MiB, (10 + i) * MiB, frozen=i in frozen) for i in range(n))
    return PlacementProblem(2**34, 0, 0, chunks, host_capacity_bytes=host_capacity)


def _plan(problem: PlacementProblem, device: tuple[int, ...] = ()):
    return make_plan(problem, [DEVICE if i in device else HOST for i in range(len(problem.chunks))],
                     budget_bytes=0, policy="cpu")


def test_every_host_chunk_speculates_without_limits_and_its_spare_is_counted():
    p = _problem()
    plan = _plan(p, device=(0,))
    out = speculate(p, plan, order=range(5, -1, -1))
    assert out.speculative == (1, 2, 3, 4, 5)  # the device chunk is no candidate
    assert out.host_bytes == plan.host_bytes + sum(p.chunks[i].host_bytes for i in range(1, 6))
    assert "5 of the 5 host chunks" in out.reasons[-1]
    check_plan("cpu", p, out)  # its bytes are the plan's own sums


def test_host_memory_left_stops_the_count_in_backward_order():
    p = _problem()
    base = _plan(p).host_bytes
    # room for chunk 5's spare (15 MiB) and chunk 4's (14 MiB), not chunk 3's (13 MiB) after them
    p = dataclasses.replace(p, host_capacity_bytes=base + 15 * MiB + 14 * MiB + 12 * MiB)
    out = speculate(p, _plan(p), order=range(5, -1, -1))
    assert out.speculative == (4, 5)
    assert out.host_bytes <= p.host_capacity_bytes
    assert "would not fit" in out.reasons[-1] and "2 of the 6" in out.reasons[-1]
    # no room at all: nothing speculates, and the plan says so
    p0 = dataclasses.replace(p, host_capacity_bytes=base)
    none = speculate(p0, _plan(p0), order=range(5, -1, -1))
    assert none.speculative == () and none.host_bytes == base and "0 of the 6" in none.reasons[-1]


def test_updates_that_fill_backward_stop_the_count():
    p = _problem()
    # 10 ms per update, 12.5 ms of backward (25 ms with the slack): the third update starts within it, the
    # fourth would not
    out = speculate(p, _plan(p), order=range(5, -1, -1), update_s=[0.01] * 6, backward_s=0.0125)
    assert out.speculative == (3, 4, 5)
    assert "already fill 2x the backward" in out.reasons[-1]
    # unmeasured times: memory alone limits
    assert speculate(p, _plan(p), order=range(5, -1, -1), update_s=None, backward_s=0.025).speculative == (
        0, 1, 2, 3, 4, 5)


def test_frozen_chunks_and_repeated_indices_are_skipped():
    p = _problem(frozen=(5,))
    plan = _plan(p)
    out = speculate(p, plan, order=[5, 4, 4, 3], update_s=None)
    assert out.speculative == (3, 4)


def test_bad_inputs_are_refused_naming_them():
    p = _problem()
    plan = _plan(p)
    with pytest.raises(ValueError, match="outside 0..5"):
        speculate(p, plan, order=[6])
    with pytest.raises(ValueError, match="one non-negative time per chunk"):
        speculate(p, plan, order=[5], update_s=[0.1], backward_s=1.0)
    with pytest.raises(ValueError, match="backward_s must be non-negative"):
        speculate(p, plan, order=[5], update_s=[0.1] * 6, backward_s=-1.0)
    with pytest.raises(ValueError, match="speculative=\\[0\\]"):  # a device chunk cannot speculate
        check_plan("cpu", p, dataclasses.replace(_plan(p, device=(0,)), speculative=(0,)))


def test_an_unmeasured_backward_does_not_stop_the_count():
    """A backward of 0 s (not measured: a forward that never runs the attached root has no phases) sets no
    time limit; memory alone does."""
    p = _problem()
    out = speculate(p, _plan(p), order=range(5, -1, -1), update_s=[0.01] * 6, backward_s=0.0)
    assert out.speculative == (0, 1, 2, 3, 4, 5)
