"""Shared by the exports: how a module and the device are labelled."""

from __future__ import annotations

from tracer.timeline import MemoryTimeline

# Optional keys of a timeline's ``meta`` written by the exports (older files lack them; readers fall back):
# the device as the user gave it (``attach(device=...)``, ``--device``), and the placement decision's figures
# (:meth:`memsched.report.plan.DecisionFigures.to_dict`).
META_DEVICE_GIVEN = "device_given"
META_DECISION = "decision"


def label(module: str) -> str:
    return module if module else "(root)"


def device_label(timeline: MemoryTimeline, device: str | None = None) -> str:
    """The device in words, as the user gave it: ``device`` when given, else the timeline's
    ``meta["device_given"]``, else the stand-in (``meta["stand_in"]``, e.g. ``sim:8.0 GiB``), else the traced
    device (``cuda:0``, ``cpu``). A stand-in says where its tensors live: ``sim:8GiB (stand-in; tensors on
    cpu)``."""
    meta = timeline.meta
    given = device if device is not None else meta.get(META_DEVICE_GIVEN)
    stand_in = meta.get("stand_in")
    text = str(given) if given else str(stand_in) if stand_in else timeline.device
    if stand_in and "stand-in" not in text:
        text += f" (stand-in; tensors on {timeline.device})"
    return text
