"""CPU AdamW update throughput: memsched's chunked fused update vs torch.optim and DeepSpeed's CPU Adam.

Run ``python bench/cpu_adam.py [--numel N] [--repeats R]`` (from the repository root); the result goes to
``bench/results/cpu_adam.json`` via :func:`bench._machine.write_result`.

What runs, in ONE process, on the same total parameter count (fp32, ``--numel`` elements):

* ``memsched_chunk<K>M``: :func:`memsched.optim.adam.fused_adamw_` once per flat chunk of ``K`` Mi elements,
  which is what memsched's hybrid optimizer runs for host-resident chunks (idea: PatrickStar chunks +
  ZeRO-Offload's CPU Adam). Several chunk sizes, one of them (``--chunk-numel``) the headline.
* ``torch_fused`` / ``torch_foreach`` / ``torch_forloop``: ``torch.optim.AdamW`` over per-parameter tensors
  shaped like a GPT (embedding + transformer blocks), with ``fused=True``, ``foreach=True`` and neither.
* ``deepspeed_param`` / ``deepspeed_chunk<K>M``: ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)`` over
  the same per-parameter tensors, and over flat chunks (skipped, with the reason recorded, when DeepSpeed or
  its C++ op is not available).
* STREAM-like bandwidth kernels in the same interleaved loop: ``triad`` (``torch.add(b, c, alpha=s, out=a)``,
  12 bytes per element as STREAM counts it), ``copy`` (8 bytes) and ``axpy`` (in place ``a += s * b``,
  12 bytes, a read-modify-write like AdamW's, so no write-allocate traffic is hidden).

Every repetition calls every implementation once, in a fixed order (ABC ABC ...), so a slow spell of the
shared machine hits them all alike; the median over repetitions is reported with min/max/quartiles.

The bandwidth roof: an fp32 AdamW step moves 28 bytes per parameter (reads param, grad, exp_avg, exp_avg_sq:
16 B; writes param, exp_avg, exp_avg_sq: 12 B), so ``roof = triad_bytes_per_s / 28`` parameters/s. A triad's
store to ``a`` also costs a read of ``a`` on write-allocate caches, which STREAM does not count; the result
also gives the roof with that traffic counted (16 B per triad element) and the roof from the in-place axpy.

Before timing, every implementation takes two identical untimed steps from the same initial state and its
params / exp_avg / exp_avg_sq are compared with memsched's (``numerics`` in the result). After the main loop:
``threads_study`` (1 thread vs the default), ``pool_study`` (below), ``layout_study`` (aligned vs staggered
flat buffers, several allocations) and ``contention_study`` (the same with a busy-loop process competing for a
core).

``pool_study``: the overlapped step updates the host chunks on the worker thread of
:class:`memsched.optim.host_updates.HostUpdates`, whose OpenMP team has its own size (``update_threads``), so
the update and its roof are measured again there: for each ``t`` in ``--pool-threads`` (default
``1..torch.get_num_threads()``) one ``HostUpdates(cpu, threads=t)`` runs, through its ``run(fn)``,
``memsched_params_chunk<K>M`` (what ``HybridAdamW._adamw`` calls for a host chunk: one ``fused_adamw_`` per
chunk, one tensor per parameter part), ``memsched_chunk<K>M`` (one flat tensor per chunk), ``triad`` and
``axpy``, interleaved over kernels and thread counts in every repetition (``--pool-repeats``). Per ``t``: the
thread count the worker actually ran with (``torch.get_num_threads()`` read inside it), M params/s of the
updates, the triad's GB/s, the roof (triad bytes/s / 28 B, also with the write-allocate 16 B per triad
element, and from the axpy) in M params/s, and each update's fraction of it (of the medians, and the median of
the per-repetition ratios). Only the kernel is timed, on the worker; the rest of a host chunk's update in the
step (waiting for its D2H copy, the gradient unscale/clip copy, the H2D copy) is not. ``--no-pool-study``
skips it.

The machine may be shared: every round records the share of the cores that OTHER processes used, and
``--wait-quiet S`` waits up to S seconds (after the DeepSpeed build) for them to leave before timing.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

if __package__ in (None, ""):  # run as a script: make ``bench`` and the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import summarize
from bench._machine import write_result  # noqa: E402
from memsched.optim.adam import fused_adamw_  # noqa: E402
from memsched.optim.host_updates import HostUpdates, default_update_threads  # noqa: E402
from policies.units import format_bytes  # noqa: E402

MI = 2**20
ADAMW_BYTES_PER_PARAM = 28  # fp32: read p, g, m, v (16 B) + write p, m, v (12 B)
TRIAD_BYTES = 12  # STREAM's count: read b, c, write a (4 B each)
TRIAD_BYTES_WITH_RFO = 16  # plus the read-for-ownership of a on write-allocate caches
COPY_BYTES = 8
AXPY_BYTES = 12  # a += s * b: read a, b, write a (a's line is already owned: no extra traffic)

HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
NUMERICS_TOL = 1e-6  # max |difference| in params, exp_avg, exp_avg_sq after the check steps
NUMERICS_STEPS = 2


# ----------------------------------------------------------------------------------------- model shapes
def transformer_shapes(numel: int, hidden: int) -> list[tuple[int, ...]]:
    """Per-parameter tensor shapes of a GPT-like model with exactly ``numel`` elements in all.

    Blocks of GPT-2 layout (ln1 w/b, qkv w/b, proj w/b, ln2 w/b, fc1 w/b, fc2 w/b: ``12 h^2 + 13 h``
    elements) fill about 80 % of ``numel``; a token embedding ``(vocab, h)`` and a final layer norm take the
    rest, and a last 1-D tensor holds the ``< h`` left-over elements, so flat and per-parameter runs update
    the same count.

    Raises:
        ValueError: if ``hidden < 8`` or ``numel`` cannot hold one block plus embedding and final norm.
    """
    if hidden < 8:
        raise ValueError(f"hidden must be >= 8, got {hidden}")
    h = hidden
    block = [
        (h,),
        (h,),
        (3 * h, h),
        (3 * h,),
        (h, h),
        (h,),
        (h,),
        (h,),
        (4 * h, h),
        (4 * h,),
        (h, 4 * h),
        (h,),
    ]
    block_numel = 12 * h * h + 13 * h
    tail = 2 * h  # final layer norm
    if numel < block_numel + tail + h:
        raise ValueError(
            f"numel={numel} is too small for hidden={h}: need >= {block_numel + tail + h} "
            f"(one block of {block_numel} + embedding row + final norm); lower --hidden or raise --numel"
        )
    layers = max(1, int(0.8 * numel) // block_numel)
    rest = numel - layers * block_numel - tail
    vocab, leftover = divmod(rest, h)
    shapes: list[tuple[int, ...]] = [(vocab, h)]
    for _ in range(layers):
        shapes.extend(block)
    shapes += [(h,), (h,)]
    if leftover:
        shapes.append((leftover,))
    return shapes


def chunk_bounds(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """``(start, length)`` of consecutive flat chunks of ``chunk_numel`` elements covering ``numel``.

    Raises:
        ValueError: if ``chunk_numel`` or ``numel`` is not positive.
    """
    if chunk_numel <= 0 or numel <= 0:
        raise ValueError(
            f"numel and chunk_numel must be positive, got numel={numel}, chunk_numel={chunk_numel}"
        )
    return [(s, min(chunk_numel, numel - s)) for s in range(0, numel, chunk_numel)]


# ----------------------------------------------------------------------------------------- implementations
@dataclass
class Impl:
    """One timed update: ``step()`` runs one full optimizer step over all ``numel`` parameters.

    ``state()`` returns flat views (or per-parameter tensors in canonical order) of params, exp_avg and
    exp_avg_sq, for the numerics check; ``tensors`` is how many tensors (chunks or parameters) one step walks.
    """

    name: str
    kind: str  # "adamw" or "bandwidth"
    step: Callable[[], None]
    bytes_per_elem: int = ADAMW_BYTES_PER_PARAM
    state: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] | None = None
    tensors: int = 1
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class FlatState:
    """Flat fp32 params / exp_avg / exp_avg_sq buffers (``numel`` elements each)."""

    p: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor

    @classmethod
    def from_master(cls, master_p: torch.Tensor) -> FlatState:
        """A copy of the master params and zeroed optimizer state, each in its own allocation."""
        return cls(master_p.clone(), torch.zeros_like(master_p), torch.zeros_like(master_p))

    def state(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        return [self.p], [self.m], [self.v]


def memsched_impl(flat: FlatState, grad: torch.Tensor, chunk_numel: int) -> Impl:
    """memsched's host-side update: one :func:`fused_adamw_` call per flat chunk (views of ``flat``)."""
    bounds = chunk_bounds(flat.p.numel(), chunk_numel)
    chunks = [
        (
            flat.p[s : s + n],
            grad[s : s + n],
            flat.m[s : s + n],
            flat.v[s : s + n],
            torch.zeros((), dtype=torch.float32),
        )
        for s, n in bounds
    ]

    def step() -> None:
        for p, g, m, v, t in chunks:
            fused_adamw_([p], [g], [m], [v], [t], **HYPER)

    return Impl(f"memsched_chunk{_mi(chunk_numel)}", "adamw", step, state=flat.state, tensors=len(chunks))


def memsched_params_impl(flat: FlatState, grad: torch.Tensor, chunk_numel: int,
                         numels: Sequence[int]) -> Impl:
    """What ``HybridAdamW`` runs: one :func:`fused_adamw_` call per flat chunk whose tensors are the views of
    the parameters' shards inside it (torch's CPU kernel treats the last ``numel % vector width`` elements of
    each tensor apart, so one tensor per parameter is what makes the update bit-exact against
    ``torch.optim.AdamW(fused=True)``), one step count per chunk."""
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    calls = []
    for s, n in chunk_bounds(flat.p.numel(), chunk_numel):
        parts = [(max(a, s), min(b, s + n)) for a, b in zip(starts, starts[1:], strict=False)
                 if max(a, s) < min(b, s + n)]
        calls.append(([flat.p[a:b] for a, b in parts], [grad[a:b] for a, b in parts],
                      [flat.m[a:b] for a, b in parts], [flat.v[a:b] for a, b in parts],
                      torch.zeros((), dtype=torch.float32)))

    def step() -> None:
        for ps, gs, ms, vs, t in calls:
            t.add_(1)
            fused_adamw_(ps, gs, ms, vs, [t] * len(ps), increment_steps=False, **HYPER)

    tensors = sum(len(c[0]) for c in calls)
    return Impl(f"memsched_params_chunk{_mi(chunk_numel)}", "adamw", step, state=flat.state, tensors=tensors)


def per_param_tensors(
    master_p: torch.Tensor, grad: torch.Tensor, shapes: Sequence[tuple[int, ...]]
) -> list[torch.nn.Parameter]:
    """Separate parameter tensors (own storage) with ``.grad`` set to views of the shared flat grad."""
    params, off = [], 0
    for shape in shapes:
        n = _prod(shape)
        p = torch.nn.Parameter(master_p[off : off + n].view(shape).clone())
        p.grad = grad[off : off + n].view(shape)
        params.append(p)
        off += n
    return params


def torch_impl(name: str, params: list[torch.nn.Parameter], **flags: bool) -> Impl:
    """``torch.optim.AdamW`` over ``params`` with the given ``fused`` / ``foreach`` flags."""
    opt = torch.optim.AdamW(
        params,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        **flags,
    )

    def state() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        return params, [opt.state[p]["exp_avg"] for p in params], [opt.state[p]["exp_avg_sq"] for p in params]

    return Impl(name, "adamw", opt.step, state=state, tensors=len(params))


def _ds_optimizer(params: list[torch.nn.Parameter]) -> Any:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(
        params,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        adamw_mode=True,
        bias_correction=True,
    )


def deepspeed_impl(name: str, params: list[torch.nn.Parameter]) -> Impl:
    """``DeepSpeedCPUAdam(adamw_mode=True)`` over ``params`` (per-parameter tensors or flat chunks)."""
    opt = _ds_optimizer(params)

    def state() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        return params, [opt.state[p]["exp_avg"] for p in params], [opt.state[p]["exp_avg_sq"] for p in params]

    return Impl(name, "adamw", opt.step, state=state, tensors=len(params))


def load_deepspeed(fresh_build: bool) -> dict[str, Any]:
    """Import DeepSpeed and build/load its CPU Adam op, timing it; never raises.

    With ``fresh_build`` the op is built in an empty ``TORCH_EXTENSIONS_DIR`` so the build time is measured.
    Returns ``{"available": bool, "version", "op_load_s", "fresh_build", "error"}``.
    """
    info: dict[str, Any] = {
        "available": False,
        "version": None,
        "op_load_s": None,
        "fresh_build": fresh_build,
    }
    if importlib.util.find_spec("deepspeed") is None:
        info["error"] = "deepspeed is not installed (benchmark-only peer: pip install deepspeed)"
        return info
    if fresh_build:
        # Kept for the life of the process (the loaded .so lives there), removed at exit.
        info["extensions_dir"] = tempfile.mkdtemp(prefix="memsched-ds-ext-")
        atexit.register(shutil.rmtree, info["extensions_dir"], ignore_errors=True)
        os.environ["TORCH_EXTENSIONS_DIR"] = info["extensions_dir"]
    t0 = time.perf_counter()
    try:
        import deepspeed

        info["version"] = deepspeed.__version__
        probe = [torch.nn.Parameter(torch.zeros(16))]
        probe[0].grad = torch.zeros(16)
        _ds_optimizer(probe).step()  # builds (or loads the cached) cpu_adam op
    except Exception as e:  # noqa: BLE001 - any failure to build/load is a recorded result, not a crash
        info["error"] = f"{type(e).__name__}: {e}"[:2000]
        return info
    info["op_load_s"] = time.perf_counter() - t0
    info["available"] = True
    return info


def bandwidth_impls(numel: int) -> list[Impl]:
    """STREAM-like kernels on three fresh fp32 arrays of ``numel`` elements (4 * numel bytes each)."""
    a = torch.zeros(numel)
    b = torch.rand(numel)
    c = torch.rand(numel)
    s = 0.5
    return [
        Impl("triad", "bandwidth", lambda: torch.add(b, c, alpha=s, out=a), bytes_per_elem=TRIAD_BYTES),
        Impl("copy", "bandwidth", lambda: a.copy_(b), bytes_per_elem=COPY_BYTES),
        # a grows by < 0.5 per call: stays finite and far from denormals over any sane number of calls.
        Impl("axpy", "bandwidth", lambda: a.add_(b, alpha=s), bytes_per_elem=AXPY_BYTES),
    ]


# ----------------------------------------------------------------------------------------- measurement

def interleaved(impls: Sequence[Impl], repeats: int) -> dict[str, dict[str, Any]]:
    """Time ``repeats`` rounds of every impl once per round (ABC ABC ...); minor page faults per call too.

    Returns ``{name: summary}`` plus ``"_load_avg_per_round"`` (the 1-minute load average before each round)
    and ``"_others_cpu_share_per_round"`` (see :class:`_CpuProbe`).
    """
    times: dict[str, list[float]] = {i.name: [] for i in impls}
    faults: dict[str, int] = {i.name: 0 for i in impls}
    load: list[float] = []  # 1-minute load average before each round: was the shared machine busy?
    others: list[float] = []  # share of all cores that OTHER processes used during each round
    for _ in range(repeats):
        load.append(os.getloadavg()[0])
        probe = _CpuProbe()
        for impl in impls:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            impl.step()
            times[impl.name].append(time.perf_counter() - t0)
            faults[impl.name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        others.append(probe.others_share())
    out: dict[str, Any] = {
        name: {**summarize(ts), "minor_faults_per_call": faults[name] / repeats} for name, ts in times.items()
    }
    out["_load_avg_per_round"] = load
    out["_others_cpu_share_per_round"] = others
    return out


class _CpuProbe:
    """Share of all cores busy with OTHER processes (or stolen by the hypervisor) since construction.

    System-wide busy CPU time (``/proc/stat`` via psutil, steal included) minus this process's own CPU time,
    over wall time x cores: 0 on a quiet machine, up to 1 when others kept every core busy. Unlike the load
    average it is not inflated by this process's own recent work (e.g. the DeepSpeed op build).
    """

    def __init__(self) -> None:
        self._t0, self._busy0, self._mine0 = time.perf_counter(), self._busy(), self._mine()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return (
            sum(t)
            - t.idle
            - getattr(t, "iowait", 0.0)
            - getattr(t, "guest", 0.0)
            - getattr(t, "guest_nice", 0.0)
        )

    @staticmethod
    def _mine() -> float:
        t = psutil.Process().cpu_times()
        return t.user + t.system

    def others_share(self) -> float:
        wall = (time.perf_counter() - self._t0) * (psutil.cpu_count() or 1)
        others = (self._busy() - self._busy0) - (self._mine() - self._mine0)
        return min(1.0, max(0.0, others / wall)) if wall > 0 else 0.0


def wait_for_quiet(max_wait_s: float, threshold: float = 0.05, window_s: float = 10.0) -> dict[str, Any]:
    """Wait (at most ``max_wait_s`` seconds) until other processes use < ``threshold`` of the cores over a
    ``window_s`` window; returns ``{"waited_s", "others_cpu_share", "quiet"}`` for the result file."""
    t0 = time.perf_counter()
    while True:
        probe = _CpuProbe()
        time.sleep(window_s)
        share = probe.others_share()
        waited = time.perf_counter() - t0
        if share < threshold or waited >= max_wait_s:
            return {"waited_s": waited, "others_cpu_share": share, "quiet": share < threshold}


def bit_exact(ref: Impl, impls: Sequence[Impl], numels: Sequence[int]) -> dict[str, bool]:
    """Whether each of ``impls`` holds exactly ``ref``'s params, exp_avg and exp_avg_sq (same steps taken)."""
    def flat(impl: Impl) -> list[torch.Tensor]:
        assert impl.state is not None
        return [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in impl.state()]

    want = flat(ref)
    return {i.name: all(torch.equal(a, b) for a, b in zip(flat(i), want, strict=True)) for i in impls}


def check_numerics(ref: Impl, others: Sequence[Impl], numels: Sequence[int]) -> dict[str, Any]:
    """Max |difference| of params, exp_avg, exp_avg_sq between ``ref`` and each of ``others``.

    Every impl's state is read as consecutive per-parameter shards (``numels``) of one flat sequence, so
    flat-chunk and per-parameter layouts compare element by element.
    """

    def flat_pieces(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        flat = [t.detach().reshape(-1) for t in ts]
        if len(flat) == len(numels) and all(t.numel() == n for t, n in zip(flat, numels, strict=True)):
            return flat
        whole = flat[0] if len(flat) == 1 else torch.cat(flat)
        return list(whole.split(list(numels)))

    assert ref.state is not None
    ref_state = [flat_pieces(x) for x in ref.state()]
    out: dict[str, Any] = {"reference": ref.name, "steps": NUMERICS_STEPS, "tolerance_abs": NUMERICS_TOL}
    ok = True
    for impl in others:
        assert impl.state is not None
        diffs = {}
        mine_state = [flat_pieces(x) for x in impl.state()]
        for key, mine, theirs in zip(("param", "exp_avg", "exp_avg_sq"), mine_state, ref_state, strict=True):
            diffs[f"max_abs_diff_{key}"] = max(
                float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True)
            )
        diffs["ok"] = all(d <= NUMERICS_TOL for d in diffs.values())
        ok &= diffs["ok"]
        out[impl.name] = diffs
    out["ok"] = ok
    return out


def threads_study(impls: Sequence[Impl], thread_counts: Sequence[int], repeats: int) -> dict[str, Any]:
    """Median time of each impl at each torch thread count, interleaved over counts (ABC@1 ABC@2 ...)."""
    default = torch.get_num_threads()
    probe = _CpuProbe()
    times: dict[str, dict[int, list[float]]] = {i.name: {n: [] for n in thread_counts} for i in impls}
    try:
        for _ in range(repeats):
            for n in thread_counts:
                torch.set_num_threads(n)
                for impl in impls:
                    t0 = time.perf_counter()
                    impl.step()
                    times[impl.name][n].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(default)
    out: dict[str, Any] = {
        name: {str(n): {"median_s": statistics.median(ts), "min_s": min(ts)} for n, ts in per_n.items()}
        for name, per_n in times.items()
    }
    out["others_cpu_share"] = probe.others_share()
    return out


def contention_study(
    impls: Sequence[Impl], thread_counts: Sequence[int], repeats: int, spinners: int = 1
) -> dict[str, Any]:
    """:func:`threads_study` while ``spinners`` busy-loop processes compete for the cores.

    In training, the CPU update shares the cores with the Python thread that drives the GPU, data loading
    and the copy threads; an OpenMP team then waits at every parallel region's barrier for a thread that
    the OS scheduler has parked, so the cost grows with the number of parallel regions (one per tensor in
    torch's fused kernel), not with the bytes. The spinners stop themselves after 10 minutes at most and are
    killed (by their pid) when the study ends.
    """
    code = "import time\nt = time.monotonic() + 600\nwhile time.monotonic() < t:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(spinners)]
    try:
        time.sleep(0.5)  # let them start spinning
        out = threads_study(impls, thread_counts, repeats)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    out["spinners"] = spinners
    out["repeats"] = repeats
    return out


def pool_study(
    adamw: Sequence[Impl],
    bandwidth: Sequence[Impl],
    numel: int,
    thread_counts: Sequence[int],
    repeats: int,
) -> dict[str, Any]:
    """The update and the bandwidth kernels on the step's own worker, at each of its thread counts.

    The overlapped step runs the host chunks' updates on the worker thread of
    :class:`memsched.optim.host_updates.HostUpdates`, whose OpenMP team has a size of its own (``threads``),
    not the training thread's. For each count ``t`` one ``HostUpdates(cpu, threads=t)`` is started, and every
    repetition runs, for each ``t`` in turn, every impl of ``adamw`` and ``bandwidth`` once on that worker
    through its public :meth:`~memsched.optim.host_updates.HostUpdates.run` (interleaved: ABC@1 ABC@2 ...
    ABC@1 ...), so the roof at ``t`` threads is measured on the same thread, with the same team, beside the
    update it bounds. The time is taken on the worker around the kernel (not the hand-off to the worker);
    the worker's ``torch.get_num_threads()`` is read there on every call. All workers live through the whole
    study (an idle OpenMP team sleeps after a short spin), as the step's worker lives beside the training
    thread's team; they are closed at the end. Repeated counts in ``thread_counts`` are measured once.

    ``bandwidth`` must hold ``triad`` (the roof) and may hold ``axpy``. Per ``t`` the result gives each
    impl's timing summary (M params/s for the updates, GB/s for the kernels), the roof (triad bytes/s / 28 B,
    and with the triad's write-allocate traffic counted: 16 B per element), the axpy roof, and each update's
    fraction of them; ``fraction_of_roof_paired`` is the median over repetitions of the ratio taken within one
    repetition (update and triad timed moments apart), less sensitive to a slow spell than the ratio of
    medians.

    Raises:
        ValueError: ``bandwidth`` has no ``triad``.
    """
    thread_counts = list(dict.fromkeys(thread_counts))
    kernels = [*adamw, *bandwidth]
    names = {i.name for i in bandwidth}
    if "triad" not in names:
        raise ValueError(f"pool_study needs the triad kernel among bandwidth, got {sorted(names)}")
    cpu = torch.device("cpu")
    times: dict[int, dict[str, list[float]]] = {t: {i.name: [] for i in kernels} for t in thread_counts}
    seen: dict[int, set[int]] = {t: set() for t in thread_counts}
    others: list[float] = []
    workers = {t: HostUpdates(cpu, threads=t) for t in thread_counts}
    try:

        def on_worker(t: int, impl: Impl) -> None:
            def fn() -> None:
                seen[t].add(torch.get_num_threads())
                t0 = time.perf_counter()
                impl.step()
                times[t][impl.name].append(time.perf_counter() - t0)

            workers[t].run(fn).result()

        for t in thread_counts:  # start every worker (its team) and warm it, untimed
            workers[t].run(lambda: None).result()
        for t in thread_counts:
            for impl in kernels:
                on_worker(t, impl)
            times[t] = {i.name: [] for i in kernels}
        for _ in range(repeats):
            probe = _CpuProbe()
            for t in thread_counts:
                for impl in kernels:
                    on_worker(t, impl)
            others.append(probe.others_share())
    finally:
        for w in workers.values():
            w.close()

    per_t: dict[str, Any] = {}
    for t in thread_counts:
        row: dict[str, Any] = {"worker_threads": sorted(seen[t]), "results": {}}
        for impl in kernels:
            r = summarize(times[t][impl.name])
            if impl.kind == "adamw":
                r["params_per_s"] = numel / r["median_s"]
                r["mparams_per_s"] = r["params_per_s"] / 1e6
            else:
                r["bytes_per_s"] = impl.bytes_per_elem * numel / r["median_s"]
                r["gb_per_s"] = r["bytes_per_s"] / 1e9
                r["bytes_per_elem_counted"] = impl.bytes_per_elem
            row["results"][impl.name] = r
        triad = row["results"]["triad"]
        roof = {
            "triad_gb_per_s": triad["gb_per_s"],
            "mparams_per_s": triad["bytes_per_s"] / ADAMW_BYTES_PER_PARAM / 1e6,
            "with_write_allocate_mparams_per_s": triad["bytes_per_s"] * TRIAD_BYTES_WITH_RFO / TRIAD_BYTES
            / ADAMW_BYTES_PER_PARAM / 1e6,
        }
        if "axpy" in row["results"]:
            roof["axpy_mparams_per_s"] = row["results"]["axpy"]["bytes_per_s"] / ADAMW_BYTES_PER_PARAM / 1e6
        row["roof"] = roof
        fractions: dict[str, Any] = {}
        for impl in adamw:
            mpps = row["results"][impl.name]["mparams_per_s"]
            # per repetition: (numel / t_update) / (12 numel / t_triad / 28) = 28 t_triad / (12 t_update)
            paired = [ADAMW_BYTES_PER_PARAM * tt / (TRIAD_BYTES * tu)
                      for tu, tt in zip(times[t][impl.name], times[t]["triad"], strict=True)]
            fractions[impl.name] = {
                "mparams_per_s": mpps,
                "fraction_of_roof": mpps / roof["mparams_per_s"],
                "fraction_of_roof_paired": statistics.median(paired),
                "fraction_of_roof_with_write_allocate": mpps / roof["with_write_allocate_mparams_per_s"],
            }
            if "axpy_mparams_per_s" in roof:
                fractions[impl.name]["fraction_of_roof_axpy"] = mpps / roof["axpy_mparams_per_s"]
        row["update_vs_roof"] = fractions
        per_t[str(t)] = row
    return {
        "thread_counts": list(thread_counts),
        "repeats": repeats,
        "worker": "memsched.optim.host_updates.HostUpdates(torch.device('cpu'), threads=t).run(fn)",
        "order": [i.name for i in kernels],
        "step_default_threads": {
            "cuda": default_update_threads(torch.device("cuda"), torch.get_num_threads()),
            "cpu": default_update_threads(cpu, torch.get_num_threads()),
        },
        "others_cpu_share_per_round": others,
        "by_threads": per_t,
        "definition": "roof = triad bytes/s on the worker at t threads (12 B per element, STREAM count) "
        "/ 28 B per fp32 AdamW parameter; fraction = update params/s / roof",
    }


def staggered_buffers(numel: int, count: int, stagger_bytes: int) -> list[torch.Tensor]:
    """``count`` fp32 buffers of ``numel`` elements; buffer ``i`` starts ``i * stagger_bytes`` bytes into its
    own allocation, so the buffers' addresses differ in their low 12 bits when ``stagger_bytes % 4096 != 0``.

    Raises:
        ValueError: if ``stagger_bytes`` is negative or not a multiple of 4 (fp32 elements).
    """
    if stagger_bytes < 0 or stagger_bytes % 4:
        raise ValueError(f"stagger_bytes must be a non-negative multiple of 4, got {stagger_bytes}")
    step = stagger_bytes // 4
    out = []
    for i in range(count):
        base = torch.empty(numel + step * i)
        out.append(base[step * i :])
    return out


def layout_study(
    numel: int,
    chunk_numel: int,
    thread_counts: Sequence[int],
    repeats: int,
    allocations: int = 3,
    stagger_bytes: int = 1088,
) -> dict[str, Any]:
    """memsched's chunked update over freshly allocated flat buffers in two layouts, at each thread count.

    ``aligned``: param, grad, exp_avg and exp_avg_sq each in its own large allocation, so all four start at
    the same offset modulo 4 KiB (what separate equal-size chunk buffers get from the allocator).
    ``staggered``: buffer ``i`` shifted by ``i * stagger_bytes`` (1088 = 1 KiB + one 64 B line by default),
    against aliasing of the four streams in the low 12 address bits ("4K aliasing").
    Each layout is allocated ``allocations`` times (one aligned/staggered pair at a time, interleaved), so the
    spread between allocations of the SAME layout shows how much of a difference is where the buffers
    happened to land (physical pages) rather than the layout.

    Returns ``{"aligned": [per-allocation threads_study entry, ...], "staggered": [...], ...}``.
    """
    out: dict[str, Any] = {"aligned": [], "staggered": [], "address_mod_4096": {}}
    gen = torch.Generator().manual_seed(1)
    for _ in range(allocations):
        layouts = {
            "aligned": staggered_buffers(numel, 4, 0),
            "staggered": staggered_buffers(numel, 4, stagger_bytes),
        }
        impls = []
        for name, (p, g, m, v) in layouts.items():
            p.copy_(torch.randn(numel, generator=gen) * 0.02)
            g.copy_(torch.randn(numel, generator=gen) * 1e-3)
            m.zero_()
            v.zero_()
            impl = memsched_impl(FlatState(p, m, v), g, chunk_numel)
            impl.name = name
            impl.step()  # warm
            impls.append(impl)
            out["address_mod_4096"][name] = [t.data_ptr() % 4096 for t in (p, g, m, v)]
        study = threads_study(impls, thread_counts, repeats)
        for name in layouts:
            out[name].append(study[name])
        del layouts, impls
        gc.collect()
    out.update(stagger_bytes=stagger_bytes, repeats=repeats, allocations=allocations)
    return out


# ----------------------------------------------------------------------------------------- the run
def run(
    numel: int = 64 * MI,
    repeats: int = 21,
    hidden: int = 1024,
    chunk_numel: int = 8 * MI,
    chunk_sweep: Sequence[int] = (1 * MI, 4 * MI, 16 * MI, 64 * MI),
    deepspeed: bool = True,
    deepspeed_fresh_build: bool = False,
    reference: bool = True,
    thread_counts: Sequence[int] | None = None,
    thread_repeats: int = 5,
    contention_repeats: int = 3,
    layout_repeats: int = 5,
    pool_threads: Sequence[int] | None = None,
    pool_repeats: int = 5,
    wait_quiet_s: float = 0.0,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Run the whole benchmark and return the result payload (see the module docstring).

    Args:
        numel: total fp32 parameters (elements) every implementation updates.
        repeats: interleaved timed rounds (after two untimed check steps).
        hidden: width of the GPT-like per-parameter shapes.
        chunk_numel: memsched's headline chunk size in elements; ``chunk_sweep`` adds other sizes (values
            ``>= numel`` mean one chunk).
        deepspeed: include DeepSpeed's CPU Adam if it can be imported and built.
        reference: include ``torch_foreach`` and ``torch_forloop``.
        thread_counts: torch thread counts for the threads study (default ``[1, torch.get_num_threads()]``;
            empty to skip).
        contention_repeats: rounds of the same study with one competing busy-loop process (0 to skip).
        layout_repeats: rounds of :func:`layout_study` (0 to skip; it allocates 8 more fp32 arrays).
        pool_threads: the worker thread counts of :func:`pool_study` (default ``1..torch.get_num_threads()``;
            empty to skip).
        pool_repeats: interleaved rounds of :func:`pool_study` (0 to skip).
        wait_quiet_s: after loading DeepSpeed (a fresh build loads the machine) and before timing, wait up to
            this long for other processes to leave the cores (see :func:`wait_for_quiet`); 0 starts at once.

    Raises:
        ValueError: on a non-positive ``numel``/``repeats``/chunk size or shapes that do not fit ``numel``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    shapes = transformer_shapes(numel, hidden)
    numels = [_prod(s) for s in shapes]
    sizes = sorted({min(c, numel) for c in (chunk_numel, *chunk_sweep)})
    for c in sizes:
        chunk_bounds(numel, c)  # validates
    headline = f"memsched_chunk{_mi(min(chunk_numel, numel))}"
    threads_default = torch.get_num_threads()
    load_start = os.getloadavg()
    free_start = psutil.virtual_memory().available
    log(
        f"numel={numel} ({format_bytes(4 * numel)} per fp32 array), {len(shapes)} tensors, threads="
        f"{torch.get_num_threads()}, load avg {load_start[0]:.2f}"
    )

    ds_info: dict[str, Any] = {"available": False, "error": "disabled (--no-deepspeed)"}
    if deepspeed:
        log("loading DeepSpeed CPU Adam op" + (" (fresh build)" if deepspeed_fresh_build else ""))
        ds_info = load_deepspeed(deepspeed_fresh_build)
        log(f"deepspeed: {ds_info}")

    quiet = None
    if wait_quiet_s > 0:
        quiet = wait_for_quiet(wait_quiet_s)
        log(f"waited {quiet['waited_s']:.0f} s for quiet: others use {quiet['others_cpu_share']:.0%}")

    gen = torch.Generator().manual_seed(0)
    master_p = torch.randn(numel, generator=gen) * 0.02  # GPT-2 init scale
    grad = torch.randn(numel, generator=gen) * 1e-3  # shared, read-only: every impl reads the same grads

    # memsched: one set of flat buffers; the chunk sizes are different partitions (views) of it.
    flat = FlatState.from_master(master_p)
    mem = {c: memsched_impl(flat, grad, c) for c in sizes}
    adamw: list[Impl] = [mem[c] for c in sizes]
    # What HybridAdamW runs: the headline chunks, one tensor per parameter part. Timed on the same buffers as
    # the flat chunks (so the two differ only in the partition); checked on buffers of its own.
    head = min(chunk_numel, numel)
    params_timed = memsched_params_impl(flat, grad, head, numels)
    params_check = memsched_params_impl(FlatState.from_master(master_p), grad, head, numels)
    adamw.append(params_timed)
    torch_params = per_param_tensors(master_p, grad, shapes)
    adamw.append(torch_impl("torch_fused", torch_params, fused=True))
    refs: list[Impl] = []
    if reference:
        refs.append(torch_impl("torch_foreach", per_param_tensors(master_p, grad, shapes), foreach=True))
        refs.append(
            torch_impl("torch_forloop", per_param_tensors(master_p, grad, shapes), foreach=False, fused=False)
        )
    ds_impls: list[Impl] = []
    if ds_info["available"]:
        ds_impls.append(deepspeed_impl("deepspeed_param", per_param_tensors(master_p, grad, shapes)))
        ds_flat = FlatState.from_master(master_p)
        ds_chunks = []
        for s, n in chunk_bounds(numel, min(chunk_numel, numel)):
            p = torch.nn.Parameter(ds_flat.p[s : s + n])  # shares ds_flat's storage
            p.grad = grad[s : s + n]
            ds_chunks.append(p)
        ds_impls.append(deepspeed_impl(f"deepspeed_chunk{_mi(min(chunk_numel, numel))}", ds_chunks))
    del master_p
    gc.collect()

    # Numerics: the headline memsched variant and every other implementation take the same two steps from
    # the same state (the other memsched chunk sizes share the headline's buffers and are not re-checked).
    others = [i for i in adamw + refs + ds_impls if i.name not in {m.name for m in mem.values()}
              and i is not params_timed] + [params_check]
    log("numerics check (untimed)")
    for impl in [mem[min(chunk_numel, numel)], *others]:
        for _ in range(NUMERICS_STEPS):
            impl.step()
    numerics = check_numerics(mem[min(chunk_numel, numel)], others, numels)
    numerics["bit_exact_vs_torch_fused"] = bit_exact(
        next(i for i in adamw if i.name == "torch_fused"),
        [mem[min(chunk_numel, numel)], params_check], numels)
    log(f"numerics ok={numerics['ok']}")
    for impl in [*mem.values(), params_timed]:  # warm the other partitions too (no new memory is touched)
        impl.step()

    bw = bandwidth_impls(numel)
    for impl in bw:
        impl.step()
    order = [*adamw, *ds_impls, *refs, *bw]
    log(f"timing {repeats} interleaved rounds of {len(order)} kernels")
    timed = interleaved(order, repeats)
    load_rounds = timed.pop("_load_avg_per_round")
    others_rounds = timed.pop("_others_cpu_share_per_round")
    results: dict[str, Any] = {}
    for impl in order:
        r = timed[impl.name]
        r["tensors_per_step"] = impl.tensors
        if impl.kind == "adamw":
            r["params_per_s"] = numel / r["median_s"]
            r["adamw_bytes_per_s"] = ADAMW_BYTES_PER_PARAM * numel / r["median_s"]
        else:
            r["bytes_per_s"] = impl.bytes_per_elem * numel / r["median_s"]
            r["bytes_per_elem_counted"] = impl.bytes_per_elem
        results[impl.name] = r
        log(f"  {impl.name:22s} median {r['median_s'] * 1e3:8.2f} ms  spread {r['spread_pct']:5.1f} %")

    triad_bps = results["triad"]["bytes_per_s"]
    roof = {
        "triad_bytes_per_s": triad_bps,
        "params_per_s": triad_bps / ADAMW_BYTES_PER_PARAM,
        "with_write_allocate_params_per_s": triad_bps
        * TRIAD_BYTES_WITH_RFO
        / TRIAD_BYTES
        / ADAMW_BYTES_PER_PARAM,
        "axpy_params_per_s": results["axpy"]["bytes_per_s"] / ADAMW_BYTES_PER_PARAM,
        "definition": "roof = triad bytes/s (12 B per element, STREAM count) / 28 B per fp32 AdamW parameter",
    }
    mem_pps = results[headline]["params_per_s"]
    targets: dict[str, Any] = {
        "headline": headline,
        "vs_roof": {"ratio": mem_pps / roof["params_per_s"], "target": 0.80},
        "vs_roof_with_write_allocate": {"ratio": mem_pps / roof["with_write_allocate_params_per_s"]},
        "vs_roof_axpy": {"ratio": mem_pps / roof["axpy_params_per_s"]},
        "vs_torch_fused": {"ratio": mem_pps / results["torch_fused"]["params_per_s"]},
    }
    targets["vs_roof"]["met"] = targets["vs_roof"]["ratio"] >= 0.80
    if "deepspeed_param" in results:
        targets["vs_deepspeed"] = {
            "ratio": mem_pps / results["deepspeed_param"]["params_per_s"],
            "target": 0.95,
            "against": "deepspeed_param",
        }
        targets["vs_deepspeed"]["met"] = targets["vs_deepspeed"]["ratio"] >= 0.95
        # Contention from other processes only ever adds time, so the best-of-N ratio is the robust check.
        targets["vs_deepspeed"]["ratio_of_min_times"] = (
            results["deepspeed_param"]["min_s"] / results[headline]["min_s"]
        )
        ds_chunk = next(k for k in results if k.startswith("deepspeed_chunk"))
        targets["vs_deepspeed_chunked"] = {
            "ratio": mem_pps / results[ds_chunk]["params_per_s"],
            "against": ds_chunk,
        }
    else:
        targets["vs_deepspeed"] = {"ratio": None, "target": 0.95, "met": None, "why": ds_info.get("error")}

    threads: dict[str, Any] = {}
    counts = thread_counts if thread_counts is not None else sorted({1, threads_default})
    if counts:
        by_name = {i.name: i for i in order}
        study = [
            by_name[n] for n in (headline, "torch_fused", "deepspeed_param", "triad", "axpy") if n in by_name
        ]
        log(f"threads study at {list(counts)}")
        threads = threads_study(study, counts, thread_repeats)
        threads["repeats"] = thread_repeats
    pool: dict[str, Any] = {}
    pool_counts = list(dict.fromkeys(range(1, threads_default + 1) if pool_threads is None else pool_threads))
    if pool_counts and pool_repeats > 0:
        # The step's update (one call per chunk, one tensor per parameter part: HybridAdamW._adamw), the flat
        # chunks, and the roof, each on the step's own worker (HostUpdates) at t threads.
        by_name = {i.name: i for i in order}
        log(f"pool study (the step's worker) at {pool_counts} threads")
        pool = pool_study([params_timed, mem[head]], [by_name["triad"], by_name["axpy"]], numel, pool_counts,
                          pool_repeats)
        for t, row in pool["by_threads"].items():
            fr = row["update_vs_roof"][params_timed.name]
            pr = row["roof"]
            log(f"  t={t:>2} (worker ran {row['worker_threads']}): update {fr['mparams_per_s']:8.1f} "
                f"M params/s, triad {pr['triad_gb_per_s']:6.2f} GB/s, roof {pr['mparams_per_s']:8.1f} "
                f"M params/s, {fr['fraction_of_roof']:.2f} of it ({fr['fraction_of_roof_paired']:.2f} "
                f"paired, {fr['fraction_of_roof_with_write_allocate']:.2f} with write-allocate)")
    layout: dict[str, Any] = {}
    if counts and layout_repeats > 0:
        log(f"layout study (aligned vs staggered buffers) at {list(counts)} threads")
        layout = layout_study(numel, min(chunk_numel, numel), counts, layout_repeats)
    contention: dict[str, Any] = {}
    if counts and contention_repeats > 0:
        # Every memsched chunk size: the cost under contention should follow the number of chunks.
        study = [i for i in order if i.kind == "adamw" and i.name not in ("torch_foreach", "torch_forloop")]
        log(f"contention study (1 busy-loop process) at {list(counts)} threads")
        contention = contention_study(study, counts, contention_repeats)

    return {
        "config": {
            "numel": numel,
            "bytes_per_fp32_array": 4 * numel,
            "hidden": hidden,
            "tensors": len(shapes),
            "largest_tensor_numel": max(numels),
            "smallest_tensor_numel": min(numels),
            "chunk_numel_headline": min(chunk_numel, numel),
            "chunk_sizes": sizes,
            "repeats": repeats,
            "numerics_steps": NUMERICS_STEPS,
            "hyperparameters": HYPER,
            "torch_threads": threads_default,
            "order": [i.name for i in order],
            "grads": "one shared read-only flat buffer (per-parameter grads are views of it)",
        },
        "load_avg_start": list(load_start),
        "load_avg_end": list(os.getloadavg()),
        "load_avg_1min_per_round": load_rounds,
        "others_cpu_share_per_round": others_rounds,
        "available_memory_bytes_start": free_start,
        "wait_for_quiet": quiet,
        "deepspeed": ds_info,
        "numerics": numerics,
        "results": results,
        "roof": roof,
        "targets": targets,
        "threads_study": threads,
        "pool_study": pool,
        "layout_study": layout,
        "contention_study": contention,
    }


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _mi(n: int) -> str:
    """Chunk size label: ``8M`` for 8 Mi elements, else the exact count (tiny smoke runs)."""
    return f"{n // MI}M" if n % MI == 0 else str(n)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=64 * MI, help="fp32 parameters per implementation (64 Mi)")
    ap.add_argument("--repeats", type=int, default=21, help="interleaved timed rounds (21)")
    ap.add_argument("--hidden", type=int, default=1024, help="GPT width for the per-parameter shapes (1024)")
    ap.add_argument("--chunk-numel", type=int, default=8 * MI, help="memsched headline chunk elements (8 Mi)")
    ap.add_argument(
        "--chunk-sweep",
        type=int,
        nargs="*",
        default=[MI, 4 * MI, 16 * MI, 64 * MI],
        help="other chunk sizes in elements",
    )
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's CPU Adam")
    ap.add_argument(
        "--deepspeed-fresh-build",
        action="store_true",
        help="build DeepSpeed's op in an empty extensions dir to time the build",
    )
    ap.add_argument("--no-reference", action="store_true", help="skip torch foreach / for-loop AdamW")
    ap.add_argument(
        "--threads",
        type=int,
        nargs="*",
        default=None,
        help="torch thread counts for the threads study (default: 1 and the current count)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before timing, wait up to this many seconds until other processes use < 5%% of the cores",
    )
    ap.add_argument(
        "--layout-repeats",
        type=int,
        default=5,
        help="rounds of the aligned/staggered layout study (5; 0 skips)",
    )
    ap.add_argument(
        "--contention-repeats", type=int, default=3, help="rounds with a competing busy process (3; 0 skips)"
    )
    ap.add_argument(
        "--pool-threads",
        type=int,
        nargs="*",
        default=None,
        help="worker thread counts for the pool study (default: 1..the current count; none skips)",
    )
    ap.add_argument("--pool-repeats", type=int, default=5, help="rounds of the pool study (5; 0 skips)")
    ap.add_argument("--no-pool-study", action="store_true", help="skip the pool study")
    ap.add_argument("--name", default="cpu_adam", help="result name: bench/results/<name>.json")
    args = ap.parse_args(argv)
    payload = run(
        numel=args.numel,
        repeats=args.repeats,
        hidden=args.hidden,
        chunk_numel=args.chunk_numel,
        chunk_sweep=args.chunk_sweep,
        deepspeed=not args.no_deepspeed,
        deepspeed_fresh_build=args.deepspeed_fresh_build,
        reference=not args.no_reference,
        thread_counts=args.threads,
        contention_repeats=args.contention_repeats,
        layout_repeats=args.layout_repeats,
        pool_threads=[] if args.no_pool_study else args.pool_threads,
        pool_repeats=args.pool_repeats,
        wait_quiet_s=args.wait_quiet,
        log=lambda s: print(s, flush=True),
    )
    path = write_result(args.name, payload)
    t = payload["targets"]
    vs_ds = t["vs_deepspeed"]["ratio"]
    print(
        f"memsched ({t['headline']}): {t['vs_roof']['ratio']:.2f}x the triad roof, "
        f"{'n/a' if vs_ds is None else f'{vs_ds:.2f}x'} DeepSpeed; numerics ok={payload['numerics']['ok']}"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
