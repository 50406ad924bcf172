"""memsched.chunks.fingerprint: equal buffers give equal fingerprints; any one- or two-element change, any
scaling and any swap (inside a slice or across slices) gives a different one, in every float dtype."""

from __future__ import annotations

import pytest
import torch

from memsched.chunks import fingerprint
from memsched.chunks.fingerprint import Fingerprinter


@pytest.fixture(autouse=True)
def small_slices(monkeypatch):
    monkeypatch.setattr(fingerprint, "SLICE", 64)  # several slices in a small buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fingerprint_sees_every_small_change(dtype):
    fp = Fingerprinter().of
    torch.manual_seed(0)
    g = torch.randn(300).to(dtype)
    base = fp(g)
    assert torch.equal(base, fp(g.clone()))
    assert base.dtype == torch.int64 and base.shape == (2,)

    def changed(h: torch.Tensor) -> bool:
        return not torch.equal(base, fp(h))

    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    one = g.clone()
    one.view(int_dtype)[17] += 1  # one ulp
    assert changed(one)
    for i, j in [(3, 40), (3, 70), (10, 74), (0, 299)]:  # same slice, other slices, same offset in the slice
        swap = g.clone()
        swap[[i, j]] = swap[[j, i]]
        if not torch.equal(swap, g):
            assert changed(swap), (i, j)
    bits = g.clone().view(int_dtype)
    bits[5] += 1
    bits[200] -= 1  # +d and -d keep the plain sum: the weighted sum sees it
    assert changed(bits.view(dtype))
    assert changed(g * 0.5) and changed(torch.zeros_like(g))
    assert not changed(g.clone())
