"""The built-in GPT: shapes, loss, causality, parameter counts, presets, dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from memsched.models import GPT, GPTConfig, build_gpt, config_for, count_parameters, lm_loss, sizes


@pytest.fixture
def tiny() -> GPT:
    torch.manual_seed(0)
    return build_gpt("tiny")


def test_forward_shape_and_dtype(tiny: GPT) -> None:
    idx = torch.randint(0, 256, (3, 17))
    logits = tiny(idx)
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_initial_loss_is_near_uniform(tiny: GPT) -> None:
    # Small N(0, 0.02) weights give near-uniform predictions: loss close to ln(vocab).
    idx = torch.randint(0, 256, (4, 64))
    loss = lm_loss(tiny, idx[:, :-1], idx[:, 1:])
    assert loss.dim() == 0 and loss.requires_grad
    assert abs(loss.item() - math.log(256)) < 0.25


def test_causal_future_tokens_do_not_change_past_logits(tiny: GPT) -> None:
    tiny.eval()
    idx = torch.randint(0, 256, (2, 32))
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 7) % 256
    with torch.no_grad():
        a, b = tiny(idx), tiny(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])  # and the future positions do see the change


def test_tied_embeddings_and_parameter_count(tiny: GPT) -> None:
    assert tiny.lm_head.weight is tiny.wte.weight
    assert count_parameters(tiny) == tiny.config.num_params()
    cfg = GPTConfig(n_layer=3, n_head=4, n_embd=96, vocab_size=300, block_size=40)
    assert count_parameters(GPT(cfg)) == cfg.num_params()


def test_gpt2_small_count_matches_the_published_model() -> None:
    # GPT-2 small (Hugging Face "gpt2") has 124,439,808 parameters: same shapes, tied embeddings.
    assert config_for("gpt2-124m").num_params() == 124_439_808


def test_named_sizes_are_ordered_and_plausible() -> None:
    names = sizes()
    counts = [config_for(n).num_params() for n in names]
    assert counts == sorted(counts)
    assert names[0] == "tiny"
    assert 1.25e9 < config_for("1.3b").num_params() < 1.4e9
    assert 2.6e9 < config_for("2.7b").num_params() < 2.8e9
    assert config_for("demo").vocab_size == 256 and config_for("1.3b").vocab_size == 50257


def test_unknown_size_lists_known_sizes() -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge'.*tiny.*1.3b"):
        config_for("huge")
    with pytest.raises(ValueError, match="known sizes"):
        build_gpt("huge")


def test_bad_config_and_inputs_are_rejected(tiny: GPT) -> None:
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(n_layer=1, n_head=3, n_embd=64)
    with pytest.raises(ValueError, match="n_layer must be a positive int"):
        GPTConfig(n_layer=0, n_head=1, n_embd=64)
    with pytest.raises(ValueError, match="block_size 256"):
        tiny(torch.zeros(1, 257, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        tiny(torch.zeros(5, dtype=torch.long))


def test_meta_build_of_a_large_preset_is_cheap() -> None:
    model = build_gpt("1.3b", device="meta")
    assert model.wte.weight.device.type == "meta"
    assert count_parameters(model) == config_for("1.3b").num_params()


def test_overrides_and_dtype() -> None:
    model = build_gpt("tiny", dtype=torch.bfloat16, block_size=64)
    assert model.config.block_size == 64
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    idx = torch.randint(0, 256, (2, 16))
    assert lm_loss(model, idx, idx).dtype == torch.float32  # the loss is computed in fp32


def test_a_few_adamw_steps_fit_a_fixed_batch(tiny: GPT) -> None:
    idx = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(tiny.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        loss = lm_loss(tiny, idx[:, :-1], idx[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.5
