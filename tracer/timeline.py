"""The tracer's output: a list of memory samples plus the queries the rest of memsched needs.

A :class:`MemoryTimeline` is plain data (no tensors, no torch import needed to read one), saved as
versioned JSON (``schema = "memsched.timeline"``, ``version = 2``) that round-trips losslessly. Version 2
added each sample's ``peak_non_model_grad_bytes``; version 1 files are read (without it).
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from tracer.categories import ALL_CATEGORIES, MODEL_DATA, NON_MODEL_DATA, Category

SCHEMA = "memsched.timeline"
VERSION = 2
READABLE_VERSIONS = (1, 2)

PHASES = ("forward", "backward", "optimizer", "other")
EVENTS = ("pre", "post", "mark")


@dataclass
class Sample:
    """One measurement, taken at a hook.

    Attributes:
        t_ns: monotonic time in nanoseconds since the tracer was entered.
        step: training step index (0-based; a step ends when the optimizer step ends).
        phase: one of ``forward``, ``backward``, ``optimizer``, ``other``.
        module: qualified module name from ``named_modules`` (``""`` is the root; the optimizer's
            class name in the optimizer phase).
        event: ``pre`` (before the module/phase ran), ``post`` (after) or ``mark`` (a free-standing mark).
        device: ``"cpu"``, ``"cuda:0"``, ``"sim"`` ...
        bytes: live bytes per category name (see :class:`tracer.Category`) at the sample, in bytes.
        peak_bytes: peak of all live bytes on the device since the previous sample of this device, in bytes.
        peak_non_model_bytes: peak of non-model bytes on the device since the previous sample, in bytes.
        cuda: on CUDA only: ``allocated``, ``peak_allocated`` (the allocator's high-water mark), ``reserved``
            (caching allocator) and ``nvml_used`` (device-level, all processes), in bytes; else ``None``.
        peak_non_model_grad_bytes: peak of non-model bytes plus gradient bytes on the device since the
            previous sample, in bytes: what the device holds at once besides parameters, buffers and optimizer
            state when gradients come and go (``None`` in version-1 files).
    """

    t_ns: int
    step: int
    phase: str
    module: str
    event: str
    device: str
    bytes: dict[str, int]
    peak_bytes: int
    peak_non_model_bytes: int
    cuda: dict[str, int] | None = None
    peak_non_model_grad_bytes: int | None = None

    @property
    def model_bytes(self) -> int:
        return sum(self.bytes.get(c.value, 0) for c in MODEL_DATA)

    @property
    def non_model_bytes(self) -> int:
        return sum(self.bytes.get(c.value, 0) for c in NON_MODEL_DATA)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


@dataclass
class ModuleStats:
    """Per-module memory figures derived from the samples (all in bytes).

    ``activation_bytes``: activation bytes still live after the module's forward that were not live before it
    (kept for backward), largest over the module's calls in one step; ``backward_peak_bytes``: peak of
    non-model bytes while the module's backward ran; ``calls``: forward calls seen over the trace.
    """

    name: str
    calls: int = 0
    activation_bytes: int = 0
    backward_peak_bytes: int = 0
    forward_peak_bytes: int = 0


@dataclass
class MemoryTimeline:
    """Samples of one traced run (one process / rank) and queries over them.

    ``meta`` holds free-form facts: ``device`` (the traced device), ``backend`` (``tensor`` / ``cuda``),
    ``torch_version``, ``rank``, ``world_size``, ``capacity_bytes`` (when known), ``steps``, ``flops`` (the
    floating-point operations of every traced step together: matrix products, convolutions, attention, by
    torch's ``torch.utils.flop_counter`` formulas).
    """

    samples: list[Sample] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        """The traced (compute) device: ``meta["device"]`` or, failing that, the first sampled device."""
        if "device" in self.meta:
            return str(self.meta["device"])
        return self.samples[0].device if self.samples else "cpu"

    def devices(self) -> list[str]:
        return sorted({s.device for s in self.samples})

    def for_device(self, device: str | None = None) -> list[Sample]:
        dev = device or self.device
        return [s for s in self.samples if s.device == dev]

    def peak_non_model_bytes(self, device: str | None = None) -> int:
        """Peak non-model data (activations + temporaries + other) on ``device`` (default: traced device),
        bytes."""
        samples = self.for_device(device)
        return max((s.peak_non_model_bytes for s in samples), default=0)

    def peak_non_model_grad_bytes(self, device: str | None = None) -> int:
        """Peak of non-model data plus gradients on ``device`` (default: traced device), bytes: the most the
        device held at once besides parameters, buffers and optimizer state. A version-1 sample, which lacks
        the figure, counts its interval's non-model peak plus the gradients live at the sample."""
        samples = self.for_device(device)
        return max((s.peak_non_model_grad_bytes if s.peak_non_model_grad_bytes is not None
                    else s.peak_non_model_bytes + s.bytes.get("gradient", 0) for s in samples), default=0)

    def peak_non_model_sample(self, device: str | None = None) -> Sample | None:
        """The sample that closes the interval in which the non-model peak occurred (module + phase of the
        peak)."""
        samples = self.for_device(device)
        return max(samples, key=lambda s: s.peak_non_model_bytes, default=None)

    def peak_non_model_interval(self, device: str | None = None) -> tuple[Sample | None, Sample | None]:
        """``(opening, closing)``: the samples around the interval that holds the non-model peak; the peak
        happened after ``opening`` (``None`` if it is the first interval) and no later than ``closing``.
        Both ``None`` for an empty timeline."""
        samples = self.for_device(device)
        if not samples:
            return None, None
        i = max(range(len(samples)), key=lambda k: samples[k].peak_non_model_bytes)
        return (samples[i - 1] if i else None), samples[i]

    def peak_bytes(self, device: str | None = None) -> int:
        return max((s.peak_bytes for s in self.for_device(device)), default=0)

    def model_data_bytes(self, device: str | None = None) -> dict[str, int]:
        """Largest live bytes seen per model-data category on ``device``, bytes."""
        samples = self.for_device(device)
        return {c.value: max((s.bytes.get(c.value, 0) for s in samples), default=0) for c in ALL_CATEGORIES
                if c in MODEL_DATA}

    def steps(self) -> list[int]:
        return sorted({s.step for s in self.samples})

    def module_stats(self, device: str | None = None) -> list[ModuleStats]:
        """Per-module figures, in first-call order (see :class:`ModuleStats`).

        Linear in the number of samples: the peak over the samples between a module's pre and post event is
        a range maximum, answered with a monotonic stack (decreasing peaks) and a binary search on it.
        """
        stats: dict[str, ModuleStats] = {}
        open_fwd: dict[str, list[int]] = {}
        open_bwd: dict[str, list[int]] = {}
        samples = self.for_device(device)
        stack_idx: list[int] = []  # sample indices, increasing; their peaks strictly decreasing
        stack_val: list[int] = []

        def peak_after(j: int) -> int:  # max peak_non_model_bytes over samples (j, newest]
            return stack_val[bisect.bisect_right(stack_idx, j)]

        act = Category.ACTIVATION.value
        for i, s in enumerate(samples):
            v = s.peak_non_model_bytes
            while stack_val and stack_val[-1] <= v:
                stack_val.pop()
                stack_idx.pop()
            stack_idx.append(i)
            stack_val.append(v)
            if s.phase == "forward":
                st = stats.setdefault(s.module, ModuleStats(s.module))
                if s.event == "pre":
                    st.calls += 1
                    open_fwd.setdefault(s.module, []).append(i)
                elif s.event == "post" and open_fwd.get(s.module):
                    j = open_fwd[s.module].pop()
                    kept = s.bytes.get(act, 0) - samples[j].bytes.get(act, 0)
                    st.activation_bytes = max(st.activation_bytes, kept)
                    st.forward_peak_bytes = max(st.forward_peak_bytes, peak_after(j))
            elif s.phase == "backward" and s.module in stats:
                st = stats[s.module]
                if s.event == "pre":
                    open_bwd.setdefault(s.module, []).append(i)
                elif s.event == "post" and open_bwd.get(s.module):
                    j = open_bwd[s.module].pop()
                    st.backward_peak_bytes = max(st.backward_peak_bytes, peak_after(j))
        return list(stats.values())

    def peak_non_model_by_phase(self, device: str | None = None) -> dict[str, int]:
        """Largest ``peak_non_model_bytes`` of the samples of each phase (a sample's phase is the phase at the
        hook that closed its interval), bytes; phases without samples are left out."""
        out: dict[str, int] = {}
        for s in self.for_device(device):
            if s.peak_non_model_bytes > out.get(s.phase, -1):
                out[s.phase] = s.peak_non_model_bytes
        return out

    def summary(self, device: str | None = None) -> dict[str, Any]:
        """Headline figures of ``device`` (default: traced device), all sizes in bytes:
        ``peak_non_model_bytes`` and where it occurred (``peak_module``, ``peak_phase``, ``peak_step``,
        ``peak_event``: the sample that closes the interval holding the peak; ``peak_after_module`` and
        ``peak_after_event``: the sample that opens it), ``peak_bytes`` (all
        categories), ``model_data_bytes`` (largest live bytes per model-data category),
        ``peak_non_model_by_phase``, ``steps`` (``meta["steps"]`` when known) and ``samples``."""
        dev = device or self.device
        opening, peak = self.peak_non_model_interval(dev)
        return {
            "device": dev,
            "samples": len(self.for_device(dev)),
            "steps": int(self.meta.get("steps", len(self.steps()))),
            "peak_non_model_bytes": peak.peak_non_model_bytes if peak else 0,
            "peak_module": peak.module if peak else None,
            "peak_phase": peak.phase if peak else None,
            "peak_step": peak.step if peak else None,
            "peak_event": peak.event if peak else None,
            "peak_after_module": opening.module if opening else None,
            "peak_after_event": opening.event if opening else None,
            "peak_bytes": self.peak_bytes(dev),
            "model_data_bytes": self.model_data_bytes(dev),
            "peak_non_model_by_phase": self.peak_non_model_by_phase(dev),
        }

    def extend(self, samples: Iterable[Sample]) -> None:
        self.samples.extend(samples)

    # ---- serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "version": VERSION, "meta": self.meta,
                "samples": [asdict(s) for s in self.samples]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryTimeline:
        """Build a timeline from :meth:`to_dict` output.

        Raises:
            ValueError: not a memsched timeline, a version this release cannot read, or a malformed sample
                (names what is wrong and what is expected).
        """
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            got = (repr(data.get("schema")) if isinstance(data, dict) and "schema" in data
                   else "no 'schema' key" if isinstance(data, dict) else f"a JSON {_json_type(data)}")
            raise ValueError(f"not a memsched timeline: expected schema {SCHEMA!r}, got {got}")
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"unsupported timeline version {data.get('version')!r}: "
                             f"this release reads {', '.join(map(str, READABLE_VERSIONS))}")
        samples, meta = data.get("samples"), data.get("meta", {})
        if not isinstance(samples, list):
            raise ValueError(f"'samples' must be a list, got {_json_type(samples)}")
        if not isinstance(meta, dict):
            raise ValueError(f"'meta' must be an object, got {_json_type(meta)}")
        return cls(samples=[_sample_from_dict(s, i) for i, s in enumerate(samples)], meta=dict(meta))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write versioned JSON atomically (write to a temporary file, then rename)."""
        atomic_write_text(path, json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MemoryTimeline:
        """Read a timeline written by :meth:`save`.

        Raises:
            OSError: the file cannot be read (missing, a folder, no permission).
            ValueError: the file is empty, binary, not JSON or not a timeline this release reads; the message
                names the file, what is wrong and what was expected.
        """
        name = os.fspath(path)
        with open(path, "rb") as f:
            raw = f.read()
        expected = f"expected a memsched timeline (JSON, schema {SCHEMA!r}, version {VERSION})"
        if not raw.strip():
            raise ValueError(f"{name!r} is empty; {expected}")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{name!r} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                             f"{expected}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{name!r} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}); "
                             f"{expected}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_byte_counts(value: Any, *, unknown_ok: bool = False) -> bool:
    """An object of name -> integer bytes (``unknown_ok``: or null, a figure that could not be read)."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and (_is_int(v) or (unknown_ok and v is None)) for k, v in value.items())


# Sample fields and the check each value must pass (``cuda`` is optional).
_SAMPLE_FIELDS: dict[str, tuple[Any, str]] = {
    "t_ns": (_is_int, "an integer"),
    "step": (_is_int, "an integer"),
    "phase": (lambda v: isinstance(v, str), "a string"),
    "module": (lambda v: isinstance(v, str), "a string"),
    "event": (lambda v: isinstance(v, str), "a string"),
    "device": (lambda v: isinstance(v, str), "a string"),
    "bytes": (_is_byte_counts, "an object of category -> integer bytes"),
    "peak_bytes": (_is_int, "an integer"),
    "peak_non_model_bytes": (_is_int, "an integer"),
    # nvml_used is null when NVML could not be read
    "cuda": (lambda v: v is None or _is_byte_counts(v, unknown_ok=True),
             "null or an object of name -> integer bytes or null"),
    "peak_non_model_grad_bytes": (lambda v: v is None or _is_int(v), "null or an integer"),
}
_OPTIONAL_FIELDS = ("cuda", "peak_non_model_grad_bytes")


def _sample_from_dict(d: Any, i: int) -> Sample:
    """One saved sample, checked (a bad one would otherwise fail far from here, in a report)."""
    if not isinstance(d, dict):
        raise ValueError(f"sample {i} must be an object, got {_json_type(d)}")
    missing = [k for k in _SAMPLE_FIELDS if k not in d and k not in _OPTIONAL_FIELDS]
    unknown = sorted(k for k in d if k not in _SAMPLE_FIELDS)
    if missing or unknown:
        problems = ([f"lacks {', '.join(map(repr, missing))}"] if missing else []) + (
            [f"has unknown {', '.join(map(repr, unknown))}"] if unknown else [])
        raise ValueError(f"sample {i} {' and '.join(problems)}; expected the fields "
                         f"{', '.join(_SAMPLE_FIELDS)} ({' and '.join(_OPTIONAL_FIELDS)} optional)")
    for key, value in d.items():
        check, what = _SAMPLE_FIELDS[key]
        if not check(value):
            raise ValueError(f"sample {i}: {key!r} must be {what}, got {value!r}")
    return Sample(**d)


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename, so an interrupted
    write (Ctrl-C) never leaves a half-written file behind. The file's mode follows the umask, like
    ``open()``'s."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a file we write gets the user's usual mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
