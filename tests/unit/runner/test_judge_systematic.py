"""The rows judged together: errors small on every row but systematic fail `rms_error`
(FlashAttention's 2x on the rows' RMS), one element far off fails `max_abs_error`
(FlashAttention's own rule), each shown with its bound on the card, while correct variants
and exact (one-key) cases pass."""

from __future__ import annotations

from mlacheck import harness, spec
from mlacheck import tolerances as tol
from mlacheck.backends.torch_ref import TorchBackend, reverse_factory, split_factory
from mlacheck.verdict import FAIL, PASS

DECODE = spec.DecodeCase(
    requests=(spec.Request(1, 300), spec.Request(2, 1000), spec.Request(1, 700)),
    num_heads=16, page_size=16,
)  # rows 0 | 1-2 | 3


class Scaled(TorchBackend):
    """The torch backend with rows[sel] of its output scaled by (1 + delta)."""

    def __init__(self, delta: float, sel: slice = slice(None)) -> None:
        super().__init__(name="scaled")
        self.delta, self.sel = delta, sel

    def run(self, case, inputs):  # noqa: ANN001, ANN201
        res = super().run(case, inputs)
        o = res.out
        o[self.sel] = (o[self.sel].float() * (1 + self.delta)).to(o.dtype)
        return res


def failed(v) -> set[str]:  # noqa: ANN001
    return {c.name for c in v.failed_checks}


def test_every_row_a_little_off_fails_the_rows_together_only() -> None:
    v = harness.run_case(DECODE, Scaled(0.006))
    assert v.status == FAIL and "rms_error" in failed(v), v.summary()
    assert failed(v) <= {"rms_error", "max_abs_error"}, v.summary()
    card = v.summary()
    assert "check rms_error failed" in card and "FlashAttention's 2x" in card
    first = card.splitlines()[0]
    assert "every request, every head" in first and "no row beyond its own bound" in first
    # the probes re-judge rows only: they do not turn it into a batch-indexing story
    assert "alone" not in first
    assert v.metrics["axis"] == "all"
    assert v.metrics["rms_error"] > tol.RMS_FACTOR * v.metrics["baseline_rms_error"]


def test_one_request_a_little_off_is_named() -> None:
    v = harness.run_case(DECODE, Scaled(0.006, slice(1, 3)))
    assert v.status == FAIL and "rms_error" in failed(v) and "row_error" not in failed(v)
    first = v.summary().splitlines()[0]
    assert first.split(" -- ")[1].startswith("request 1 of 3 (kv 1000)"), first
    assert v.metrics["axis"] == "requests"


class OneElement(TorchBackend):
    """The largest output element two ulps off: invisible in its row's L2, not in the max."""

    def run(self, case, inputs):  # noqa: ANN001, ANN201
        res = super().run(case, inputs)
        flat = res.out.view(-1)
        i = int(flat.float().abs().argmax())
        flat[i] = (flat[i].float() * (1 + 4 * tol.OUTPUT_ULP["bf16"])).to(flat.dtype)
        return res


def test_one_element_far_off_fails_max_abs_error_alone() -> None:
    v = harness.run_case(DECODE, OneElement(name="one-element"))
    assert v.status == FAIL and failed(v) == {"max_abs_error"}, v.summary()
    card = v.summary()
    assert "FlashAttention's decode rule" in card
    assert card.splitlines()[0].split(" -- ")[1].startswith("rows of request")
    assert v.metrics["axis"] == "rows"


def test_correct_variants_stay_well_inside_both_bounds() -> None:
    prefill = spec.PrefillCase(segments=(spec.Segment(40, 0), spec.Segment(30, 600)),
                               num_heads=16)
    for b in (split_factory(), reverse_factory()):
        for case in (DECODE, prefill):
            v = harness.run_case(case, b)
            assert v.status == PASS, v.summary()
            checks = {c.name: c for c in v.checks}
            for name in ("rms_error", "max_abs_error"):
                assert checks[name].value <= 0.75 * checks[name].bound, (b.name, case.id, name)


def test_exact_cases_are_held_to_the_floors() -> None:
    """kv 1: the baseline is exact (zero error); the bounds are the floors, not zero."""
    one = spec.DecodeCase(requests=(spec.Request(1, 1), spec.Request(1, 1)), num_heads=16,
                          page_size=16)
    v = harness.run_case(one, split_factory())
    assert v.status == PASS, v.summary()
    checks = {c.name: c for c in v.checks}
    assert v.metrics["baseline_max_abs_error"] == 0.0
    assert checks["max_abs_error"].bound > 0 and checks["rms_error"].bound == tol.OUTPUT_ROUNDOFF["bf16"]
    assert isinstance(v.metrics["rms_error"], float)


def test_checks_ignore_rows_the_golden_cannot_judge() -> None:
    """A NaN row fails `nonfinite`; the rows judged together are the finite ones."""

    class NanRow(TorchBackend):
        def run(self, case, inputs):  # noqa: ANN001, ANN201
            res = super().run(case, inputs)
            res.out[0, 0] = float("nan")
            return res

    v = harness.run_case(DECODE, NanRow(name="nan-row"))
    assert "nonfinite" in failed(v)
    assert not {"rms_error", "max_abs_error"} & failed(v), v.summary()
