"""What ``p.grad`` is once ZeRO-2 reduced a chunk's gradients: a :class:`ShardedGrad`, a tensor with the
parameter's shape, dtype and device and no data, that refuses every operation with an error that says why.

[Note: sharded gradients]
At ZeRO stage 2 each rank keeps only its shard of a chunk's averaged gradients (``Chunk.grad_shard``,
``[hi - lo]``); the whole gradient buffer is freed as soon as it is reduce-scattered. ``p.grad`` cannot be a
view of data this rank no longer holds, and ``None`` would be a lie: torch's
``clip_grad_norm_(model.parameters())`` (Hugging Face Trainer, Accelerate) would then compute the norm of no
gradient, or of this rank's part only, and clip wrongly without a word. So ``p.grad`` becomes a ShardedGrad:
``p.grad is not None`` holds as in torch, and anything that reads or writes it raises, naming
``sched.clip_grad_norm_`` (exact over all ranks) and ``zero_stage=1`` (whole gradients on every rank). The
one operation it follows is ``zero_()`` (``model.zero_grad(set_to_none=False)``), which zeroes the
parameter's part of the shard. FSDP2 keeps sharded gradients as ``DTensor`` for the same reason; a
ShardedGrad is the refusal half of that, without a distributed tensor type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class ShardedGradError(RuntimeError):
    """An operation read or wrote a gradient that ZeRO-2 sharded over the ranks (see the module)."""


class ShardedGrad(torch.Tensor):
    """``p.grad`` of a parameter whose chunk's gradients were reduce-scattered (see the module).

    Args:
        param: the parameter (its shape, strides, dtype and device are the guard's).
        what: how errors name it (``"parameter 'fc.weight' in chunk 3"``).
        world: the number of ranks.
        on_zero: called by ``zero_()`` (zeroes the parameter's part of the shard).
    """

    _what: str
    _world: int
    _on_zero: Callable[[], None]

    @staticmethod
    def __new__(cls, param: torch.Tensor, what: str, world: int, on_zero: Callable[[], None]) -> ShardedGrad:
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, strides=param.stride(), dtype=param.dtype,
                                                device=param.device, requires_grad=False)
        t._what, t._world, t._on_zero = what, world, on_zero
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ShardedGrad({self._what}, shape={tuple(self.shape)}, sharded over {self._world} ranks)"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.zero_.default and len(args) == 1 and isinstance(args[0], ShardedGrad):
            args[0]._on_zero()
            return args[0]
        guard = next((a for a in tree_leaves((args, kwargs)) if isinstance(a, ShardedGrad)), None)
        what = guard._what if guard is not None else "a parameter"
        world = guard._world if guard is not None else "several"
        raise ShardedGradError(
            f"memsched ZeRO-2/3: {func} on the gradient of {what}, which is sharded over {world} ranks (each "
            "rank holds only its shard of the averaged gradients; the whole gradient exists nowhere). "
            "torch.nn.utils.clip_grad_norm_(model.parameters()) cannot see it: clip with "
            "sched.clip_grad_norm_(max_norm) (exact, over all ranks), or attach with zero_stage=1 to keep "
            "whole gradients on every rank (Trainer: max_grad_norm=0 and clip through memsched)")


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a :class:`ShardedGrad`."""
    return isinstance(t, ShardedGrad)
