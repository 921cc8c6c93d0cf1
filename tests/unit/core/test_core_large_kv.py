"""High placement: live pages really sit past 2^31 / 2^32 bytes of the pool (bug class 6, mlacheck/bugclasses.py).

Two tiers (docs/ci.md "Test tiers"). The slow tier builds the real 2 GiB / 4 GiB pools on CPU
(fp8 latent pools, one byte per element, so the 4 GiB case costs ~4 GiB of RAM). The default
run builds the same cases in a 24-bit offset model (Placement.scaled: high at 2^23 / 2^24,
8-16 MiB pools) through the same code (assign_pages, build_pool, byte_range, byte_region,
gather, the golden) and asserts the same: live pages on both sides of the boundary, the
requests' regions named relative to it, the pages past it holding exactly the request's data.
The placement arithmetic and the region names at the real 2^31 / 2^32 are checked without
allocating (the last two tests).

Build cost is dominated by the one-fill poisoning of the pool (first-touch page faults). The
20 s bound is asserted on the process CPU time of the build, which other load on the machine
does not inflate; wall time is printed next to it (measured here, quiet: 2^31 ≈ 0.4-1.8 s,
2^32 ≈ 1.7-3.3 s wall, CPU 0.9 / 1.7 s; on a machine shared with other jobs, up to ~25 s wall).
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from mlacheck import golden, inputs, kvcache
from mlacheck.spec import DecodeCase, Placement, Quant, Request

BUILD_SECONDS = 20.0
# Offset models: 24 bits (megabyte pools, the default run) and the real 32 (the slow tier:
# GiB pools, one memory_heavy test at a time, tests/conftest.py).
OFFSET_MODELS = [pytest.param(24, id="off24"),
                 pytest.param(32, marks=[pytest.mark.slow, pytest.mark.large_kv,
                                         pytest.mark.memory_heavy], id="off32")]


def _build_high(
    placement: Placement, page_size: int, fmt: str
) -> tuple[DecodeCase, inputs.DecodeInputs, float, float]:
    case = DecodeCase(
        requests=(Request(1, 300), Request(2, 700), Request(1, 33)), num_heads=4,
        page_size=page_size, quant=Quant(fmt, fmt), placement=placement,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    b = inputs.build(case)
    return case, b, time.perf_counter() - t0, time.process_time() - c0


@pytest.mark.parametrize("bits", OFFSET_MODELS)
@pytest.mark.parametrize(
    ("offset", "page_size", "fmt"),
    [(1 << 32, 1, "fp8_e4m3fn"), (1 << 31, 1, "fp8_e4m3fnuz"), (1 << 31, 64, "fp8_e4m3fn")],
    ids=["2^32-p1-fn", "2^31-p1-fnuz", "2^31-p64-fn"],
)
def test_high_placement_straddles_boundary(offset: int, page_size: int, fmt: str,
                                           bits: int) -> None:
    """`offset` is the real boundary; in the 24-bit model it becomes 2^23 / 2^24."""
    placement = Placement("high", offset_bytes=offset).scaled(bits)
    offset = placement.offset_bytes
    case, b, wall, cpu = _build_high(placement, page_size, fmt)
    assert isinstance(b, inputs.DecodeInputs)
    pool = b.pool
    print(f"\n[high placement {case.id}] built in {wall:.2f} s wall, {cpu:.2f} s CPU, "
          f"pool {pool.nbytes / 2**30:.3f} GiB")
    assert cpu < BUILD_SECONDS
    assert pool.nbytes > offset  # the pool really is larger than 2 GiB / 4 GiB (or 8 / 16 MiB)
    signed, unsigned = placement.wraps
    name = f"above 2^{bits}" if offset == unsigned else f"2^{bits - 1}..2^{bits}"
    assert offset in (signed, unsigned)

    starts = [pool.page_byte_range(int(p))[0] for p in pool.table.indices]
    assert any(s >= offset for s in starts), "no live page above the boundary"
    assert any(s + pool.page_bytes <= offset for s in starts), "no live page below it"
    regions = []
    for r in range(len(case.requests)):
        lo, hi = pool.byte_range(r)
        assert 0 <= lo < hi <= pool.nbytes
        regions.append(kvcache.byte_region(lo, hi, bits))
    assert any(name in reg for reg in regions), regions
    # at least one request has a page past the boundary (not only unused pool bytes)
    assert any(pool.byte_range(r)[1] > offset for r in range(len(case.requests)))

    # the pages past the boundary hold exactly the request's data, and the golden reads them
    for r, kv in enumerate(b.kv):
        assert torch.equal(pool.gather(r), kv.dequant())
    res = golden.reference(b)
    assert torch.isfinite(res.out).all() and torch.isfinite(res.lse).all()
    del b, pool, res
    gc.collect()


def test_byte_region_names() -> None:
    assert kvcache.byte_region(0, 4096) == "below 2^31"
    assert kvcache.byte_region((1 << 31) - 8, (1 << 31) + 8) == "below 2^31 .. 2^31..2^32"
    assert kvcache.byte_region(1 << 31, 1 << 32) == "2^31..2^32"  # hi is exclusive
    assert kvcache.byte_region((1 << 32) - 1, (1 << 32) + 1) == "2^31..2^32 .. above 2^32"
    assert kvcache.byte_region(1 << 32, (1 << 32) + 100) == "above 2^32"
    assert kvcache.byte_region(0, (1 << 33)) == "below 2^31 .. above 2^32"
    # a 24-bit offset model names its own boundaries
    assert kvcache.byte_region(0, 4096, 24) == "below 2^23"
    assert kvcache.byte_region((1 << 23) - 8, (1 << 23) + 8, 24) == "below 2^23 .. 2^23..2^24"
    assert kvcache.byte_region(1 << 24, (1 << 24) + 100, 24) == "above 2^24"


def test_scale_model_placement() -> None:
    """Placement.scaled moves a 2^31 / 2^32 high placement to the 24-bit model's boundaries;
    the width is a later field: the real cases keep their ids, the model's ids say it."""
    real = Placement("high", offset_bytes=1 << 31)
    assert real.wraps == (1 << 31, 1 << 32) and real.offset_bits == 32
    model = real.scaled(24)
    assert (model.offset_bytes, model.offset_bits, model.wraps) == (1 << 23, 24, (1 << 23, 1 << 24))
    assert Placement("high", offset_bytes=1 << 32).scaled(24).offset_bytes == 1 << 24
    assert model.scaled(32) == real and real.scaled(32) == real
    case = DecodeCase(requests=(Request(1, 40),), placement=real)
    assert "offset_bits" not in case.identity_json()  # ids of existing cases unchanged
    scaled = DecodeCase(requests=(Request(1, 40),), placement=model)
    assert "-high23-off24-" in scaled.id and "-high31-" in case.id
    for bad in (8, 33, 24.0, True):
        with pytest.raises(ValueError, match="offset_bits must be an integer in 16..32"):
            Placement(offset_bits=bad)  # type: ignore[arg-type]


def test_high_placement_window_is_small_pool_math() -> None:
    """The same placement logic without allocating: the window starts ~half the live pages
    below the boundary page and live pages lie on both sides of it."""
    gen = torch.Generator().manual_seed(0)
    lens = [300, 700, 33]
    page_bytes = 576  # page size 1, fp8
    table, pool_pages = kvcache.assign_pages(lens, 1, page_bytes, Placement("high", 1 << 32), gen)
    live = sum(lens)
    boundary = -(-(1 << 32) // page_bytes)
    assert pool_pages == boundary - live // 2 + live + 8
    idx = table.indices
    assert int(idx.min()) >= boundary - live // 2 and int(idx.max()) < pool_pages
    assert int((idx < boundary).sum()) >= live // 2 - 8 and int((idx >= boundary).sum()) >= live // 2
