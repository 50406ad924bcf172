"""A few named GPUs and their memory, for ``memsched plan --gpu NAME``.

Capacities are the nominal memory sizes NVIDIA sells the boards with, which are binary (a "40GB" A100 has
40 GiB of HBM, 40960 MiB in ``nvidia-smi``). The driver and the CUDA context keep a few hundred MiB of that,
so a plan against a nominal size is slightly optimistic; pass ``--capacity`` with a measured figure
(``torch.cuda.mem_get_info()``) when the margin is thin.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class GPU:
    """A named GPU: ``memory_bytes`` is its nominal memory, bytes."""

    name: str
    memory_bytes: int
    description: str


_TABLE: tuple[GPU, ...] = (
    GPU("t4", 16 * GiB, "NVIDIA T4, 16 GiB GDDR6"),
    GPU("v100-16gb", 16 * GiB, "NVIDIA V100, 16 GiB HBM2"),
    GPU("a10", 24 * GiB, "NVIDIA A10, 24 GiB GDDR6"),
    GPU("l4", 24 * GiB, "NVIDIA L4, 24 GiB GDDR6"),
    GPU("rtx3090", 24 * GiB, "GeForce RTX 3090, 24 GiB GDDR6X"),
    GPU("rtx4090", 24 * GiB, "GeForce RTX 4090, 24 GiB GDDR6X"),
    GPU("v100-32gb", 32 * GiB, "NVIDIA V100, 32 GiB HBM2"),
    GPU("a100-40gb", 40 * GiB, "NVIDIA A100, 40 GiB HBM2"),
    GPU("a6000", 48 * GiB, "NVIDIA RTX A6000, 48 GiB GDDR6"),
    GPU("l40s", 48 * GiB, "NVIDIA L40S, 48 GiB GDDR6"),
    GPU("a100-80gb", 80 * GiB, "NVIDIA A100, 80 GiB HBM2e"),
    GPU("h100-80gb", 80 * GiB, "NVIDIA H100, 80 GiB HBM3"),
    GPU("h200", 141 * GiB, "NVIDIA H200, 141 GB HBM3e (torch sees 139.8 GiB)"),
)
GPUS: dict[str, GPU] = {g.name: g for g in _TABLE}


def gpu_names() -> list[str]:
    """Known GPU names, smallest memory first."""
    return [g.name for g in _TABLE]


def get_gpu(name: str) -> GPU:
    """The GPU called ``name`` (case-insensitive).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    gpu = GPUS.get(str(name).strip().lower())
    if gpu is None:
        raise ValueError(f"unknown GPU {name!r}: known GPUs are {', '.join(gpu_names())} "
                         "(or give --capacity SIZE, e.g. 24GiB)")
    return gpu
