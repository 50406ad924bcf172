"""Chunk layout (size search, packing), chunk buffers, parameter views, gradient hooks, moves, re-packing."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from memsched.chunks import (
    PARAM_ALIGN,
    Allocator,
    ChunkStore,
    build_layout,
    chunk_bytes,
    ordered_groups,
    search_chunk_size,
)
from memsched.chunks.layout import _greedy_waste
from memsched.planning.problem import build_problem
from policies.types import DEVICE, HOST
from tests._numerics import same


def brute_force_best(groups: list[list[int]], min_chunks: int) -> int:
    lo = max(n for g in groups for n in g)
    hi = max(lo, -(-sum(n for g in groups for n in g) // min_chunks))
    return min(range(lo, hi + 1), key=lambda c: (_greedy_waste(groups, c), c))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=12), min_size=1, max_size=3),
       st.integers(1, 10))
def test_search_matches_brute_force_on_small_cases(groups, min_chunks):
    # Exact whenever the candidate range fits max_candidates (here always).
    c = search_chunk_size(groups, min_chunks=min_chunks, max_candidates=10_000)
    assert c == brute_force_best(groups, min_chunks)


def test_search_waste_exact_and_grid_on_large_ranges():
    rnd = random.Random(0)
    numels = [rnd.randint(1, 5000) for _ in range(300)]
    c = search_chunk_size(numels, max_candidates=64)
    layout = build_layout(numels, chunk_numel=c)
    assert layout.waste_numel == _greedy_waste([numels], c)
    # The grid result is never worse than the smallest legal size (always a candidate).
    assert layout.waste_numel <= _greedy_waste([numels], max(numels))
    assert layout.n_chunks >= 8


@pytest.mark.parametrize("numels", [[10] * 100, [3, 7, 2, 9, 4, 4, 1, 8, 6, 5] * 5])
def test_layout_packs_in_order_without_splitting(numels):
    layout = build_layout(numels)
    assert layout.n_chunks >= 8  # the model allows at least 8 chunks
    seen = []
    for ci, slots in enumerate(layout.chunks):
        assert layout.used_numel(ci) <= layout.chunk_numel
        end = 0
        for s in slots:
            assert s.chunk == ci and s.offset == end and s.numel == numels[s.index]
            end += s.numel
            seen.append(s.index)
    assert seen == list(range(len(numels)))


def test_layout_groups_never_share_a_chunk():
    layout = build_layout([[5, 5, 5], [5, 5]], chunk_numel=12)
    assert layout.chunk_groups == (0, 0, 1)
    assert [[s.index for s in c] for c in layout.chunks] == [[0, 1], [2], [0, 1]]
    assert layout.waste_numel == 3 * 12 - 25


def test_layout_errors_name_the_value():
    with pytest.raises(ValueError, match="largest parameter \\(9 elements\\), got 4"):
        build_layout([9, 1], chunk_numel=4)
    with pytest.raises(ValueError, match="item 1 is 0"):
        build_layout([3, 0])
    with pytest.raises(ValueError, match="no parameters"):
        build_layout([[]])


def test_ordered_groups_puts_used_first_and_keeps_the_rest():
    a, b, c, d = (nn.Parameter(torch.zeros(i + 1)) for i in range(4))
    assert ordered_groups([[a, b, c, d]], [c, a]) == [[c, a, b, d]]


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        return self.head(self.frozen(torch.relu(self.mid(self.emb(idx)))))


def make_store(model, chunk_numel=None, **kw):
    params = [p for p in model.parameters() if p.requires_grad]
    return ChunkStore([params], Allocator(torch.device("cpu")), chunk_numel=chunk_numel, **kw)


def test_parameters_become_views_tied_once_frozen_untouched():
    torch.manual_seed(0)
    m = Tied()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    frozen_ptr = m.frozen.weight.data_ptr()
    store = make_store(m, chunk_numel=48)
    assert sum(len(c.params) for c in store.chunks) == 3  # emb.weight (= head.weight), mid.weight, mid.bias
    assert m.head.weight is m.emb.weight
    assert m.frozen.weight.data_ptr() == frozen_ptr and m.frozen.weight.grad is None
    for n, p in m.named_parameters():
        assert same(p, before[n]), n
        if p.requires_grad:
            c = store.param_chunk[id(p)]
            base = c.data.data_ptr()
            assert base <= p.data_ptr() < base + c.numel * c.data.element_size()
            assert p.grad is None and c.grad is None  # no gradient (buffer) before a backward makes one
    # Writing the chunk buffer is seen by the module (views, not copies).
    c = store.param_chunk[id(m.mid.bias)]
    off, n = store.param_range[id(m.mid.bias)]
    c.data[off:off + n] = 7.0
    assert torch.all(m.mid.bias == 7.0)


def test_gradients_land_in_the_flat_buffer_and_readiness_fires_once_per_chunk():
    torch.manual_seed(0)
    m = Tied()
    ready = []
    store = make_store(m, chunk_numel=48, on_grads_ready=lambda c: ready.append(c.index))
    idx = torch.randint(0, 10, (6,))
    m(idx).sum().backward()
    assert sorted(ready) == list(range(len(store.chunks)))
    g_emb = m.emb.weight.grad.clone()
    # Reference gradients from an untouched copy.
    torch.manual_seed(0)
    ref = Tied()
    ref(idx).sum().backward()
    assert torch.allclose(g_emb, ref.emb.weight.grad)
    assert torch.allclose(m.mid.weight.grad, ref.mid.weight.grad)
    # The user sets grads to None (nn.Module.zero_grad): autograd makes new tensors; the hook puts them back.
    m.zero_grad(set_to_none=True)
    assert m.mid.weight.grad is None
    m(idx).sum().backward()
    assert m.mid.weight.grad.data_ptr() == store.grads.view(m.mid.weight).data_ptr()
    assert torch.allclose(m.mid.weight.grad, ref.mid.weight.grad)
    store.grads.zero_grad()  # set_to_none: the gradient buffers are freed
    assert all(c.grad is None for c in store.chunks) and all(p.grad is None for p in store.params())
    assert all(not c.ready for c in store.chunks)
    m(idx).sum().backward()  # made again by the next backward, with the same gradients
    assert torch.allclose(m.mid.weight.grad, ref.mid.weight.grad)
    store.grads.zero_grad(set_to_none=False)  # zeroed in place, views kept
    assert all(torch.count_nonzero(c.grad) == 0 for c in store.chunks)
    assert m.mid.weight.grad.data_ptr() == store.grads.view(m.mid.weight).data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_bytes_match_the_real_tensors(dtype):
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    store = make_store(m, chunk_numel=80, compute_dtype=dtype)
    alloc = store.alloc
    for placement in (HOST, DEVICE):
        for c in store.chunks:
            # exact: as long as what it holds, rounded up to the alignment ([Note: exact chunks])
            assert c.numel == -(-max(off + n for off, n in c.ranges) // PARAM_ALIGN) * PARAM_ALIGN
            cb = chunk_bytes(c.numel, compute_dtype=dtype, n_params=len(c.params))
            expected = cb.host_state_bytes if placement == HOST else cb.device_state_bytes
            c.init_state(placement, alloc)
            real = sum(t.numel() * t.element_size() for t in c.state_tensors())
            assert real == expected
            grad = store.grads.alloc(c)  # made by the first backward
            assert c.data.numel() * c.data.element_size() + grad.numel() * grad.element_size() \
                == cb.resident_bytes
    assert m[0].weight.dtype == dtype


def test_parameters_start_at_multiples_of_param_align_in_their_chunk():
    """[Note: parameter alignment in chunks]: the gaps (and an exact chunk's end, rounded up to the alignment)
    count as padding; the store packs that way, and each buffer of a chunk's optimizer state, one allocation,
    starts aligned."""
    layout = build_layout([100, 3, 50, 7], chunk_numel=2 * PARAM_ALIGN + 50, align=PARAM_ALIGN, exact=True)
    assert [[(s.offset, s.numel) for s in c] for c in layout.chunks] == [[(0, 100), (128, 3), (256, 50)],
                                                                         [(0, 7)]]
    assert layout.numels == (384, 128) and layout.waste_numel == 384 + 128 - 160
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 3))
    store = make_store(m, chunk_numel=1000)
    (c,) = store.chunks
    assert c.numel == 6 * PARAM_ALIGN
    for p in m.parameters():
        off, n = store.param_range[id(p)]
        assert off % PARAM_ALIGN == 0 and n == p.numel()
        assert p.data_ptr() - c.data.data_ptr() == off * 4
    c.init_state(DEVICE, store.alloc)
    assert (c.exp_avg_sq.data_ptr() - c.exp_avg.data_ptr()) % (4 * PARAM_ALIGN) == 0


def test_moves_are_bit_exact_round_trips():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    store = make_store(m, chunk_numel=PARAM_ALIGN + 8)
    c = store.chunks[0]
    n = 2 * PARAM_ALIGN
    assert c.numel == n  # the first layer: 8 x 8, the alignment gap, 8, the gap to the chunk's aligned end
    c.init_state(HOST, store.alloc, exp_avg=torch.randn(n), exp_avg_sq=torch.rand(n),
                 steps=[3] * len(c.params))
    snap = [t.clone() for t in (c.master, c.exp_avg, c.exp_avg_sq, c.steps)]
    assert c.move_to(DEVICE, store.alloc) == 3 * n * 4
    assert c.master is None and c.host_grad is None
    assert same(c.data, snap[0]) and same(c.exp_avg, snap[1]) and same(c.steps, snap[3])
    c.move_to(HOST, store.alloc)
    for a, b in zip((c.master, c.exp_avg, c.exp_avg_sq, c.steps), snap, strict=True):
        assert same(a, b)
    with pytest.raises(ValueError, match="placement must be"):
        c.move_to("gpu", store.alloc)


def test_repack_moves_state_with_parameters():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2))
    store = make_store(m, chunk_numel=42)
    for i, c in enumerate(store.chunks):
        c.init_state(HOST if i % 2 else DEVICE, store.alloc, exp_avg=torch.randn(c.numel),
                     exp_avg_sq=torch.rand(c.numel), steps=[5] * len(c.params))

    def per_param():
        out = {}
        for p in store.params():
            c = store.param_chunk[id(p)]
            off, n = store.param_range[id(p)]
            out[id(p)] = tuple(t.clone() for t in (p.detach(), c.exp_avg[off:off + n],
                                                    c.exp_avg_sq[off:off + n], c.master_view()[off:off + n]))
        return out

    before = per_param()
    order = list(m[2].parameters()) + list(m[0].parameters()) + list(m[1].parameters())
    assert store.repack(order)
    assert store.chunks[0].params[0] is m[2].weight
    after = per_param()
    for k, vals in before.items():
        for a, b in zip(vals, after[k], strict=True):
            assert same(a, b)
    assert all(torch.all(c.steps == 5) for c in store.chunks)
    assert not store.repack(order)  # same layout again: nothing to do


def test_build_problem_on_meta_matches_the_real_chunks():
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 32))
    real = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 32))
    real.register_buffer("stat", torch.zeros(10))
    meta.register_buffer("stat", torch.zeros(10, device="meta"))
    problem, layout = build_problem(meta, 1000, 10**6, gpu_margin_mem_ratio=0.5)
    store = make_store(real)
    assert layout == store.layout
    # compute buffers and the buffer; the gradient buffers of the host chunks offloading at once (the two
    # largest) count while any chunk is on the host
    sizes = [c.data.nbytes for c in store.chunks]
    assert len(sizes) == 3 and sizes == [4 * n for n in layout.numels]  # 8192 and 4096 in chunks of their own
    resident = sum(sizes) + 40
    assert problem.resident_model_bytes == resident
    assert problem.host_grad_working_bytes == sum(sorted(sizes)[-2:])
    one, _ = build_problem(meta, 1000, 10**6, grad_working_chunks=1)
    assert one.host_grad_working_bytes == max(sizes)
    assert problem.margin_bytes == 10**6 - 1000 - resident
    steps = [4 * len(slots) for slots in layout.chunks]  # one fp32 step count per parameter
    # on the device: moments and step counts, and the chunk's gradients stay there too (fp32)
    assert [c.device_bytes for c in problem.chunks] == [n * (8 + 4) + s
                                                        for n, s in zip(layout.numels, steps, strict=True)]
    mixed, _ = build_problem(meta, 0, 10**6, master_weights=True)
    n0 = layout.numels[0]
    assert mixed.chunks[0].device_bytes == n0 * (12 + 2) + steps[0]
    # fp32 master and moments and bf16 host gradients (the update's fp32 gradients: one scratch shared by
    # the chunks, [Note: one fp32 gradient scratch]); the parameters' bf16 copy only where a plan keeps them
    # on the host ([Note: lean host chunks])
    assert mixed.chunks[0].host_bytes == n0 * (12 + 2) + steps[0]
    assert mixed.chunks[0].param_host_bytes == 2 * n0
    # a GPU that cannot read host memory in place: the parameters read their host copy between steps
    no_views, _ = build_problem(meta, 0, 10**6, master_weights=True, host_views=False)
    assert no_views.chunks[0].host_bytes == n0 * (12 + 2 + 2) + steps[0]
    assert no_views.chunks[0].param_host_bytes == 0
    # overlap: an fp32 gradient buffer per chunk, and the host copy of the parameters (the H2D source)
    overlapped, _ = build_problem(meta, 0, 10**6, master_weights=True, private_grads=True)
    assert overlapped.chunks[0].host_bytes == n0 * (16 + 2 + 2) + steps[0]
    assert overlapped.chunks[0].param_host_bytes == 0
    zero2, zlayout = build_problem(meta, 0, 10**6, world_size=4)  # more ranks: uniform chunks
    assert zlayout.uniform and zero2.chunks[0].device_bytes == -(-zlayout.chunk_numel // 4) * 8 + steps[0]
    with pytest.raises(ValueError, match="world_size"):
        build_problem(meta, 0, 10**6, world_size=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_state_is_one_allocation_and_the_plan_counts_it_pinned(dtype):
    import mmap

    from memsched.chunks import pinned_bytes
    from memsched.planning.problem import build_problem
    from policies.types import HOST

    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    store = make_store(m, chunk_numel=80, compute_dtype=dtype)
    c = store.chunks[0]
    c.init_state(HOST, store.alloc)
    storages = {t.untyped_storage().data_ptr() for t in c.state_tensors()}
    assert len(storages) == 1  # master, moments, step, host gradient, staging: one (pinned) allocation
    cb = chunk_bytes(c.numel, compute_dtype=dtype, n_params=len(c.params))
    assert c.state_tensors()[0].untyped_storage().nbytes() == cb.host_state_bytes == c.state_nbytes()
    page = mmap.PAGESIZE  # pinned in whole pages (memsched.devices.pinned), not a power of two
    assert pinned_bytes(cb.host_state_bytes) == -(-cb.host_state_bytes // page) * page
    assert pinned_bytes(page) == page and pinned_bytes(page + 1) == 2 * page
    assert pinned_bytes(3 * page + 1) == 4 * page and pinned_bytes(5 * page + 1) == 6 * page
    assert pinned_bytes(1025, pinned=False) == 1025
    problem, _ = build_problem(m, 0, 2**30, chunk_numel=80, compute_dtype=dtype, pinned=True)
    assert problem.chunks[0].host_bytes == pinned_bytes(cb.host_state_bytes)


def test_building_chunks_of_a_model_already_on_the_device_peaks_near_its_final_size():
    """Each chunk binds its parameters as soon as it is built, so their old storage is freed before the next
    chunk is allocated: the peak is the chunks' compute buffers plus one chunk, not that plus every parameter
    (no gradient buffer exists before a backward)."""
    from tracer.accounting import StorageAccountant
    from tracer.categories import Category

    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(16)])
    param_bytes = sum(p.numel() * 4 for p in m.parameters())
    peak = [0]
    acc = StorageAccountant(on_allocate=lambda _d, _n, live: peak.__setitem__(0, max(peak[0], live)))
    for p in m.parameters():
        acc.classify(p, Category.PARAMETER)  # the model is "on the device" already
    with acc:
        store = make_store(m, chunk_numel=64 * 64 + 64)  # one layer per chunk: 16 chunks
        final = acc.total_bytes("cpu")
    acc.close()
    chunk_bytes_ = store.layout.chunk_numel * 4  # the compute buffer of one chunk
    assert final == store.layout.total_numel * 4  # the old parameter storages are gone
    assert peak[0] <= final + param_bytes / 16 + chunk_bytes_ < 2.5 * param_bytes


def test_bindings_follow_the_lifecycle_and_refuse_what_it_does_not_allow():
    """memsched.chunks.binding: every chunk starts bound to its device buffer; a sharded chunk (ZeRO-3) comes
    back only by a gather (to DEVICE), never to host views of this rank's part; a refused change re-binds
    nothing."""
    from memsched.chunks.binding import Binding

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    store = make_store(model, chunk_numel=20)
    bindings = store.bindings
    c = store.chunks[0]
    assert [bindings.state(k) for k in store.chunks] == [Binding.DEVICE] * len(store.chunks)
    data = c.data
    bindings.to_sharded(c)
    assert bindings.state(c) is Binding.SHARDED and c.data is None
    views = [p.data for p in c.params]
    assert all(torch.isnan(v).all() and v.stride() == (0,) * v.dim() for v in views)  # absent views
    with pytest.raises(RuntimeError, match="cannot go from sharded views to host views"):
        bindings.to_host(c)
    assert bindings.state(c) is Binding.SHARDED
    assert all(p.data.data_ptr() == v.data_ptr() for p, v in zip(c.params, views, strict=True))
    bindings.data_arrived(c, data)  # a gather brought the whole buffer back
    bindings.to_device(c)
    assert bindings.state(c) is Binding.DEVICE
    assert all(p.data_ptr() == store.data_view(p).data_ptr() for p in c.params)


# ---- exact chunks (issue 31: padding at most 5 %) ----------------------------------------------------------
def test_exact_chunks_hold_only_their_parameters_and_a_large_one_gets_a_chunk_of_its_own():
    # an embedding three times an eighth of the model, in the middle of first-use order (as GPT-2's)
    numels = [100] * 5 + [5000] + [300] * 40
    exact = build_layout(numels, exact=True)
    uniform = build_layout(numels)
    assert uniform.chunk_numel >= 5000 and uniform.waste_numel > 0.2 * sum(numels)
    assert exact.waste_numel == 0
    assert exact.chunk_numel < 5000 and exact.chunk_numel <= -(-sum(numels) // 8)
    assert exact.numels == tuple(exact.used_numel(i) for i in range(exact.n_chunks))
    own = [i for i, slots in enumerate(exact.chunks) if [s.index for s in slots] == [5]]
    assert own and exact.numels[own[0]] == 5000
    # first-use order: the chunk holding parameters 0..4 (used before the embedding) comes before its chunk
    first = [min(s.index for s in slots) for slots in exact.chunks]
    assert first == sorted(first)
    slots = [s for c in exact.chunks for s in c]
    assert sorted(s.index for s in slots) == list(range(len(numels)))
    assert all(s.chunk == i for i, c in enumerate(exact.chunks) for s in c)
    assert all(s.offset + s.numel <= exact.numels[s.chunk] for s in slots)


def test_a_given_chunk_size_is_exact_too_and_still_bounds_the_uniform_chunks():
    exact = build_layout([8, 8, 3, 8], chunk_numel=16, exact=True)
    assert exact.numels == (16, 11)
    with pytest.raises(ValueError, match="largest parameter"):
        build_layout([8, 20], chunk_numel=16)


@pytest.mark.parametrize("size", ["tiny", "demo", "small", "gpt2-124m", "350m", "1.3b"])
def test_every_gpt_preset_packs_without_padding_on_one_rank(size):
    from memsched.models import config_for
    from memsched.models.gpt import GPT

    with torch.device("meta"):
        numels = [p.numel() for p in GPT(config_for(size)).parameters()]
    layout = build_layout(numels, exact=True)
    assert layout.waste_numel == 0
    assert layout.n_chunks >= 4  # the placement keeps its granularity
