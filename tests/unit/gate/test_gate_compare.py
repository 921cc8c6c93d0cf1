"""Gate verdicts on synthetic records."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mlacheck.gate import stats
from mlacheck.gate.compare import (
    PAIRED,
    UNPAIRED,
    GatePolicy,
    compare,
    power_statement,
    render_markdown,
    summary_line,
    write_plot,
)
from mlacheck.gate.errors import GateError
from mlacheck.gate.record import GateRecord, MetricSummary, RunMetadata
from mlacheck.gate.task import FLEXIBLE, STRICT

Factory = Callable[..., GateRecord]
N = 1319
BASE_RIGHT = 1050  # baseline strict-match accuracy 79.6%


def _baseline(factory: Factory) -> GateRecord:
    return factory([i < BASE_RIGHT for i in range(N)])


def _flip(base: GateRecord, right_to_wrong: int, wrong_to_right: int) -> list[bool]:
    out = [s.strict_correct for s in base.samples]
    rw = [i for i, ok in enumerate(out) if ok][:right_to_wrong]
    wr = [i for i, ok in enumerate(out) if not ok][:wrong_to_right]
    for i in rw:
        out[i] = False
    for i in wr:
        out[i] = True
    return out


def test_clearly_worse_candidate_fails_with_right_discordance(record_factory: Factory) -> None:
    base = _baseline(record_factory)
    cand = record_factory(_flip(base, 60, 8))
    v = compare(base, cand, GatePolicy())
    assert not v.passed and v.exit_code == 1
    p = v.primary
    assert p is not None and p.mode == PAIRED
    assert (p.b, p.c) == (60, 8)
    assert p.difference.estimate == pytest.approx(-52 / N)
    assert p.difference.lower < -0.02
    assert p.mcnemar_midp is not None and p.mcnemar_midp < 1e-6
    assert [c.name for c in v.checks if not c.passed] == ["non-inferiority"]
    assert summary_line(v).startswith("FAIL")


def test_equal_candidate_passes(record_factory: Factory) -> None:
    base = _baseline(record_factory)
    cand = record_factory(_flip(base, 30, 30))
    v = compare(base, cand, GatePolicy())
    assert v.passed and v.exit_code == 0
    p = v.primary
    assert p is not None and (p.b, p.c) == (30, 30) and p.difference.estimate == 0.0
    expected = stats.newcombe_paired_interval(1020, 30, 30, N - 1080, 0.90)
    assert (p.difference.lower, p.difference.upper) == pytest.approx(
        (expected.lower, expected.upper)
    )
    assert -0.02 < p.difference.lower < 0 < p.difference.upper
    assert p.min_detectable_drop < 0.02 and p.p_pass_if_equal > 0.8
    assert v.notes == ()


def test_small_drop_inside_margin_passes_and_beyond_fails(record_factory: Factory) -> None:
    base = _baseline(record_factory)
    assert compare(base, record_factory(_flip(base, 30, 25)), GatePolicy()).passed
    # the same table fails a tighter margin
    assert not compare(base, record_factory(_flip(base, 30, 25)), GatePolicy(margin=0.005)).passed


def test_failed_requests_fail_even_when_accuracy_is_equal(record_factory: Factory) -> None:
    base = record_factory([True, False] * 100)
    cand = record_factory([True, False] * 100, failed_requests=2)
    v = compare(base, cand, GatePolicy())
    assert not v.passed
    failed = {c.name: c for c in v.checks if not c.passed}
    assert set(failed) == {"run complete"}
    assert "2 failed requests" in failed["run complete"].detail


def test_candidate_without_samples_fails(record_factory: Factory) -> None:
    base = record_factory([True, False] * 10)
    cand = record_factory([], failed_requests=20)
    v = compare(base, cand, GatePolicy())
    assert not v.passed and v.primary is None
    assert "FAIL" in render_markdown(v)


def test_invalid_rate_ceiling(record_factory: Factory) -> None:
    base = record_factory([True] * 800 + [False] * 200)
    invalid = [False] * 900 + [True] * 100  # 10% without a number, all already wrong
    cand = record_factory([True] * 800 + [False] * 200, invalid=invalid)
    v = compare(base, cand, GatePolicy())
    assert not v.passed and [c.name for c in v.checks if not c.passed] == ["invalid outputs"]
    assert v.invalid_count == 100 and v.invalid_rate == pytest.approx(0.10)
    assert compare(base, cand, GatePolicy(invalid_rate_ceiling=0.10)).passed


def test_accuracy_floor(record_factory: Factory) -> None:
    base = _baseline(record_factory)
    cand = record_factory(_flip(base, 10, 10))
    assert compare(base, cand, GatePolicy(accuracy_floor=0.75)).passed
    v = compare(base, cand, GatePolicy(accuracy_floor=0.85))
    assert [c.name for c in v.checks if not c.passed] == ["accuracy floor"]


def test_gate_metric_can_be_flexible(record_factory: Factory) -> None:
    base = record_factory([True] * 900 + [False] * 100, flexible=[True] * 900 + [False] * 100)
    # the candidate lost the "####" format on 300 questions but kept the number
    cand = record_factory([True] * 600 + [False] * 400, flexible=[True] * 900 + [False] * 100)
    assert not compare(base, cand, GatePolicy(metric=STRICT)).passed
    v = compare(base, cand, GatePolicy(metric=FLEXIBLE))
    assert v.passed and v.primary is not None and v.primary.metric == FLEXIBLE
    assert [c.metric for c in v.secondary] == [STRICT]


def test_unpaired_fallback(record_factory: Factory) -> None:
    base = GateRecord(
        metadata=RunMetadata(model="published", backend="lm-eval-results", num_fewshot=5),
        metrics={STRICT: MetricSummary(0.80, 0.011, N), FLEXIBLE: MetricSummary(0.81, 0.011, N)},
        n_planned=N,
    )
    equal = record_factory([i < 1055 for i in range(N)])
    v = compare(base, equal, GatePolicy())
    p = v.primary
    assert p is not None and p.mode == UNPAIRED and p.b is None and p.mcnemar_midp is None
    expected = stats.newcombe_unpaired_interval(1055, N, 1055, N, 0.90)
    assert (p.difference.lower, p.difference.upper) == pytest.approx(
        (expected.lower, expected.upper)
    )
    # unpaired: the equal candidate is not shown non-inferior at 2 points (underpowered)
    assert not v.passed and any("underpowered" in n for n in v.notes)
    assert any("unpaired" in n for n in v.notes)
    # ... but is at 4 points, while a clearly worse one is not
    assert compare(base, equal, GatePolicy(margin=0.04)).passed
    worse = record_factory([i < 950 for i in range(N)])
    assert not compare(base, worse, GatePolicy(margin=0.04)).passed


def test_incomparable_runs_are_errors(record_factory: Factory) -> None:
    base = record_factory([True, False, True])
    other_q = record_factory([True, False, True], hashes=["a" * 16, "b" * 16, "c" * 16])
    with pytest.raises(GateError, match="different question"):
        compare(base, other_q, GatePolicy())
    with pytest.raises(GateError, match="different task protocol"):
        compare(base, record_factory([True, False, True], protocol="q" * 64), GatePolicy())
    with pytest.raises(GateError, match="no document in common"):
        compare(base, record_factory([True], doc_ids=[99]), GatePolicy())
    with pytest.raises(GateError, match="baseline is not a complete run"):
        compare(record_factory([True], failed_requests=1), base, GatePolicy())
    with pytest.raises(GateError, match="margin"):
        GatePolicy(margin=2.0)


def test_partial_overlap_is_noted(record_factory: Factory) -> None:
    base = record_factory([True] * 100)
    cand = record_factory([True] * 50)  # ran with --limit 50
    v = compare(base, cand, GatePolicy())
    assert v.primary is not None and v.primary.n_candidate == 50
    assert any("50 only in baseline" in n for n in v.notes)


def test_markdown_and_plot(tmp_path: Path, record_factory: Factory) -> None:
    base = _baseline(record_factory)
    v = compare(base, record_factory(_flip(base, 60, 8)), GatePolicy())
    md = render_markdown(v, "plot.png")
    assert md.startswith("# GSM8K gate: FAIL")
    assert "| strict-match (gate) | paired | 1319 |" in md
    assert "| 60 | 8 |" in md
    assert power_statement(v.primary, v.policy) in md  # type: ignore[arg-type]
    assert "68 discordant" in md and "![GSM8K gate](plot.png)" in md
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    write_plot(v, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
