"""The forward hooks that drive the parameter fetcher: the root's begin and end, each module's reads.

:class:`FetchHooks` owns the hooks of one :class:`memsched.runtime.param_fetch.ParamFetcher` on the model:
the root's forward pre-hook (prepended: before any read of the forward) and forward hook (the forward's
begin and end, :meth:`memsched.runtime.param_fetch.ParamFetcher.forward_begin` and ``forward_end``), and per
module a forward pre-hook reading the offloaded chunks of its own parameters; while reads are recorded,
every module's pre- and post-hook (the innermost module of each read) and every parameter's
post-accumulate-grad hook. It refuses a compiled forward that would read chunks away
(:func:`_refuse_compiled`) and a submodule run outside the attached model's forward
(:meth:`FetchHooks.check_rootless`). Its lifecycle: none until :meth:`FetchHooks.install` (attach, once); from
then on registered exactly while the fetcher is active, again at each change of what it fetches or records
(:meth:`FetchHooks.reinstall`); none after :meth:`FetchHooks.remove` (``close()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from memsched.chunks import ChunkStore
from memsched.runtime.hook_order import add_forward_pre_hook
from tracer.hook_handles import Detachable
from tracer.param_reads import phase_now


class FetchHooks:
    """The model's hooks of one parameter fetcher (see the module docstring).

    Args:
        model: the attached model.
        store: the chunks.
        fetcher: the :class:`memsched.runtime.param_fetch.ParamFetcher` that owns these hooks (its reads, its
            forward's begin and end, its recorder).
    """

    def __init__(self, model: torch.nn.Module, store: ChunkStore, fetcher: Any) -> None:
        self._model, self._store = model, store
        self._fetcher = fetcher  # memsched.runtime.param_fetch.ParamFetcher (a type would be an import cycle)
        self.installed = False
        self._root: list[Any] = []
        self._modules: list[Any] = []

    def install(self) -> None:
        """From now on the hooks are registered while the fetcher is active (:meth:`reinstall`)."""
        self.installed = True

    def reinstall(self) -> bool:
        """Take every hook off and, if installed and the fetcher active, register them for what it fetches
        and records now. Returns whether they are on."""
        self.remove()
        fetcher = self._fetcher
        if not (self.installed and fetcher.active):
            return False
        # before any read of the forward (its module reads are hooked after it, the root's appended)
        begin = Detachable(lambda *_a: fetcher.forward_begin())
        self._root.append(add_forward_pre_hook(self._model, begin, prepend=True))
        end = Detachable(lambda *_a: fetcher.forward_end())
        self._root.append(self._model.register_forward_hook(end, always_call=True))
        store, recorder = self._store, fetcher.recorder
        if recorder.on:  # when each gradient is made, for the gradients in flight
            for p in store.params():
                made = Detachable(recorder.grad_made)
                self._modules.append(p.register_post_accumulate_grad_hook(made))
        for name, m in self._model.named_modules():
            root = m is self._model  # the root's read comes after the forward's start (forward_begin)
            if recorder.on:  # every module: the innermost one is recorded with each read
                own = [p for p in m.parameters(recurse=False) if id(p) in store.param_chunk]
                pre = Detachable(self._recording_pre(name, own))
                self._modules.append(add_forward_pre_hook(m, pre, prepend=not root))
                post = Detachable(lambda *_a: recorder.leave())
                self._modules.append(m.register_forward_hook(post, always_call=True))
                continue
            # a module's forward reads its own parameters, as the recording saw it (_recording_pre); what it
            # reads of other chunks the read guard sees, as it did then
            reads = tuple(sorted({store.param_chunk[id(p)].index for p in m.parameters(recurse=False)
                                  if id(p) in store.param_chunk and store.param_chunk[id(p)].index
                                  in fetcher.offloaded}))
            if reads:
                hook = Detachable(self._module_pre(name, reads))
                self._modules.append(add_forward_pre_hook(m, hook, prepend=not root))
        return True

    def remove(self) -> None:
        """Take every hook off."""
        for h in (*self._root, *self._modules):
            h.remove()
        self._root.clear()
        self._modules.clear()

    def _recording_pre(self, name: str, own: list[torch.nn.Parameter]) -> Callable[..., None]:
        def pre(*_a: Any) -> None:
            self._fetcher.recorder.enter(name)
            if own and not torch.compiler.is_compiling():
                self.check_rootless(name, {self._store.param_chunk[id(p)].index for p in own})
                self._fetcher.read_params(own, "module")
        return pre

    def _module_pre(self, name: str, reads: tuple[int, ...]) -> Callable[..., None]:
        def pre(*_a: Any) -> None:
            if torch.compiler.is_compiling():
                _refuse_compiled(reads)  # a graph break: it runs, and raises, eagerly
                return
            self.check_rootless(name, reads)
            self._fetcher.read_group(reads, phase_now())
        return pre

    def check_rootless(self, name: str, chunks: Iterable[int]) -> None:
        """[Note: a forward that never runs the root] (:mod:`memsched.planning.planner`): module ``name``
        runs while parameters of ``chunks`` are host views between steps. The attached model's forward binds
        them (its hooks begin a step's reads), so none ran: the training code calls submodules directly.
        Their parameters would be read as host tensors on the device (torch's device error on a GPU):
        refused here, naming the module and the fix."""
        if self._store.backward.in_backward:
            return
        bindings = self._store.bindings
        away = sorted(i for i in chunks if bindings.host_bound(self._store.chunks[i]))
        if away:
            chunks_text = f"chunk{'s' if len(away) > 1 else ''} {', '.join(map(str, away))}"
            raise RuntimeError(
                f"memsched: module {name!r} runs outside a forward of the attached "
                f"{type(self._model).__name__}, and the parameters it reads ({chunks_text}) are on the host: "
                "memsched fetches parameters from the attached model's forward. Call the attached model (a "
                "forward that calls its parts), or attach the module you call")


@torch.compiler.disable
def _refuse_compiled(chunks: tuple[int, ...]) -> None:
    """Compiled code would read parameters kept on the host without fetching them (the fetcher's hooks
    compile to nothing, and the read guard does not see inside a graph): refused rather than read as the
    absent views' NaN.

    Raises:
        RuntimeError: always; names the chunks and what to do.
    """
    raise RuntimeError(
        f"memsched: compiled code reads parameters the plan keeps on the host or ZeRO-3 shards over the "
        f"ranks (chunks {list(chunks)}), which torch.compile does not fetch yet. Run the model eagerly, or "
        "give it room to keep every parameter on the device (a larger device, a smaller batch, or policy "
        "'cpu' if the parameters fit; zero_stage=2 keeps whole parameters on every rank)")
