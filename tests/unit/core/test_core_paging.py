"""Page tables (AITER / vLLM / FlashInfer conventions), CK layouts and pool gathers."""

from __future__ import annotations

import pytest
import torch

from mlacheck import fp8, inputs, kvcache, layouts
from mlacheck.kvcache import PageTable
from mlacheck.spec import (
    FORMATS,
    DecodeCase,
    Paging,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
    vector_width,
)

PAGE_SIZES = [1, 16, 64, 1024]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(fp8.int_dtype(t.dtype))


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _kv_lens(ps: int) -> list[int]:
    """Exact multiples of the page size, one-past, one-short, single tokens, odd lengths."""
    return [1, ps, ps + 1, 2 * ps, 3 * ps - 1 if ps > 1 else 3, 4 * ps, 77, 1000]


def _table(ps: int, placement: Placement | None = None, seed: int = 0) -> tuple[PageTable, int]:
    gen = torch.Generator().manual_seed(seed)
    return kvcache.assign_pages(_kv_lens(ps), ps, 4096, placement or Placement(), gen)


# --------------------------------------------------------------------------- page tables


def test_hand_built_conventions() -> None:
    """Expected values written out by hand for page size 16, kv_lens [16, 17, 1]."""
    t = PageTable(16, torch.tensor([0, 1, 3, 4]), torch.tensor([5, 2, 9, 0]), torch.tensor([16, 17, 1]))
    indptr, indices, last = t.to_aiter()
    assert indptr.tolist() == [0, 1, 3, 4] and indices.tolist() == [5, 2, 9, 0]
    assert last.tolist() == [16, 1, 1]
    assert all(x.dtype == torch.int32 for x in (indptr, indices, last))
    bt, seq = t.to_vllm(pad_value=-1)
    assert bt.tolist() == [[5, -1], [2, 9], [0, -1]] and seq.tolist() == [16, 17, 1]
    assert bt.dtype == seq.dtype == torch.int32
    fi_indptr, fi_indices, fi_lens = t.to_flashinfer()
    assert fi_indptr.tolist() == [0, 1, 3, 4] and fi_indices.tolist() == [5, 2, 9, 0]
    assert fi_lens.tolist() == [16, 17, 1]
    assert t.slots_of(1).tolist() == [2 * 16 + i for i in range(16)] + [9 * 16]
    with pytest.raises(ValueError, match="page counts"):
        PageTable(16, torch.tensor([0, 1, 2, 4]), torch.tensor([5, 2, 9, 0]), torch.tensor([16, 17, 1]))


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("kind", ["packed", "shuffled"])
def test_conventions_round_trip(ps: int, kind: str) -> None:
    t, pool_pages = _table(ps, Placement(kind, spare_pages=7))
    lens = torch.tensor(_kv_lens(ps))
    assert torch.equal(t.kv_lens, lens)
    counts = t.indptr[1:] - t.indptr[:-1]
    assert torch.equal(counts, (lens + ps - 1) // ps)
    # every live page is a distinct pool page
    assert t.indices.unique().numel() == t.indices.numel() == int(t.indptr[-1])
    assert int(t.indices.min()) >= 0 and int(t.indices.max()) < pool_pages == int(t.indptr[-1]) + 7

    last = t.last_page_lens
    assert bool(((last >= 1) & (last <= ps)).all())
    assert torch.equal(last, (lens - 1) % ps + 1)
    exact = lens % ps == 0
    assert bool(exact.any()) and torch.equal(last[exact], torch.full_like(last[exact], ps))

    a = t.to_aiter()
    assert PageTable.from_aiter(ps, *a).same_as(t)
    # index arrays padded past the end (as some kernels need) convert back the same
    padded = torch.cat([a[1], torch.full((9,), -1, dtype=torch.int32)])
    assert PageTable.from_aiter(ps, a[0], padded, a[2]).same_as(t)

    for pad in (0, -1, 123456):
        bt, seq = t.to_vllm(pad_value=pad)
        assert bt.shape == (t.batch, int(counts.max()))
        for r in range(t.batch):
            assert bt[r, : int(counts[r])].tolist() == t.pages_of(r).tolist()
            assert bool((bt[r, int(counts[r]) :] == pad).all())
        assert PageTable.from_vllm(ps, bt, seq).same_as(t)

    f = t.to_flashinfer()
    assert PageTable.from_flashinfer(ps, *f).same_as(t)
    assert PageTable.from_flashinfer(ps, f[0], torch.cat([f[1], f[1][:3]]), f[2]).same_as(t)

    # slots cover each request's tokens in order, in its own pages only
    for r in range(t.batch):
        slots = t.slots_of(r)
        assert slots.numel() == int(lens[r])
        assert set((slots // ps).tolist()) == set(t.pages_of(r).tolist())
        assert torch.equal(slots % ps, torch.arange(int(lens[r])) % ps)


def test_in_pages_of_keeps_every_slot() -> None:
    """Page p of 16 tokens is pages 4p .. 4p+3 of 4; each request keeps the pages it needs
    (a request of 0 tokens keeps none)."""
    t = PageTable(16, torch.tensor([0, 1, 3, 4, 4]), torch.tensor([5, 2, 9, 0]),
                  torch.tensor([16, 17, 1, 0]))
    small = t.in_pages_of(4)
    assert small.page_size == 4 and small.indptr.tolist() == [0, 4, 9, 10, 10]
    assert small.indices.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 36, 0]
    assert all(torch.equal(small.slots_of(r), t.slots_of(r)) for r in range(4))
    assert t.in_pages_of(16).same_as(t)
    with pytest.raises(ValueError, match="no whole number"):
        t.in_pages_of(3)


def test_of_requests_keeps_their_pages_in_order() -> None:
    """The table a call gets when other requests are left out: the same physical pages."""
    t = PageTable(16, torch.tensor([0, 1, 3, 4, 4]), torch.tensor([5, 2, 9, 0]),
                  torch.tensor([16, 17, 1, 0]))
    sub = t.of_requests([1, 2])
    assert sub.indptr.tolist() == [0, 2, 3] and sub.indices.tolist() == [2, 9, 0]
    assert sub.kv_lens.tolist() == [17, 1]
    assert all(torch.equal(sub.slots_of(i), t.slots_of(r)) for i, r in enumerate([1, 2]))
    assert t.of_requests([]).batch == 0 and t.of_requests(range(4)).same_as(t)


def test_same_as_detects_differences() -> None:
    t, _ = _table(16)
    other = PageTable(16, t.indptr.clone(), t.indices.flip(0), t.kv_lens.clone())
    assert not t.same_as(other)
    assert not t.same_as(_table(16, seed=1)[0])


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp16", "fp32"])
def test_vectorized_layouts_lossless_and_ck_shaped(fmt: str) -> None:
    vec = vector_width(fmt)
    assert vec == {"bf16": 8, "fp16": 8, "fp32": 4}.get(fmt, 16)
    g = torch.Generator().manual_seed(3)
    p, ps, h, d = 3, 32, 2, 64
    dtype = fp8.fmt(fmt).dtype
    raw = torch.randint(0, 256, (p, ps, h, d * dtype.itemsize), generator=g, dtype=torch.uint8)
    lin = raw.view(dtype)  # arbitrary bit patterns, NaN encodings included
    k = layouts.to_vectorized_k(lin, vec)
    v = layouts.to_vectorized_v(lin, vec)
    assert k.shape == (p, h, d // vec, ps, vec)  # CK K: [pages, H, D/vec, page_size, vec]
    assert v.shape == (p, h, ps // vec, d, vec)  # CK V: [pages, H, page_size/vec, D, vec]
    lb, kb, vb = _bits(lin), _bits(k), _bits(v)
    for pi, si, hi, di in [(0, 0, 0, 0), (2, 31, 1, 63), (1, 9, 0, 17), (1, 17, 1, vec + 1)]:
        assert kb[pi, hi, di // vec, si, di % vec] == lb[pi, si, hi, di]
        assert vb[pi, hi, si // vec, di, si % vec] == lb[pi, si, hi, di]
    assert _bit_equal(layouts.from_vectorized_k(k), lin)
    assert _bit_equal(layouts.from_vectorized_v(v), lin)


# --------------------------------------------------------------------------- pools

LAYOUTS = [("linear", "latent"), ("linear", "k"), ("linear", "v"), ("vectorized", "k"),
           ("vectorized", "v")]
PLACEMENTS = [Placement("packed", spare_pages=3), Placement("shuffled", spare_pages=5),
              Placement("high", offset_bytes=1 << 16, spare_pages=2)]


def _stored(shape: tuple[int, ...], fmt: str, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=g) * 3
    return fp8.quantize(x, fmt, 1.0, "saturate")


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(("layout", "kind"), LAYOUTS, ids=[f"{a}-{b}" for a, b in LAYOUTS])
def test_pool_gather_returns_written_tokens(fmt: str, layout: str, kind: str) -> None:
    g = torch.Generator().manual_seed(7)
    ps, h, d = 16, 2, 32
    lens = [1, 16, 37, 5]
    scale = torch.tensor(0.37)
    for placement in PLACEMENTS:
        values = [_stored((n, h, d), fmt, g) for n in lens]
        page_bytes = ps * h * d * fp8.fmt(fmt).itemsize
        table, n_pages = kvcache.assign_pages(lens, ps, page_bytes, placement, g)
        pool = kvcache.build_pool(values, table, n_pages, fmt, scale, "cpu", layout, kind)
        assert pool.num_pages == n_pages and pool.page_bytes == page_bytes
        assert pool.data.dtype == fp8.fmt(fmt).dtype
        lin = pool.linear()
        assert lin.shape == (n_pages, ps, h, d)
        for r, want in enumerate(values):
            got = pool.gather(r, dequant=False)
            assert _bit_equal(got, want), (placement.kind, r)
            deq = pool.gather(r)
            assert deq.dtype == torch.float32
            assert torch.equal(deq, want.float() * scale)
            slots = table.slots_of(r)
            assert _bit_equal(lin.reshape(-1, h, d)[slots], want)
        if placement.kind == "high":
            below = [p for p in table.indices.tolist() if (p + 1) * page_bytes <= 1 << 16]
            above = [p for p in table.indices.tolist() if p * page_bytes >= 1 << 16]
            assert below and above  # live pages straddle offset_bytes


@pytest.mark.parametrize(
    ("fmt", "layout"),
    [("bf16", "linear"), ("bf16", "vectorized"), ("fp8_e4m3fn", "vectorized"),
     ("fp8_e4m3fnuz", "linear")],
)
def test_built_prefill_pools_hold_the_inputs(fmt: str, layout: str) -> None:
    case = PrefillCase(
        segments=(Segment(16, 16), Segment(5), Segment(9, 40)), num_heads=2,
        quant=Quant(fmt, fmt), paging=Paging(16, layout),
    )
    b = inputs.build(case)
    assert b.k_pool is not None and b.v_pool is not None
    assert b.k_pool.kind == "k" and b.v_pool.kind == "v" and b.k_pool.layout == layout
    assert b.k_pool.table.same_as(b.v_pool.table)
    cuts = b.cu_seqlens_k.tolist()
    for i in range(len(case.segments)):
        assert _bit_equal(b.k_pool.gather(i, dequant=False), b.k.stored[cuts[i] : cuts[i + 1]])
        assert _bit_equal(b.v_pool.gather(i, dequant=False), b.v.stored[cuts[i] : cuts[i + 1]])
        assert torch.equal(b.k_pool.gather(i), b.k.dequant()[cuts[i] : cuts[i + 1]])


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_built_decode_pool_holds_the_inputs(ps: int) -> None:
    case = DecodeCase(
        requests=(Request(1, 1), Request(2, 64), Request(4, 129)), num_heads=2, page_size=ps,
        quant=Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz"),
    )
    b = inputs.build(case)
    assert b.pool.data.shape[1:] == (ps, 1, 576)
    for r, kv in enumerate(b.kv):
        assert _bit_equal(b.pool.gather(r, dequant=False), kv.stored)
        assert torch.equal(b.pool.gather(r), kv.dequant())
    assert b.qo_indptr.tolist() == [0, 1, 3, 7]
