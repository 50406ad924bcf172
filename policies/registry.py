"""The placement-policy registry: names -> policy functions with typed, validated options.

A placement policy is a plain function ``fn(problem, **options) -> PlacementPlan`` registered by name::

    @policies.register("half", options={"frac": Option(float, 0.5, "share of chunks on the device", 0, 1)},
                       help="Keep the first-used share of the chunks on the device.")
    def half(problem, frac):
        k = int(len(problem.chunks) * frac)
        return policies.make_plan(problem, [DEVICE] * k + [HOST] * (len(problem.chunks) - k),
                                  budget_bytes=max(0, problem.margin_bytes))

``policies.get("half", frac=0.25)`` then returns a :class:`Policy` whose ``plan(problem)`` calls the
function and checks the plan it returns (every chunk placed once, byte sums right, the device part within
the GPU margin, the host part within ``host_capacity_bytes``), so no policy, built-in or custom, can hand
the scheduler a plan certain to run out of memory. Named, swappable placement policies follow ColossalAI
Gemini (``placement_policy="static" | "auto"``).

Everything here is pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from policies.plans import PlacementError, check_base_fits, check_plan, make_plan
from policies.types import PlacementPlan, PlacementProblem
from policies.units import format_bytes, parse_bytes

__all__ = [
    "Option", "Policy", "PolicyInfo", "PlacementError", "UnknownPolicyError", "UnknownOptionError",
    "register", "unregister", "get", "names", "describe", "make_plan", "check_base_fits",
]

PolicyFn = Callable[..., PlacementPlan]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]*$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class UnknownPolicyError(LookupError, ValueError):
    """No policy is registered under that name; the message lists the known names.

    Both a ``LookupError`` (a lookup failed) and a ``ValueError`` (bad user input), so either ``except``
    works; not a ``KeyError``, whose ``str()`` would wrap the message in quotes.
    """


class UnknownOptionError(ValueError):
    """The policy has no option of that name; the message lists the options it has."""


def _num(x: float | None) -> str | None:
    """Bounds printed without a useless ``.0``: ``[0, 1]`` rather than ``[0.0, 1.0]``."""
    if x is None:
        return None
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Option:
    """One option of a placement policy: type, default, one-line help and allowed range.

    Attributes:
        type: ``bool``, ``int``, ``float`` or ``str``.
        default: used when the option is not given (checked against type and range at registration).
        help: one line.
        min, max: inclusive bounds of ``int``/``float`` options (``None`` = unbounded).
        is_bytes: an ``int`` size in bytes; strings such as ``"512MiB"`` are accepted (:func:`parse_bytes`).

    Values given as strings (from a command line) are converted: ``"0.5"``, ``"1GiB"``, ``"true"``.

    Raises:
        ValueError: an unsupported type, ``is_bytes`` on a non-int, a multi-line help, or bounds on a
            bool/str option.
    """

    type: type
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    is_bytes: bool = False

    def __post_init__(self) -> None:
        if self.type not in (bool, int, float, str):
            raise ValueError(f"Option type must be bool, int, float or str, got {self.type!r}")
        if self.is_bytes and self.type is not int:
            raise ValueError(f"a bytes Option must have type int, got {self.type.__name__}")
        if not isinstance(self.help, str) or "\n" in self.help:
            raise ValueError(f"Option help must be one line of text, got {self.help!r}")
        if (self.min is not None or self.max is not None) and self.type not in (int, float):
            raise ValueError(f"only int and float options take min/max, not {self.type.__name__}")

    @property
    def type_name(self) -> str:
        """``"bytes"`` for byte sizes, else the type's name."""
        return "bytes" if self.is_bytes else self.type.__name__

    def allowed(self) -> str:
        """The allowed values in words: ``"a float in [0, 1]"``, ``"bytes >= 0"``, ``"a bool"``."""
        lo, hi = _num(self.min), _num(self.max)
        article = "" if self.is_bytes else ("an " if self.type is int else "a ")
        if lo is not None and hi is not None:
            return f"{article}{self.type_name} in [{lo}, {hi}]"
        if lo is not None:
            return f"{article}{self.type_name} >= {lo}"
        if hi is not None:
            return f"{article}{self.type_name} <= {hi}"
        return f"{article}{self.type_name}"

    def default_text(self) -> str:
        """The default for people: ``"0.05"``, ``"512.0 MiB"``."""
        return format_bytes(self.default) if self.is_bytes else repr(self.default)

    def describe(self) -> str:
        """``"a float in [0, 1], default 1.0"``."""
        return f"{self.allowed()}, default {self.default_text()}"

    def coerce(self, value: Any, *, name: str = "option", policy: str = "?") -> Any:
        """Return ``value`` converted to this option's type and checked against its range.

        Raises:
            ValueError: wrong type (bools are not numbers here), unparsable text, NaN/infinity, or out of
                range; the message names the option, the value and what is allowed.
        """
        bad = f"option {name}={value!r} of placement policy {policy!r} must be {self.allowed()}"
        if isinstance(value, str) and self.type is not str:
            text = value.strip()
            try:
                if self.type is bool:
                    if text.lower() not in _TRUE | _FALSE:
                        raise ValueError(text)
                    value = text.lower() in _TRUE
                elif self.is_bytes:
                    value = parse_bytes(text)
                elif self.type is int:
                    value = int(text)
                else:
                    value = float(text)
            except ValueError:
                raise ValueError(bad) from None
        if self.type in (bool, str):
            if not isinstance(value, self.type):
                raise ValueError(bad)
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(bad)
        if self.type is int:
            if not isinstance(value, numbers.Integral):
                raise ValueError(bad)
            value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(bad)
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise ValueError(f"{bad}; {value!r} is out of range")
        return value


@dataclass(frozen=True)
class PolicyInfo:
    """What ``memsched policies`` shows about one policy.

    Attributes:
        name: registered name.
        help: one-line description.
        options: option name -> :class:`Option`, in declaration order.
    """

    name: str
    help: str
    options: Mapping[str, Option] = field(default_factory=dict)

    def options_text(self) -> str:
        """``"offload_optim_frac=1.0 (a float in [0, 1])"``, or ``"(no options)"``."""
        if not self.options:
            return "(no options)"
        return ", ".join(f"{n}={o.default_text()} ({o.allowed()})" for n, o in self.options.items())


@dataclass(frozen=True)
class _Entry:
    info: PolicyInfo
    fn: PolicyFn


_REGISTRY: dict[str, _Entry] = {}


class Policy:
    """A registered placement policy with its options bound; call ``plan(problem)`` or the object itself.

    Attributes:
        name: the registered name.
        help: one-line description.
        options: the options in force (defaults filled in), read-only.
    """

    def __init__(self, entry: _Entry, options: Mapping[str, Any]) -> None:
        self._fn = entry.fn
        self.name = entry.info.name
        self.help = entry.info.help
        self.options: Mapping[str, Any] = MappingProxyType(dict(options))

    def __repr__(self) -> str:
        return f"Policy({self.name!r}{''.join(f', {k}={v!r}' for k, v in self.options.items())})"

    def __call__(self, problem: PlacementProblem) -> PlacementPlan:
        return self.plan(problem)

    def plan(self, problem: PlacementProblem) -> PlacementPlan:
        """Place every optimizer-state chunk of ``problem`` on the device or the host.

        Returns:
            a :class:`PlacementPlan` whose ``policy`` and ``options`` are this policy's name and options.

        Raises:
            TypeError: ``problem`` is not a :class:`PlacementProblem`, or the policy function returned
                something other than a :class:`PlacementPlan`.
            PlacementError: resident model data + peak non-model data alone exceed the capacity (no
                placement can help), the policy cannot place the chunks, or its plan would not fit the
                device or the host.
            ValueError: the policy function returned an inconsistent plan (a bug in a custom policy).
        """
        if not isinstance(problem, PlacementProblem):
            raise TypeError(
                f"placement policy {self.name!r} needs a PlacementProblem, got {type(problem).__name__}"
            )
        check_base_fits(problem)
        plan = self._fn(problem, **self.options)
        if not isinstance(plan, PlacementPlan):
            raise TypeError(
                f"placement policy {self.name!r} returned {type(plan).__name__}, not a PlacementPlan"
            )
        plan = dataclasses.replace(plan, policy=self.name, options=dict(self.options))
        check_plan(self.name, problem, plan)
        return plan


def _as_option(policy: str, name: str, spec: Option | tuple) -> Option:
    if isinstance(spec, Option):
        return spec
    if isinstance(spec, tuple) and len(spec) == 3:
        return Option(*spec)
    raise ValueError(
        f"option {name!r} of placement policy {policy!r} must be an Option or a (type, default, help) "
        f"tuple, got {spec!r}"
    )


def register(
    name: str,
    *,
    options: Mapping[str, Option | tuple] | None = None,
    help: str | None = None,
    replace: bool = False,
) -> Callable[[PolicyFn], PolicyFn]:
    """Decorator registering ``fn(problem, **options) -> PlacementPlan`` as placement policy ``name``.

    Args:
        name: lower-case identifier (letters, digits, ``_``, ``-``).
        options: option name -> :class:`Option`, or a ``(type, default, help)`` tuple.
        help: one line; defaults to the first line of the function's docstring.
        replace: allow replacing a policy already registered under that name.

    Returns:
        the decorator; it returns the function unchanged.

    Raises:
        ValueError: bad name, name taken (without ``replace=True``), no help, a malformed option or
            default, or a function that does not accept the declared options. The registry is then
            unchanged.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"policy name must match {_NAME_RE.pattern} (e.g. 'auto'), got {name!r}")

    def decorator(fn: PolicyFn) -> PolicyFn:
        if name in _REGISTRY and not replace:
            raise ValueError(
                f"placement policy {name!r} is already registered; pass replace=True to replace it"
            )
        text = help if help is not None else (inspect.getdoc(fn) or "").split("\n", 1)[0]
        if not isinstance(text, str) or not text.strip() or "\n" in text:
            raise ValueError(f"placement policy {name!r} needs a one-line help or docstring, got {text!r}")
        opts: dict[str, Option] = {}
        for opt_name, spec in (options or {}).items():
            if not isinstance(opt_name, str) or not opt_name.isidentifier():
                raise ValueError(
                    f"option names of placement policy {name!r} must be identifiers, got {opt_name!r}"
                )
            opt = _as_option(name, opt_name, spec)
            # A bad default fails now, not at first use; a good one is stored normalised (1 -> 1.0).
            default = opt.coerce(opt.default, name=opt_name, policy=name)
            opts[opt_name] = dataclasses.replace(opt, default=default)
        try:
            inspect.signature(fn).bind(None, **{k: o.default for k, o in opts.items()})
        except TypeError as e:
            raise ValueError(
                f"policy function {getattr(fn, '__name__', fn)!r} must accept (problem"
                f"{''.join(', ' + k for k in opts)}): {e}"
            ) from None
        _REGISTRY[name] = _Entry(PolicyInfo(name, text.strip(), MappingProxyType(opts)), fn)
        return fn

    return decorator


def unregister(name: str) -> None:
    """Remove a registered policy (for tests and plug-ins).

    Raises:
        UnknownPolicyError: no policy has that name.
    """
    _entry(name)
    del _REGISTRY[name]


def names() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)


def describe() -> list[PolicyInfo]:
    """Name, one-line help and options of every registered policy, sorted by name."""
    return [_REGISTRY[n].info for n in names()]


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):  # TypeError: an unhashable "name"
        known = names()
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownPolicyError(
            f"unknown placement policy {name!r}; known: {', '.join(known)}{hint}"
        ) from None


def get(name: str, **options: Any) -> Policy:
    """The policy ``name`` with ``options`` bound (the others at their defaults).

    Option values may be strings (``"0.5"``, ``"1GiB"``, ``"true"``), as from a command line.

    Raises:
        UnknownPolicyError: no policy has that name (the message lists the known names).
        UnknownOptionError: the policy has no such option (the message lists its options).
        ValueError: an option value of the wrong type or out of range (the message names value and range).
    """
    entry = _entry(name)
    allowed = entry.info.options
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        takes = f"its options are: {', '.join(allowed)}" if allowed else "it takes no options"
        raise UnknownOptionError(
            f"placement policy {name!r} has no option {', '.join(map(repr, unknown))}; {takes}"
        )
    bound = {
        k: opt.coerce(options[k], name=k, policy=name) if k in options else opt.default
        for k, opt in allowed.items()
    }
    return Policy(entry, bound)
