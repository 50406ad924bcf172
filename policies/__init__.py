"""Placement policies: pure functions from a trace summary + chunk sizes + device capacity to a plan."""

from policies.types import DEVICE, HOST, ChunkSpec, PlacementPlan, PlacementProblem
from policies.units import format_bytes, parse_bytes

__all__ = ["DEVICE", "HOST", "ChunkSpec", "PlacementPlan", "PlacementProblem", "format_bytes", "parse_bytes"]
