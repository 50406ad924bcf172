"""Llama-class presets (issue 42): the public shapes of Llama 3.2 1B/3B, Llama 3.1 8B and Qwen2.5 7B, built
with transformers, and ``memsched plan --model NAME`` over them (fake tensors: nothing is allocated)."""

from __future__ import annotations

import json

import pytest
import torch

from memsched.cli.main import main
from memsched.models.llama import LLAMA_PRESETS, hf_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(LLAMA_PRESETS))
def test_each_preset_s_formula_counts_the_parameters_transformers_builds(name: str) -> None:
    """The shapes as transcribed, and the count the plan reports, against the model transformers builds from
    them (on the meta device: no memory); tied embeddings counted once."""
    shape = LLAMA_PRESETS[name]
    cls = transformers.Qwen2ForCausalLM if shape.family == "qwen2" else transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(hf_config(name))
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    assert model.config.tie_word_embeddings == shape.tied
    assert shape.source.startswith("huggingface.co/") and shape.source.endswith("/config.json")


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_memsched_plan_takes_a_llama_preset_and_plans_activation_checkpointing(capsys) -> None:
    # long enough that activations, not the embedding's gradient at backward's end, make the peak
    common = ("--model", "llama-3.2-1b", "--dtype", "bf16", "--batch-size", "2", "--seq-len", "2048",
              "--capacity", "24GiB", "--host-memory", "128GiB")
    plain = _plan(capsys, *common)
    ckpt = _plan(capsys, *common, "--checkpointing")
    w = plain["workload"]
    assert (w["model"], w["dtype"], w["parameters"]) == \
        ("llama-3.2-1b", "bfloat16", LLAMA_PRESETS["llama-3.2-1b"].num_params())
    assert w["source"] == LLAMA_PRESETS["llama-3.2-1b"].source and ckpt["workload"]["checkpointing"] is True
    # checkpointing keeps fewer activations: less non-model data at the peak
    assert ckpt["trace"]["peak_non_model_bytes"] < plain["trace"]["peak_non_model_bytes"]
    # every chunk on the host: at least the fp32 master and both moments, 12 bytes per parameter
    assert plain["plans"]["cpu"]["host_bytes"] >= 12 * w["parameters"]


@pytest.mark.parametrize(("args", "match"), [
    (("--model", "tiny", "--checkpointing"), "--checkpointing applies to a Llama-class --model"),
    (("--model", "llama-3.2-1b", "--lora", "4"), "--lora applies to the built-in GPT sizes"),
])
def test_options_that_do_not_apply_are_refused(args, match, capsys) -> None:
    assert main(["plan", *args, "--capacity", "8GiB"]) == 2
    assert match in capsys.readouterr().err


def test_memsched_plan_takes_a_hugging_face_config_json(tmp_path, capsys) -> None:
    """A model's own ``config.json`` (here a small Mistral, whose block is Llama's, with GQA), as a file or
    its folder: the plan builds its shapes; a config of another architecture is refused by name."""
    config = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "rope_theta": 1e6,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from memsched.models.llama import llama_shape

    shape = llama_shape(str(tmp_path))
    # embeddings in and out, per block q/o 64x64, k/v 64x32, the MLP 3 x 64 x 160, two norms; the final norm
    assert shape.num_params() == 2 * 320 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + 2 * 64) + 64
    r = _plan(capsys, "--model", str(tmp_path / "config.json"), "--dtype", "bf16", "--batch-size", "1",
              "--seq-len", "32", "--capacity", "1GiB", "--no-largest-preset")
    assert r["workload"]["parameters"] == shape.num_params()
    assert r["workload"]["source"] == str(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    assert main(["plan", "--model", str(tmp_path), "--capacity", "1GiB"]) == 2
    assert "model_type 'gpt2' is not a Llama-class decoder" in capsys.readouterr().err
