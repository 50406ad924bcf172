"""A pipeline stage's step for ``memsched plan``: the forwards and backwards of its micro-batches, in the
order a pipeline schedule runs them, so the trace's peak of non-model data holds every micro-batch whose
activations are alive at once.

The orders are those of ``torch.distributed.pipelining``'s single-stage schedules, for stage ``i`` of ``S``
with ``N`` micro-batches:

* ``gpipe``: the ``N`` forwards, then the ``N`` backwards (``ScheduleGPipe``): ``N`` micro-batches in flight.
* ``1f1b``: ``min(N, S - i)`` forwards, then one backward and one forward in turn, then the backwards left
  (``Schedule1F1B``): at most ``min(N, S - i)`` in flight, whatever ``N``.

A stage other than the first receives its input as a leaf that requires grad (the previous stage's
activations), and one other than the last receives its output's gradient (the next stage's input gradient)
right before that micro-batch's backward, as the schedule's receive buffers are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memsched.models import config_for
from memsched.target import Workload

SCHEDULES = ("gpipe", "1f1b")


def schedule_order(schedule: str, stage: int, n_stages: int, n_microbatches: int) -> list[tuple[str, int]]:
    """The actions of stage ``stage`` (of ``n_stages``) in one step: ``("F", k)`` and ``("B", k)`` for
    micro-batch ``k`` of ``n_microbatches``, in the schedule's order (see the module docstring).

    Raises:
        ValueError: an unknown schedule, or a stage, stage count or micro-batch count out of range.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if n_stages < 1 or not 0 <= stage < n_stages or n_microbatches < 1:
        raise ValueError(f"stage {stage} of {n_stages} with {n_microbatches} micro-batches: need "
                         "0 <= stage < stages and at least one micro-batch")
    n = n_microbatches
    if schedule == "gpipe":
        return [("F", k) for k in range(n)] + [("B", k) for k in range(n)]
    warmup = min(n, n_stages - stage)
    order = [("F", k) for k in range(warmup)]
    for k in range(n):
        order.append(("B", k))
        if warmup + k < n:
            order.append(("F", warmup + k))
    return order


def in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward ran and whose backward has not, at once, in ``order``."""
    alive = peak = 0
    for action, _ in order:
        alive += 1 if action == "F" else -1
        peak = max(peak, alive)
    return peak


def gpt_stage_workload(size: str, batch_size: int, seq_len: int, *, stages: int, stage: int,
                       micro_batches: int, schedule: str, seed: int = 0,
                       ) -> Callable[[torch.device], Workload]:
    """A workload function for stage ``stage`` of the built-in GPT of ``size`` cut into ``stages``
    (:func:`memsched.models.gpt_stages.split_gpt`), whose loss runs the stage's step: ``batch_size``
    sequences of ``seq_len`` tokens (one data-parallel rank's batch per step) split into ``micro_batches``
    equal micro-batches, forwards and backwards in ``schedule``'s order (:func:`schedule_order`).

    Raises:
        ValueError: unknown size or schedule, a stage out of range, more stages than blocks, a sequence
            longer than the model's block size, or a batch that ``micro_batches`` does not divide.
    """
    config = config_for(size)
    order = schedule_order(schedule, stage, stages, micro_batches)
    if not 1 <= stages <= config.n_layer:
        raise ValueError(f"--stages must be in [1, {config.n_layer}] for the {size!r} GPT's {config.n_layer} "
                         f"blocks, got {stages}")
    if seq_len > config.block_size:
        raise ValueError(f"sequence length {seq_len} exceeds the {size!r} model's block_size "
                         f"{config.block_size}")
    if batch_size % micro_batches:
        raise ValueError(f"a batch of {batch_size} does not split into {micro_batches} equal micro-batches")
    micro = batch_size // micro_batches

    def build(device: torch.device) -> Workload:
        from memsched.models import build_gpt
        from memsched.models.gpt_stages import split_gpt, stage_loss

        torch.manual_seed(seed)
        module = split_gpt(build_gpt(size, device=device), stages)[stage]
        first, last = stage == 0, stage == stages - 1

        def loss_fn(m: torch.nn.Module) -> torch.Tensor:
            outputs: dict[int, torch.Tensor] = {}
            for action, k in order:
                if action == "F":
                    tokens = torch.randint(0, config.vocab_size, (micro, seq_len + 1), device=device)
                    x = tokens[:, :-1] if first else torch.randn(
                        micro, seq_len, config.n_embd, device=device, dtype=m.blocks[0].linear1.weight.dtype,
                        requires_grad=True)
                    out = m(x)
                    outputs[k] = stage_loss(out, tokens[:, 1:]) if last else out
                    continue
                out = outputs.pop(k)
                torch.autograd.backward(out, None if last else torch.randn_like(out))
            # every action ran above; the caller's backward of this leaf does nothing more
            return torch.zeros((), device=device, requires_grad=True)

        return Workload(module, loss_fn, f"gpt {size} stage {stage} of {stages}, {micro_batches} "
                                         f"micro-batches ({schedule})")

    build.__qualname__ = f"gpt[{size}] stage {stage}/{stages}"
    return build
