"""Placement policies: registry, built-ins (cuda, cpu, static, auto), properties, `memsched policies`."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import policies
from policies import (
    DEVICE,
    HOST,
    ChunkSpec,
    Option,
    PlacementError,
    PlacementPlan,
    PlacementProblem,
    UnknownOptionError,
    UnknownPolicyError,
    format_bytes,
    make_plan,
)
from policies.builtin import auto_budget_bytes, auto_reserve_bytes

GiB, MiB = 2**30, 2**20
BUILTINS = ["auto", "cpu", "cuda", "static"]


def chunks_of(*device_bytes: int, host_factor: int = 2) -> tuple[ChunkSpec, ...]:
    return tuple(ChunkSpec(i, b, host_factor * b) for i, b in enumerate(device_bytes))


def problem(capacity: int = 16 * GiB, peak: int = 8 * GiB, resident: int = 3 * GiB, chunks=None,
            ratio: float = 0.8, host: int | None = None) -> PlacementProblem:
    if chunks is None:
        chunks = chunks_of(*[512 * MiB] * 12)
    return PlacementProblem(capacity, peak, resident, chunks, ratio, host)


# ---------------------------------------------------------------------------------------------- no torch


def test_policies_package_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import policies, policies.builtin, policies.registry, policies.types, policies.units\n"
        "p = policies.PlacementProblem(2**30, 0, 0, [policies.ChunkSpec(0, 2**20, 2**20)])\n"
        "print(sorted(policies.names()), policies.get('auto').plan(p).placement)\n"
        "assert 'torch' not in {m.split('.')[0] for m, v in sys.modules.items() if v is not None}\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "['auto', 'cpu', 'cuda', 'static'] ('device',)" in out.stdout


# ---------------------------------------------------------------------------------------------- registry


def test_names_sorted_and_get_returns_bound_policy() -> None:
    assert policies.names() == sorted(policies.names())
    assert set(BUILTINS) <= set(policies.names())
    pol = policies.get("static", offload_optim_frac=0.25)
    assert pol.name == "static"
    static_options = {"offload_optim_frac": 0.25, "offload_param_frac": 0.0, "max_prefetch": 2}
    assert dict(pol.options) == static_options
    assert dict(policies.get("auto").options) == {"reserve_frac": 0.05, "reserve_bytes": 0, "max_prefetch": 2,
                                                  "warmup_non_model_share": 0.8}
    with pytest.raises(TypeError):
        pol.options["offload_optim_frac"] = 0.5  # read-only
    plan = pol(problem())
    assert plan == pol.plan(problem())
    assert plan.policy == "static" and dict(plan.options) == static_options


def test_unknown_policy_lists_known_names() -> None:
    with pytest.raises(UnknownPolicyError) as e:
        policies.get("autoo")
    assert isinstance(e.value, LookupError) and isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.startswith("unknown placement policy 'autoo'; known: auto, cpu, cuda, static")
    assert "did you mean 'auto'" in msg


def test_unknown_option_lists_allowed_options() -> None:
    with pytest.raises(UnknownOptionError, match="no option 'offload_frac'; its options are: offload_optim"):
        policies.get("static", offload_frac=0.5)
    with pytest.raises(UnknownOptionError, match="reserve_frac, reserve_bytes"):
        policies.get("auto", margin=1)
    with pytest.raises(UnknownOptionError, match="takes no options"):
        policies.get("cpu", anything=1)


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), float("inf"), True, "abc", None, [0.5]])
def test_bad_option_value_names_value_and_range(bad: object) -> None:
    with pytest.raises(ValueError) as e:
        policies.get("static", offload_optim_frac=bad)
    msg = str(e.value)
    assert f"offload_optim_frac={bad!r}" in msg
    assert "a float in [0, 1]" in msg


def test_option_values_from_strings() -> None:
    assert policies.get("static", offload_optim_frac="0.5").options["offload_optim_frac"] == 0.5
    assert policies.get("auto", reserve_bytes="512MiB").options["reserve_bytes"] == 512 * MiB
    assert policies.get("auto", reserve_bytes=7).options["reserve_bytes"] == 7
    assert policies.get("static", offload_optim_frac=1).options["offload_optim_frac"] == 1.0
    with pytest.raises(ValueError, match="reserve_bytes='lots'.*bytes >= 0"):
        policies.get("auto", reserve_bytes="lots")
    with pytest.raises(ValueError, match="reserve_bytes=-1.*out of range"):
        policies.get("auto", reserve_bytes=-1)
    with pytest.raises(ValueError, match="reserve_bytes=1.5"):
        policies.get("auto", reserve_bytes=1.5)


def test_option_kinds() -> None:
    flag = Option(bool, False, "a flag")
    assert flag.coerce("yes") is True and flag.coerce("off") is False and flag.coerce(True) is True
    with pytest.raises(ValueError, match="must be a bool"):
        flag.coerce(1)
    with pytest.raises(ValueError, match="must be a bool"):
        flag.coerce("maybe")
    count = Option(int, 3, "a count", min=1, max=5)
    assert count.coerce("4") == 4 and count.allowed() == "an int in [1, 5]"
    with pytest.raises(ValueError, match="out of range"):
        count.coerce(6)
    assert Option(str, "x", "text").coerce("y") == "y"
    with pytest.raises(ValueError):
        Option(list, [], "no lists")
    with pytest.raises(ValueError):
        Option(str, "x", "bounded text", min=0)
    with pytest.raises(ValueError):
        Option(float, 0.0, "two\nlines")


def test_describe_gives_help_and_options() -> None:
    infos = {i.name: i for i in policies.describe()}
    assert [i.name for i in policies.describe()] == policies.names()
    assert set(BUILTINS) <= set(infos)
    static = infos["static"].options["offload_optim_frac"]
    assert (static.type, static.default, static.min, static.max) == (float, 1.0, 0, 1)
    assert infos["auto"].options["reserve_bytes"].is_bytes
    assert infos["cpu"].options == {}
    for info in infos.values():
        assert info.help and "\n" not in info.help


# ---------------------------------------------------------------------------------------- custom policies


@pytest.fixture
def scratch() -> Iterator[list[str]]:
    """Names registered by a test, unregistered afterwards so the global registry stays clean."""
    made: list[str] = []
    yield made
    for name in made:
        if name in policies.names():
            policies.unregister(name)


def test_register_custom_policy(scratch: list[str]) -> None:
    scratch.append("first-k")

    @policies.register("first-k", options={"k": (int, 1, "chunks on the device")})
    def first_k(problem: PlacementProblem, k: int) -> PlacementPlan:
        """Put the first k chunks on the device."""
        k = min(k, len(problem.chunks))
        return make_plan(problem, [DEVICE] * k + [HOST] * (len(problem.chunks) - k), budget_bytes=0)

    assert "first-k" in policies.names()
    info = {i.name: i for i in policies.describe()}["first-k"]
    assert info.help == "Put the first k chunks on the device."  # from the docstring
    plan = policies.get("first-k", k="3").plan(problem())
    assert plan.policy == "first-k" and dict(plan.options) == {"k": 3}
    assert plan.placement == (DEVICE,) * 3 + (HOST,) * 9
    assert plan.device_bytes == 3 * 512 * MiB and plan.host_bytes == 9 * 1024 * MiB
    assert first_k(problem(), k=0).placement == (HOST,) * 12  # the decorator returns the function

    # a taken name needs replace=True; the failed attempt leaves the registered policy in place
    with pytest.raises(ValueError, match="already registered"):
        policies.register("first-k", help="other")(lambda problem: None)
    assert policies.get("first-k").plan(problem()).placement[0] == DEVICE
    policies.register("first-k", help="all on the host", replace=True)(
        lambda problem: make_plan(problem, [HOST] * len(problem.chunks), budget_bytes=0)
    )
    assert policies.get("first-k").plan(problem()).device_bytes == 0
    assert policies.get("first-k").options == {}

    policies.unregister("first-k")
    assert "first-k" not in policies.names()
    with pytest.raises(UnknownPolicyError):
        policies.unregister("first-k")


def test_builtin_names_cannot_be_clobbered_by_accident() -> None:
    with pytest.raises(ValueError, match="'auto' is already registered"):
        policies.register("auto", help="mine")(lambda problem: None)
    assert policies.get("auto").plan(problem()).policy == "auto"


@pytest.mark.parametrize(
    ("kwargs", "fn", "match"),
    [
        ({"help": "x"}, lambda problem: None, None),  # valid, as a control
        ({}, lambda problem: None, "one-line help"),
        ({"help": "two\nlines"}, lambda problem: None, "one-line help"),
        ({"help": "x", "options": {"f": (float, math.nan, "bad default")}}, lambda problem, f: None, "f=nan"),
        ({"help": "x", "options": {"f": Option(float, 2.0, "h", 0, 1)}}, lambda problem, f: None, "f=2.0"),
        ({"help": "x", "options": {"f": Option(float, 0.5, "h", 0, 1)}}, lambda problem: None, "must accept"),
        ({"help": "x", "options": {"f": (float, 0.5)}}, lambda problem, f: None, "(type, default, help)"),
        ({"help": "x", "options": {"not valid": (int, 1, "h")}}, lambda problem, **kw: None, "identifiers"),
    ],
)
def test_bad_registrations_leave_registry_unchanged(kwargs, fn, match, scratch: list[str]) -> None:
    scratch.append("scratch")
    before = policies.names()
    if match is None:
        policies.register("scratch", **kwargs)(fn)
        assert policies.names() == sorted([*before, "scratch"])
        return
    with pytest.raises(ValueError, match=re.escape(match)):
        policies.register("scratch", **kwargs)(fn)
    assert policies.names() == before


@pytest.mark.parametrize("name", ["", "Auto", "has space", "9lives", None])
def test_bad_policy_names(name: object) -> None:
    with pytest.raises(ValueError, match="policy name must match"):
        policies.register(name, help="x")  # type: ignore[arg-type]


def test_plans_from_custom_policies_are_checked(scratch: list[str]) -> None:
    p = problem()
    scratch += ["greedy", "short", "liar", "nothing", "odd"]
    policies.register("greedy", help="x")(lambda problem: make_plan(problem, [DEVICE] * 12, budget_bytes=0))
    policies.register("short", help="x")(lambda problem: make_plan(problem, [], budget_bytes=0))
    policies.register("liar", help="x")(
        lambda problem: PlacementPlan("liar", (HOST,) * 12, device_bytes=0, host_bytes=1, margin_bytes=0,
                                      budget_bytes=0)
    )
    policies.register("nothing", help="x")(lambda problem: None)
    policies.register("odd", help="x")(
        lambda problem: PlacementPlan("odd", ("gpu",) * 12, 0, 0, problem.margin_bytes, 0)
    )
    with pytest.raises(PlacementError, match=r"6\.0 GiB of optimizer state on the device.*margin of 5\.0"):
        policies.get("greedy").plan(p)
    with pytest.raises(ValueError, match="placement must hold one of"):
        policies.get("short").plan(p)
    with pytest.raises(ValueError, match="host_bytes=1"):
        policies.get("liar").plan(p)
    with pytest.raises(TypeError, match="returned NoneType"):
        policies.get("nothing").plan(p)
    with pytest.raises(ValueError, match="used placement 'gpu'"):
        policies.get("odd").plan(p)
    with pytest.raises(TypeError, match="needs a PlacementProblem"):
        policies.get("cpu").plan({"capacity_bytes": 1})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- problem validation


@pytest.mark.parametrize("ratio", [1.5, -0.1, float("nan"), float("inf"), True, "0.5"])
def test_problem_rejects_bad_ratio(ratio: object) -> None:
    with pytest.raises(ValueError, match=r"gpu_margin_mem_ratio must be a number in \[0, 1\], got "):
        problem(ratio=ratio)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": -1}, "capacity_bytes must be >= 0 bytes, got -1"),
        ({"peak": -5}, "peak_non_model_bytes must be >= 0 bytes, got -5"),
        ({"resident": 1.5}, "resident_model_bytes must be a whole number of bytes, got 1.5"),
        ({"host": -1}, "host_capacity_bytes must be >= 0 bytes"),
        ({"chunks": [object()]}, r"chunks\[0\] must be a ChunkSpec"),
        ({"chunks": 5}, "must be a sequence of ChunkSpec"),
    ],
)
def test_problem_rejects_bad_sizes(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        problem(**kwargs)


def test_chunk_spec_rejects_negative_or_fractional_sizes() -> None:
    with pytest.raises(ValueError, match="ChunkSpec.device_bytes must be >= 0 bytes, got -1"):
        ChunkSpec(0, -1, 0)
    with pytest.raises(ValueError, match="ChunkSpec.host_bytes must be a whole number of bytes"):
        ChunkSpec(0, 1, 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ChunkSpec.index must be >= 0"):
        ChunkSpec(-1, 1, 1)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"fragmentation_bytes": -1}, "fragmentation_bytes must be >= 0 bytes, got -1"),
    ({"fragmentation_bytes": 2.5}, "fragmentation_bytes must be a whole number of bytes, got 2.5"),
    ({"host_capacity_source": 7}, "host_capacity_source must be text or None, got 7"),
])
def test_problem_rejects_bad_machine_inputs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PlacementProblem(16 * GiB, 0, 0, chunks_of(MiB), **kwargs)


def test_problem_normalises_chunks_to_a_tuple() -> None:
    p = problem(chunks=list(chunks_of(1, 2, 3)), ratio=1)
    assert isinstance(p.chunks, tuple) and len(p.chunks) == 3
    assert p.gpu_margin_mem_ratio == 1.0 and isinstance(p.gpu_margin_mem_ratio, float)
    hash(p)


@pytest.mark.parametrize("name", BUILTINS)
def test_every_policy_refuses_when_non_model_and_resident_data_do_not_fit(name: str) -> None:
    p = problem(capacity=10 * GiB, peak=8 * GiB, resident=3 * GiB)
    with pytest.raises(PlacementError) as e:
        policies.get(name).plan(p)
    msg = str(e.value)
    assert "3.0 GiB" in msg and "8.0 GiB" in msg and "10.0 GiB" in msg and "by 1.0 GiB" in msg
    assert "no placement policy can fix this" in msg


# -------------------------------------------------------------------------------------------- built-ins


def test_cuda_places_everything_on_the_device_when_it_fits() -> None:
    p = problem(chunks=chunks_of(*[256 * MiB] * 8))  # 2 GiB in a 5 GiB margin
    plan = policies.get("cuda").plan(p)
    assert plan.placement == (DEVICE,) * 8
    assert (plan.device_bytes, plan.host_bytes, plan.margin_bytes) == (2 * GiB, 0, 5 * GiB)
    assert any("leaving 3.0 GiB of the margin free" in r for r in plan.reasons)
    assert not any("Warning" in r for r in plan.reasons)  # 2 GiB < 0.8 x 5 GiB


def test_cuda_warns_beyond_ratio_and_fails_beyond_margin() -> None:
    plan = policies.get("cuda").plan(problem(chunks=chunks_of(*[512 * MiB] * 9)))  # 4.5 of 5 GiB
    assert any("Warning" in r and "gpu_margin_mem_ratio 0.8" in r for r in plan.reasons)
    with pytest.raises(PlacementError) as e:
        policies.get("cuda").plan(problem())  # 6 GiB of chunks in a 5 GiB margin
    msg = str(e.value)
    for part in ("capacity 16.0 GiB", "peak non-model data 8.0 GiB", "resident model data 3.0 GiB",
                 "12 optimizer-state chunks 6.0 GiB", "short by 1.0 GiB", "'auto'", "'cpu'"):
        assert part in msg


def test_cpu_places_everything_on_the_host_and_checks_host_capacity() -> None:
    plan = policies.get("cpu").plan(problem())
    assert plan.placement == (HOST,) * 12
    assert (plan.device_bytes, plan.host_bytes, plan.budget_bytes) == (0, 12 * GiB, 0)
    assert any("12.0 GiB of pinned memory" in r for r in plan.reasons)
    with pytest.raises(PlacementError, match=r"needs 12\.0 GiB of pinned host memory.*only 8\.0 GiB"):
        policies.get("cpu").plan(problem(host=8 * GiB))


def test_host_capacity_error_gives_exact_bytes_and_names_the_limit() -> None:
    p = PlacementProblem(16 * GiB, 8 * GiB, 3 * GiB, chunks_of(*[512 * MiB] * 12), 0.8, 8 * GiB,
                         host_capacity_source="the locked-memory limit RLIMIT_MEMLOCK (ulimit -l) of 8.0 GiB")
    with pytest.raises(PlacementError) as e:
        policies.get("cpu").plan(p)
    msg = str(e.value)
    assert "(12,884,901,888 bytes)" in msg and "(8,589,934,592 bytes) is available" in msg
    assert "short by 4,294,967,296 bytes" in msg and "(the locked-memory limit RLIMIT_MEMLOCK" in msg
    # auto's host part is what it cannot keep on the device: 5 GiB margin -> fewer host chunks, same check
    plan = policies.get("auto").plan(p)
    assert plan.host_bytes <= 8 * GiB


def test_static_offloads_the_last_used_chunks_first() -> None:
    p = problem(chunks=chunks_of(*[512 * MiB] * 8))
    plan = policies.get("static", offload_optim_frac=0.25).plan(p)
    assert plan.placement == (DEVICE,) * 6 + (HOST,) * 2
    # a fraction between chunk boundaries rounds toward more offload: at most (1 - frac) stays on the device
    plan = policies.get("static", offload_optim_frac=0.26).plan(p)
    assert plan.placement == (DEVICE,) * 5 + (HOST,) * 3
    assert policies.get("static", offload_optim_frac=0.0).plan(p).placement == (DEVICE,) * 8
    default = policies.get("static").plan(p)
    assert default.placement == (HOST,) * 8 == policies.get("cpu").plan(p).placement
    assert not any("Warning" in r for r in plan.reasons)


def test_static_warns_beyond_ratio_and_refuses_beyond_margin() -> None:
    plan = policies.get("static", offload_optim_frac=0.25).plan(problem())  # 9 x 512 MiB = 4.5 GiB of 5
    assert plan.device_bytes == 9 * 512 * MiB
    assert any("Warning" in r for r in plan.reasons)
    with pytest.raises(PlacementError) as e:
        policies.get("static", offload_optim_frac=0.0).plan(problem())
    msg = str(e.value)
    assert "keeps 12 chunks (6.0 GiB)" in msg and "GPU margin 5.0 GiB" in msg
    suggested = float(re.search(r"offload_optim_frac >= ([0-9.]+)", msg).group(1))
    plan = policies.get("static", offload_optim_frac=suggested).plan(problem())
    assert plan.device_bytes == 10 * 512 * MiB  # the suggestion keeps as much as fits, not less


def test_auto_worked_example() -> None:
    # margin 16 - 8 - 3 = 5 GiB; reserve ceil(0.05 x 16 GiB); budget floor(0.8 x (margin - reserve))
    plan = policies.get("auto").plan(problem())
    reserve = math.ceil(16 * GiB * Fraction(0.05))
    budget = math.floor(Fraction(0.8) * (5 * GiB - reserve))
    k = budget // (512 * MiB)
    assert plan.budget_bytes == budget and plan.margin_bytes == 5 * GiB
    assert plan.placement == (DEVICE,) * k + (HOST,) * (12 - k)
    text = " ".join(plan.reasons)
    assert f"Fragmentation reserve {format_bytes(reserve)}" in text
    assert f"Budget {format_bytes(budget)}" in text
    assert f"{k} of 12 chunks" in text and f"Chunk {k} (512.0 MiB) would exceed the budget" in text

    bigger = policies.get("auto", reserve_bytes="2GiB").plan(problem())
    assert bigger.budget_bytes == math.floor(Fraction(0.8) * 3 * GiB)
    none = policies.get("auto", reserve_frac=0).plan(problem(ratio=1))
    assert none.budget_bytes == 5 * GiB and none.device_bytes == 5 * GiB


def test_auto_reserve_from_measured_fragmentation() -> None:
    cap = 16 * GiB
    blanket = math.ceil(Fraction(0.05) * cap)  # 819.2 MiB
    # measured: a third lower bound; it can only raise the reserve
    assert auto_reserve_bytes(cap, 0.05, 0, 300 * MiB) == blanket
    assert auto_reserve_bytes(cap, 0.05, 0, 2 * GiB) == 2 * GiB
    assert auto_reserve_bytes(cap, 0.05, 3 * GiB, 2 * GiB) == 3 * GiB  # reserve_bytes: the user's minimum
    assert auto_reserve_bytes(cap, 0.05, 0, None) == blanket  # not measured

    measured = PlacementProblem(cap, 8 * GiB, 3 * GiB, chunks_of(*[512 * MiB] * 12),
                                fragmentation_bytes=2 * GiB)
    plan = policies.get("auto").plan(measured)
    assert plan.budget_bytes == math.floor(Fraction(0.8) * (5 * GiB - 2 * GiB))
    text = " ".join(plan.reasons)
    want = ("Fragmentation reserve 2.0 GiB (the larger of reserve_frac 0.05 x capacity and reserve_bytes "
            "0 B, and the allocator fragmentation measured in warmup, 2.0 GiB: reserved - allocated at the "
            "peak).")
    assert want in text
    # a large measured fragmentation keeps room free: fewer chunks than under the blanket 5 % reserve
    assert plan.device_bytes < policies.get("auto").plan(problem()).device_bytes
    small = PlacementProblem(cap, 8 * GiB, 3 * GiB, chunks_of(*[512 * MiB] * 12), fragmentation_bytes=MiB)
    assert policies.get("auto").plan(small).device_bytes == policies.get("auto").plan(problem()).device_bytes


def test_auto_budget_is_monotone_to_the_byte_beyond_float_precision() -> None:
    # near 2**62 a float holds 0.05 x capacity only to 32 bytes: float budgets could drop as capacity grows
    base = 2**62
    budgets = [auto_budget_bytes(problem(capacity=base + d, peak=0, resident=0, chunks=()), 0.05, 0)
               for d in range(256)]
    assert budgets == sorted(budgets)
    assert budgets[-1] - budgets[0] <= 255  # grows by at most ratio x 1 byte per byte of capacity


def test_auto_with_no_chunks() -> None:
    plan = policies.get("auto").plan(problem(chunks=()))
    assert plan.placement == () and plan.device_bytes == plan.host_bytes == 0


# ----------------------------------------------------------------------------------- property tests

sizes = st.integers(min_value=0, max_value=2**34)
chunk_lists = st.lists(st.tuples(sizes, sizes), min_size=1, max_size=24).map(
    lambda pairs: tuple(ChunkSpec(i, d, h) for i, (d, h) in enumerate(pairs))
)
ratios = st.floats(min_value=0, max_value=1)


@st.composite
def problems(draw, ratio=ratios) -> PlacementProblem:
    chunks = draw(chunk_lists)
    total = sum(c.device_bytes for c in chunks)
    host_total = sum(c.host_bytes for c in chunks)
    peak = int(total * draw(st.floats(0, 2))) + draw(st.integers(0, 2**30))
    resident = int(total * draw(st.floats(0, 2))) + draw(st.integers(0, 2**30))
    # the margin, relative to the optimizer state: mostly between none and all of it (partial placements),
    # sometimes negative (nothing fits), sometimes huge (sizes past 2**53, where float budgets would drift)
    kind = draw(st.sampled_from(["partial", "partial", "partial", "negative", "huge"]))
    if kind == "negative":
        margin = draw(st.integers(min_value=-(2**34), max_value=-1))
    elif kind == "huge":
        margin = draw(st.integers(min_value=0, max_value=2**62))
    else:
        margin = int(total * draw(st.floats(min_value=0, max_value=1.5))) + draw(st.integers(0, 2**20))
    capacity = max(0, peak + resident + margin)
    host = draw(st.sampled_from([None, None, "some"]))
    if host is not None:
        host = int(host_total * draw(st.floats(min_value=0, max_value=1.5)))
    frag = draw(st.sampled_from([None, None, "some"]))  # measured on CUDA only
    if frag is not None:
        frag = draw(st.integers(min_value=0, max_value=2**36))
    return PlacementProblem(capacity, peak, resident, chunks, draw(ratio), host, fragmentation_bytes=frag)


@st.composite
def policy_specs(draw) -> tuple[str, dict]:
    name = draw(st.sampled_from(BUILTINS))
    if name == "static":
        return name, {"offload_optim_frac": draw(ratios)}
    if name == "auto":
        return name, {"reserve_frac": draw(st.floats(0, 0.2)), "reserve_bytes": draw(st.integers(0, 2**32))}
    return name, {}


def _is_prefix_fill(placement: tuple[str, ...]) -> bool:
    k = placement.count(DEVICE)
    return placement == (DEVICE,) * k + (HOST,) * (len(placement) - k)


@given(problems(), policy_specs())
@settings(max_examples=200, deadline=None)
def test_every_plan_fits_and_places_every_chunk_once(p: PlacementProblem, spec) -> None:
    name, options = spec
    try:
        plan = policies.get(name, **options).plan(p)
    except PlacementError:
        # refusing is allowed only when the policy's placement truly does not fit
        total = sum(c.device_bytes for c in p.chunks)
        host_total = sum(c.host_bytes for c in p.chunks)
        host_short = p.host_capacity_bytes is not None and host_total > p.host_capacity_bytes
        if name == "cuda":
            assert p.margin_bytes < total
        elif name == "cpu":
            assert p.margin_bytes < 0 or host_short
        elif name == "auto":
            assert p.margin_bytes < 0 or p.host_capacity_bytes is not None
        elif p.margin_bytes >= 0 and not host_short:  # static: its device part must exceed the margin
            roomy = PlacementProblem(2**63, 0, 0, p.chunks)
            assert policies.get(name, **options).plan(roomy).device_bytes > p.margin_bytes
        return
    assert p.resident_model_bytes + p.peak_non_model_bytes + plan.device_bytes <= p.capacity_bytes
    assert len(plan.placement) == len(p.chunks) and set(plan.placement) <= {DEVICE, HOST}
    pairs = list(zip(p.chunks, plan.placement, strict=True))
    assert plan.device_bytes == sum(c.device_bytes for c, w in pairs if w == DEVICE)
    assert plan.host_bytes == sum(c.host_bytes for c, w in pairs if w == HOST)
    assert p.host_capacity_bytes is None or plan.host_bytes <= p.host_capacity_bytes
    assert plan.margin_bytes == p.margin_bytes and plan.policy == name and plan.reasons
    assert 0 <= plan.budget_bytes <= max(0, p.margin_bytes)
    assert _is_prefix_fill(plan.placement)  # first-used chunks stay on the device
    if name == "auto":
        assert plan.device_bytes <= plan.budget_bytes
        k = plan.placement.count(DEVICE)
        if k < len(p.chunks) and plan.budget_bytes > 0:  # maximal: the next chunk would not fit
            assert plan.device_bytes + p.chunks[k].device_bytes > plan.budget_bytes
    json.dumps(plan.to_dict())


@given(problems(ratio=st.just(0.5)), ratios, ratios)
@settings(max_examples=150, deadline=None)
def test_auto_is_monotone_in_the_ratio(p: PlacementProblem, r1: float, r2: float) -> None:
    assume(p.margin_bytes >= 0)
    lo, hi = sorted((r1, r2))
    a = policies.get("auto").plan(PlacementProblem(p.capacity_bytes, p.peak_non_model_bytes,
                                                   p.resident_model_bytes, p.chunks, lo))
    b = policies.get("auto").plan(PlacementProblem(p.capacity_bytes, p.peak_non_model_bytes,
                                                   p.resident_model_bytes, p.chunks, hi))
    assert a.budget_bytes <= b.budget_bytes
    assert a.device_bytes <= b.device_bytes
    assert set(a.device_chunks) <= set(b.device_chunks)


@given(problems(), st.integers(min_value=0, max_value=2**40), ratios,
       st.integers(min_value=0, max_value=2**36))
@settings(max_examples=150, deadline=None)
def test_auto_is_monotone_in_capacity(p: PlacementProblem, more: int, reserve_frac: float,
                                      reserve_bytes: int) -> None:
    assume(p.margin_bytes >= 0)
    pol = policies.get("auto", reserve_frac=reserve_frac, reserve_bytes=reserve_bytes)
    a = pol.plan(PlacementProblem(p.capacity_bytes, p.peak_non_model_bytes, p.resident_model_bytes,
                                  p.chunks, p.gpu_margin_mem_ratio))
    b = pol.plan(PlacementProblem(p.capacity_bytes + more, p.peak_non_model_bytes, p.resident_model_bytes,
                                  p.chunks, p.gpu_margin_mem_ratio))
    assert a.budget_bytes <= b.budget_bytes
    assert a.device_bytes <= b.device_bytes
    assert set(a.device_chunks) <= set(b.device_chunks)


@given(problems(), st.integers(min_value=0, max_value=2**40), st.integers(min_value=0, max_value=2**36),
       st.integers(min_value=0, max_value=2**36))
@settings(max_examples=150, deadline=None)
def test_auto_with_measured_fragmentation_is_monotone(p: PlacementProblem, more: int, frag: int,
                                                      extra: int) -> None:
    # more capacity never places less; more fragmentation never places more
    assume(p.margin_bytes >= 0)

    def plan(capacity: int, fragmentation: int) -> PlacementPlan:
        return policies.get("auto").plan(PlacementProblem(
            capacity, p.peak_non_model_bytes, p.resident_model_bytes, p.chunks, p.gpu_margin_mem_ratio,
            fragmentation_bytes=fragmentation))

    base, roomier, fragmented = plan(p.capacity_bytes, frag), plan(p.capacity_bytes + more, frag), \
        plan(p.capacity_bytes, frag + extra)
    assert base.budget_bytes <= roomier.budget_bytes and set(base.device_chunks) <= set(roomier.device_chunks)
    assert fragmented.budget_bytes <= base.budget_bytes
    assert set(fragmented.device_chunks) <= set(base.device_chunks)


@given(problems(ratio=st.just(0.0)))
@settings(max_examples=100, deadline=None)
def test_auto_with_ratio_zero_places_like_cpu(p: PlacementProblem) -> None:
    assume(p.margin_bytes >= 0)
    p = PlacementProblem(p.capacity_bytes, p.peak_non_model_bytes, p.resident_model_bytes, p.chunks, 0.0)
    auto, cpu = policies.get("auto").plan(p), policies.get("cpu").plan(p)
    assert auto.placement == cpu.placement == (HOST,) * len(p.chunks)
    assert auto.host_bytes == cpu.host_bytes and auto.device_bytes == 0 == auto.budget_bytes


@given(chunk_lists, ratios, ratios)
@settings(max_examples=150, deadline=None)
def test_static_is_monotone_in_offload_fraction(chunks, f1: float, f2: float) -> None:
    lo, hi = sorted((f1, f2))
    p = PlacementProblem(2**62, 0, 0, chunks)  # the margin never binds here
    a = policies.get("static", offload_optim_frac=lo).plan(p)
    b = policies.get("static", offload_optim_frac=hi).plan(p)
    assert a.device_bytes >= b.device_bytes
    assert set(a.host_chunks) <= set(b.host_chunks)
    total = sum(c.device_bytes for c in chunks)
    # at least offload_optim_frac of the optimizer-state bytes leave the device
    assert total - b.device_bytes >= Fraction(hi) * total
    if hi == 1.0:
        assert b.placement == (HOST,) * len(chunks)


@given(problems(), ratios)
@settings(max_examples=150, deadline=None)
def test_static_suggestion_always_fits(p: PlacementProblem, frac: float) -> None:
    assume(p.margin_bytes >= 0 and p.host_capacity_bytes is None)
    try:
        policies.get("static", offload_optim_frac=frac).plan(p)
    except PlacementError as e:
        suggested = float(re.search(r"offload_optim_frac >= ([0-9.e-]+)", str(e)).group(1))
        assert suggested > frac
        plan = policies.get("static", offload_optim_frac=suggested).plan(p)
        assert plan.device_bytes <= p.margin_bytes


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_lists_one_line_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    from memsched.cli.main import main

    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":", 1)[0] for line in lines] == policies.names()
    by_name = {line.split(":", 1)[0]: line for line in lines}
    assert "offload_optim_frac=1.0 (a float in [0, 1])" in by_name["static"]
    assert "reserve_frac=0.05" in by_name["auto"] and "reserve_bytes=0 B (bytes >= 0)" in by_name["auto"]
    assert "(no options)" in by_name["cpu"] and "(no options)" in by_name["cuda"]
    for info in policies.describe():
        assert info.help in by_name[info.name]


def test_cli_verbose_and_json(capsys: pytest.CaptureFixture[str], scratch: list[str]) -> None:
    from memsched.cli.main import main

    scratch.append("zz-custom")
    policies.register("zz-custom", options={"n": (int, 2, "how many")}, help="A custom one.")(
        lambda problem, n: make_plan(problem, [HOST] * len(problem.chunks), budget_bytes=0)
    )
    assert main(["policies", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "zz-custom: A custom one. Options: n=2 (an int)" in out
    assert "    n: how many (an int, default 2)" in out
    assert "    offload_optim_frac: share of optimizer-state bytes kept on the host" in out

    assert main(["policies", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in data] == policies.names()
    static = next(d for d in data if d["name"] == "static")
    assert static["options"][0] == {
        "name": "offload_optim_frac", "type": "float", "default": 1.0, "min": 0, "max": 1,
        "allowed": "a float in [0, 1]",
        "help": "share of optimizer-state bytes kept on the host; the last-used chunks go first",
    }
    assert [o["name"] for o in static["options"]] == [
        "offload_optim_frac", "offload_param_frac", "max_prefetch"]
