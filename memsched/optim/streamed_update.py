"""A host chunk's optimizer update on the device, its state streamed over the link (``host_update=``).

A host chunk keeps its fp32 master, ``exp_avg`` and ``exp_avg_sq`` in pinned host memory. When the plan
streams it (:attr:`policies.PlacementPlan.streamed`, :mod:`policies.update_paths`), ``step()`` updates it on
the device instead of the CPU, piece by piece (at most ``sizing.STREAM_PIECE_NUMEL`` elements, cut where the
kernel's result does not change: :func:`memsched.optim.adam.kernel_spans`), with two pieces in flight:

1. H2D: the piece's master and moments (and its gradients, when backward sent them to the host) into one of
   two device buffer sets, after the D2H copies that last read that set;
2. on the compute stream, once those copies are in: the gradients upcast, unscaled and clipped in fp32, the
   device's fused AdamW over each parameter's part of the piece (``torch._fused_adamw_``, as for a device
   chunk), and the parameters written in place from the new master (a cast under mixed precision);
3. D2H: the new master and moments back into the host state, on the copy stream, while the next piece goes on.

The step counts move on the host (as the CPU kernel moves them) and go to the device with the piece. Under
mixed precision a chunk that keeps a host copy of its parameters (``staging``: their values between steps,
and where they go when they leave the device) gets them back D2H too. ``step()`` issues the streamed updates
first, then runs the CPU path's updates (or hands them to the worker) while the copies and the device work,
and returns once the streamed updates' D2H copies are done (:meth:`StreamedUpdates.wait`): from then on the
host state and the parameters' host values are those of the step, for every reader.

The numbers are those of fused AdamW on the device that runs it, as for a device chunk
(:doc:`docs/semantics.md`, exactness). The idea is Megatron-LM's ``--chunked-optimizer-state-offload``
(copy-in, update on the GPU, copy-out per 256 MB piece).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memsched.chunks import Chunk, ChunkStore, param_shards, sizing
from memsched.chunks.sizing import BUFFER_SETS, stream_staging_bytes
from memsched.devices.transfers import Streams, TransferStats
from memsched.optim.adam import fp32_grad, fused_adamw_, kernel_spans
from memsched.telemetry.step_timeline import CPU_UPDATE


def piece_numel(chunks: Sequence[Chunk]) -> int:
    """:func:`memsched.chunks.sizing.stream_piece_numel` of ``chunks``' shards."""
    return sizing.stream_piece_numel([c.shard_numel for c in chunks])


class StreamedUpdates:
    """The host chunks updated on the device and the D2H copies that write their host state back.

    Args:
        store: the chunks.
        streams: the copy streams (CUDA side streams, the stand-in's link, or synchronous copies).
        transfers: the step's transfer statistics.
        span: the step timeline's ``span``.
    """

    def __init__(self, store: ChunkStore, streams: Streams, transfers: TransferStats,
                 span: Callable[..., None]) -> None:
        self.store = store
        self.streams = streams
        self.transfers = transfers
        self.span = span
        self.chunks: frozenset[int] = frozenset()  # the plan's streamed chunks (PlacementPlan.streamed)
        self._copies: list[Any] = []  # events of the D2H copies still writing host state
        self._sets: list[dict[str, torch.Tensor]] = []  # the step's device buffer sets (prepare)
        self._piece = 0
        self.updates = 0  # chunk updates made on the device (statistics)

    def takes(self, c: Chunk) -> bool:
        """Whether ``c``'s update runs here: the plan streams it and its parameters are on the device."""
        return c.index in self.chunks and c.data is not None and c.master is not None

    def temporary_bytes(self, chunks: Sequence[Chunk]) -> int:
        """Device bytes a step that streams ``chunks`` holds for them (0 without any), bytes."""
        if not chunks:
            return 0
        return stream_staging_bytes(piece_numel(chunks), chunks[0].compute_dtype)

    def prepare(self, chunks: Sequence[Chunk]) -> None:
        """Allocate the device buffer sets a step that streams ``chunks`` uses (none without any), before the
        step's first in-place write, so that running out of device memory leaves everything as it was.

        Raises:
            torch.OutOfMemoryError: (CUDA) the device cannot hold them.
        """
        self.release()
        if not chunks:
            return
        piece = piece_numel(chunks)
        alloc = self.store.alloc
        dev_dtype = chunks[0].compute_dtype
        f32 = ("master", "exp_avg", "exp_avg_sq", "g")
        self._sets = [{k: alloc.device_empty(piece, torch.float32) for k in f32}
                      | {"gc": alloc.device_empty(piece, dev_dtype)} for _ in range(BUFFER_SETS)]
        self._piece = piece

    def release(self) -> None:
        """Free the buffer sets :meth:`prepare` allocated, for a step that updates nothing (fp16 overflow)."""
        self._sets, self._piece = [], 0

    def update(self, chunks: Sequence[Chunk], hps: Sequence[dict[str, Any]], active: set[int],
               inv_scale: torch.Tensor | None, coefs: list[torch.Tensor]) -> None:
        """Update ``chunks`` (host chunks this object :meth:`takes`, after :meth:`prepare` for them) on the
        device, piece by piece (module docstring). ``hps``: each param group's hyper-parameters; ``active``:
        ids of the parameters with a gradient this step; ``inv_scale`` and ``coefs`` (fp16 inverse loss scale,
        clip coefficients) are device tensors. The buffer sets are freed at the end."""
        sets, piece, self._sets = self._sets, self._piece, []
        if not chunks:
            return
        assert sets, "StreamedUpdates.prepare() first"
        self.wait()  # the previous step's copies still write the host state the H2D copies read
        last: list[Any] = [None] * BUFFER_SETS  # per set, the D2H copy that last read it
        j = 0
        for c in chunks:
            t0 = time.perf_counter()
            j = self._update_one(c, hps[c.group], active, inv_scale, coefs, piece, sets, last, j)
            self.span(CPU_UPDATE, "streamed update", t0, time.perf_counter(), chunk=c.index)
            self.updates += 1
            self.store.after_update(c)

    def _update_one(self, c: Chunk, hp: dict[str, Any], active: set[int], inv_scale: torch.Tensor | None,
                    coefs: list[torch.Tensor], piece: int, sets: list[dict[str, torch.Tensor]],
                    last: list[Any], j: int) -> int:
        store, streams, alloc = self.store, self.streams, self.store.alloc
        parts: list[tuple[int, int, int]] = []  # (parameter index, start in the shard, numel)
        for k, (p, part) in enumerate(zip(c.params, param_shards(c.ranges, c.lo, c.hi), strict=True)):
            if id(p) in active and part is not None:
                parts.append((k, part.shard_start, part.numel))
        if not parts:
            return j
        assert c.master is not None and c.exp_avg is not None and c.exp_avg_sq is not None
        assert c.steps is not None
        with torch.no_grad():
            with alloc.host_context():  # the counts move on the host, as the CPU kernel moves them
                torch._foreach_add_([c.steps[k] for k, _, _ in parts], 1)
            steps = alloc.device_empty(c.steps.numel(), torch.float32)
            steps_copy = streams.copy_h2d(steps, c.steps)
            on_host = store.offloads(c)  # the gradients went to the host in backward
            grads = c.grad_host if on_host else c.reduced_grad()
            assert grads is not None
            param = c.param_part()
            for lo, hi in kernel_spans([(s, n) for _, s, n in parts], piece):
                n, buf = hi - lo, sets[j % BUFFER_SETS]
                after = last[j % BUFFER_SETS]
                copies = [steps_copy] + [streams.copy_h2d(buf[k][:n], getattr(c, k)[lo:hi], after)
                                         for k in ("master", "exp_avg", "exp_avg_sq")]
                if on_host:
                    copies.append(streams.copy_h2d(buf["gc"][:n], grads[lo:hi], after))
                self.transfers.add_h2d(n * (12 + (grads.element_size() if on_host else 0)))
                streams.wait(copies, "streamed update <- H2D")
                g = fp32_grad(buf["gc"][:n] if on_host else grads[lo:hi], buf["g"][:n], inv_scale, coefs)
                views: dict[str, list[torch.Tensor]] = {"p": [], "g": [], "m": [], "v": [], "s": []}
                for k, s, num in parts:
                    a, b = max(s, lo) - lo, min(s + num, hi) - lo
                    if a >= b:
                        continue
                    views["p"].append(buf["master"][a:b])
                    views["g"].append(g[a:b])
                    views["m"].append(buf["exp_avg"][a:b])
                    views["v"].append(buf["exp_avg_sq"][a:b])
                    views["s"].append(steps[k])
                fused_adamw_(views["p"], views["g"], views["m"], views["v"], views["s"], lr=hp["lr"],
                             beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                             weight_decay=hp["weight_decay"], maximize=hp["maximize"], increment_steps=False)
                param[lo:hi].copy_(buf["master"][:n])  # the parameters, on the compute stream
                with alloc.host_context():
                    for k in ("master", "exp_avg", "exp_avg_sq"):
                        ev = streams.copy_d2h(getattr(c, k)[lo:hi], buf[k][:n])
                        if ev is not None:
                            self._copies.append(ev)
                            last[j % BUFFER_SETS] = ev
                    if c.staging is not None:  # the parameters' host copy (their values between steps, and
                        # where they go when they leave the device) follows, as the CPU update's cast does
                        ev = streams.copy_d2h(c.staging[lo:hi], param[lo:hi])
                        if ev is not None:
                            self._copies.append(ev)
                self.transfers.add_d2h(n * (12 + (param.element_size() if c.staging is not None else 0)))
                j += 1
        return j

    def wait(self) -> None:
        """Block until the D2H copies of the streamed updates wrote the host state."""
        copies, self._copies = self._copies, []
        for ev in copies:
            ev.synchronize()
