"""Where each host chunk's optimizer update runs: on the CPU, or streamed through the device.

A host chunk's state (fp32 master, ``exp_avg``, ``exp_avg_sq``) lives in pinned host memory. Its update can
run

* on the CPU, where the state is: about 28 bytes of host memory traffic per element (ZeRO-Offload's CPU
  Adam); its gradients came over the link in backward and its new parameters go back over it;
* or *streamed*: the state goes to the device piece by piece, the device's fused AdamW updates it there and
  writes the parameters in place, and the state comes back: 12 bytes each way per element over the link, plus
  the gradients (as Megatron-LM's ``--chunked-optimizer-state-offload``, which streams 256 MB pieces).

The two paths run at once (the CPU on its cores, the stream on the link's copy engines and the device), so
the step's update takes about the larger of the two. :func:`choose_update_paths` streams the first-used host
chunks (the next forward reads them first) for as long as that lowers the larger time, given the CPU update
rate measured in warmup and the link's bandwidth. Pure function; no torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from policies.types import HOST, PlacementPlan, PlacementProblem
from policies.units import format_bytes

#: The modes of ``attach(host_update=...)``.
HOST_UPDATE_MODES = ("cpu", "device", "auto")

#: fp32 master, exp_avg and exp_avg_sq: bytes per element each way over the link for a streamed update.
STATE_BYTES = 12


def streaming_bytes(numel: int, grad_bytes: int, param_bytes: int, *, grads_on_host: bool,
                    host_param_copy: bool) -> tuple[int, int]:
    """``(H2D, D2H)`` bytes over the link of one streamed update of ``numel`` elements.

    Args:
        numel: elements updated.
        grad_bytes: bytes per element of the gradients (their compute dtype).
        param_bytes: bytes per element of the parameters (compute dtype).
        grads_on_host: the gradients went to the host in backward (they come back with the state).
        host_param_copy: the chunk keeps a host copy of its parameters in the compute dtype, which follows.
    """
    h2d = numel * (STATE_BYTES + (grad_bytes if grads_on_host else 0))
    d2h = numel * (STATE_BYTES + (param_bytes if host_param_copy else 0))
    return h2d, d2h


def stream_seconds(streamed: Sequence[int], link_bytes: Sequence[tuple[int, int]],
                   link_bytes_per_s: float | None) -> float:
    """Seconds the ``streamed`` chunks' updates take over the link: the larger direction's bytes
    (``link_bytes``, per chunk ``(H2D, D2H)``) over the bandwidth per direction (bytes per second); 0 without
    streamed chunks or a known bandwidth."""
    if not streamed or not link_bytes_per_s:
        return 0.0
    h2d, d2h = sum(link_bytes[i][0] for i in streamed), sum(link_bytes[i][1] for i in streamed)
    return max(h2d, d2h) / link_bytes_per_s


def choose_update_paths(problem: PlacementProblem, plan: PlacementPlan, *, mode: str,
                        eligible: Sequence[int], cpu_elements_per_s: float | None,
                        link_bytes_per_s: float | None, link_bytes: Sequence[tuple[int, int]],
                        param_h2d_bytes: Sequence[int], staging_bytes: int,
                        rate_source: str = "warmup", link_source: str = "") -> PlacementPlan:
    """``plan`` with :attr:`PlacementPlan.streamed` (the host chunks whose update runs on the device) and a
    reason saying which path each host chunk took and why.

    Args:
        problem: the plan's problem (its capacity and resident model data bound the staging buffers).
        plan: the plan.
        mode: ``"cpu"`` (no chunk streams), ``"device"`` (every eligible chunk streams) or ``"auto"`` (the
            chunks whose streaming lowers the step's update time, see the module docstring).
        eligible: the host chunks that may stream, in first-use order (their parameters live on the device).
        cpu_elements_per_s: the CPU update rate measured in warmup, elements per second (``None``: unknown).
        link_bytes_per_s: the host link's bandwidth per direction, bytes per second (``None``: unknown).
        link_bytes: per chunk (indexed like ``problem.chunks``), ``(H2D, D2H)`` bytes of its streamed update
            (:func:`streaming_bytes`).
        param_h2d_bytes: per chunk, the bytes its CPU update sends to the device (its new parameters).
        staging_bytes: the device bytes the streamed update holds while it runs (its piece buffers).
        rate_source: where ``cpu_elements_per_s`` comes from, for the reason (``"warmup"``).
        link_source: where ``link_bytes_per_s`` comes from, for the reason (``""``: not said).

    Raises:
        ValueError: an unknown ``mode``, or an ``eligible`` chunk that is not on the host.
    """
    if mode not in HOST_UPDATE_MODES:
        raise ValueError(f"host_update must be one of {HOST_UPDATE_MODES}, got {mode!r}")
    bad = [i for i in eligible if not 0 <= i < len(problem.chunks) or plan.placement[i] != HOST]
    if bad:
        raise ValueError(f"eligible names chunks that are not on the host: {bad!r}")
    host = [i for i, where in enumerate(plan.placement) if where == HOST and not problem.chunks[i].frozen]
    if mode == "cpu" or not host:
        return plan
    host_set = set(host)
    cands = [i for i in eligible if i in host_set]
    room = problem.capacity_bytes - problem.resident_model_bytes - plan.device_bytes
    why: str
    chosen: list[int] = []
    if not cands:
        why = "none may stream (their parameters live on the host)"
    elif staging_bytes > room:
        why = (f"streaming needs {format_bytes(staging_bytes)} of device memory at the step, more than the "
               f"{format_bytes(max(0, room))} the plan leaves")
    elif mode == "device":
        chosen = cands
        why = "host_update='device'"
    elif not cpu_elements_per_s or not link_bytes_per_s:
        why = ("the CPU update rate or the link's bandwidth is unknown (the stand-in without link=, or no "
               "warmup measurement), so the update stays on the CPU")
    else:
        numel = {i: problem.chunks[i].numel for i in host}

        def cost(k: int) -> tuple[float, float]:
            streamed = set(cands[:k])
            cpu = sum(numel[i] for i in host if i not in streamed) / cpu_elements_per_s
            h2d = sum(link_bytes[i][0] if i in streamed else param_h2d_bytes[i] for i in host)
            d2h = sum(link_bytes[i][1] for i in streamed)
            return cpu, max(h2d, d2h) / link_bytes_per_s

        best = min(range(len(cands) + 1), key=lambda k: (max(cost(k)), k))
        chosen = cands[:best]
        cpu_s, link_s = cost(best)
        all_cpu, _ = cost(0)
        source = f" ({link_source})" if link_source else ""
        why = (f"the CPU updates at {cpu_elements_per_s / 1e6:.0f} M elements/s ({rate_source}) and the link "
               f"moves {format_bytes(link_bytes_per_s)}/s per direction{source}: CPU {cpu_s * 1e3:.1f} ms "
               f"beside link {link_s * 1e3:.1f} ms, against {all_cpu * 1e3:.1f} ms all on the CPU")
    streamed = tuple(sorted(chosen))
    text = (f"host_update={mode!r}: {len(streamed)} of the {len(host)} host chunks are updated on the device "
            f"(state streamed over the link in pieces, {format_bytes(staging_bytes)} of device memory at the "
            f"step), the others on the CPU; {why}.")
    return dataclasses.replace(plan, streamed=streamed, staging_bytes=staging_bytes if streamed else 0,
                               reasons=(*plan.reasons, text))
