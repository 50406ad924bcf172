"""Llama-class presets: the public shapes of the models offload users fine-tune (issue 42), built with
Hugging Face transformers' ``LlamaForCausalLM`` (Qwen2.5 has the same block with biases on q/k/v:
``Qwen2ForCausalLM``) for ``memsched plan --model NAME`` and anything else that traces a workload
(:mod:`memsched.target`).

The shapes come from each model's ``config.json`` on the Hugging Face Hub (``source`` below); no weights are
read. This module imports neither torch nor transformers at import time (``memsched --help`` lists the names).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a Llama-class decoder (all counts; ``source``: where the numbers come from).

    Attributes:
        layers: decoder blocks (``num_hidden_layers``).
        hidden: model width (``hidden_size``).
        intermediate: the SwiGLU MLP's width (``intermediate_size``).
        heads: query heads (``num_attention_heads``); ``kv_heads``: key/value heads (GQA).
        vocab: vocabulary size; ``tied``: input and output embeddings shared (``tie_word_embeddings``).
        rope_theta: RoPE base; ``qkv_bias``: biases on q/k/v (Qwen2); ``family``: ``"llama"`` or ``"qwen2"``.
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float
    source: str
    qkv_bias: bool = False
    family: str = "llama"

    def num_params(self) -> int:
        """Parameters, from the shapes alone (tied embeddings counted once): embeddings, per block the
        attention projections (q and o ``hidden^2``, k and v ``hidden * kv_heads * head_dim``, q/k/v biases
        for Qwen2), the MLP ``3 * hidden * intermediate`` and two RMSNorm weights, then the final norm."""
        head_dim = self.hidden // self.heads
        kv = self.kv_heads * head_dim
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        if self.qkv_bias:
            attn += self.hidden + 2 * kv
        block = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return emb + self.layers * block + self.hidden


LLAMA_PRESETS: dict[str, LlamaShape] = {
    "llama-3.2-1b": LlamaShape(16, 2048, 8192, 32, 8, 128256, True, 500000.0,
                               "huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json"),
    "llama-3.2-3b": LlamaShape(28, 3072, 8192, 24, 8, 128256, True, 500000.0,
                               "huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json"),
    "llama-3.1-8b": LlamaShape(32, 4096, 14336, 32, 8, 128256, False, 500000.0,
                               "huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"),
    "qwen2.5-7b": LlamaShape(28, 3584, 18944, 28, 4, 152064, False, 1000000.0,
                             "huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json", qkv_bias=True,
                             family="qwen2"),
}


#: ``model_type`` values of a Hugging Face config that build as one of the two families (Mistral's block is
#: Llama's; its sliding window does not change the shapes or, up to the window, the memory)
_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def shape_from_config(config: dict[str, Any], source: str) -> LlamaShape:
    """The :class:`LlamaShape` of a Hugging Face ``config.json`` (its parsed dict) of a Llama-class model.

    Raises:
        ValueError: the ``model_type`` is not Llama-class (names the known ones) or a field is missing.
    """
    kind = config.get("model_type")
    if kind not in _FAMILIES:
        raise ValueError(f"{source}: model_type {kind!r} is not a Llama-class decoder; memsched plan builds "
                         f"{', '.join(sorted(_FAMILIES))} configs")
    try:
        heads = config["num_attention_heads"]
        return LlamaShape(layers=config["num_hidden_layers"], hidden=config["hidden_size"],
                          intermediate=config["intermediate_size"], heads=heads,
                          kv_heads=config.get("num_key_value_heads") or heads, vocab=config["vocab_size"],
                          tied=bool(config.get("tie_word_embeddings", False)),
                          rope_theta=float(config.get("rope_theta", 10000.0)), source=source,
                          qkv_bias=_FAMILIES[kind] == "qwen2", family=_FAMILIES[kind])
    except KeyError as e:
        raise ValueError(f"{source}: the config has no {e.args[0]!r}") from None


def llama_shape(name: str) -> LlamaShape | None:
    """The Llama-class shape ``name`` stands for: a preset (:data:`LLAMA_PRESETS`), a local ``config.json``
    (or a folder holding one), or a Hugging Face model id that transformers resolves (from its cache, or the
    Hub where it can reach it); ``None`` for anything else (a built-in GPT size).

    Raises:
        ValueError: a config that is not Llama-class, or an id (``owner/name``) transformers cannot resolve.
    """
    import json
    import os

    if name in LLAMA_PRESETS:
        return LLAMA_PRESETS[name]
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if path.endswith(".json") and os.path.isfile(path):
        with open(path) as f:
            return shape_from_config(json.load(f), os.path.abspath(path))
    if "/" not in name or name.endswith(".json"):
        return None
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(name)
    except ImportError as e:
        raise ImportError('a Hugging Face model id is resolved by transformers: pip install "memsched[hf]"') \
            from e
    except (OSError, ValueError) as e:
        raise ValueError(f"transformers cannot resolve the model id {name!r} (offline, or not on the Hub): "
                         f"{e}. Give the path of its config.json instead") from e
    return shape_from_config(config.to_dict(), f"huggingface.co/{name}/blob/main/config.json")


def hf_config(name: str, *, max_positions: int = 2048) -> Any:
    """The transformers config of preset ``name`` (``LlamaConfig`` or ``Qwen2Config``), with
    ``max_position_embeddings`` ``max_positions`` (RoPE: the shapes do not depend on it).

    Raises:
        ValueError: unknown name (lists the known ones).
        ImportError: transformers is not installed (``pip install "memsched[hf]"``).
    """
    shape = llama_shape(name)
    if shape is None:
        raise ValueError(f"unknown Llama-class preset {name!r}: known ones are {', '.join(LLAMA_PRESETS)}, "
                         "or the path of a config.json")
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"the {name!r} preset is built with Hugging Face transformers: "
                          'pip install "memsched[hf]"') from e
    cls = transformers.Qwen2Config if shape.family == "qwen2" else transformers.LlamaConfig
    return cls(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
               num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
               num_key_value_heads=shape.kv_heads, tie_word_embeddings=shape.tied,
               rope_theta=shape.rope_theta, max_position_embeddings=max_positions, attention_dropout=0.0)


def llama_workload(name: str, batch_size: int, seq_len: int, *, checkpointing: bool = False,
                   seed: int = 0) -> Callable[[Any], Any]:
    """A workload function (:mod:`memsched.target`) for preset ``name`` on random tokens
    ``[batch_size, seq_len]``, its loss the causal LM loss; ``checkpointing``: Hugging Face's
    ``gradient_checkpointing_enable()`` (non-reentrant), as fine-tuning scripts call it.

    Raises:
        ValueError: unknown name, or a non-positive batch size or sequence length.
        ImportError: transformers is not installed.
    """
    for what, value in (("batch size", batch_size), ("sequence length", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    config = hf_config(name, max_positions=max(2048, seq_len))

    def build(device: Any) -> Any:
        import torch
        import transformers

        from memsched.target import Workload

        torch.manual_seed(seed)
        cls = transformers.Qwen2ForCausalLM if llama_shape(name).family == "qwen2" else \
            transformers.LlamaForCausalLM
        with torch.device(device):
            model = cls(config)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()

        def loss_fn(m: Any) -> Any:
            ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)
            return m(input_ids=ids, labels=ids).loss

        return Workload(model, loss_fn, name + (" + checkpointing" if checkpointing else ""))

    build.__qualname__ = f"llama[{name}]"
    return build
