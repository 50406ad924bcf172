"""StorageAccountant and higher-order ops (``torch.ops.higher_order.*``): their bodies' ops are counted as any
op, temporaries included; what they return that no op in them made counts as new; an op with no kernel is
named (the comment "Higher-order ops" in tracer/accounting.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator

from tracer import StorageAccountant
from tracer.accounting import register_higher_order_rules

rng_prims = pytest.importorskip("torch._prims.rng_prims")
aten = torch.ops.aten
F32 = 4


def _other(acc: StorageAccountant) -> int:
    return acc.live_bytes("cpu")["other"]


def test_run_with_rng_state_counts_its_op_and_keeps_its_random_numbers():
    x = torch.randn(1000)
    state = torch.get_rng_state()
    ref = rng_prims.run_with_rng_state(state, aten.native_dropout.default, x, 0.5, True)
    acc = StorageAccountant()
    with acc:
        out, mask = rng_prims.run_with_rng_state(state, aten.native_dropout.default, x, 0.5, True)
    assert torch.equal(out, ref[0]) and torch.equal(mask, ref[1])
    assert _other(acc) == 1000 * F32 + 1000  # the output and its bool mask
    assert acc.category_of(x) is None  # the input was not made here


def test_run_and_save_rng_state_counts_the_state_and_the_output():
    x = torch.randn(100)
    acc = StorageAccountant()
    with acc:
        state, out = rng_prims.run_and_save_rng_state(aten.rand_like.default, x)
    assert _other(acc) == state.untyped_storage().nbytes() + 100 * F32
    assert acc.category_of(out) is not None


class _Body(nn.Module):
    def forward(self, a: torch.Tensor) -> tuple[torch.Tensor]:
        big = a.repeat(100)  # a temporary 100 times the input, freed before the body returns
        return (big.sum() + a,)


def test_a_graphs_temporaries_are_in_the_peak():
    """invoke_subgraph's kernel runs its graph with no mode on (it asserts so): the accountant runs the graph
    under itself, so the temporary the graph frees before returning is in the peak, not only the output."""
    invoke_subgraph = pytest.importorskip("torch._higher_order_ops.invoke_subgraph").invoke_subgraph
    x = torch.randn(1000)
    acc = StorageAccountant()
    with acc:
        (out,) = invoke_subgraph(torch.fx.symbolic_trace(_Body()), "body", x)
    peak, peak_non_model = acc.take_peaks("cpu")
    assert peak >= 100 * 1000 * F32 and peak == peak_non_model
    assert _other(acc) == 1000 * F32  # what is left: the output
    assert torch.equal(out, x.repeat(100).sum() + x)


def test_cond_runs_the_branch_it_takes_under_the_mode():
    cond = pytest.importorskip("torch._higher_order_ops.cond").cond
    x = torch.randn(100)
    acc = StorageAccountant()
    with acc:
        (out,) = cond(torch.tensor(True), lambda a: (a.repeat(10).sum() + a,), lambda a: (a * 2,), (x,))
    assert acc.take_peaks("cpu")[0] >= 10 * 100 * F32
    assert torch.equal(out, x.repeat(10).sum() + x)


def _test_hop(name: str) -> HigherOrderOperator:
    class TestHop(HigherOrderOperator):
        def __init__(self) -> None:
            super().__init__(name)

        def __call__(self, fn, *args):
            return super().__call__(fn, *args)

    hop = TestHop()
    hop.fallthrough(DispatchKey.AutogradCPU)
    return hop


def test_a_higher_order_op_without_a_kernel_is_named():
    hop = _test_hop("memsched_test_no_kernel")
    with pytest.raises(NotImplementedError, match=r"higher_order\.memsched_test_no_kernel.*dispatch key CPU"):
        with StorageAccountant():
            hop(lambda a: a, torch.ones(3))


def test_outputs_no_op_made_count_and_returned_inputs_do_not():
    """A kernel that allocates without dispatching (as inductor's code does): its output counts as new; an
    input it returns does not."""
    hop = _test_hop("memsched_test_undispatched")

    @hop.py_impl(DispatchKey.CompositeExplicitAutograd)
    def _(fn, *args):
        with torch.utils._python_dispatch._disable_current_modes():  # allocations the mode does not see
            return fn(*args)

    x = torch.ones(100)
    acc = StorageAccountant()
    with acc:
        y = hop(lambda a: a * 2, x)
        same = hop(lambda a: a, x)
    assert same is x and acc.category_of(x) is None
    assert _other(acc) == 100 * F32 and acc.category_of(y) is not None


def test_the_rules_for_torch_whose_modes_do_not_see_higher_order_ops():
    """Older torch sends a higher-order op to a mode only through a rule registered for the mode's class
    (``py_impl``): the rules run the same code."""
    hop = rng_prims.run_with_rng_state
    had = StorageAccountant in hop.python_key_table
    register_higher_order_rules([hop])
    try:
        assert StorageAccountant in hop.python_key_table
        x = torch.randn(1000)
        state = torch.get_rng_state()
        acc = StorageAccountant()
        with acc:
            out, _ = hop(state, aten.native_dropout.default, x, 0.5, True)
        assert _other(acc) == 1000 * F32 + 1000
        assert torch.equal(out, hop(state, aten.native_dropout.default, x, 0.5, True)[0])
    finally:
        if not had:
            del hop.python_key_table[StorageAccountant]
            hop._dispatch_cache.clear()
