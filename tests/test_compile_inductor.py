"""Compiled training with inductor on the CPU is bit-exact against compiled ``torch.optim.AdamW(fused=True)``
(issue 41, item 5), on a transformer none of this project's models resembles (``tests/_compile_models.py``),
in both orders, without a graph break.

Two settings make the comparison meaningful, as docs/compile.md explains:

- ``torch.use_deterministic_algorithms(True)``: otherwise inductor's CPU code for the embedding's backward
  accumulates rows with ``atomic_add`` from several OpenMP threads, and compiled torch alone differs from
  itself run to run;
- the reference's first step runs eagerly (``force_eager``), as memsched's traced warmup step does.
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
from torch._dynamo.utils import counters

import memsched
from tests._compile_models import batches, loss, unfamiliar_transformer

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6: no stance")]

STEPS = 4  # the traced eager step, the step that compiles, then two compiled ones
LR, WD = 1e-3, 0.1


@pytest.fixture(scope="module")
def deterministic():
    """Deterministic algorithms for the module (see the module docstring), as they were after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _step(compiled, model, opt, backward, batch: torch.Tensor, eager: bool) -> torch.Tensor:
    with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
        value = loss(compiled, batch, model.vocab)
    backward(value)
    opt.step()
    opt.zero_grad()
    return value.detach()


@pytest.fixture(scope="module")
def reference(deterministic):
    """The model, its batches, and what the compiled reference holds after :data:`STEPS` steps: parameters,
    optimizer state (by parameter name), losses. Trained once for both orders."""
    torch._dynamo.reset()
    model = unfamiliar_transformer()
    data = batches(model, STEPS)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=WD,
                            fused=True)
    compiled = torch.compile(ref)  # inductor
    losses = [_step(compiled, ref, opt, lambda v: v.backward(), b, eager=i == 0) for i, b in enumerate(data)]
    state = {n: {k: opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")}
             for n, p in ref.named_parameters() if p.requires_grad}
    return model, data, dict(ref.named_parameters()), state, losses


@pytest.mark.parametrize("order", ["attach-then-compile", "compile-then-attach"])
def test_inductor_on_the_cpu_is_bit_exact_against_compiled_adamw(reference, order):
    initial, data, ref_params, ref_state, ref_losses = reference
    model = copy.deepcopy(initial)
    torch._dynamo.reset()  # the reference's frames and counters apart from memsched's
    counters.clear()
    if order == "compile-then-attach":
        compiled = torch.compile(model)
        sched = memsched.attach(model, device="cpu", lr=LR, weight_decay=WD)
    else:
        sched = memsched.attach(model, device="cpu", lr=LR, weight_decay=WD)
        compiled = torch.compile(model)
    with sched:
        losses = [_step(compiled, model, sched.optimizer, sched.backward, b, eager=False) for b in data]
        state = sched.optimizer.state_dict()["state"]
    # the compiled steps: one graph, no break, no recompilation
    assert counters["frames"]["ok"] > 0
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)), (losses, ref_losses)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref_params[n].detach()), n
    # memsched numbers its state as its param_groups list the parameters: all, frozen ones too, in order
    names = [n for n, _ in model.named_parameters()]
    assert {names[i] for i in state} == set(ref_state)
    for i, s in state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s[k], ref_state[names[i]][k]), (names[i], k)


def test_the_compile_bench_trains_this_transformer(tmp_path, monkeypatch):
    """``bench/compile_step.py --model unfamiliar`` (aot_eager here, no C++ compiler needed; its inductor runs
    are committed): bit-identical with no graph break, and the process's threads and deterministic setting are
    left as they were."""
    from bench import compile_step

    monkeypatch.setenv("MEMSCHED_BENCH_OUT", str(tmp_path))
    threads, before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    assert compile_step.main(["--model", "unfamiliar", "--size", "tiny", "--device", "cpu", "--backend",
                              "aot_eager", "--blocks", "1", "--block", "1", "--warmup", "2",
                              "--own-process-steps", "0", "--threads", "1", "--name", "compile"]) == 0
    result = json.loads((tmp_path / "compile.json").read_text())
    assert result["bit_identical"] and result["control_bit_identical"]
    assert result["relative_difference"] == 0.0
    assert result["graph_breaks_total"] == 0
    assert (result["config"]["batch"], result["config"]["seq_len"]) == (4, 16)  # the model's, not --batch's
    assert torch.get_num_threads() == threads and torch.are_deterministic_algorithms_enabled() == before
