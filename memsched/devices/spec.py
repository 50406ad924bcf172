"""Which device memsched computes on, and how much memory it has.

``device`` strings: ``"cuda"`` / ``"cuda:N"`` (a real GPU), ``"cpu"`` (no accelerator: host and device memory
are the same, every chunk stays where it is), ``"sim:8GiB"`` (the stand-in accelerator of
:mod:`memsched.devices.simdevice`: tensors on the CPU, capacity accounted and enforced like a GPU's). ``None``
means ``"cuda"`` when CUDA is available, else ``"cpu"``.

``"sim:8GiB,host=2GiB"`` also gives the stand-in machine's host memory: the plan's host part must fit it (as
well as the real machine's available memory, see :mod:`memsched.devices.host_memory`), so the host-memory
check can be exercised on any machine, whatever its RAM.

``"sim:8GiB,gpu=h200"`` names the GPU the stand-in stands for (:mod:`memsched.devices.gpus`): the step-time
prediction after warmup then uses that GPU's FLOP/s (:mod:`memsched.planning.step_model`), as it does on a
real GPU found in the table. It changes nothing else (the capacity is the given size).

``"sim:8GiB,link=25GBps"`` models the host link: the stand-in's H2D and D2H copies then run on copy threads,
one per direction, and each takes ``bytes / bandwidth`` (:mod:`memsched.devices.transfers`), so the cost of
the transfers and the stalls they cause show on a machine without a GPU. Bandwidths are bytes per second,
``GBps``/``GB/s`` decimal (10**9), ``GiBps``/``GiB/s`` binary (2**30), likewise K, M, T. Without ``link=``
the stand-in copies synchronously, at the CPU's speed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import psutil
import torch

from policies.units import parse_positive_bytes

ALLOWED = ("'cuda', 'cuda:N', 'cpu', 'sim:SIZE', optionally with ',host=SIZE', ',link=BANDWIDTH' and "
           "',gpu=NAME' (e.g. 'sim:8GiB', 'sim:8GiB,host=2GiB', 'sim:8GiB,link=25GBps', 'sim:8GiB,gpu=h200'; "
           "units B, KiB, MiB, GiB, KB, MB, GB; "
           "bandwidths 25GBps, 25GB/s, 12GiBps, 12GiB/s, 800MBps) or None")
LINK_FORMS = ("a number of bytes per second: 25GBps, 25GB/s, 12GiBps, 12GiB/s, 800MBps (KB, MB, GB, TB are "
              "powers of 10**3; KiB, MiB, GiB, TiB of 2**10; B alone is bytes)")


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed compute device.

    Attributes:
        kind: ``"cuda"``, ``"cpu"`` or ``"sim"``.
        torch_device: where the tensors live (``sim:0``: the stand-in, :mod:`memsched.devices.sim_backend`).
        capacity_bytes: memory usable by this process, bytes (CUDA: :func:`usable_bytes` at attach, without
            the CUDA context and other processes, capped by the per-process memory fraction when one is set;
            cpu: the machine's memory; sim: the given size).
        name: the device name in traces (``"cuda:0"``, ``"cpu"``, ``"sim:0"``).
        host_capacity_bytes: the stand-in machine's host memory (``sim:SIZE,host=SIZE``), bytes; ``None``
            elsewhere (the real machine's memory is read when planning, :mod:`memsched.devices.host_memory`).
        link_bytes_per_s: the stand-in's modelled host link (``sim:SIZE,link=25GBps``), bytes per second;
            ``None``: copies are synchronous (and on CUDA the real link is used).
        gpu: the GPU table's name of this device (:mod:`memsched.devices.gpus`): CUDA's, when the table
            knows it; the stand-in's ``gpu=NAME``; else ``None``.
    """

    kind: str
    torch_device: torch.device
    capacity_bytes: int
    name: str
    host_capacity_bytes: int | None = None
    link_bytes_per_s: float | None = None
    gpu: str | None = None

    @property
    def is_sim(self) -> bool:
        return self.kind == "sim"


def usable_bytes(total: int, free: int, reserved: int, fraction: float | None = None) -> int:
    """Device memory this process can still fill, bytes: what is free plus what its own caching allocator
    holds (``free + reserved``: the CUDA context, other processes and memory held outside the allocator are
    not usable), and at most ``fraction * total`` when a per-process memory fraction is set."""
    usable = free + reserved
    if fraction is not None:
        usable = min(usable, int(total * fraction))
    return int(max(0, usable))


def cuda_capacity_bytes(device: torch.device) -> int:
    """:func:`usable_bytes` of a CUDA device now. The per-process fraction
    (``torch.cuda.set_per_process_memory_fraction``) is read where this torch exposes it (torch >= 2.5 has
    ``get_per_process_memory_fraction``); with an older torch a fraction set by the user is not seen."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = None
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer torch only
    if get_fraction is not None:
        try:
            fraction = float(get_fraction(device))
        except (RuntimeError, TypeError, ValueError):
            fraction = None
    return usable_bytes(int(total), int(free), int(torch.cuda.memory_reserved(device)), fraction)


def _parse_size(device: str, what: str, text: str) -> int:
    """``text`` as bytes > 0; errors name the device string, ``what`` the size is, and the allowed forms."""
    if not text.strip():
        raise ValueError(f"device {device!r} lacks a size for {what}; allowed: {ALLOWED}")
    try:
        return parse_positive_bytes(text)
    except ValueError as e:
        raise ValueError(f"bad device {device!r}: {what}: {e}; allowed: {ALLOWED}") from None


_BANDWIDTH_RE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)([iI]?)([Bb])\s*(?:ps|/s)\s*$")
_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_bandwidth(text: str) -> float:
    """A link bandwidth such as ``"25GBps"``, ``"25GB/s"``, ``"12GiBps"`` or ``"800 MB/s"``, in bytes per
    second (> 0, finite). Decimal prefixes are powers of 10**3, binary ones (``KiB``...) of 2**10.

    Raises:
        ValueError: anything else (the message names the text and the allowed forms); ``b`` (bits, as in
            ``25Gbps``) is refused with the byte equivalent.
    """
    m = _BANDWIDTH_RE.match(str(text))
    if m is None:
        raise ValueError(f"cannot parse bandwidth {text!r}: expected {LINK_FORMS}")
    number, prefix, binary, unit = m.group(1), m.group(2).lower(), m.group(3), m.group(4)
    if binary and not prefix:
        raise ValueError(f"cannot parse bandwidth {text!r}: expected {LINK_FORMS}")
    if unit == "b":
        raise ValueError(f"bandwidth {text!r} is in bits per second; give bytes per second (e.g. "
                         f"'{float(number) / 8:g}{prefix.upper()}{binary}Bps' for {text.strip()!r}): "
                         f"{LINK_FORMS}")
    value = float(number) * (1024 if binary else 1000) ** _PREFIX[prefix]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"bandwidth {text!r} must be > 0 and finite: {LINK_FORMS}")
    return value


def _parse_sim(device: str, spec: str) -> DeviceSpec:
    """``SIZE`` then any of ``,host=SIZE``, ``,link=BANDWIDTH`` and ``,gpu=NAME`` after ``sim:``."""
    size, sep, rest = spec.partition(",")
    cap = _parse_size(device, "the capacity", size)
    options: dict[str, str] = {}
    for item in rest.split(",") if sep else []:
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if key not in ("host", "link", "gpu") or not eq:
            raise ValueError(f"bad device {device!r}: after the size the stand-in takes only 'host=SIZE' "
                             f"(its host memory), 'link=BANDWIDTH' (its modelled host link) and 'gpu=NAME' "
                             f"(the GPU it stands for), got {item.strip()!r}; allowed: {ALLOWED}")
        if key in options:
            raise ValueError(f"bad device {device!r}: {key}= is given twice; allowed: {ALLOWED}")
        options[key] = value
    host = _parse_size(device, "the host memory (host=SIZE)", options["host"]) if "host" in options else None
    link = None
    if "link" in options:
        if not options["link"].strip():
            raise ValueError(f"device {device!r} lacks a bandwidth for the host link (link=BANDWIDTH); "
                             f"allowed: {LINK_FORMS}")
        try:
            link = parse_bandwidth(options["link"])
        except ValueError as e:
            raise ValueError(f"bad device {device!r}: the host link (link=BANDWIDTH): {e}") from None
    gpu = None
    if "gpu" in options:
        from memsched.devices.gpus import GPUS, gpu_names

        gpu = options["gpu"].strip().lower()
        if gpu not in GPUS:
            raise ValueError(f"bad device {device!r}: unknown GPU {options['gpu'].strip()!r} in gpu=NAME; "
                             f"known GPUs: {', '.join(gpu_names())}")
    from memsched.devices import sim_backend

    sim_backend.load()
    return DeviceSpec("sim", torch.device(sim_backend.NAME, 0), cap, "sim:0", host, link, gpu)


def parse_device(device: str | torch.device | None) -> DeviceSpec:
    """Parse a ``device`` argument of :func:`memsched.attach`.

    Raises:
        ValueError: the text is none of the allowed forms (the message names it and lists them), a CUDA device
            was asked for without CUDA, the CUDA index is out of range, or a ``sim`` size (capacity or
            ``host=``) is not > 0.
        RuntimeError: ``cuda`` in a process that loaded the stand-in, or ``sim`` in one that uses CUDA
            ([Note: one accelerator per process] in :mod:`memsched.devices.sim_backend`).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise ValueError(f"device must be one of {ALLOWED}; got {device!r}")
    text = device.strip()
    low = text.lower()
    if low.startswith("sim:") or low == "sim":
        return _parse_sim(device, text[4:] if low.startswith("sim:") else "")
    if low == "cpu":
        return DeviceSpec("cpu", torch.device("cpu"), int(psutil.virtual_memory().total), "cpu")
    if low == "cuda" or low.startswith("cuda:"):
        try:
            dev = torch.device(low)
        except RuntimeError:
            raise ValueError(f"bad device {device!r}; allowed: {ALLOWED}") from None
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} needs CUDA, but CUDA is not available here "
                             "(torch.cuda.is_available() is False); use 'cpu' or a stand-in such as "
                             "'sim:8GiB'")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices "
                             f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
        from memsched.devices import sim_backend

        sim_backend.check_cuda_autograd()
        dev = torch.device("cuda", index)
        from memsched.devices.gpus import gpu_for_device_name

        known = gpu_for_device_name(torch.cuda.get_device_name(dev))
        return DeviceSpec("cuda", dev, cuda_capacity_bytes(dev), str(dev), gpu=known.name if known else None)
    raise ValueError(f"bad device {device!r}; allowed: {ALLOWED}")
