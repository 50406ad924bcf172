"""A step-time model of a placement plan, from what the warmup step measured.

During warmup every chunk is on the host, so the last warmup step's step timeline
(:mod:`memsched.telemetry.step_timeline`) measures the CPU update of the whole optimizer state (its AdamW
throughput, elements/s) besides the forward and the backward. For a plan with ``N`` elements on the host:

* CPU update ``U = N / throughput``;
* serial step ``forward + backward + U`` (the device chunks' update, on a GPU, is small next to it and not
  modelled);
* overlapped step ``forward + backward + max(0, U - forward)``: the worker runs during the next forward;
* with ``overlap="backward"`` the plan's speculating chunks update during backward first, and what is left
  runs during the next forward; chunks streamed through the device take the link's time at the step beside
  the CPU's (:func:`memsched.planning.step_model.exposed_update`, the one formula both models use).

The warmup step is traced, so its forward and backward are upper bounds (the tracer costs about 1.1x on a
large step, more on a tiny one), and it is the first step (allocator warm-up). The point is the comparison
between plans and between serial and overlapped, which the same bias affects alike; ``bench/overlap_step.py``
compares the prediction with the measured step. The idea of pricing a placement by measured phase times is
PatrickStar's (arXiv 2108.05818, section 6, which places operators by a CPU/GPU cost comparison).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memsched.planning.step_model import MODE_NAMES, exposed_update, speculative_elements_of
from memsched.telemetry.step_timeline import CPU_UPDATE, StepRecord


@dataclass(frozen=True)
class WarmupCosts:
    """Measured in the last warmup step: ``forward_s``, ``backward_s`` (seconds) and the CPU AdamW throughput
    ``cpu_elements_per_s`` (``None`` when nothing was updated on the host); over the warmup, the FLOPs of one
    step (``flops``, the tracer's count, ``tracer.MemoryTimeline.meta["flops"]``; 0 when not counted)."""

    forward_s: float
    backward_s: float
    cpu_elements_per_s: float | None
    flops: int = 0

    @classmethod
    def from_record(cls, record: StepRecord, host_elements: int, flops: int = 0) -> WarmupCosts:
        """From a warmup step's record, in which ``host_elements`` (every chunk's shard) were updated on the
        CPU, and the FLOPs of one step."""
        phases = record.phase_seconds()
        update = sum(s.seconds for s in record.spans if s.track == CPU_UPDATE and s.name == "update")
        rate = host_elements / update if update > 0 and host_elements > 0 else None
        return cls(phases["forward"], phases["backward"], rate, int(flops))

    def with_steady_phases(self, summary: dict[str, Any]) -> WarmupCosts:
        """The same CPU throughput with the forward and backward of steady-state steps
        (:meth:`memsched.telemetry.step_timeline.StepTimeline.mean_summary`), untraced: the better model once
        a few steps ran."""
        return WarmupCosts(summary["phases_s"]["forward"], summary["phases_s"]["backward"],
                           self.cpu_elements_per_s, self.flops)

    def predict(self, host_elements: int, overlap: bool | str, *, speculative_elements: int | None = None,
                link_s: float = 0.0) -> dict[str, Any]:
        """The modelled step (seconds) for a plan that updates ``host_elements`` on the CPU
        (``speculative_elements`` of them from backward with ``overlap="backward"``; ``None``: all) and
        streams others through the device in ``link_s`` seconds: ``step_s``, ``cpu_update_s``,
        ``exposed_cpu_s`` (all the step waits for, the stream's included), ``forward_s``, ``backward_s``,
        ``overlap``, ``speculative_s``, ``link_s``.

        Raises:
            ValueError: an unknown overlap mode, or speculative elements not among the host elements.
        """
        rate = self.cpu_elements_per_s
        cpu = host_elements / rate if rate else 0.0
        speculative = speculative_elements_of(host_elements, overlap, speculative_elements) / rate if rate \
            else 0.0
        exposed = exposed_update(cpu, self.forward_s, self.backward_s, overlap, speculative_s=speculative,
                                 link_s=link_s)
        return {"model": "warmup", "step_s": self.forward_s + self.backward_s + exposed, "cpu_update_s": cpu,
                "exposed_cpu_s": exposed, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "overlap": overlap, "speculative_s": speculative, "link_s": link_s}

    def reason(self, host_elements: int, host_chunks: int, overlap: bool | str, *,
               speculative_elements: int | None = None, link_s: float = 0.0, streamed_chunks: int = 0) -> str:
        """The plan's sentence on its predicted step (:meth:`predict`'s arguments; ``streamed_chunks``: how
        many chunks stream through the device).

        Raises:
            ValueError: as :meth:`predict`.
        """
        p = self.predict(host_elements, overlap, speculative_elements=speculative_elements, link_s=link_s)
        rate = (f" at {self.cpu_elements_per_s / 1e6:.0f} M elements/s" if self.cpu_elements_per_s else "")
        mode = MODE_NAMES[overlap]
        spec = (f" ({p['speculative_s'] * 1e3:.1f} ms of it from backward)" if overlap == "backward" else "")
        stream = (f" + the update of {streamed_chunks} chunks streamed through the device, "
                  f"{link_s * 1e3:.1f} ms over the link" if streamed_chunks else "")
        return (f"Predicted step {p['step_s'] * 1e3:.1f} ms ({mode} CPU "
                f"update): forward {p['forward_s'] * 1e3:.1f} ms + backward {p['backward_s'] * 1e3:.1f} ms "
                f"measured in the warmup step (traced: upper bounds) + CPU update of {host_chunks} host "
                f"chunks {p['cpu_update_s'] * 1e3:.1f} ms{rate}{spec}{stream}, of which "
                f"{p['exposed_cpu_s'] * 1e3:.1f} ms exposed.")
