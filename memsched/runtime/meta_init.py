"""Models built on the meta device (issue 42): their parameters are materialised in their chunks at attach.

[Note: models built on meta]
An 8B model built on the CPU takes 32 GB (fp32) before attach copies it into chunks, so a host that holds
the chunks may not hold the model too. Built on ``meta`` (``with torch.device("meta")``, accelerate's or
transformers' ``init_empty_weights``), a parameter has a shape and no storage: attach gives each one its
slot in a chunk, built and placed one chunk at a time as any model is (``ChunkStore._build``), so the
process never holds the model's parameters twice. The values come after attach, written through the
parameters as any write after attach is (``model.load_state_dict``, low-memory checkpoint loading, or the
model's own initialisation: ``module.reset_parameters()``, transformers'
``model.apply(model._init_weights)``); the fp32 masters follow at the step
(:meth:`memsched.optim.grads.GradChecks.sync_user_param_writes`), so they start from the values as the
model holds them (a bf16 model: its bf16 values). FSDP2 materialises its meta parameters with ``to_empty``
and ``reset_parameters`` in the same way.

A slot of a meta parameter starts as NaN. A parameter never given values would train silently on
whatever memory it got, so the first forward of the model, and the first step, refuse while any such
parameter still holds a NaN (a loaded or initialised model holds none), naming the parameters. Buffers are
not model data and memsched does not make them: a meta buffer (``torch.device("meta")`` makes RoPE's
``inv_freq`` one) is refused at attach, since no state dict restores a non-persistent buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def check_meta(model: torch.nn.Module, chunked: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters of ``model`` on the meta device, all of which memsched materialises in its chunks.

    Args:
        model: the module given to attach.
        chunked: the parameters that go into chunks (trainable ones, and one rank's frozen ones).

    Returns:
        The meta parameters (each in ``chunked``), in ``model.named_parameters()`` order.

    Raises:
        ValueError: a buffer is on the meta device, or a meta parameter stays out of the chunks (a frozen
            one with more ranks): it names the tensor and what to do.
    """
    for name, b in model.named_buffers():
        if b.device.type == "meta":
            raise ValueError(
                f"buffer {name!r} is on the meta device: memsched materialises the parameters of a model "
                "built on meta, not its buffers (no state dict restores a non-persistent buffer such as "
                "RoPE's inv_freq). Build the buffers for real: accelerate.init_empty_weights() "
                "(include_buffers=False, its default) puts only the parameters on meta; or compute them "
                "(module.to_empty(device=...) and the module's own initialisation) before memsched.attach")
    ids = {id(p) for p in chunked}
    meta = []
    for name, p in model.named_parameters():
        if p.device.type != "meta":
            continue
        if id(p) not in ids:
            raise ValueError(
                f"parameter {name!r} is on the meta device and would stay out of memsched's chunks (a frozen "
                "parameter with more than one rank): materialise it before memsched.attach (e.g. "
                "model.to_empty(device=...) and initialise it)")
        meta.append(p)
    return meta


def materialise(params: Sequence[torch.nn.Parameter]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Give each meta parameter in ``params`` a placeholder with storage that attach can move into a chunk:
    NaN of its shape and dtype, one element on the CPU, expanded (torch refuses to set a meta tensor's
    ``.data`` to a real one, so the parameter object, which the model and the user's references hold,
    swaps its contents: ``torch.utils.swap_tensors``).

    Returns:
        ``(parameter, its meta contents)`` pairs, to undo a refused attach (:func:`unmaterialise`).

    Raises:
        ValueError: a parameter cannot swap its contents (something holds a weak reference to it); the
            parameters swapped so far are meta again.
    """
    done: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    for p in params:
        placeholder = torch.nn.Parameter(torch.full((), float("nan"), dtype=p.dtype).expand(p.shape),
                                         requires_grad=p.requires_grad)
        try:
            torch.utils.swap_tensors(p, placeholder)
        except RuntimeError as e:
            unmaterialise(done)
            raise ValueError(f"a meta parameter of shape {tuple(p.shape)} cannot be materialised in place: "
                             f"{e}. Attach before anything else holds a reference to the parameters "
                             "(hooks, another optimizer)") from e
        done.append((p, placeholder))  # the placeholder object now holds the meta contents
    return done


def unmaterialise(done: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """Undo :func:`materialise` (a refused attach): each parameter is on the meta device again, as given.
    Best effort: a parameter that can no longer swap keeps its placeholder values (NaN)."""
    for p, meta in reversed(done):
        if p.device.type != "meta":
            try:
                p.data = p.data.new_empty(0)  # drop a chunk view first
                torch.utils.swap_tensors(p, meta)
            except RuntimeError:
                pass


class MetaBorn:
    """The parameters of a model built on meta until each one holds values.

    Args:
        params: the meta parameters (:func:`check_meta`), chunk views once attach built the chunks.
        values: ``values(p)`` -> ``p``'s values now, wherever its chunk keeps them (a tensor of ``p``'s
            shape; not ``p`` itself, which reads as a placeholder while its chunk is away).
        names: ``id(p)`` -> the parameter's name.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], values: Any, names: dict[int, str]) -> None:
        self._params = list(params)
        self._values = values
        self._names = names

    def check(self, where: str) -> None:
        """Raise unless every meta-born parameter holds values (no NaN left in it); once they all do, the
        check costs nothing again.

        Raises:
            ValueError: names (up to five of) the parameters still holding a NaN, and how to give values.
        """
        if not self._params:
            return
        with torch.no_grad():
            missing = [p for p in self._params if bool(self._values(p).isnan().any())]
        if missing:
            names = [self._names.get(id(p), f"<shape {tuple(p.shape)}>") for p in missing]
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            raise ValueError(
                f"{where}: {len(missing)} parameter(s) built on the meta device were never given values "
                f"({', '.join(repr(n) for n in names[:5])}{more}). After memsched.attach, load them "
                "(model.load_state_dict(...)) or initialise them (module.reset_parameters(), transformers' "
                "model.apply(model._init_weights)); nothing was computed or updated")
        self._params = []
