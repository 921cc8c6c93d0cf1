"""FP8 P: each row's bound (mlacheck.judge._fp8_row_bounds). A correct kernel that rounds
the row's largest weight (a lazily rescaled max) has room for that rounding on the rows that
carry it, so one row 9 % off fails where the P-normalised baseline's case-wide bound (issue
34) let 10-13 % pass, while torch-lazy and the worst rounding of every largest weight pass."""

from __future__ import annotations

import math

import pytest
import torch

from mlacheck import harness, spec
from mlacheck import tolerances as tol
from mlacheck.backends.numerics import Numerics, _online
from mlacheck.backends.registry import resolve
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.golden.core import exact_matmuls
from mlacheck.judge import _fp8_row_bounds, by_rows, row_errors
from mlacheck.verdict import FAIL, PASS

# benchmarks/sensitivity.py's decode case (docs/detection.md section 2), seed 0
DECODE = spec.DecodeCase(requests=(spec.Request(1, 37), spec.Request(1, 300),
                                   spec.Request(1, 129), spec.Request(2, 64)),
                         num_heads=16, page_size=16,
                         quant=spec.Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax"))


class OneRowOff(TorchBackend):
    """The torch backend with one row of its output scaled by (1 + delta)."""

    def __init__(self, delta: float, row: tuple[int, int]) -> None:
        super().__init__(name="one-row-off")
        self.delta, self.row = delta, row

    def run(self, case, inputs):  # noqa: ANN001, ANN201
        res = super().run(case, inputs)
        t, h = self.row
        res.out[t, h] = (res.out[t, h].float() * (1 + self.delta)).to(res.out.dtype)
        return res


def _row_check(v):  # noqa: ANN001, ANN202
    return next(c for c in v.checks if c.name == "row_error")


def test_fp8_runs_the_peak_rounded_baseline_and_bounds_rows_with_it() -> None:
    assert harness.baselines(DECODE)[-1] is harness.PEAK_ROUNDED_BASELINE
    v = harness.run_case(DECODE, resolve("torch"))
    assert v.status == PASS, v.summary()
    assert "bound per row" in _row_check(v).detail


def test_one_row_nine_percent_off_fails_under_the_case_wide_family_bound() -> None:
    for row in ((0, 3), (2, 11), (4, 7)):
        v = harness.run_case(DECODE, OneRowOff(0.09, row))
        c = _row_check(v)
        assert v.status == FAIL and not c.passed, v.summary()
        assert c.bound < 0.09 and c.value > c.bound
        assert [(w.request, w.heads) for w in v.where]  # localised


def test_kernels_that_round_the_largest_weight_pass() -> None:
    worst = TorchBackend(Numerics(peak_rounding=tol.PEAK_ROUNDOFFS), name="peak-rounded")
    for backend in (resolve("torch-lazy"), worst, resolve("torch-split")):
        v = harness.run_case(DECODE, backend)
        assert v.status == PASS, v.summary()
        assert _row_check(v).value < _row_check(v).bound


def _two_key_row(stale: float, ratio: float, cos: float = 0.0) -> dict[str, torch.Tensor]:
    """One query row whose weight two keys carry, in the second kv tile: P = `stale` and
    `stale` x `ratio` against the first tile's only key, where a lazily rescaled max stays
    (log(stale) < 7 ln 2), and 1 and `ratio` against the true max, where the eager baseline
    rounds them; their V of norm 1 at cosine `cos`; every other key ~e^-30 below."""
    dv, sk = 64, 128
    s = torch.full((sk,), -30.0)
    s[0], s[64], s[65] = 0.0, math.log(stale), math.log(stale * ratio)
    q = torch.zeros(1, 1, 8)
    q[0, 0, 0] = 1.0
    k = torch.zeros(sk, 1, 8)
    k[:, 0, 0] = s
    v = torch.randn(sk, 1, dv, generator=torch.Generator().manual_seed(3)) * 0.1
    v[64, 0], v[65, 0] = 0.0, 0.0
    v[64, 0, 0], v[65, 0, 0], v[65, 0, 1] = 1.0, cos, math.sqrt(1 - cos * cos)
    gold = (torch.softmax(s.double(), 0) @ v[:, 0].double()).reshape(1, 1, dv)
    pos = torch.tensor([sk - 1])

    def run(nm: Numerics) -> torch.Tensor:
        with exact_matmuls():
            return _online(q, k, v, 0, sk, 1.0, False, "fp8_e4m3fn", nm, 0.0, None, pos)[0]

    return {"gold": gold, "eager": run(Numerics()), "lazy": run(resolve("torch-lazy").numerics),
            "peak": run(Numerics(peak_rounding=tol.PEAK_ROUNDOFFS))}


def _lazy_row(r: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(torch-lazy's row error, the eager baseline's, the row's bound) of a _two_key_row."""
    g_bad = torch.zeros(1, 1, dtype=torch.bool)
    bound, _ = _fp8_row_bounds(r["eager"], r["peak"], r["gold"], g_bad, 1.0,
                               tol.row_floor("bf16"))
    return (float(by_rows(row_errors, r["lazy"], r["gold"])),
            float(by_rows(row_errors, r["eager"], r["gold"])), float(bound))


def test_near_tied_largest_weights_get_the_allowance_together() -> None:
    """Two keys nearly tied for the row's largest weight (0.0009 apart in score): the eager
    baseline rounds both to P = 1, a lazily rescaled kernel rounds both (P ~ 34.05 and 34.02,
    just past the midpoint 34 of e4m3's 32 and 36) up by ~5.8 %. The allowance must cover
    both (harness.PEAK_ROUNDED_BASELINE takes every weight the eager rounding puts at the
    peak's value), not the exact maximum alone: with the key at P == 1 alone (main before
    2026-11-27 10:00) this row's lazy error was 1.18x its bound (the same mechanism took
    torch-lazy to 0.97 of the bound on premerge seed 19). Now under the ceiling one largest
    weight sets, (u / (1 + u)) / (u + floor) = 0.886 of the bound (tolerances.PEAK_ROUNDOFFS)."""
    err, eager, bound = _lazy_row(_two_key_row(34.05, math.exp(-0.0009)))
    assert eager < 0.01  # the eager rounding leaves both near-tied weights ~exact
    assert 0.05 < err < bound
    u = 2.0**-4
    assert err / bound < (u / (1 + u)) / (u + tol.row_floor("bf16")) + 0.02


@pytest.mark.xfail(strict=True, reason="known (issue 28): two dominant weights that are not "
                   "tied and that the eager rounding leaves exact (P = 1 and 13/16) get one "
                   "allowance, for the largest; covering both costs the FP8 one-row "
                   "sensitivity (9.6-12 % over 5 seeds, docs/detection.md section 2)")
def test_two_distinct_dominant_weights_rounded_lazily_pass() -> None:
    """A correct lazily rescaled kernel (stale max 83.7 below: P = 83.7 -> 80, -4.4 %, and
    68.01 -> 72, +5.9 %) on a row two keys carry with V at cosine -0.5: 1.2x the bound."""
    err, eager, bound = _lazy_row(_two_key_row(83.7, 13 / 16, -0.5))
    assert eager < 1e-3 and err > 0.08
    assert err < bound
