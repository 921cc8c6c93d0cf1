"""FP8 P: each row's bound (mlacheck.judge._fp8_row_bounds). A correct kernel that rounds
the row's largest weight (a lazily rescaled max) has room for that rounding on the rows that
carry it, so one row 9 % off fails where the P-normalised baseline's case-wide bound (issue
34) let 10-13 % pass, while torch-lazy and the worst rounding of every largest weight pass."""

from __future__ import annotations

from mlacheck import harness, spec
from mlacheck import tolerances as tol
from mlacheck.backends.numerics import Numerics
from mlacheck.backends.registry import resolve
from mlacheck.backends.torch_ref import TorchBackend
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
