"""The hooks that feed elastic placement (:mod:`memsched.planning.elastic`): the model's forward pre-hook
plans for the step's inputs, its always-called forward hook notices an out-of-memory error, and the
optimizer's ``zero_grad()`` notices one that a compiled forward raised (the retry loop calls it in its
``except``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

import policies
from memsched.devices.simdevice import OUT_OF_MEMORY, oom_bytes  # noqa: F401 (oom_bytes: re-exported)
from memsched.planning.elastic import Elastic, shapes
from memsched.runtime.hook_order import add_forward_pre_hook
from policies.types import HOST
from tracer.hook_handles import Detachable


def unfittable_message(elastic: Elastic, planner: Any, sig: Any,
                       exc: BaseException | None = None) -> str | None:
    """What to tell a user whose inputs ``sig`` ran out of memory with every optimizer-state chunk already on
    the host (nothing is left to offload, so a retry fails again): the bytes they need (at least what was in
    use when the allocation failed plus the allocation, from the error ``exc``: :func:`oom_bytes`; else an
    estimate scaled by element count from the inputs measured), the device's capacity, and what to reduce.
    ``None`` when some chunk is still on the device, or moving parameters to the host could make room
    (re-planning can)."""
    plan, problem = planner.plan, planner.problem
    if plan is None or problem is None or sig is None or any(where != HOST for where in plan.placement):
        return None
    requested, in_use = oom_bytes(exc)
    movable = 0  # parameters a re-plan could still move to the host (two chunks stay for the reads)
    if problem.accesses:
        on_device = [c.param_bytes for c in problem.chunks if not plan.params_on_host(c.index)]
        movable = max(0, sum(on_device) - 2 * max(on_device, default=0))
        if movable and (requested is None or in_use is None
                        or in_use + requested - movable <= problem.capacity_bytes):
            return None  # moving parameters to the host may make room

    fb = policies.format_bytes
    cap, resident = problem.capacity_bytes, problem.resident_model_bytes
    est = elastic.estimate(sig)
    if requested is not None and in_use is not None:
        at_least = in_use + requested
        need = (f"at least {at_least} bytes ({fb(at_least)}: {fb(in_use)} in use when {fb(requested)} more "
                "were asked for, and the rest of the step still to come)")
    elif est is not None:
        need_b = resident + est[0]
        need = (f"about {need_b} bytes ({fb(need_b)}: {fb(resident)} of resident model data and about "
                f"{fb(est[0])} of non-model data, scaled by element count from inputs {shapes(est[1])})")
    else:
        need = f"more than the {fb(max(0, cap - resident))} left beside {fb(resident)} of resident model data"
    params = (f" (moving the parameters there too would free at most {fb(movable)})" if movable else "")
    return (f"memsched: inputs {shapes(sig)} do not fit the device even with every optimizer-state chunk on "
            f"the host, where all of them already are{params}: they need {need}; the device has {cap} bytes "
            f"({fb(cap)}), {fb(resident)} of it resident model data (parameters, buffers). Reduce the batch "
            "size or the sequence length, or checkpoint activations (torch.utils.checkpoint). Nothing was "
            "updated")


def explain_oom(exc: BaseException, message: str | None) -> None:
    """Append ``message`` (the scheduler's explanation of an out-of-memory error: nothing left to offload,
    or a warmup that kept the parameters on the device) to ``exc``'s message, once (the exception keeps
    its type, so retry loops still catch it)."""
    first = exc.args[0] if exc.args else ""
    if message and isinstance(first, str) and message not in first:
        exc.args = (f"{first}\n{message}", *exc.args[1:])


def install_elastic_hooks(model: torch.nn.Module, elastic: Elastic,
                          observe_zero_grad: Callable[[Callable[[], None]], None],
                          explain: Callable[[BaseException], str | None] | None = None) -> list[Any]:
    """Install the hooks on ``model`` and register the ``zero_grad`` observer through ``observe_zero_grad``;
    returns the hook handles (the caller removes them at ``close()``). With ``explain`` (the scheduler's
    explanation of an out-of-memory error, e.g. :func:`unfittable_message`) a forward that runs out of
    memory says why (:func:`explain_oom`)."""

    def before(_m: torch.nn.Module, args: Any, kwargs: Any) -> None:
        elastic.before_forward(args, kwargs)

    def after(_m: torch.nn.Module, _args: Any, output: Any) -> None:
        # On failure torch calls always-called hooks inside its ``except`` with no output; a forward that
        # succeeds inside the user's own ``except`` (the retry) has an output. Compiled code never calls this
        # on failure (the retry loop's zero_grad() reports it: on_zero_grad below).
        if torch.compiler.is_compiling():
            return
        exc = sys.exc_info()[1]
        if output is None and isinstance(exc, OUT_OF_MEMORY):
            elastic.on_oom()
            if explain is not None:
                explain_oom(exc, explain(exc))

    def on_zero_grad() -> None:  # in the retry loop's ``except``: the compiled forward ran out of memory
        if isinstance(sys.exc_info()[1], OUT_OF_MEMORY):
            elastic.on_oom()

    observe_zero_grad(on_zero_grad)
    return [add_forward_pre_hook(model, Detachable(before), prepend=True, with_kwargs=True),
            model.register_forward_hook(Detachable(after), always_call=True)]
