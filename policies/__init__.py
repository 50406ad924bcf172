"""Placement policies: pure functions from a trace summary + chunk sizes + device capacity to a plan.

``policies.get("auto").plan(problem)`` places optimizer-state chunks; ``policies.names()`` and
``policies.describe()`` list what is registered; ``@policies.register(...)`` adds a custom policy (see
:mod:`policies.registry`). Built-ins (:mod:`policies.builtin`): ``auto``, ``cpu``, ``cuda``, ``static``.
No torch here.
"""

from policies import builtin  # noqa: F401  (registers the built-in policies)
from policies.registry import (
    Option,
    PlacementError,
    Policy,
    PolicyInfo,
    UnknownOptionError,
    UnknownPolicyError,
    describe,
    get,
    make_plan,
    names,
    register,
    unregister,
)
from policies.types import DEVICE, HOST, ChunkSpec, PlacementPlan, PlacementProblem
from policies.units import format_bytes, parse_bytes

__all__ = [
    "DEVICE", "HOST", "ChunkSpec", "PlacementPlan", "PlacementProblem", "format_bytes", "parse_bytes",
    "Option", "PlacementError", "Policy", "PolicyInfo", "UnknownOptionError", "UnknownPolicyError",
    "describe", "get", "make_plan", "names", "register", "unregister",
]
