"""Poisoned free pages and partial-page tails, and guard rows around output buffers.

An out-of-range read (a free page, or the tail past kv_len of a partial last page) must show:
NaN in every format (fp8 NaN encodings: e4m3fn 0x7F/0xFF, e4m3fnuz 0x80), or the finite
sentinel with Placement(tail_poison="sentinel"); a golden computed through a corrupted page
table therefore yields NaN where the corruption is read, and nowhere else.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mlacheck import fp8, golden, inputs, kvcache
from mlacheck.kvcache import GUARD_ROWS, GUARD_VALUE, KVPool, PageTable
from mlacheck.spec import (
    FORMATS,
    DecodeCase,
    Paging,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
)


def read_free_page(pool: KVPool) -> torch.Tensor:
    """What a kernel gets reading a page no request owns (stored format, linear layout)."""
    free = kvcache.free_pages(pool)
    assert free.numel() > 0
    return pool.linear()[int(free[0])]


def read_tail(pool: KVPool, r: int) -> torch.Tensor:
    """The slots of request r's last page past its kv_len (stored format)."""
    t = pool.table
    last = int(t.pages_of(r)[-1])
    n = int(t.last_page_lens[r])
    assert n < t.page_size, "request has no partial last page"
    return pool.linear()[last, n:]


def _expect_nan(x: torch.Tensor, fmt: str) -> None:
    assert x.numel() > 0
    assert torch.isnan(fp8.dequantize(x)).all()
    if fp8.fmt(fmt).is_fp8:
        codes = set(x.contiguous().view(torch.uint8).unique().tolist())
        assert codes <= set(fp8.FP8_NAN_BYTES[fmt]), codes


def test_fp8_nan_encodings() -> None:
    for name, codes in fp8.FP8_NAN_BYTES.items():
        dt = fp8.fmt(name).dtype
        for c in codes:
            assert torch.isnan(torch.tensor([c], dtype=torch.uint8).view(dt).float()).all()
        assert fp8.nan_fill_value(name) == (torch.uint8, fp8.fmt(name).nan_bits)
        assert fp8.fmt(name).nan_bits in codes
    assert fp8.FP8_NAN_BYTES == {"fp8_e4m3fn": (0x7F, 0xFF), "fp8_e4m3fnuz": (0x80,)}
    # 0x80 is -0 in e4m3fn but NaN in fnuz: the poison must be per format
    assert torch.tensor([0x80], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item() == 0.0


LAYOUTS = [("linear", "latent"), ("vectorized", "k"), ("vectorized", "v")]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(("layout", "kind"), LAYOUTS, ids=[f"{a}-{b}" for a, b in LAYOUTS])
@pytest.mark.parametrize("tail_poison", ["nan", "sentinel"])
def test_free_pages_and_tails_are_poisoned(fmt: str, layout: str, kind: str, tail_poison: str) -> None:
    g = torch.Generator().manual_seed(11)
    ps, h, d, lens = 16, 2, 32, [5, 16, 21]
    values = [fp8.quantize(torch.randn(n, h, d, generator=g), fmt, 1.0, "saturate") for n in lens]
    table, n_pages = kvcache.assign_pages(lens, ps, 1024, Placement("shuffled", spare_pages=4), g)
    pool = kvcache.build_pool(values, table, n_pages, fmt, torch.tensor(0.5), "cpu", layout, kind,
                              tail_poison)
    assert kvcache.free_pages(pool).numel() == 4
    for p in kvcache.free_pages(pool).tolist():  # every free page, whatever the tail policy
        _expect_nan(pool.linear()[p], fmt)
    for r in (0, 2):  # partial last pages
        tail = read_tail(pool, r)
        assert tail.shape[0] == ps - lens[r] % ps
        if tail_poison == "nan":
            _expect_nan(tail, fmt)
        else:
            sentinel = fp8.sentinel_value(fmt)
            deq = fp8.dequantize(tail, pool.scale)
            assert torch.isfinite(deq).all()
            want = torch.tensor(sentinel).to(tail.dtype).float() * 0.5
            assert torch.equal(deq, torch.full_like(deq, float(want)))
            assert float(want) >= 0.5 * 240  # far outside realistic activations
    assert torch.isfinite(pool.gather(1)).all()  # request 1 fills its pages exactly


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3fn", "fp8_e4m3fnuz"])
def test_corrupted_page_table_gives_nan_golden(fmt: str) -> None:
    case = DecodeCase(
        requests=(Request(1, 40), Request(3, 50), Request(2, 33)), num_heads=2, page_size=16,
        quant=Quant(fmt, fmt),
    )
    b = inputs.build(case)
    good = golden.reference(b)
    assert torch.isfinite(good.out).all()
    _expect_nan(read_free_page(b.pool), fmt)

    t = b.pool.table
    indices = t.indices.clone()
    indices[int(t.indptr[1])] = int(kvcache.free_pages(b.pool)[0])  # request 1's first page
    bad_table = PageTable(t.page_size, t.indptr, indices, t.kv_lens)
    b.pool = dataclasses.replace(b.pool, table=bad_table)
    res = golden.reference(b)
    rows = slice(1, 4)  # request 1's three MTP tokens, all of which see kv position 0
    assert torch.isnan(res.out[rows]).all() and torch.isnan(res.lse[rows]).all()
    keep = [0, 4, 5]
    assert torch.equal(res.out[keep], good.out[keep])  # other requests are untouched


@pytest.mark.parametrize("tail_poison", ["nan", "sentinel"])
def test_reading_past_kv_len_shows(tail_poison: str) -> None:
    """A table whose kv_len is one too long reads the poisoned tail: NaN, or with the sentinel
    finite but far off; only the query that sees that position is affected (bottom-right)."""
    case = DecodeCase(
        requests=(Request(3, 50), Request(1, 20)), num_heads=2, page_size=16,
        placement=Placement(tail_poison=tail_poison),
    )
    b = inputs.build(case)
    good = golden.reference(b)
    t = b.pool.table
    lens = t.kv_lens.clone()
    lens[0] += 1  # 51 still fits the 4th page of 16
    b.pool = dataclasses.replace(b.pool, table=PageTable(t.page_size, t.indptr, t.indices, lens))
    res = golden.reference(b)
    assert torch.equal(res.out[3:], good.out[3:])  # request 1 untouched
    # bottom-right: only the last query of request 0 sees the new position 50 (the tail)
    assert torch.isfinite(res.out[0:2]).all() and torch.isfinite(res.lse[0:2]).all()
    if tail_poison == "nan":
        assert torch.isnan(res.out[2]).all() and torch.isnan(res.lse[2]).all()
    else:
        assert torch.isfinite(res.out[2]).all()
        assert (res.out[2] - good.out[2]).abs().max() > 10


@pytest.mark.multiseg
@pytest.mark.parametrize("layout", ["linear", "vectorized"])
def test_corrupted_prefill_table_gives_nan_golden(layout: str) -> None:
    case = PrefillCase(
        segments=(Segment(8, 8), Segment(5, 20)), num_heads=2, paging=Paging(16, layout),
        quant=Quant("fp8_e4m3fn", "fp8_e4m3fn"),
    )
    b = inputs.build(case)
    assert b.k_pool is not None and b.v_pool is not None
    t = b.k_pool.table
    indices = t.indices.clone()
    indices[int(t.indptr[1])] = int(kvcache.free_pages(b.k_pool)[0])  # segment 1's first page
    bad = PageTable(t.page_size, t.indptr, indices, t.kv_lens)
    good = golden.reference(b)
    b.k_pool = dataclasses.replace(b.k_pool, table=bad)
    b.v_pool = dataclasses.replace(b.v_pool, table=bad)
    res = golden.reference(b)
    assert torch.isnan(res.out[8:]).all() and torch.isnan(res.lse[8:]).all()
    assert torch.equal(res.out[:8], good.out[:8])


# --------------------------------------------------------------------------- guards


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_guard_rows(dtype: torch.dtype) -> None:
    g = kvcache.guarded_empty((5, 3, 4), dtype, "cpu")
    assert g.out.shape == (5, 3, 4) and g.full.shape == (5 + 2 * GUARD_ROWS, 3, 4)
    assert torch.equal(g.full, torch.full_like(g.full, GUARD_VALUE))
    assert g.violations() == []
    g.out.copy_(torch.randn(5, 3, 4))  # a kernel writing exactly its rows
    assert g.violations() == []

    g.full[GUARD_ROWS + 5, 1, 2] = 0.0  # one element one row past the end
    v = g.violations()
    assert len(v) == 1 and "row 5" in v[0] and "after" in v[0] and "1 elements" in v[0]
    assert "\n" not in v[0]

    g = kvcache.guarded_empty((5, 3, 4), dtype, "cpu")
    g.full[GUARD_ROWS - 1] = float("nan")  # a whole row before the start
    v = g.violations()
    assert len(v) == 1 and "row -1" in v[0] and "before" in v[0] and "12 elements" in v[0]

    g = kvcache.guarded_empty((5, 3, 4), dtype, "cpu")
    g.full[0, 0, 0] = GUARD_VALUE + 0.25  # any change counts
    g.full[-1] = 7.0
    v = g.violations()
    assert any("row -2" in m for m in v) and any("row 6" in m for m in v) and len(v) == 2


def test_built_inputs_carry_guarded_outputs() -> None:
    b = inputs.build(DecodeCase(requests=(Request(2, 10),), num_heads=3, page_size=1))
    assert b.out.out.shape == (2, 3, 512) and b.out.out.dtype == torch.bfloat16
    assert b.out.violations() == []
    p = inputs.build(PrefillCase(segments=(Segment(4), Segment(3, 2)), num_heads=2,
                                 quant=Quant("fp16", "fp16")))
    assert p.out.out.shape == (7, 2, 128) and p.out.out.dtype == torch.float16
    assert p.out.violations() == []
