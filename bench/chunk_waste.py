"""Chunk padding: the elements each model's chunks hold beyond its parameters, with memsched's chunk-size
search (:func:`memsched.chunks.layout.search_chunk_size`).

Run ``python bench/chunk_waste.py`` from the repository root (a second or so: the models are built on the
``meta`` device and only their parameter sizes are packed). The result goes to
``bench/results/chunk_waste.json`` via :func:`bench._machine.write_result`.

Models: the GPT presets from ``tiny`` to ``2.7b`` (fp32, one param group, tied embeddings counted once), the
demo's model, ResNet-18 and ResNet-50 shaped models built from torch layers (no torchvision needed; ResNet-50
also with timm's two param groups: weight decay on the convolution and linear weights, none on norms and
biases) and a LoRA model (a frozen GPT ``small`` with rank-8 adapters on its feed-forward layers,
:func:`memsched.models.lora.add_lora`: the adapters are packed, and the frozen base in chunks of its own). Per
model: ``parameters`` (packed elements, the frozen ones included), ``largest_param`` (elements), and for two
layouts, ``exact`` (memsched with one rank: each chunk as long as what it holds, a parameter larger than the
searched size in a chunk of its own, [Note: exact chunks] in :mod:`memsched.chunks.layout`) and ``uniform``
(every chunk of the searched size, as PatrickStar and Gemini do, and memsched with more ranks), each packed
as memsched packs, every parameter at a multiple of :data:`memsched.chunks.PARAM_ALIGN` elements ([Note:
parameter alignment in chunks]):
``chunk_numel`` (the searched size), ``chunks``, ``largest_chunk``, ``smallest_chunk``, ``padding_numel`` and
``padding_pct`` (padding over the parameters, percent).

Target (issue 31): padding at most 5 % of the parameter bytes for every model, unless one parameter alone is
larger than the device allows for a chunk. Uniform chunks of a size between the largest parameter and an
eighth of the model make a model with one tensor much larger than the rest pay for it in every chunk; exact
chunks have no padding with one rank but the alignment gaps between parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._machine import write_result  # noqa: E402
from memsched.chunks import PARAM_ALIGN  # noqa: E402
from memsched.chunks.layout import build_layout  # noqa: E402
from memsched.models import config_for  # noqa: E402
from memsched.models.gpt import GPT  # noqa: E402
from memsched.models.lora import add_lora  # noqa: E402

GPT_SIZES = ["tiny", "demo", "small", "gpt2-124m", "125m", "350m", "760m", "1.3b", "2.7b"]


# ---- ResNet shapes from torch layers ----------------------------------------------------------------------
class Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.down = (nn.Sequential(nn.Conv2d(cin, width, 1, stride, bias=False), nn.BatchNorm2d(width))
                     if stride != 1 or cin != width else None)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.down = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                     if stride != 1 or cin != out else None)


def resnet(block: type, layers: list[int], classes: int = 1000) -> nn.Module:
    """The parameter shapes of torchvision's ResNet (v1.5), built from torch layers."""
    m = nn.Module()
    m.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
    m.bn1 = nn.BatchNorm2d(64)
    cin = 64
    for i, (n, width) in enumerate(zip(layers, [64, 128, 256, 512], strict=True)):
        blocks = []
        for j in range(n):
            blocks.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
            cin = width * block.expansion
        setattr(m, f"layer{i + 1}", nn.Sequential(*blocks))
    m.fc = nn.Linear(cin, classes)
    return m


def timm_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """timm's ``param_groups_weight_decay``: decay for weights of 2+ dims, none for norms and biases."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    return [decay, rest]


# ---- LoRA --------------------------------------------------------------------------------------------------
def lora_gpt(size: str, r: int = 8) -> nn.Module:
    """GPT ``size`` frozen, with rank-``r`` adapters on its feed-forward layers (``memsched plan --lora``)."""
    return add_lora(GPT(config_for(size)), r)


# ---- measuring ---------------------------------------------------------------------------------------------
def unique_trainable(params: list[nn.Parameter]) -> list[int]:
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p.numel())
    return out


def measure(name: str, groups: list[list[nn.Parameter]]) -> dict[str, Any]:
    numels = [g for g in (unique_trainable(g) for g in groups) if g]
    # the frozen parameters: a group of their own, after the trainable ones (memsched.chunks.store)
    frozen = list({id(p): p.numel() for g in groups for p in g if not p.requires_grad}.values())
    numels += [frozen] if frozen else []
    row: dict[str, Any] = {"model": name, "param_groups": len(numels),
                           "largest_param": max(n for g in numels for n in g)}
    for key, exact in (("exact", True), ("uniform", False)):
        layout = build_layout(numels, align=PARAM_ALIGN, exact=exact)
        used = layout.total_numel - layout.waste_numel
        row["parameters"] = used
        row[key] = {"chunk_numel": layout.chunk_numel, "chunks": layout.n_chunks,
                    "largest_chunk": max(layout.numels), "smallest_chunk": min(layout.numels),
                    "padding_numel": layout.waste_numel,
                    "padding_pct": round(100 * layout.waste_numel / used, 2)}
    return row


def main() -> int:
    rows = []
    with torch.device("meta"):
        for size in GPT_SIZES:
            rows.append(measure(f"gpt {size}", [list(GPT(config_for(size)).parameters())]))
        r18, r50 = resnet(Basic, [2, 2, 2, 2]), resnet(Bottleneck, [3, 4, 6, 3])
        rows.append(measure("resnet-18 (torch layers)", [list(r18.parameters())]))
        rows.append(measure("resnet-50 (torch layers)", [list(r50.parameters())]))
        rows.append(measure("resnet-50, timm's two param groups", timm_groups(r50)))
        rows.append(measure("lora r=8 on a frozen gpt small", [list(lora_gpt("small").parameters())]))
    for row in rows:
        e, u = row["exact"], row["uniform"]
        print(f"{row['model']:<36} exact: {e['chunks']:>3} chunks of <= {e['largest_chunk']:>11,}, padding "
              f"{e['padding_pct']:6.2f} %   uniform: {u['chunks']:>3} x {u['chunk_numel']:>11,}, padding "
              f"{u['padding_pct']:6.2f} %")
    path = write_result("chunk_waste", {"target_padding_pct": 5.0, "models": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
