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
        raw = torch.as_tensor(_CudaArray(host, st.data_ptr(), st.nbytes()),
                              device=torch.device("cuda", device.index if device.index is not None
                                                  else torch.cuda.current_device()))
        return raw.view(host.dtype).as_strided(host.shape, host.stride(), host.storage_offset())
    raise ValueError(f"device_alias: no host alias for device type {kind!r}; expected 'cpu', 'sim' or 'cuda'")


def settle(device: torch.device) -> None:
    """Before memsched reads on the host a buffer that device kernels may have written through an alias (a
    user's ``clip_grad_norm_``, ``load_state_dict`` or ``p.mul_`` between steps): on CUDA, wait for the
    current stream's work (kernels write mapped memory asynchronously); elsewhere nothing to wait for."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
