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
    """A named GPU: ``memory_bytes`` is its nominal memory, bytes; ``fp32_flops`` and ``half_flops`` its
    peak dense FLOP/s in fp32 (without TF32: torch's default matmul precision) and in bf16/fp16 on tensor
    cores with fp32 accumulation, from NVIDIA's datasheets (SXM boards where there are several), for the
    step-time model (:mod:`memsched.planning.step_model`). ``link_bytes_per_s``: the nominal bandwidth of
    its host link per direction, bytes per second (PCIe 3.0, 4.0 and 5.0 x16: 15.75, 31.5 and 63 GB/s after
    line coding, the PCI-SIG base specifications), which ``memsched plan --host-update`` uses when no
    ``--link-bandwidth`` is given; measured copies reach less."""

    name: str
    memory_bytes: int
    description: str
    fp32_flops: float = 0.0
    half_flops: float = 0.0
    link_bytes_per_s: float = 0.0


#: Nominal PCIe x16 bandwidth per direction, bytes per second, by generation.
PCIE_X16 = {3: 15.75e9, 4: 31.5e9, 5: 63e9}


_TABLE: tuple[GPU, ...] = (
    GPU("t4", 16 * GiB, "NVIDIA T4, 16 GiB GDDR6", 8.1e12, 65e12, PCIE_X16[3]),
    GPU("v100-16gb", 16 * GiB, "NVIDIA V100, 16 GiB HBM2", 15.7e12, 125e12, PCIE_X16[3]),
    GPU("a10", 24 * GiB, "NVIDIA A10, 24 GiB GDDR6", 31.2e12, 125e12, PCIE_X16[4]),
    GPU("l4", 24 * GiB, "NVIDIA L4, 24 GiB GDDR6", 30.3e12, 121e12, PCIE_X16[4]),
    GPU("rtx3090", 24 * GiB, "GeForce RTX 3090, 24 GiB GDDR6X", 35.6e12, 71e12, PCIE_X16[4]),
    GPU("rtx4090", 24 * GiB, "GeForce RTX 4090, 24 GiB GDDR6X", 82.6e12, 165.2e12, PCIE_X16[4]),
    GPU("v100-32gb", 32 * GiB, "NVIDIA V100, 32 GiB HBM2", 15.7e12, 125e12, PCIE_X16[3]),
    GPU("a100-40gb", 40 * GiB, "NVIDIA A100, 40 GiB HBM2", 19.5e12, 312e12, PCIE_X16[4]),
    GPU("a6000", 48 * GiB, "NVIDIA RTX A6000, 48 GiB GDDR6", 38.7e12, 154.8e12, PCIE_X16[4]),
    GPU("l40s", 48 * GiB, "NVIDIA L40S, 48 GiB GDDR6", 91.6e12, 362e12, PCIE_X16[4]),
    GPU("a100-80gb", 80 * GiB, "NVIDIA A100, 80 GiB HBM2e", 19.5e12, 312e12, PCIE_X16[4]),
    GPU("h100-80gb", 80 * GiB, "NVIDIA H100, 80 GiB HBM3", 67e12, 989e12, PCIE_X16[5]),
    GPU("h200", 141 * GiB, "NVIDIA H200, 141 GB HBM3e (torch sees 139.8 GiB)", 67e12, 989e12, PCIE_X16[5]),
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


def gpu_for_device_name(device_name: str) -> GPU | None:
    """The table's GPU for a CUDA device name as torch reports it (``"NVIDIA H100 80GB HBM3"`` ->
    ``h100-80gb``, ``"NVIDIA H200"`` -> ``h200``), or ``None``: the entry whose model (the name before its
    memory size) is a word of the device name, with a memory size in the name preferred."""
    words = device_name.lower().replace("-", " ").split()
    words += [a + b for a, b in zip(words, words[1:], strict=False)]  # "RTX 4090" -> "rtx4090"
    found = [g for g in _TABLE if g.name.split("-")[0] in words]
    sized = [g for g in found if "-" in g.name and g.name.split("-")[1] in words]
    return (sized or found or [None])[0]
