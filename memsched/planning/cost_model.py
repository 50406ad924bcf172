"""A step-time model of a placement plan, from what the warmup step measured.

During warmup every chunk is on the host, so the last warmup step's step timeline
(:mod:`memsched.telemetry.step_timeline`) measures the CPU update of the whole optimizer state (its AdamW
throughput, elements/s) besides the forward and the backward. For a plan with ``N`` elements on the host:

* CPU update ``U = N / throughput``;
* serial step ``forward + backward + U`` (the device chunks' update, on a GPU, is small next to it and not
  modelled);
* overlapped step ``forward + backward + max(0, U - forward)``: the worker runs during the next forward.

The warmup step is traced, so its forward and backward are upper bounds (the tracer costs about 1.1x on a
large step, more on a tiny one), and it is the first step (allocator warm-up). The point is the comparison
between plans and between serial and overlapped, which the same bias affects alike; ``bench/overlap_step.py``
compares the prediction with the measured step. The idea of pricing a placement by measured phase times is
PatrickStar's (arXiv 2108.05818, section 6, which places operators by a CPU/GPU cost comparison).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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

    def predict(self, host_elements: int, overlap: bool) -> dict[str, Any]:
        """The modelled step (seconds) for a plan with ``host_elements`` on the host: ``step_s``,
        ``cpu_update_s``, ``exposed_cpu_s``, ``forward_s``, ``backward_s``, ``overlap``."""
        cpu = host_elements / self.cpu_elements_per_s if self.cpu_elements_per_s else 0.0
        exposed = max(0.0, cpu - self.forward_s) if overlap else cpu
        return {"model": "warmup", "step_s": self.forward_s + self.backward_s + exposed, "cpu_update_s": cpu,
                "exposed_cpu_s": exposed, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "overlap": overlap}

    def reason(self, host_elements: int, host_chunks: int, overlap: bool) -> str:
        """The plan's sentence on its predicted step."""
        p = self.predict(host_elements, overlap)
        rate = (f" at {self.cpu_elements_per_s / 1e6:.0f} M elements/s" if self.cpu_elements_per_s else "")
        return (f"Predicted step {p['step_s'] * 1e3:.1f} ms ({'overlapped' if overlap else 'serial'} CPU "
                f"update): forward {p['forward_s'] * 1e3:.1f} ms + backward {p['backward_s'] * 1e3:.1f} ms "
                f"measured in the warmup step (traced: upper bounds) + CPU update of {host_chunks} host "
                f"chunks {p['cpu_update_s'] * 1e3:.1f} ms{rate}, of which {p['exposed_cpu_s'] * 1e3:.1f} ms "
                "exposed.")
