"""Which host chunks start their CPU update during backward (``overlap="backward"``), within the host budget.

A host chunk whose update starts during backward is updated *speculatively*: into a second (spare) host state
of the chunk's layout, committed at the step only when it equals the step's own update, else dropped and
redone (memsched's ``memsched.optim.early_update``). Each such chunk therefore costs its host state twice.
This module decides how many chunks may pay that, as a pure function of the plan, the chunks' update times
and the backward's length measured in warmup, and the host memory left:

* candidates are the plan's host chunks of trainable parameters updated on the CPU (not
  ``PlacementPlan.streamed``), in the order backward completes their gradients (earliest first: they have
  the most backward left to hide behind);
* a candidate is taken while its spare state fits the host memory the plan leaves free
  (``PlacementProblem.host_capacity_bytes`` less the plan's ``host_bytes``);
* and while the updates taken so far do not already fill backward (twice its warmup time:
  :data:`BACKWARD_SLACK`): a later chunk's update would start after backward anyway, where the step updates it
  as early, overlapping the next forward, with no spare.

The idea of updating the offloaded optimizer state during backward comes from ZeRO-Offload's delayed parameter
update (arXiv 2101.06840, section 5) and DeepSpeed SuperOffload's speculation-then-validation; here the result
is exact because a speculative update is only kept when it is the step's. No torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from policies.plans import plan_bytes
from policies.types import HOST, PlacementPlan, PlacementProblem
from policies.units import format_bytes

#: The updates taken may fill this many times the warmup's backward: warmup times are single samples (one
#: stall in the update's measurement must not cut speculation that backward hides), and an update that starts
#: late in backward still overlaps what follows it.
BACKWARD_SLACK = 2.0


def speculate(problem: PlacementProblem, plan: PlacementPlan, *, order: Sequence[int],
              update_s: Sequence[float] | None = None, backward_s: float | None = None) -> PlacementPlan:
    """``plan`` with the chunks whose update starts during backward (:attr:`PlacementPlan.speculative`), their
    spare host states counted in ``host_bytes``, and a reason that says how many and what stopped the count.

    Args:
        problem: the placement problem ``plan`` was made for.
        plan: the plan (its host-placed chunks of trainable parameters are the candidates).
        order: chunk indices (of ``problem.chunks``) in the order backward completes their gradients, earliest
            first; indices that are not candidates are skipped.
        update_s: seconds of each chunk's CPU update (indexed like ``problem.chunks``), or ``None`` when not
            measured: then the count is limited by host memory alone.
        backward_s: seconds of one backward pass, or ``None`` or 0 (not measured, e.g. a forward that never
            runs the attached root: no time limit).

    Raises:
        ValueError: ``order`` names a chunk that does not exist, or ``update_s`` has the wrong length or a
            negative entry, or ``backward_s`` is negative.
    """
    n = len(problem.chunks)
    if any(not 0 <= i < n for i in order):
        raise ValueError(f"order names chunks outside 0..{n - 1}: {sorted(set(order))!r}")
    if update_s is not None and (len(update_s) != n or any(t < 0 for t in update_s)):
        raise ValueError(f"update_s must hold one non-negative time per chunk ({n}), got {list(update_s)!r}")
    if backward_s is not None and backward_s < 0:
        raise ValueError(f"backward_s must be non-negative, got {backward_s!r}")
    timed = update_s is not None and backward_s is not None and backward_s > 0  # 0: not measured
    cap = problem.host_capacity_bytes
    free = None if cap is None else cap - plan.host_bytes
    chosen: list[int] = []
    spare = busy = 0.0
    stop = ""
    seen: set[int] = set(plan.streamed)  # updated on the device at the step: no CPU update to start early
    for i in order:
        c = problem.chunks[i]
        if i in seen or plan.placement[i] != HOST or c.frozen:
            continue
        seen.add(i)
        if timed and busy >= BACKWARD_SLACK * backward_s:  # type: ignore[operator]
            stop = (f"the updates of the first {len(chosen)} already fill {BACKWARD_SLACK:g}x the backward "
                    f"measured in warmup ({backward_s * 1e3:.1f} ms); the others are updated at the "  # type: ignore[operator]
                    "step")
            break
        if free is not None and spare + c.host_bytes > free:
            stop = (f"the next one's spare state ({format_bytes(c.host_bytes)}) would not fit the "
                    f"{format_bytes(max(0, free))} of host memory the plan leaves free")
            break
        chosen.append(i)
        spare += c.host_bytes
        if timed:
            busy += update_s[i]  # type: ignore[index]
    host = sum(1 for i, where in enumerate(plan.placement)
               if where == HOST and not problem.chunks[i].frozen and i not in plan.streamed)
    speculative = tuple(sorted(chosen))
    _, host_bytes = plan_bytes(problem, plan.placement, plan.param_placement, speculative)
    if not host:
        return plan
    text = (f"overlap='backward': {len(chosen)} of the {host} host chunks updated on the CPU start their "
            f"update during backward, each with a spare host state ({format_bytes(int(spare))} in all, "
            "counted in the host bytes)")
    text += f"; {stop}." if stop else "."
    return dataclasses.replace(plan, speculative=speculative, host_bytes=host_bytes,
                               reasons=(*plan.reasons, text))
