"""FP8 formats, quantisation with explicit overflow policies, and scales (bug class 7, mlacheck/bugclasses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from mlacheck import fp8

FP8 = ["fp8_e4m3fn", "fp8_e4m3fnuz"]


def q(values: list[float], name: str, policy: str, scale: float = 1.0) -> list[float]:
    return fp8.quantize(torch.tensor(values), name, scale, policy).float().tolist()


def same(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def test_format_facts() -> None:
    fn, fnuz = fp8.fmt("fp8_e4m3fn"), fp8.fmt("fp8_e4m3fnuz")
    assert (fn.max, fnuz.max) == (448.0, 240.0)
    assert fn.max == torch.finfo(torch.float8_e4m3fn).max
    assert fnuz.max == torch.finfo(torch.float8_e4m3fnuz).max
    assert fn.is_fp8 and fnuz.is_fp8 and not fp8.fmt("bf16").is_fp8
    assert (fn.native_overflow, fnuz.native_overflow) == ("saturate", "nan")
    assert fp8.fmt("bf16").native_overflow == "inf"
    assert fn.eps == fnuz.eps == 2.0**-4 and fp8.fmt("bf16").eps == 2.0**-8
    assert fp8.overflow_threshold("fp8_e4m3fn") == 464.0  # 448 + half of ulp 32
    assert fp8.overflow_threshold("fp8_e4m3fnuz") == 248.0  # 240 + half of ulp 16
    assert fp8.chip_fp8_format("gfx942") == "fp8_e4m3fnuz"
    assert fp8.chip_fp8_format("gfx950") == fp8.chip_fp8_format("sm_90") == "fp8_e4m3fn"
    with pytest.raises(ValueError, match="unknown format"):
        fp8.fmt("fp8_e5m2")
    with pytest.raises(ValueError, match="overflow policy"):
        fp8.quantize(torch.ones(2), "fp8_e4m3fn", 1.0, "wrap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale policy"):
        fp8.pick_scale(torch.ones(2), "fp8_e4m3fn", "max")


def test_torch_policy_differs_per_format() -> None:
    """torch 2.13 CPU: e4m3fn saturates at 448 (even inf); e4m3fnuz gives NaN from 248 on."""
    xs = [239.0, 240.0, 247.9, 248.0, 300.0, 448.0, 463.9, 464.0, 500.0, 1e6, float("inf")]
    fn = q(xs + [-x for x in xs], "fp8_e4m3fn", "torch")
    assert fn[:11] == [240.0, 240.0, 240.0, 256.0, 288.0, 448.0, 448.0, 448.0, 448.0, 448.0, 448.0]
    assert fn[11:] == [-x for x in fn[:11]]
    fnuz = q(xs + [-x for x in xs], "fp8_e4m3fnuz", "torch")
    assert fnuz[:3] == [240.0, 240.0, 240.0]
    assert all(math.isnan(v) for v in fnuz[3:11] + fnuz[14:])
    # a unit-scale cast of the same bf16 activation: finite on gfx950, NaN on gfx942
    assert q([300.0], "fp8_e4m3fn", "torch") == [288.0]
    assert math.isnan(q([300.0], "fp8_e4m3fnuz", "torch")[0])


@pytest.mark.parametrize("name", FP8)
def test_saturate_policy_clamps(name: str) -> None:
    m = fp8.fmt(name).max
    got = q([m, m + 1, 1e4, float("inf"), -1e4, -float("inf"), 3.0], name, "saturate")
    assert got == [m, m, m, m, -m, -m, 3.0]
    assert math.isnan(q([float("nan")], name, "saturate")[0])  # NaN stays NaN


@pytest.mark.parametrize("name", FP8)
def test_nan_policy_turns_overflow_into_nan(name: str) -> None:
    m, thr = fp8.fmt(name).max, fp8.overflow_threshold(name)
    got = q([m, thr - 0.01, thr + 0.01, 1e4, -1e4, float("inf")], name, "nan")
    assert got[:2] == [m, m]  # rounds onto max: not an overflow
    assert all(math.isnan(v) for v in got[2:])
    # the tie at thr rounds to even: e4m3fn 464 -> 448 (max's mantissa is even), fnuz 248 -> NaN
    tie = q([thr, -thr], name, "nan")
    if name == "fp8_e4m3fn":
        assert tie == [448.0, -448.0]
    else:
        assert all(math.isnan(v) for v in tie)


def test_nan_policy_matches_the_native_fnuz_cast_and_makes_fn_uniform() -> None:
    """On fnuz, 'nan' is exactly what torch's cast does; on fn it differs from the native cast
    only where the native cast saturates a real overflow."""
    xs = torch.cat([torch.linspace(-600, 600, 24001), torch.tensor([247.99, 248.0, 464.0, 464.01])])
    nat = fp8.quantize(xs, "fp8_e4m3fnuz", 1.0, "torch").view(torch.uint8)
    pol = fp8.quantize(xs, "fp8_e4m3fnuz", 1.0, "nan").view(torch.uint8)
    assert torch.equal(nat, pol)
    fn_nan = fp8.quantize(xs, "fp8_e4m3fn", 1.0, "nan").float()
    fn_sat = fp8.quantize(xs, "fp8_e4m3fn", 1.0, "torch").float()
    over = xs.abs() > 464.0
    assert torch.isnan(fn_nan[over]).all()
    assert torch.equal(fn_nan[~over], fn_sat[~over])


@pytest.mark.parametrize("name", FP8)
def test_round_trip_error_is_half_an_ulp(name: str) -> None:
    """Normal-range values: relative error <= 2^-4 (half an ulp of a 3-bit mantissa), nearly
    attained; subnormals: absolute error <= half the subnormal spacing."""
    f = fp8.fmt(name)
    tiny = torch.finfo(f.dtype).tiny  # smallest normal: 2^-6 (fn), 2^-7 (fnuz)
    g = torch.Generator().manual_seed(5)
    mags = torch.exp(torch.empty(20000).uniform_(math.log(tiny), math.log(f.max), generator=g))
    x = mags * torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0)
    for policy in ("torch", "saturate", "nan"):
        back = fp8.dequantize(fp8.quantize(x, name, 1.0, policy))  # type: ignore[arg-type]
        rel = ((back - x).abs() / x.abs()).max().item()
        assert 0.05 < rel <= f.eps, (policy, rel)
    sub = torch.linspace(-tiny, tiny, 1001)
    spacing = tiny * 2.0**-3
    err = (fp8.round_trip(sub, name) - sub).abs().max().item()
    assert err <= spacing / 2 + 1e-12
    # representable values are exact
    codes = torch.arange(256, dtype=torch.uint8).view(f.dtype).float()
    codes = codes[torch.isfinite(codes)]
    assert torch.equal(fp8.round_trip(codes, name), codes)


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("per_token", [False, True], ids=["tensor", "token"])
def test_amax_scale_maps_amax_onto_max(name: str, per_token: bool) -> None:
    f = fp8.fmt(name)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, 40, generator=g) * torch.tensor([1e-3, 1.0, 700.0]).view(1, 3, 1)
    scale = fp8.pick_scale(x, name, "amax", per_token)
    assert scale.dtype == torch.float32
    if per_token:
        assert scale.shape == (6, 3, 1)
        torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / f.max, rtol=0, atol=0)
    else:
        assert scale.shape == ()
        assert scale.item() == pytest.approx(x.abs().max().item() / f.max, rel=1e-7)
    stored = fp8.quantize(x, name, scale)  # torch policy: no overflow with an amax scale
    assert torch.isfinite(stored.float()).all()
    amax = stored.float().abs().amax(-1) if per_token else stored.float().abs().max()
    assert bool((amax == f.max).all())
    back = fp8.dequantize(stored, scale)
    normal = (x / scale).abs() >= torch.finfo(f.dtype).tiny
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max().item() <= f.eps * (1 + 1e-5)
    if per_token:  # per-token scales keep the tiny-magnitude head accurate too
        assert bool(normal[:, 0].all())
    else:
        assert not bool(normal[:, 0].all())  # per tensor: the 1e-3 head falls to subnormals


def test_unit_and_non_fp8_scales_are_one() -> None:
    x = torch.randn(4, 8) * 1000
    for name, policy, per_token, shape in [
        ("fp8_e4m3fn", "unit", False, ()), ("fp8_e4m3fnuz", "unit", True, (4, 1)),
        ("bf16", "amax", False, ()), ("fp16", "amax", True, (4, 1)), ("fp32", "amax", False, ()),
    ]:
        s = fp8.pick_scale(x, name, policy, per_token)
        assert s.shape == shape and bool((s == 1).all()), (name, policy)
    zero = torch.zeros(3, 5)
    assert bool((fp8.pick_scale(zero, "fp8_e4m3fn", "amax", True) == 1).all())  # no 0 scale
    assert fp8.pick_scale(zero, "fp8_e4m3fn", "amax").item() == 1.0


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_wide_format_nan_fill_and_sentinel(name: str) -> None:
    f = fp8.fmt(name)
    bits_dtype, bits = fp8.nan_fill_value(name)
    t = torch.empty(4, dtype=f.dtype)
    t.view(bits_dtype).fill_(bits)
    assert torch.isnan(t.float()).all()
    s = fp8.sentinel_value(name)
    assert math.isfinite(s) and s >= 1e4 and math.isfinite(torch.tensor(s).to(f.dtype).item())
    for n in FP8:
        assert fp8.sentinel_value(n) == fp8.fmt(n).max


def test_one_width_table_and_the_spec_formats_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlacheck import formats

    for name, f in fp8.FORMATS.items():
        assert f.bits_dtype == fp8.int_dtype(f.dtype) and f.bits_dtype.itemsize == f.itemsize
        assert fp8.format_of(f.dtype) == name
    with pytest.raises(ValueError, match="no mlacheck format is stored as torch.float64"):
        fp8.format_of(torch.float64)
    monkeypatch.setattr(formats, "FORMATS", (*formats.FORMATS, "fp4_e2m1"))
    with pytest.raises(ImportError, match="does not match"):
        fp8._check_covers_formats()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_dequantize_is_the_plain_product_and_leaves_its_input_alone(dtype: torch.dtype) -> None:
    """Taken in place on a fresh copy (one fp32 temporary less): the same bits as
    `x.float() * scale` for every scale kind, and an fp32 input is not scaled in place."""
    x = (torch.randn(64, 3, 8, generator=torch.Generator().manual_seed(0)) * 40).to(dtype)
    before = x.clone()
    for scale in (1.0, 0.37, torch.tensor(0.0123), torch.rand(64, 1, 1),
                  torch.rand(64, 1, 1, dtype=torch.float64)):
        want, got = x.float() * scale, fp8.dequantize(x, scale)
        assert got.dtype == want.dtype and torch.equal(got, want), scale
        assert torch.equal(x.view(fp8.int_dtype(dtype)), before.view(fp8.int_dtype(dtype)))
