"""The stand-in accelerator as a PyTorch device, ``torch.device("sim")``.

A PrivateUse1 backend (``sim_backend.cpp`` beside this file), built with ``torch.utils.cpp_extension.load``
at first use and cached (once per machine and torch version). Its memory is host
memory, but its tensors are device tensors: ``p.device`` is ``sim:0``, ``p.is_sim`` is true, and an op that
mixes a device tensor with a CPU tensor (other than a zero-dim scalar) raises torch's
"Expected all tensors to be on the same device" error, as CUDA does. So code that would fail on a GPU fails
on a laptop or CI first.

What it models (bytes, always): the device's capacity (an allocation beyond it raises memsched's
:class:`~memsched.devices.simdevice.SimOutOfMemoryError`, a ``torch.OutOfMemoryError`` with the bytes
requested, in use and the capacity), allocations rounded like the CUDA caching allocator's blocks (512 B),
live and peak allocated bytes (:func:`memory_allocated`, :func:`max_memory_allocated`), and pinned host memory
(``tensor.pin_memory()``, :func:`pinned_empty`, and ``torch.empty(..., pin_memory=True)`` where CUDA is not
available; ``is_pinned()`` holds for the buffer and
its views) counted in whole pages, as ``cudaHostRegister`` pins memory (:mod:`memsched.devices.pinned`),
with an optional host capacity. Streams and events are no-ops: copies are
synchronous (memsched's copy threads model the link, :mod:`memsched.devices.transfers`). Random ops use the
CPU's generator, so ``torch.manual_seed`` seeds the stand-in.

The idea follows PyTorch's PrivateUse1 extension point and its OpenReg example backend.

Tensors move between host and device in place (``p.data = host_tensor``, ``module.to("sim")``), as between
the CPU and CUDA: see [Note: the stand-in and `p.data = ...`] in the C++ source.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

NAME = "sim"
_SOURCE = Path(__file__).with_name("sim_backend.cpp")
# device-typed views of host memory ([Note: parameters read where they compute] in
# memsched.devices.host_alias), built into the same extension
_SOURCES = (_SOURCE, Path(__file__).with_name("host_alias.cpp"))
_lock = threading.Lock()
_loaded = False
_autograd_ok = False  # a backward on the stand-in ran (see _check_autograd_threads)
_pinned_ready = False  # torch initialised the stand-in as its accelerator (see pinned_empty)


class SimBackendBuildError(RuntimeError):
    """The stand-in device's C++ backend could not be built (no compiler, no ninja, a build error)."""


def _missing_tools() -> list[str]:
    missing = []
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        missing.append("a C++ compiler (Debian/Ubuntu: `apt-get install g++`; macOS: "
                       "`xcode-select --install`)")
    try:
        import ninja  # noqa: F401
    except ImportError:
        if shutil.which("ninja") is None:
            missing.append("ninja (`pip install ninja`)")
    return missing


def load(*, check_autograd: bool = True) -> None:
    """Build (first use) or load the backend and register it as ``torch.device("sim")`` (idempotent,
    thread-safe). ``check_autograd``: run one backward on the device, so that autograd can: where the
    process's first backward ran before the stand-in could reserve its autograd queue, the stand-in's
    backward runs on the calling thread from then on ([Note: a backward on the stand-in, in any load
    order]); ``False`` in a process that forks workers which use autograd (a fork server), since autograd
    refuses to run in a process forked after its threads started.

    Raises:
        SimBackendBuildError: no C++ compiler or ninja (the message says which command installs it), the
            build failed (the compiler's output is in the message), or another process held the build lock
            longer than :func:`build_wait_seconds` (the message names the lock file, its holder, and what to
            do; [Note: the build lock]).
        ValueError: ``MEMSCHED_SIM_BUILD_WAIT`` is not a positive number of seconds.
        RuntimeError: this process already renamed the PrivateUse1 backend to another name, or it already
            uses CUDA (see [Note: one accelerator per process]), or a backward cannot run on the stand-in
            (:func:`_check_autograd_threads`).
    """
    global _loaded
    if _loaded:
        if check_autograd:
            _check_autograd_threads()
        return
    with _lock:
        if _loaded:
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized() and _has_accelerator_api():
            raise RuntimeError(
                "memsched's stand-in device (device='sim:SIZE') cannot be loaded in a process that already "
                "uses CUDA: torch then takes it as the process's accelerator, and every later backward over "
                "CUDA tensors fails inside torch's autograd engine (pytorch/pytorch#161129). Use the "
                "stand-in in a process of its own, or train on 'cuda'")
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            raise RuntimeError(f"memsched's stand-in device needs torch's PrivateUse1 backend, which this "
                               f"process already named {current!r}: one PrivateUse1 backend per process")
        missing = _missing_tools()
        if missing:
            raise SimBackendBuildError(
                "memsched's stand-in device (device='sim:SIZE') is a small C++ extension built at first use, "
                "and this machine lacks " + " and ".join(missing))
        from torch.utils import cpp_extension

        build_dir = Path(cpp_extension._get_build_directory("memsched_sim", verbose=False))
        _build_and_load(cpp_extension, build_dir, build_wait_seconds())
        torch.ops.memsched_sim.use_cpu_numerics()
        _use_memscheds_out_of_memory_error()
        from memsched.runtime.compile_stance import route_inductor_around_the_stand_in

        route_inductor_around_the_stand_in(NAME)  # [Note: torch.compile's default backend on the stand-in]
        if current != NAME:
            torch.utils.rename_privateuse1_backend(NAME)
            torch._register_device_module(NAME, _device_module())
            torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True,
                                                                for_packed_sequence=False,
                                                                for_storage=True)
        _loaded = True
    if check_autograd:
        _check_autograd_threads()


# [Note: the build lock]
# torch's JIT builder serializes processes on a lock file in the build directory (`<build dir>/lock`, a
# `torch.utils.file_baton.FileBaton`): the first process creates it, runs ninja (a no-op once built) and
# removes it; the others wait, with no bound, for the file to go. A process killed in between (an interrupted
# test run, an OOM kill) leaves the file behind, and every later load waited forever at 0% CPU. memsched
# loads with a baton of its own kind:
# - a lock file no process holds open (the owner keeps its file descriptor open until it removes the file;
#   on Linux /proc tells who holds it, elsewhere `lsof`), seen so twice `_STALE_RECHECK_S` apart, is stale:
#   it is taken over, under an flock of `<build dir>/memsched_takeover.lock` so that two processes never
#   take over the same lock, one the other's fresh one;
# - every wait (for the lock, for the takeover flock) ends after `build_wait_seconds()` (the environment's
#   MEMSCHED_SIM_BUILD_WAIT, default 600 s: a build takes under a minute, on a loaded machine a few) with an
#   error that names the lock file, its holder, and what to do;
# - memsched's baton removes the lock file before it closes its descriptor, so a lock file that exists is
#   always held while its owner lives.
# torch's builder looks up `FileBaton` in `torch.utils.cpp_extension` at each build, so memsched swaps in its
# baton for the duration of its own load only (under this module's lock) and puts torch's back.
_DEFAULT_BUILD_WAIT_S = 600.0
_STALE_RECHECK_S = 0.3
_HOLDERS_EVERY_S = 1.0


def build_wait_seconds() -> float:
    """How long a load waits for another process's build of the stand-in, seconds: the environment's
    ``MEMSCHED_SIM_BUILD_WAIT`` (default 600) ([Note: the build lock]).

    Raises:
        ValueError: ``MEMSCHED_SIM_BUILD_WAIT`` is not a positive number of seconds.
    """
    raw = os.environ.get("MEMSCHED_SIM_BUILD_WAIT")
    if raw is None or raw.strip() == "":
        return _DEFAULT_BUILD_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"MEMSCHED_SIM_BUILD_WAIT={raw!r}: expected a positive, finite number of seconds "
                         "to wait for another process's build of the stand-in (default 600)")
    return value


def lock_holders(path: str | os.PathLike[str]) -> list[int] | None:
    """The ids of the processes that hold ``path`` open (the build lock's owner keeps it open), or ``None``
    where this system cannot tell (no /proc and no ``lsof``, or a process of the file's owner that may not
    be inspected). ``[]`` when the file does not exist."""
    path = os.path.realpath(path)
    try:
        owner_uid = os.stat(path).st_uid
    except FileNotFoundError:
        return []
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return _lsof_holders(path)
    holders: list[int] = []
    unknown = False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
        except PermissionError:
            try:  # another user's process cannot hold a file of ours; one of the same user might
                unknown = unknown or entry.stat().st_uid == owner_uid
            except OSError:
                pass
            continue
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(entry / "fd" / fd)
            except OSError:
                continue
            if target == path:
                holders.append(int(entry.name))
                break
    return None if unknown and not holders else holders


def _lsof_holders(path: str) -> list[int] | None:
    lsof = shutil.which("lsof")
    if lsof is None:
        return None
    import subprocess

    try:
        done = subprocess.run([lsof, "-t", "--", path], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode not in (0, 1):
        return None
    return [int(x) for x in done.stdout.split() if x.isdigit()]


def _describe(pids: list[int] | None) -> str:
    """``process 123 (python -m pytest ...)`` for the lock's holders, as far as this system tells."""
    if pids is None:
        return "an owner this system cannot name"
    if not pids:
        return "no process (its owner is gone)"
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = ""
        cmd = cmd.strip()
        out.append(f"process {pid}" + (f" ({cmd[:120]})" if cmd else ""))
    return ", ".join(out)


class _StaleLock(Exception):
    """The build lock's owner went away while this process waited: load again (and take it over)."""


def _lock_inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _is_stale(path: str) -> bool:
    """The lock file exists and no process holds it, seen twice ``_STALE_RECHECK_S`` apart (the same file)."""
    first = _lock_inode(path)
    if first is None or lock_holders(path) != []:
        return False
    time.sleep(_STALE_RECHECK_S)
    return _lock_inode(path) == first and lock_holders(path) == []


def _bounded_baton(deadline: float) -> type:
    """A ``FileBaton`` whose waits end at ``deadline`` (``time.monotonic()``) and which takes over a stale
    lock ([Note: the build lock])."""
    from torch.utils.file_baton import FileBaton

    def timeout_error(lock: str, what: str) -> SimBackendBuildError:
        return SimBackendBuildError(
            f"memsched's stand-in device: gave up after waiting {build_wait_seconds():.0f} s for {what} "
            f"{lock}, held by {_describe(lock_holders(lock))}. A build of the stand-in takes under a minute "
            "(a few on a loaded machine). If that process is stuck, end it; if no build is running, delete "
            f"{lock}; to wait longer, set MEMSCHED_SIM_BUILD_WAIT=SECONDS")

    class Baton(FileBaton):  # type: ignore[misc,valid-type]
        def try_acquire(self) -> bool:
            if super().try_acquire():
                return True
            with self._takeover_mutex():
                if not _is_stale(self.lock_file_path):
                    return False
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.lock_file_path)
                return bool(super().try_acquire())

        def wait(self) -> None:
            last_check = time.monotonic()
            while os.path.exists(self.lock_file_path):
                now = time.monotonic()
                if now >= deadline:
                    raise timeout_error(self.lock_file_path, "torch's build lock")
                if now - last_check >= _HOLDERS_EVERY_S:
                    last_check = now
                    if _is_stale(self.lock_file_path):
                        raise _StaleLock(self.lock_file_path)
                time.sleep(min(self.wait_seconds, max(0.0, deadline - now)))

        def release(self) -> None:  # the file goes before the descriptor that marks it held
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.lock_file_path)
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

        @contextlib.contextmanager
        def _takeover_mutex(self) -> Iterator[None]:
            try:
                import fcntl
            except ImportError:  # no flock here: no takeover either
                yield
                return
            path = os.path.join(os.path.dirname(self.lock_file_path), "memsched_takeover.lock")
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise timeout_error(path, "the takeover lock") from None
                        time.sleep(0.05)
                yield
            finally:
                os.close(fd)  # releases the flock

    return Baton


def _build_and_load(cpp_extension: types.ModuleType, build_dir: Path, wait_s: float) -> None:
    """``cpp_extension.load`` of the stand-in with memsched's baton ([Note: the build lock]).

    Raises:
        SimBackendBuildError: the build failed, or the wait for another process's build ran out.
    """
    deadline = time.monotonic() + wait_s
    original = cpp_extension.FileBaton
    cpp_extension.FileBaton = _bounded_baton(deadline)
    try:
        for _attempt in range(3):
            try:
                cpp_extension.load(name="memsched_sim", sources=[str(p) for p in _SOURCES],
                                   extra_cflags=["-O2"], is_python_module=False, verbose=False,
                                   build_directory=str(build_dir))
                return
            except _StaleLock:
                # the owner died mid-build: load again and take its lock over; torch's builder would take
                # the build as done by this process (its in-process version record), so forget that first
                versions = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
                getattr(versions, "entries", {}).pop("memsched_sim", None)
            except SimBackendBuildError:
                raise
            except (RuntimeError, OSError, ImportError) as e:
                raise SimBackendBuildError(f"memsched's stand-in device could not be built from {_SOURCE} in "
                                           f"{build_dir}: {e}") from e
        raise SimBackendBuildError(
            f"memsched's stand-in device: the build lock {build_dir / 'lock'} was left behind three times in "
            "a row by processes that ended mid-build; load again, or delete the lock file if no build is "
            "running")
    finally:
        cpp_extension.FileBaton = original


_oom_library: object = None  # the Python kernel of memsched_sim::raise_out_of_memory, kept alive
# The error the allocator raises, made by memsched.devices.simdevice (which imports this module and registers
# its maker at import: set_out_of_memory_error); until then a plain torch.OutOfMemoryError with the numbers.
_oom_error: Callable[[int, int, int], BaseException] | None = None


def set_out_of_memory_error(make: Callable[[int, int, int], BaseException]) -> None:
    """``make(requested, in_use, capacity)`` (bytes) builds the error the stand-in's allocator raises
    (:func:`memsched.devices.simdevice.allocator_out_of_memory`)."""
    global _oom_error
    _oom_error = make


def _raise_out_of_memory(requested: int, in_use: int, capacity: int) -> None:
    """The kernel of ``memsched_sim::raise_out_of_memory``, which the stand-in's allocator calls when an
    allocation does not fit ([Note: the stand-in's out-of-memory error] in the C++ source).

    Raises:
        memsched.devices.simdevice.SimOutOfMemoryError: always (a ``torch.OutOfMemoryError``; a plain one
            with the same attributes before :mod:`memsched.devices.simdevice` is imported).
    """
    if _oom_error is not None:
        raise _oom_error(requested, in_use, capacity)
    base = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    err = base(f"sim out of memory: tried to allocate {requested} bytes on the stand-in device sim:0 with "
               f"{in_use} bytes allocated of a capacity of {capacity} bytes")
    err.requested, err.in_use, err.capacity = requested, in_use, capacity  # type: ignore[attr-defined]
    raise err


def _use_memscheds_out_of_memory_error() -> None:
    global _oom_library
    if _oom_library is None:
        lib = torch.library.Library("memsched_sim", "IMPL")  # the op is defined in the C++ source
        lib.impl("raise_out_of_memory", _raise_out_of_memory, "CompositeExplicitAutograd")
        _oom_library = lib
    torch.ops.memsched_sim.use_python_out_of_memory_errors()


# [Note: one accelerator per process]
# torch's autograd engine synchronizes a node with the streams of the process's one accelerator
# (`at::getAccelerator()`), and a registered PrivateUse1 backend takes precedence over CUDA. With the stand-in
# loaded, a CUDA node has no stream of that accelerator and any backward over CUDA tensors fails with
# "opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED" (torch >= 2.8, pytorch/pytorch#161129; seen
# on an H200 with torch 2.11, bench/results/gpu_pytest_cuda_h200.log). The registration cannot be undone, so
# memsched refuses both orders loudly: loading the stand-in where CUDA is in use (`load`), and attaching on
# CUDA where the stand-in is loaded (`check_cuda_autograd`).


def _has_accelerator_api() -> bool:
    return hasattr(torch, "accelerator") and hasattr(torch.accelerator, "current_accelerator")


def is_loaded() -> bool:
    """Whether this process registered the stand-in (see :func:`load`)."""
    return _loaded


def took_the_accelerator() -> bool:
    """Whether this process loaded the stand-in and torch names it, not CUDA, the process's accelerator: a
    backward over CUDA tensors, fake ones included, then fails inside torch's autograd engine
    ([Note: one accelerator per process])."""
    if not _loaded or not _has_accelerator_api():
        return False
    current = torch.accelerator.current_accelerator()
    return current is not None and current.type != "cuda"


def check_cuda_autograd() -> None:
    """Refuse CUDA training in a process where the stand-in took the accelerator's place
    ([Note: one accelerator per process]).

    Raises:
        RuntimeError: the stand-in is loaded and torch names it, not CUDA, the process's accelerator.
    """
    if took_the_accelerator():
        current = torch.accelerator.current_accelerator()
        raise RuntimeError(
            f"this process loaded memsched's stand-in device, so torch takes {current.type!r}, not CUDA, as "
            "its accelerator, and a backward over CUDA tensors would fail inside torch's autograd engine "
            "(pytorch/pytorch#161129). Train on CUDA in a process that does not use the stand-in "
            "(device='sim:SIZE')")


def _probe_backward() -> bool:
    """One backward on the stand-in; ``False`` where autograd has no ready queue for it (torch's internal
    assert on ``device_ready_queues_``)."""
    x = torch.ones(1, device=NAME, requires_grad=True)
    try:
        (x * 2).sum().backward()
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        return False
    return True


def _check_autograd_threads() -> None:
    """Make sure a backward runs on the stand-in ([Note: a backward on the stand-in, in any load order]):
    where autograd made its device queues before the stand-in was registered, its backward runs on the
    calling thread from now on.

    Raises:
        RuntimeError: a backward still cannot run on the stand-in (the message says what to do).
    """
    global _autograd_ok
    if _autograd_ok:
        return
    if not _probe_backward():
        torch.ops.memsched_sim.run_backward_on_caller_threads()
        if not _probe_backward():
            raise RuntimeError(
                "memsched's stand-in device (device='sim:SIZE') was loaded after this process ran its first "
                "backward, and torch's autograd, which makes its device queues at the first backward, cannot "
                "run a backward over its tensors, not even on the calling thread. Load it first: import "
                "memsched after torch and before any backward, or call memsched.devices.sim_backend.load() "
                "first")
    _autograd_ok = True
    if not backward_on_caller_threads():
        atexit.register(_let_the_device_thread_finish)


def backward_on_caller_threads() -> bool:
    """Whether the stand-in's backward runs on the thread that calls it rather than on a device thread of
    autograd's ([Note: a backward on the stand-in, in any load order]): the stand-in was loaded after the
    process's first backward."""
    return _loaded and bool(torch.ops.memsched_sim.backward_on_caller_threads())


def run_backward_on_this_thread() -> None:
    """Let this thread run a backward over stand-in tensors where the stand-in was loaded after the process's
    first backward (:func:`backward_on_caller_threads`): turns off autograd's multithreading for this thread
    (``torch.autograd.set_multithreading_enabled(False)``, thread-local). Every thread that computes on the
    stand-in does so by itself; only a thread that runs a backward over a graph made on another thread,
    with a gradient made there too, needs to call it. A no-op otherwise."""
    if backward_on_caller_threads():
        torch._C._set_multithreading_enabled(False)


# [Note: a backward on the stand-in, in any load order]
# torch's autograd engine makes its per-device ready queues once, at the process's first backward, from the
# device guards registered then (`Engine::start_device_threads`); a PrivateUse1 guard registered later has no
# queue, and a backward over its tensors fails inside the engine. Two remedies, in this order:
# 1. `reserve_autograd_queue` registers a placeholder PrivateUse1 guard (where torch has `torch._C._acc`) as
#    soon as memsched is imported with torch (`import memsched` after torch, or any memsched module that
#    imports torch), where no CUDA device exists (CUDA's guard makes the queue for device index 0 already)
#    and the PrivateUse1 name is free. The first backward then makes a queue for it, and the stand-in, loaded
#    later, replaces the placeholder with its own guard: torch.accelerator names no accelerator until then.
#    Like a CUDA machine's, such a process refuses autograd in children it forks after its first backward.
# 2. Where the first backward ran before that (torch imported and a backward run before memsched was
#    imported, or torch without `_acc`), the stand-in runs its backward on the thread that calls it, as torch
#    runs the CPU's: every thread that allocates on the stand-in or runs an op on it turns autograd's
#    multithreading off for itself (thread-local, `torch.autograd.set_multithreading_enabled(False)`), so a
#    training thread, the loading thread or any other, runs its backward. The one backward this cannot serve
#    is on a thread that touched no stand-in tensor before it: `loss.backward(gradient)` over a graph and a
#    gradient both made on another thread fails inside torch's engine ("device_ready_queues_"); call
#    `run_backward_on_this_thread()` on that thread first. The flag stays on those threads (it is part of the
#    device's registration, which cannot be undone); it changes nothing for CPU tensors, whose backward runs
#    on the calling thread anyway.
_reserved = False
_reserved_guard: object = None  # the placeholder guard (kept alive with the process)


def reserve_autograd_queue() -> bool:
    """Register a placeholder PrivateUse1 device guard so that the process's first backward makes an autograd
    queue for the stand-in, should it be loaded later ([Note: a backward on the stand-in, in any load
    order]). Cheap; idempotent. Does nothing where the stand-in is loaded, a CUDA device or another
    accelerator exists, the PrivateUse1 backend has another name, or torch has no ``torch._C._acc``
    (older torch). Returns whether the placeholder is registered."""
    global _reserved, _reserved_guard
    if _reserved or _loaded:
        return _reserved
    acc = getattr(torch._C, "_acc", None)
    register = getattr(acc, "register_python_privateuseone_device_guard", None)
    if register is None or not hasattr(acc, "DeviceGuard"):
        return False
    with _lock:
        if _reserved or _loaded or torch._C._get_privateuse1_backend_name() != "privateuseone":
            return _reserved
        if torch.cuda.device_count() > 0:  # NVML first: does not initialise CUDA
            return False
        if _has_accelerator_api() and torch.accelerator.current_accelerator() is not None:
            return False

        class _PlaceholderGuard(acc.DeviceGuard):  # type: ignore[misc,name-defined]
            def type_(self) -> object:
                return torch._C._autograd.DeviceType.PrivateUse1

        _reserved_guard = _PlaceholderGuard()
        register(_reserved_guard)
        _reserved = True
    return True


# [Note: the device thread at exit]
# Autograd runs a stand-in backward on its device thread, which drops the graph's last references after the
# caller has its gradients; dropping a tensor that has a Python object takes the GIL. If the main thread goes
# straight from its last backward into interpreter finalization, holding the GIL, that thread is made to exit
# while it waits for it, mid-unwind: "terminate called without an active exception", exit status 134, often
# in short scripts (load() alone, or one backward, then exit). Letting go of the GIL briefly at exit lets the
# waiting thread finish first. A backward at exit cannot serve: it leaves the thread with the same work
# during finalization.


def _let_the_device_thread_finish() -> None:
    for _ in range(5):
        time.sleep(0.001)


def loaded() -> bool:
    """Whether :func:`load` has run in this process."""
    return _loaded


# ---- the torch.sim module ------------------------------------------------------------------------------
def _stats() -> list[int]:
    return list(torch.ops.memsched_sim.stats())


def memory_allocated(device: object = None) -> int:
    """Bytes allocated on the stand-in now (each allocation rounded up to 512 B, as CUDA's allocator)."""
    return _stats()[0]


def max_memory_allocated(device: object = None) -> int:
    """Peak of :func:`memory_allocated` since the last :func:`reset_peak_memory_stats`, bytes."""
    return _stats()[1]


def capacity() -> int:
    """The stand-in's capacity, bytes."""
    return _stats()[2]


def pinned_bytes() -> int:
    """Pinned host memory live now, bytes (each buffer rounded up to the page)."""
    return _stats()[4]


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A flat ``torch.uint8`` CPU tensor of ``nbytes`` bytes (uninitialised) of the stand-in's pinned host
    memory, counted in whole pages. ``torch.empty(..., pin_memory=True)`` gives the same where no CUDA is
    available; where it is, torch pins with CUDA's allocator instead, which the stand-in does not see.

    Raises:
        RuntimeError: ``nbytes`` < 0.
        torch.OutOfMemoryError: the stand-in host is full (``sim:SIZE,host=SIZE``).
    """
    global _pinned_ready
    if not _pinned_ready:
        # torch answers is_pinned() through the accelerator's hooks only once it initialised the accelerator
        # (at its first pinning), so one pinning through torch comes first.
        torch.empty(0).pin_memory()  # 0 bytes: nothing counted
        _pinned_ready = True
    return torch.ops.memsched_sim.pinned_empty(nbytes)


def max_pinned_bytes() -> int:
    """Peak of :func:`pinned_bytes` since the last :func:`reset_peak_memory_stats`, bytes."""
    return _stats()[5]


def moving_bytes() -> int:
    """Live bytes marked as model data that comes and goes within a step (:func:`move`)."""
    return _stats()[8]


def max_fixed_bytes() -> int:
    """Peak of :func:`memory_allocated` minus :func:`moving_bytes` since the last reset, bytes."""
    return _stats()[9]


def move(nbytes: int) -> None:
    """``nbytes`` more (negative: fewer) of the live bytes come and go within a step (fetched parameters):
    :func:`max_fixed_bytes` leaves them out. Call before the buffer is allocated and after it is dropped."""
    torch.ops.memsched_sim.move(int(nbytes))


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Device allocations made on this thread inside are not counted against the capacity or in the peaks
    (re-entrant): for a reference computation kept beside a scheduler's data on the stand-in. Without the
    stand-in loaded (a CUDA process) there is nothing to leave out, and it does nothing."""
    if not _loaded:
        yield
        return
    torch.ops.memsched_sim.begin_uncounted()
    try:
        yield
    finally:
        torch.ops.memsched_sim.end_uncounted()


def reset_peak_memory_stats(device: object = None) -> None:
    """Restart the peaks (device bytes, blocks, requested bytes, the fixed bytes, pinned bytes) from what is
    live now. ``torch.accelerator.reset_peak_memory_stats()`` restarts the device's only, as CUDA's."""
    torch.ops.memsched_sim.reset_peak()


def memory_reserved(device: object = None) -> int:
    """Bytes the stand-in holds for tensors, as ``torch.cuda.memory_reserved``: it caches nothing (a freed
    block goes back at once), so this is :func:`memory_allocated`."""
    return memory_allocated(device)


def max_memory_reserved(device: object = None) -> int:
    """Peak of :func:`memory_reserved` since the last :func:`reset_peak_memory_stats`, bytes."""
    return max_memory_allocated(device)


def empty_cache() -> None:
    """As ``torch.cuda.empty_cache``: the stand-in caches no freed memory, so there is nothing to release."""


def memory_stats(device: object = None) -> dict[str, int]:
    """The stand-in's allocator statistics under ``torch.cuda.memory_stats``'s names (the ``all`` pool; the
    stand-in has no small and large pools): ``allocation``/``segment``/``active`` (blocks) and
    ``allocated_bytes``/``reserved_bytes``/``active_bytes``/``requested_bytes`` (bytes), each with
    ``.current``, ``.peak``, ``.allocated`` and ``.freed``; ``num_ooms``. Uncounted allocations
    (:func:`uncounted`) are left out."""
    s = _stats()
    out: dict[str, int] = {}
    blocks, nbytes, requested = (s[10], s[11], s[12], s[13]), (s[0], s[1], s[14], s[15]), s[16:20]
    for name, values in (("allocation", blocks), ("segment", blocks), ("active", blocks),
                         ("allocated_bytes", nbytes), ("reserved_bytes", nbytes), ("active_bytes", nbytes),
                         ("requested_bytes", requested)):
        for field, v in zip(("current", "peak", "allocated", "freed"), values, strict=True):
            out[f"{name}.all.{field}"] = int(v)
    out["num_ooms"] = int(s[20])
    return dict(sorted(out.items()))


def reset_accumulated_memory_stats(device: object = None) -> None:
    """Restart the running totals (``.allocated``, ``.freed``, ``num_ooms``) of :func:`memory_stats`."""
    torch.ops.memsched_sim.reset_accumulated()


def set_capacity(nbytes: int) -> None:
    """Set the stand-in's capacity, bytes (> 0). Allocations already made stay."""
    torch.ops.memsched_sim.set_capacity(int(nbytes))


def set_host_capacity(nbytes: int) -> None:
    """Set the stand-in host's pinned-memory capacity, bytes (> 0)."""
    torch.ops.memsched_sim.set_host_capacity(int(nbytes))


def counted_bytes(nbytes: int) -> int:
    """The bytes an allocation of ``nbytes`` takes on the stand-in (rounded up to 512 B; 0 for 0)."""
    return int(torch.ops.memsched_sim.counted_bytes(int(nbytes)))


def mem_get_info(device: object = None) -> tuple[int, int]:
    """``(free, total)`` bytes, as ``torch.cuda.mem_get_info``: total is the capacity in force (``2**63 - 1``
    while no scheduler caps the stand-in)."""
    s = _stats()
    return max(0, s[2] - s[0]), s[2]


class _Stream:
    """The stand-in's one stream: work on it is done when it returns."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _Stream()


def _device_module() -> types.ModuleType:
    mod = types.ModuleType("torch.sim", "memsched's stand-in accelerator (memsched.devices.sim_backend)")
    supported = [torch.float32, torch.float16, torch.bfloat16]
    fns = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,  # copies and kernels are synchronous
        "is_initialized": lambda: True,
        "_is_in_bad_fork": lambda: False,
        "_lazy_init": lambda: None,
        "get_amp_supported_dtype": lambda: supported,
        # The stand-in's random ops draw from the CPU generator, which torch.manual_seed seeds already.
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: None,
        "seed": lambda: torch.default_generator.seed(),
        "seed_all": lambda: None,
        "initial_seed": lambda: torch.default_generator.initial_seed(),
        "get_rng_state": lambda device=None: torch.get_rng_state(),
        "set_rng_state": lambda state, device=None: torch.set_rng_state(state),
        "memory_allocated": memory_allocated,
        "max_memory_allocated": max_memory_allocated,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "memory_reserved": memory_reserved,
        "max_memory_reserved": max_memory_reserved,
        "memory_stats": memory_stats,
        "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
        "empty_cache": empty_cache,
        "mem_get_info": mem_get_info,
        # One synchronous stream (torch.distributed.checkpoint asks the accelerator's module for these).
        "current_stream": lambda device=None: _STREAM,
        "default_stream": lambda device=None: _STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        "device": lambda device=None: contextlib.nullcontext(),  # one device: nothing to switch
    }
    for k, v in fns.items():
        setattr(mod, k, v)
    sys.modules.setdefault("torch.sim", mod)
    return mod


# With any memsched module that imports torch ([Note: a backward on the stand-in, in any load order]).
reserve_autograd_queue()
