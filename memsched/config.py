"""The options of :func:`memsched.attach`, validated once into small frozen dataclasses.

``attach`` keeps its keyword API; :func:`make_config` maps it onto :class:`SchedulerConfig` and is the one
place each value is checked (the checks themselves live with what they check: policies in
:mod:`policies`, the ratio in :func:`policies.types.check_ratio`, devices in :mod:`memsched.devices.spec`,
hyper-parameters in :mod:`memsched.optim.hyperparams`, ZeRO options in :mod:`memsched.distributed`).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

import policies
from memsched.chunks.sizing import TRAINABLE_DTYPES
from memsched.devices.spec import DeviceSpec, parse_device
from memsched.distributed.options import (
    COLLECTIVE_TIMEOUT_S,
    DataParallelConfig,
    as_timedelta,
    check_build_mode,
    check_zero_options,
)
from memsched.optim.early_update import check_overlap
from memsched.optim.hyperparams import check_hyperparameters, frozen_given, hyperparameter_groups
from memsched.optim.precision import check_dtype
from memsched.planning.plan_check import load_expected_plan
from memsched.planning.planner import PlanningOptions
from policies.types import check_ratio
from policies.units import parse_positive_bytes
from policies.update_paths import HOST_UPDATE_MODES


@dataclass(frozen=True)
class PlacementConfig:
    """Which placement policy plans, how much of the GPU margin it may fill, after how many traced steps."""

    policy: policies.Policy
    gpu_margin_mem_ratio: float
    warmup_steps: int


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW's defaults (``lr``, ``betas``, ``eps``, ``weight_decay``), the param groups (trainable
    parameters only, each group's hyper-parameters checked against the defaults) and the frozen parameters
    given in them (``frozen_given``: a ``torch.optim.AdamW`` over the same groups would update them once they
    have a gradient)."""

    defaults: dict[str, Any]
    groups: list[dict[str, Any]]
    frozen_given: tuple[torch.nn.Parameter, ...] = ()


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything a :class:`memsched.Scheduler` needs, checked."""

    placement: PlacementConfig
    adamw: AdamWConfig
    data_parallel: DataParallelConfig
    device: DeviceSpec
    compute_dtype: torch.dtype
    chunk_numel: int | None
    overlap: bool = False
    replan: str = "auto"
    early_update: bool = False  # overlap="backward" (memsched.optim.early_update)
    host_memory_bytes: int | None = None  # host_memory= at attach: the host budget's own limit, bytes
    expected_plan: Mapping[str, Any] | None = None  # `memsched plan --json` to check the runtime plan against
    update_threads: int | None = None  # the CPU update worker's intra-op threads (None: the default)
    host_update: str = "cpu"  # where host chunks are updated (policies.update_paths.HOST_UPDATE_MODES)

    def planning(self) -> PlanningOptions:
        """The options planning reads (:class:`memsched.planning.planner.PlanningOptions`)."""
        return PlanningOptions(
            device=self.device, policy=self.placement.policy,
            gpu_margin_mem_ratio=self.placement.gpu_margin_mem_ratio, compute_dtype=self.compute_dtype,
            chunk_numel=self.chunk_numel, overlap=self.overlap, early_update=self.early_update,
            host_memory_bytes=self.host_memory_bytes, host_update=self.host_update)


def _check_warmup(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"warmup_steps must be an integer >= 1, got {n!r}")
    return int(n)


SUPPORTED_PARAM_DTYPES = TRAINABLE_DTYPES  # float32, bfloat16, float16


def _check_param_dtypes(model: torch.nn.Module, groups: list[dict[str, Any]]) -> None:
    """Refuse trainable parameters memsched cannot train exactly (float64 would silently become float32,
    a complex parameter would lose its imaginary part)."""
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        for p in g["params"]:
            if p.dtype not in SUPPORTED_PARAM_DTYPES:
                raise ValueError(
                    f"parameter {names.get(id(p), tuple(p.shape))!r} is {p.dtype}: memsched trains float32, "
                    "bfloat16 and float16 parameters (with fp32 master weights); convert the model (e.g. "
                    "model.float()) or freeze the parameter (requires_grad_(False)) before attach")


def _check_params_in_model(model: torch.nn.Module, groups: list[dict[str, Any]]) -> None:
    """Every parameter given in ``params`` belongs to ``model`` (memsched binds parameters to chunks and
    traces the model; one from elsewhere would be trained blind)."""
    mine = {id(p) for p in model.parameters()}
    for i, g in enumerate(groups):
        for p in g["params"]:
            if id(p) not in mine:
                raise ValueError(f"param group {i} holds a parameter of shape {tuple(p.shape)} that is not a "
                                 "parameter of the model given to memsched.attach")


def _check_betas(betas: Any) -> tuple[Any, ...]:
    try:
        return tuple(betas)
    except TypeError:
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}") from None


def _check_dense_gradients(model: torch.nn.Module, groups: list[dict[str, Any]]) -> None:
    """Refuse trainable parameters whose module makes sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``), as ``torch.optim.AdamW`` refuses their gradients at its first step.

    Raises:
        ValueError: names the module and what to use instead.
    """
    trainable = {id(p) for g in groups for p in g["params"]}
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and \
                id(m.weight) in trainable:
            raise ValueError(
                f"module {name or type(m).__name__!r} is a {type(m).__name__} with sparse=True: its "
                "gradients are sparse, and AdamW (torch's and memsched's) does not support sparse "
                "gradients. Build it with sparse=False, or train it with torch.optim.SparseAdam outside "
                "memsched (freeze it, or leave it out of params=)")


def make_config(model: torch.nn.Module, *, policy: str = "auto", gpu_margin_mem_ratio: float = 0.8,
                device: str | torch.device | None = None, warmup_steps: int = 1, lr: float = 1e-3,
                weight_decay: float = 1e-2, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                params: Iterable[Any] | None = None, policy_options: dict[str, Any] | None = None,
                dtype: torch.dtype | None = None, chunk_numel: int | None = None, zero_stage: int = 1,
                process_group: Any = None, fetch: str = "all_gather", dist_timeout: float | None = None,
                collective_timeout: float | None = COLLECTIVE_TIMEOUT_S,
                chunk_build: str = "auto", overlap: bool | str = False,
                replan: str = "auto", host_memory: int | str | None = None,
                expected_plan: str | os.PathLike | Mapping[str, Any] | None = None,
                update_threads: int | None = None, host_update: str = "cpu") -> SchedulerConfig:
    """Check every option of :func:`memsched.attach` (same names and meanings) before anything is touched.

    Raises:
        ValueError: as :func:`memsched.attach` documents (each message names the value and what is allowed).
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"memsched.attach needs an nn.Module, got {type(model).__name__}")
    placement = PlacementConfig(policies.get(policy, **(policy_options or {})),
                                check_ratio(gpu_margin_mem_ratio), _check_warmup(warmup_steps))
    compute_dtype = check_dtype(dtype)
    spec = parse_device(device)
    if params is not None and not isinstance(params, (list, tuple)):
        params = list(params)  # read twice (an iterator such as model.parameters() once only)
    groups = hyperparameter_groups(params, model)
    _check_dense_gradients(model, groups)
    _check_param_dtypes(model, groups)
    _check_params_in_model(model, groups)
    defaults = {"lr": lr, "betas": _check_betas(betas), "eps": eps, "weight_decay": weight_decay}
    check_hyperparameters(defaults, "attach()")
    for i, g in enumerate(groups):
        check_hyperparameters({**defaults, **g}, f"param group {i}")
    if chunk_numel is not None:
        largest = max(p.numel() for g in groups for p in g["params"])
        if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < largest:
            raise ValueError(f"chunk_numel must be an integer >= the largest parameter ({largest} elements), "
                             f"got {chunk_numel!r}")
    stage, fetch = check_zero_options(zero_stage, fetch)
    dp = DataParallelConfig(stage, fetch, process_group, as_timedelta(dist_timeout),
                            check_build_mode(chunk_build), as_timedelta(collective_timeout))
    overlap, early_update = check_overlap(overlap)
    if replan not in ("auto", "off"):
        raise ValueError(f"replan must be 'auto' or 'off', got {replan!r}")
    host_bytes = None
    if host_memory is not None:
        try:
            host_bytes = parse_positive_bytes(host_memory)
        except ValueError as e:
            raise ValueError(f"host_memory must be bytes (an int) or a size such as '64GiB': {e}") from None
    expected = load_expected_plan(expected_plan) if expected_plan is not None else None
    if update_threads is not None and (isinstance(update_threads, bool) or not isinstance(update_threads, int)
                                       or update_threads < 1):
        raise ValueError(f"update_threads must be an integer >= 1 or None, got {update_threads!r}")
    if host_update not in HOST_UPDATE_MODES:
        raise ValueError(f"host_update must be one of {HOST_UPDATE_MODES}, got {host_update!r}")
    adamw = AdamWConfig(defaults, groups, tuple(frozen_given(params, model)))
    return SchedulerConfig(placement, adamw, dp, spec, compute_dtype, chunk_numel,
                           overlap, replan, early_update, host_bytes, expected, update_threads, host_update)
