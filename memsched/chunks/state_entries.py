"""What ``model.state_dict()`` holds for parameters that are views into chunks: each its own storage.

[Note: state dict entries of their own]
A trainable parameter is a view into its chunk, so ``param.detach()``, what ``state_dict()`` holds, shares one
storage with every other parameter of the chunk. Savers that group tensors by storage then go wrong:
safetensors' ``save_model`` / ``load_model`` refuse any entry that does not cover its whole storage ("None is
covering the entire storage"), and Accelerate's ``save_state`` (safetensors by default) keeps only the first
name of each storage, dropping every other parameter of the chunk with a log line. So a ``state_dict``
post-hook of the root model gives each such entry a storage of its own that aliases exactly its bytes of the
chunk (``UntypedStorage`` slicing keeps the chunk's memory alive), with no copy. Each entry is still
``param.detach()`` (it shares the parameter's version counter, so a write through it is a write to the
parameter, which memsched follows as torch would), and tied names share one entry, so savers see them as the
one tensor they are. ``keep_vars=True`` (the parameters themselves) is left alone.
"""

from __future__ import annotations

from typing import Any

import torch


def _set_version(t: torch.Tensor, version: int) -> None:
    """Put the version counter ``t`` shares with its parameter back to ``version`` (``set_`` bumped it, and no
    value changed). Torch's signature of this private function changed over releases; where it is absent the
    bump stays, which only makes memsched take in the unchanged values once more."""
    fn = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if fn is None:
        return
    try:
        fn((t,), (version,))
    except TypeError:
        fn(t, version)


def own_storage_view(p: torch.Tensor) -> torch.Tensor:
    """``p.detach()`` on a storage of its own: the bytes ``p`` covers (dense: ``numel`` elements from its
    first), aliased, not copied; same shape, strides, dtype, device and version counter as ``p``."""
    out = p.detach()
    version = out._version
    start = p.storage_offset() * p.element_size()
    with torch.no_grad():
        out.set_(p.untyped_storage()[start:start + p.numel() * p.element_size()], 0, p.shape, p.stride())
    _set_version(out, version)
    return out


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive elements of memory (any permutation of strides, no
    overlap, no gap): only then can a storage of exactly its bytes hold it."""
    if t.numel() == 0:
        return False
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
    return span == t.numel() and all(s > 0 for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)


def own_storage_entries(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                        _local_metadata: Any) -> None:
    """A ``state_dict`` post-hook (the root model's, installed by attach): see [Note: state dict entries of
    their own]. Entries that cover their storage already (buffers, frozen parameters) stay as they are."""
    made: dict[tuple[Any, ...], torch.Tensor] = {}
    for k, v in state_dict.items():
        if not k.startswith(prefix) or not isinstance(v, torch.Tensor) or isinstance(v, torch.nn.Parameter):
            continue
        key = (v.data_ptr(), v.dtype, tuple(v.shape), v.stride())
        own = made.get(key)  # a tied name: the entry of the first
        if own is None:
            whole = v.storage_offset() == 0 and v.untyped_storage().nbytes() == v.numel() * v.element_size()
            # an absent view (ZeRO-3, sharded) is not dense: nothing of its own to alias
            own = made[key] = v if whole or not _dense(v) else own_storage_view(v)
        state_dict[k] = own
