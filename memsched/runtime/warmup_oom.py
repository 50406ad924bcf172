"""Why a warmup step ran out of memory, and the hint that would help, from the device's bytes at the failure.

Before the first plan nothing is traced, so an out-of-memory error in warmup is explained from what the
device held when it failed: the chunks' parameters, the chunks' gradient buffers (one buffer of the chunk's
size per chunk whose gradients backward is making), the buffers and the frozen parameters kept out of chunks
(another dtype than the compute dtype, a tensor subclass, or more ranks: memsched keeps them on the device),
and the rest, the step's activations and temporaries. Keeping the chunks' parameters (trainable and frozen)
on the host during warmup (``auto``'s ``warmup_non_model_share=1.0``, ``static``'s ``offload_param_frac``)
helps only when it frees enough; where it would not, the message names what is too big instead of a hint
that cannot work (issue 31).
"""

from __future__ import annotations

from policies.units import format_bytes

#: The hint per policy that keeps the trainable parameters on the host during warmup.
PARAMS_ON_HOST_HINT = {"auto": "policy_options={'warmup_non_model_share': 1.0}",
                       "static": "policy_options={'offload_param_frac': F} with F > 0"}


def warmup_oom_message(*, capacity: int, in_use: int, requested: int, chunk_params_on_device: int,
                       frozen_and_buffers: int, largest_chunk: int, policy: str,
                       params_on_host: bool, chunk_grads_on_device: int = 0) -> str | None:
    """The explanation of a warmup step's out-of-memory error (all arguments bytes, but ``policy``, the
    placement policy's name, and ``params_on_host``: the warmup already keeps the trainable parameters on
    the host). ``None`` when there is nothing to say beyond the error.

    With every trainable chunk on the host, a read brings at most two chunks' parameters at a time (the one
    read and the next, fetched ahead): the step would need ``in_use + requested - chunk_params_on_device + 2 x
    largest_chunk``. If that fits, the hint is to keep the parameters on the host (unless they already are);
    if not, the message says whether the frozen parameters and buffers or the activations are what is too
    big.
    """
    need = in_use + requested
    without = need - chunk_params_on_device + 2 * largest_chunk
    if without <= capacity:
        if params_on_host:
            return None
        how = PARAMS_ON_HOST_HINT.get(policy)
        fix = (f"attach with {how} to trace with the parameters on the host, each chunk fetched for its reads"
               if how is not None else
               f"policy {policy!r} keeps every parameter on the device; 'auto' can keep them on the host")
        return ("memsched: the warmup step ran out of memory with every parameter on the device (nothing is "
                f"traced yet to plan from); {fix}")
    rest = max(0, need - chunk_params_on_device - chunk_grads_on_device - frozen_and_buffers)
    head = ("memsched: the warmup step ran out of memory, and keeping the chunks' parameters (trainable and "
            f"frozen) on the host would not make room: it needs at least {format_bytes(without)} ({without} "
            f"bytes) with them there, on a device of {format_bytes(capacity)} ({capacity} bytes). ")
    if chunk_grads_on_device >= max(rest, frozen_and_buffers):
        return head + (f"The chunks' gradient buffers take {format_bytes(chunk_grads_on_device)}: backward "
                       f"makes a chunk's gradients in one buffer of its size ({format_bytes(largest_chunk)} "
                       "for the largest chunk, which holds at least the largest parameter whole); the "
                       f"activations and temporaries take {format_bytes(rest)}. Use a larger device; smaller "
                       "chunks (chunk_numel=) help only down to the largest parameter")
    if 2 * largest_chunk >= max(rest, frozen_and_buffers):
        return head + (f"The largest chunk holds {format_bytes(largest_chunk)} of parameters, and a read "
                       "needs its chunk whole on the device, with the next one fetched ahead (a parameter "
                       "larger than the chunk size has a chunk of its own); the activations and temporaries "
                       f"take {format_bytes(rest)}. Use a larger device, or split that parameter (e.g. a "
                       "vocabulary head in parts)")
    if frozen_and_buffers >= rest:
        return head + (f"The buffers and the frozen parameters kept out of chunks take "
                       f"{format_bytes(frozen_and_buffers)}, and memsched keeps them on the device (it "
                       "chunks and offloads frozen parameters of the compute dtype only, with one rank); the "
                       f"activations and temporaries take {format_bytes(rest)}. Use a larger device, or "
                       "frozen parameters in the compute dtype")
    return head + (f"The activations and temporaries take at least {format_bytes(rest)} (beside "
                   f"{format_bytes(frozen_and_buffers)} of frozen parameters and buffers). Reduce the batch "
                   "size or the sequence length, or recompute activations (torch.utils.checkpoint)")
