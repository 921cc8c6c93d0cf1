"""FlashMLA's sparse FP8 decode (DeepSeek-V3.2) through the adapter, on a CPU.

The V3.2 cache conversion is exact (its dequantised values are bit for bit mlacheck's), the
fake `flash_mla` (tests/unit/nvidia/_nvidia_fakes.py: the 656-byte cache decoded as the sm_90
kernel does, -1 masked, LSE +inf for rows without a valid index) PASSes the premerge
`sparse-v32-*` cases through mlacheck's judge, and planted kernel faults (tile scales
ignored, tile 0's scale for every tile, index -1 read as token 0) FAIL.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _nvidia_fakes import fake_flash_mla, install, on_cpu, v32_decode  # noqa: I001  (test-local helper)

from mlacheck.backends import flashmla
from mlacheck.harness import RunOptions, run_case
from mlacheck.inputs import build
from mlacheck.kvcache import KVPool
from mlacheck.matrices import load
from mlacheck.spec import Quant, Request, SparseDecodeCase

V32 = Quant("bf16", "fp8_e4m3fn", "unit")
V32_QUANT = Quant("bf16", "fp8_e4m3fn", "unit")  # FlashMLA's sparse decode: bf16 q, e4m3fn V3.2 cache
PREMERGE_V32 = [mc.case for mc in load("premerge").cases if mc.group.startswith("sparse-v32")]
SMALL = SparseDecodeCase(requests=(Request(1, 63), Request(2, 130)), topk=64, num_heads=64,
                         page_size=61, quant=V32)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(torch.int32)


def assert_exact(pool: KVPool) -> flashmla.V32Cache:
    """The V3.2 cache dequantises (kernel dtypes, and plain fp32) to the pool's values, bit for
    bit, NaN where the pool has NaN."""
    cache = flashmla.v32_cache(pool)
    want = pool.data.reshape(-1, 576).float() * pool.scale.float()
    raw = cache.data.view(torch.uint8).reshape(-1, 656)
    fp32 = torch.cat([(raw[:, :512].view(torch.float8_e4m3fn).float().view(-1, 4, 128)
                       * raw[:, 512:528].contiguous().view(torch.float32)[..., None]).reshape(-1, 512),
                      raw[:, 528:].contiguous().view(torch.bfloat16).float()], dim=1)
    for got in (v32_decode(cache.data), fp32):
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        finite = ~torch.isnan(want)
        assert torch.equal(bits(got[finite]), bits(want[finite]))
    return cache


def tile_scales(cache: flashmla.V32Cache) -> torch.Tensor:
    return cache.data.view(torch.uint8).reshape(-1, 656)[:, 512:528].contiguous().view(torch.float32)


def test_the_v32_cache_is_exact_and_its_tile_scales_vary() -> None:
    pool = build(SMALL).pool
    assert bool(torch.isnan(pool.data.float()).any())  # poisoned free pages and tails
    cache = assert_exact(pool)
    assert cache.data.shape == (pool.num_pages, SMALL.page_size, 1, 656)
    assert cache.data.dtype == torch.float8_e4m3fn and cache.data.stride(1) == 656
    scales = tile_scales(cache)
    live = ~torch.isnan(pool.data.reshape(-1, 576)[:, :512].float()).any(dim=1)
    assert len(set(scales[live].flatten().tolist())) > 1  # across tokens and tiles
    assert bool((scales[live] != scales[live][:, :1]).any())  # within one token
    assert cache.shift_min is not None and cache.shift_max is not None
    assert 0 <= cache.shift_min < cache.shift_max and cache.tiles_kept > 0
    # the NoPE values really use the e4m3 range: every scaled tile's amax is above 224
    nope = cache.data.view(torch.uint8).reshape(-1, 656)[:, :512].view(torch.float8_e4m3fn)
    amax = nope.float().view(-1, 4, 128).abs().amax(-1)[live]
    assert bool(((amax > 224) | (scales[live] == 1.0)).all())


@pytest.mark.parametrize("scale", [1.0, 2.0**-7, 8.0])
def test_the_v32_cache_is_exact_for_wide_ranges_zero_and_nan_tiles(scale: float) -> None:
    """Tiles from the smallest e4m3 subnormal to 448, an all-zero tile, a NaN tile, -0."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, 576, generator=gen)
    x[..., :512] *= torch.exp2(torch.randint(-12, 9, (8, 4, 4), generator=gen).float()
                               ).repeat_interleave(128, dim=-1)
    x[0, 0, :128] = 0.0
    x[0, 1, 128:256] = -0.0
    x[0, 2, 300] = float("nan")
    x[0, 3, :128] = 2.0**-9  # the smallest subnormal: shifted by 17
    data = x.to(torch.float8_e4m3fn).view(8, 4, 1, 576)
    pool = build(SMALL).pool
    pool = dataclasses.replace(pool, data=data, scale=torch.tensor(scale))
    cache = assert_exact(pool)
    scales = tile_scales(cache).view(8, 4, 4)
    assert scales[0, 0, 0] == scale and scales[0, 2, 2] == scale  # zero tile, NaN tile: kept
    assert scales[0, 3, 0] == scale * 2.0**-17 and cache.shift_max == 17
    raw = cache.data.view(torch.uint8).view(8, 4, 656)
    assert raw[0, 1, 128:256].eq(0x80).all()  # -0 stays -0


def test_a_scale_that_is_no_power_of_two_is_refused() -> None:
    pool = build(SMALL).pool
    with pytest.raises(ValueError, match="power of two"):
        flashmla.v32_cache(dataclasses.replace(pool, scale=torch.tensor(0.75)))


def test_premerge_has_v32_cases_and_they_are_the_sparse_cases_flashmla_takes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The shapes the V3.2 groups promise; of every premerge and nightly sparse case the
    capability accepts exactly those groups' (the others: 16 heads, bf16 KV, amax scales)."""
    cases = PREMERGE_V32
    assert {c.num_heads for c in cases} == {64, 128} and {64, 576, 2048} <= {c.topk for c in cases}
    assert {1, 64} <= {c.page_size for c in cases} and any(c.page_size % 2 for c in cases)
    assert any(c.valid_cap == 0 for c in cases) and any(c.valid_cap for c in cases)
    assert any(len({r.q_len for r in c.requests}) > 1 for c in cases)
    assert any(r.kv_len == c.topk + d for c in cases for r in c.requests for d in (-1, 0, 1))
    install(monkeypatch, {"flash_mla": fake_flash_mla()})
    cap = on_cpu(flashmla.FlashMLABackend()).capabilities()["mla_sparse_decode"]
    for name in ("premerge", "nightly"):
        sparse = [mc for mc in load(name).cases if isinstance(mc.case, SparseDecodeCase)]
        taken = [mc for mc in sparse if cap.why_not(mc.case, "cpu") is None]
        # the covering arrays (issue 34) can draw a V3.2-shaped row too (nightly's 3-wise
        # has one): taken rightly, so the named-group check leaves them out, shape-checked
        covering = [mc for mc in taken if mc.group in ("sparse-pairwise", "sparse-3wise")]
        assert all(mc.case.num_heads in (64, 128) and mc.case.quant == V32_QUANT
                   for mc in covering), [mc.id for mc in covering]
        assert {mc.group for mc in taken if mc not in covering} == {
            mc.group for mc in sparse if mc.group.startswith("sparse-v32-fp8")}


def test_a_changed_signature_refuses_the_sparse_op_naming_the_keyword(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fm = fake_flash_mla()
    fm.flash_mla_with_kvcache = (lambda q, k_cache, block_table, cache_seqlens, head_dim_v,
                                 tile_scheduler_metadata, softmax_scale=None, causal=False: None)
    install(monkeypatch, {"flash_mla": fm})
    refusal = flashmla.FlashMLABackend().capabilities()["mla_sparse_decode"].refusal
    assert refusal and "is_fp8_kvcache" in refusal


@pytest.mark.parametrize("case", PREMERGE_V32, ids=lambda c: c.id)
def test_the_fake_passes_the_premerge_v32_cases(monkeypatch: pytest.MonkeyPatch,
                                               case: SparseDecodeCase) -> None:
    install(monkeypatch, {"flash_mla": fake_flash_mla()})
    v = run_case(case, on_cpu(flashmla.FlashMLABackend()), RunOptions("cpu"))
    assert v.status == "PASS", v.reason
    meta = v.implementation["flashmla"]
    assert meta["calls"] == len({r.q_len for r in case.requests if r.q_len})
    v32 = meta["v32_cache"]
    assert v32["pow2_shift_min"] < v32["pow2_shift_max"]


# Each planted fault, with the check that must catch it; a case where it acts: -1 padding
# (kv_len < topk, valid_cap), scales differing across one token's tiles (any case).
FAULTS = {
    "ignores-tile-scales": (PREMERGE_V32[0], {"row_error"}),
    "tile0-scale-for-all": (PREMERGE_V32[0], {"row_error"}),
    "minus-one-reads-token-0": (next(c for c in PREMERGE_V32 if c.valid_cap == 100),
                                {"row_error", "nonfinite", "lse"}),
}


@pytest.mark.parametrize("bug", list(FAULTS))
def test_planted_kernel_faults_fail(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    case, checks = FAULTS[bug]
    install(monkeypatch, {"flash_mla": fake_flash_mla(bug)})
    v = run_case(case, on_cpu(flashmla.FlashMLABackend()), RunOptions("cpu"))
    assert v.status == "FAIL", (bug, v.status, v.reason)
    failed = {c.name for c in v.failed_checks}
    assert failed & checks, (bug, failed, v.reason)


@pytest.mark.parametrize(("case", "words"), [
    (dataclasses.replace(SMALL, quant=Quant("bf16", "fp8_e4m3fn", "amax")),
     ("amax", "power-of-two", "RoPE in bf16")),
    (dataclasses.replace(SMALL, quant=Quant("bf16", "fp8_e4m3fnuz", "unit")),
     ("fp8_e4m3fnuz", "float8_e4m3fn")),
    (dataclasses.replace(SMALL, quant=Quant("bf16", "bf16")), ("kv format bf16",)),
    (dataclasses.replace(SMALL, num_heads=16), ("16 heads", "h_q 64 or 128")),
    (dataclasses.replace(SMALL, layout="vectorized", page_size=64), ("layout vectorized",)),
])
def test_what_the_sparse_decode_does_not_take_is_a_skip_naming_it(
        monkeypatch: pytest.MonkeyPatch, case: SparseDecodeCase, words: tuple[str, ...]) -> None:
    install(monkeypatch, {"flash_mla": fake_flash_mla()})
    v = run_case(case, on_cpu(flashmla.FlashMLABackend()), RunOptions("cpu"))
    assert v.status == "SKIP", v.reason
    for w in words:
        assert w in v.reason, (w, v.reason)


def test_the_fake_enforces_the_real_checks() -> None:
    """The fake's own guards: what the real library would refuse, it refuses."""
    fm = fake_flash_mla()
    inp = build(PREMERGE_V32[0])
    cache = flashmla.v32_cache(inp.pool).data
    q = inp.q.stored.view(1, 1, 64, 576)
    idx = torch.zeros(1, 1, 2048, dtype=torch.int32)
    call = dict(q=q, k_cache=cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                softmax_scale=0.1, causal=False, is_fp8_kvcache=True, indices=idx)

    def run(**change: object) -> None:
        fm.flash_mla_with_kvcache(tile_scheduler_metadata=fm.get_mla_metadata()[0],
                                  **{**call, **change})

    run()
    for change in (dict(causal=True), dict(is_fp8_kvcache=False), dict(q=q.float()),
                   dict(q=q[:, :, :16]), dict(indices=idx.long()),
                   dict(k_cache=inp.pool.data), dict(k_cache=cache[:, ::2]),
                   dict(indices=torch.full_like(idx, cache.shape[0] * cache.shape[1]))):
        with pytest.raises(AssertionError):
            run(**change)
