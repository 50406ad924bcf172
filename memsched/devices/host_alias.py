"""Device-typed aliases of host memory: what an offloaded parameter and its gradient read as between steps.

[Note: parameters read where they compute]
A chunk whose optimizer state lives on the host keeps its parameters' values and gradients in pinned host
buffers between steps (``param_host``, ``grad_host``; [Note: host binding] in :mod:`memsched.chunks.binding`).
User code between steps expects every parameter on the device it computes on: ``x.to(model.device)``,
``generate()``, an evaluation loop, an EMA over ``state_dict()``, ``AveragedModel``, PEFT's merge, torch's
``clip_grad_norm_`` (which groups gradients by device, so a second device changes its summation order). So a
host-bound parameter is a view of its host buffer *typed as the compute device*, with no copy:

* CUDA: a CUDA tensor over the pinned host buffer. Pinned memory is mapped into the device's address space
  (unified virtual addressing: the device pointer is the host pointer), so a kernel reads and writes it over
  the link (zero-copy); torch adopts the pointer through ``__cuda_array_interface__`` and keeps the buffer
  alive as long as the alias. Such reads are as slow as the link: the forward fetches chunks to the device
  first, as always, and only reads made between steps (a ``generate()``, a norm) cross the link.
* The stand-in: a ``sim`` tensor over the host buffer's bytes (``memsched_alias::host_alias``), which holds
  the buffer and is not counted against the stand-in's capacity.
* ``device="cpu"``: the host buffer itself.

Accelerate's offload hooks take the other road (they move a forward's inputs to the execution device and
leave ``model.device`` reading ``cpu``), which breaks ``generate()`` and every pattern above. FSDP2's
``CPUOffloadPolicy`` keeps host tensors between steps; its parameters read as ``cpu`` then too.

Writes through an alias land in the host buffer. On CUDA a kernel writes it asynchronously: memsched's own
host-side reads of buffers that user code may have written through aliases synchronize the device first
(:func:`settle`).
"""

from __future__ import annotations

import ctypes
import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes


def _load_sim_op() -> None:
    """The ``memsched_alias::host_alias`` op is built into the stand-in's extension (``host_alias.cpp``
    beside ``sim_backend.cpp``) and loaded with it (idempotent)."""
    from memsched.devices import sim_backend

    sim_backend.load()


class _CudaArray:
    """The ``__cuda_array_interface__`` (version 2) of a flat run of bytes at a pointer, holding its owner."""

    def __init__(self, owner: torch.Tensor, ptr: int, nbytes: int) -> None:
        self.owner = owner  # torch keeps this object, and so the host buffer, alive with the alias
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2, "strides": None}


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the same bytes as the host tensor ``host`` (same dtype, shape, strides and
    storage offset; no copy), that keeps ``host``'s memory alive ([Note: parameters read where they compute]).

    Args:
        host: a dense CPU tensor; on CUDA it must be pinned (page-locked) memory.
        device: the compute device: ``cpu`` (``host`` itself), ``sim`` (the stand-in) or ``cuda``.

    Raises:
        ValueError: ``host`` is not a dense CPU tensor, or (CUDA) not pinned; or ``device`` is of another
            type.
    """
    if host.device.type != "cpu" or host.layout != torch.strided:
        raise ValueError(f"device_alias: expected a dense CPU tensor, got {host.device} ({host.layout})")
    kind = device.type
    if kind == "cpu":
        return host
    if kind == "sim":
        _load_sim_op()
        # host memory, not the device's: no dispatch mode (a tracer's accountant, the stand-in's accounting)
        # may count it as an allocation
        with _disable_current_modes():
            return torch.ops.memsched_alias.host_alias(host)
    if kind == "cuda":
        if not host.is_pinned():
            raise ValueError("device_alias: a CUDA alias needs pinned host memory (unified addressing maps "
                             "pinned memory into the device's address space); this host tensor is pageable")
        st = host.untyped_storage()
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = torch.device("cuda", index)
        raw = torch.as_tensor(_CudaArray(host, st.data_ptr(), st.nbytes()), device=target)
        if raw.data_ptr() != st.data_ptr() or raw.device != target:
            # torch copied it (another device registered the memory, or an older torch): not a view
            raise ValueError(f"torch made a copy on {raw.device}, not a view of the host memory on {target}")
        return raw.view(host.dtype).as_strided(host.shape, host.stride(), host.storage_offset())
    raise ValueError(f"device_alias: no host alias for device type {kind!r}; expected 'cpu', 'sim' or 'cuda'")


_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
_host_pointer_ok: dict[int, bool] = {}
_warned: set[str] = set()


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded in this process (found through ``/proc/self/maps``), or
    ``None``."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart" in line and "/" in line})
        return ctypes.CDLL(paths[0]) if paths else None
    except OSError:
        return None


def _registered_memory_is_mapped(index: int) -> bool:
    """Whether a kernel on CUDA device ``index`` may use the host pointer of memory registered with
    ``cudaHostRegister`` (as :mod:`memsched.devices.pinned` pins it): the device attribute
    ``cudaDevAttrCanUseHostPointerForRegisteredMem``, read once per device. ``False`` where it cannot be
    read."""
    ok = _host_pointer_ok.get(index)
    if ok is None:
        ok = False
        lib = _cudart()
        if lib is not None:
            try:
                value = ctypes.c_int(0)
                ok = lib.cudaDeviceGetAttribute(ctypes.byref(value), _CAN_USE_HOST_POINTER, index) == 0 and \
                    value.value == 1
            except (AttributeError, OSError):
                ok = False
        _host_pointer_ok[index] = ok
    return ok


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def reads_host_memory(device: torch.device, *, pinned: bool) -> bool:
    """Whether parameters and gradients in host memory can read as ``device`` (:func:`host_alias_of` makes
    their views): the CPU and the stand-in always; CUDA for pinned memory where the GPU uses registered host
    memory at its host address. Where this is false, a host-bound parameter reads as ``cpu``."""
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return pinned and _registered_memory_is_mapped(index)


def host_alias_of(host: torch.Tensor, device: torch.device, *, pinned: bool) -> torch.Tensor | None:
    """:func:`device_alias` where the device can read the memory in place, else ``None`` (the caller keeps
    the host view, which reads as ``cpu``): ``device="cpu"``; on CUDA, pageable memory (``pinned`` false), a
    GPU that cannot use registered host memory at its host address, or an alias torch would not build in
    place (said once, with the reason)."""
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return device_alias(host, device)
    if not pinned:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _registered_memory_is_mapped(index):
        _warn_once(f"mapped{index}", f"memsched: cuda:{index} cannot use registered host memory at its host "
                   "address (cudaDevAttrCanUseHostPointerForRegisteredMem is 0, or the CUDA runtime could "
                   "not be asked): parameters of host chunks read as cpu tensors between steps")
        return None
    try:
        return device_alias(host, torch.device("cuda", index))
    except (RuntimeError, ValueError, TypeError) as e:
        _warn_once(f"alias{index}", f"memsched: no CUDA view of pinned host memory ({e}): parameters of "
                   "host chunks read as cpu tensors between steps")
        return None


def settle(device: torch.device) -> None:
    """Before memsched reads on the host a buffer that device kernels may have written through an alias (a
    user's ``clip_grad_norm_``, ``load_state_dict`` or ``p.mul_`` between steps), or frees one such a kernel
    may still read: on CUDA, wait for the device's work (kernels read and write mapped memory
    asynchronously, on any stream); elsewhere nothing to wait for."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
