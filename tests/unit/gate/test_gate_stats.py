"""Gate statistics against statsmodels/scipy and published worked examples."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sst

from mlacheck.gate import stats

_NEEDS = "statsmodels provides the reference values"


@pytest.fixture
def sm_prop():  # type: ignore[no-untyped-def]
    return pytest.importorskip("statsmodels.stats.proportion", reason=_NEEDS)


@pytest.fixture
def sm_ct():  # type: ignore[no-untyped-def]
    return pytest.importorskip("statsmodels.stats.contingency_tables", reason=_NEEDS)


COUNTS = [(0, 10), (1, 10), (5, 10), (10, 10), (3, 250), (81, 263), (1100, 1319), (1319, 1319)]


@pytest.mark.parametrize("x,n", COUNTS)
@pytest.mark.parametrize("confidence", [0.90, 0.95, 0.99])
def test_wilson_matches_statsmodels(sm_prop, x: int, n: int, confidence: float) -> None:
    iv = stats.wilson_interval(x, n, confidence)
    lo, hi = sm_prop.proportion_confint(x, n, alpha=1 - confidence, method="wilson")
    assert iv.lower == pytest.approx(lo, abs=1e-12)
    assert iv.upper == pytest.approx(hi, abs=1e-12)
    assert iv.estimate == x / n


@pytest.mark.parametrize(
    "x1,n1,x2,n2",
    [(56, 70, 48, 80), (9, 10, 3, 10), (0, 10, 0, 20), (10, 10, 0, 10), (1100, 1319, 1090, 1319)],
)
@pytest.mark.parametrize("confidence", [0.90, 0.95])
def test_unpaired_newcombe_matches_statsmodels(
    sm_prop, x1: int, n1: int, x2: int, n2: int, confidence: float
) -> None:
    iv = stats.newcombe_unpaired_interval(x1, n1, x2, n2, confidence)
    lo, hi = sm_prop.confint_proportions_2indep(
        x1, n1, x2, n2, method="newcomb", compare="diff", alpha=1 - confidence
    )
    assert iv.lower == pytest.approx(lo, abs=1e-12)
    assert iv.upper == pytest.approx(hi, abs=1e-12)


def test_unpaired_newcombe_published_example() -> None:
    # Newcombe (1998a), Stat. Med. 17:873, Table II example (a): 56/70 - 48/80,
    # method 10 (hybrid score): 0.0524 to 0.3339.
    iv = stats.newcombe_unpaired_interval(56, 70, 48, 80, 0.95)
    assert (round(iv.lower, 4), round(iv.upper, 4)) == (0.0524, 0.3339)


def test_paired_newcombe_published_examples() -> None:
    # Fagerland, Lydersen & Laake, Statistical Analysis of Contingency Tables (2017), ch. 8,
    # Cavo et al. (2012) table [[59, 6], [16, 80]]: Newcombe square-and-add
    # estimate -0.0621, 95% CI -0.1186 to -0.0046.
    iv = stats.newcombe_paired_interval(59, 6, 16, 80, 0.95)
    assert round(iv.estimate, 4) == -0.0621
    assert (round(iv.lower, 4), round(iv.upper, 4)) == (-0.1186, -0.0046)
    # Altman et al., Statistics with Confidence (2000), p. 52: table [[14, 5], [0, 22]],
    # Newcombe's method: 0.011 to 0.226.
    iv = stats.newcombe_paired_interval(14, 5, 0, 22, 0.95)
    assert (round(iv.lower, 3), round(iv.upper, 3)) == (0.011, 0.226)


def test_paired_interval_orientation_and_symmetry() -> None:
    iv = stats.newcombe_paired_interval(50, 3, 12, 35, 0.90)
    flipped = stats.newcombe_paired_interval(50, 12, 3, 35, 0.90)
    assert iv.estimate == pytest.approx((3 - 12) / 100)
    assert (flipped.lower, flipped.upper) == pytest.approx((-iv.upper, -iv.lower))
    # no discordant pairs: estimate 0 inside a narrow interval
    iv0 = stats.newcombe_paired_interval(900, 0, 0, 100, 0.90)
    assert iv0.estimate == 0.0 and iv0.lower < 0.0 < iv0.upper and iv0.upper - iv0.lower < 0.01
    # pairing helps: the paired interval is narrower than the unpaired one for the same margins
    un = stats.newcombe_unpaired_interval(53, 100, 62, 100, 0.90)
    assert iv.upper - iv.lower < un.upper - un.lower


@pytest.mark.parametrize(
    "b,c", [(0, 0), (0, 1), (1, 0), (3, 3), (6, 16), (16, 6), (20, 2), (40, 35)]
)
def test_mcnemar_midp_matches_binomial_and_statsmodels(sm_ct, b: int, c: int) -> None:
    n, k = b + c, min(b, c)
    if n == 0:
        assert stats.mcnemar_midp(b, c) == 1.0
        return
    manual = min(1.0, 2 * (sst.binom.cdf(k, n, 0.5) - 0.5 * sst.binom.pmf(k, n, 0.5)))
    assert stats.mcnemar_midp(b, c) == pytest.approx(manual, abs=1e-14)
    exact = sm_ct.mcnemar(np.array([[10, b], [c, 10]]), exact=True).pvalue
    assert stats.mcnemar_exact_p(b, c) == pytest.approx(exact, abs=1e-14)
    # mid-p = exact conditional p minus the point probability of the observed table
    if b != c:
        assert stats.mcnemar_midp(b, c) == pytest.approx(
            exact - sst.binom.pmf(k, n, 0.5), abs=1e-14
        )
    else:
        assert stats.mcnemar_midp(b, c) == pytest.approx(1.0) == pytest.approx(exact)


def test_mcnemar_published_example() -> None:
    # Fagerland et al. (2017) ch. 8, Cavo et al. table: exact conditional P = 0.052479,
    # mid-P = 0.034690.
    assert round(stats.mcnemar_exact_p(6, 16), 6) == 0.052479
    assert round(stats.mcnemar_midp(6, 16), 6) == 0.034690


def test_power_formula_is_self_consistent() -> None:
    n, disc, alpha = 1319, 80, 0.05
    mdd = stats.paired_min_detectable_difference(n, disc, alpha, 0.8)
    se = stats.paired_standard_error(n, disc)
    assert mdd == pytest.approx((sst.norm.ppf(0.95) + sst.norm.ppf(0.8)) * math.sqrt(disc / n / n))
    # at margin = delta_min an equally accurate candidate passes with exactly the power
    assert stats.prob_pass_if_equal(mdd, se, alpha) == pytest.approx(0.8)
    # identical runs: floored at one discordant pair, never zero
    assert stats.paired_min_detectable_difference(n, 0, alpha, 0.8) > 0


def _simulate_gate(n: int, p_b: float, p_c: float, margin: float, sims: int, seed: int) -> float:
    """Fraction of simulated paired runs that pass the gate (Newcombe lower bound, 90%)."""
    rng = np.random.default_rng(seed)
    passes = 0
    for a_b_c_d in rng.multinomial(n, [0.8 - p_b, p_b, p_c, 0.2 - p_c], size=sims):
        a, b, c, d = (int(v) for v in a_b_c_d)
        lower = stats.newcombe_paired_interval(a, c, b, d, 0.90).lower
        passes += lower > -margin
    return passes / sims


def test_power_statement_matches_simulated_gate() -> None:
    # A candidate with the baseline's accuracy and 8% discordant questions (4% each way):
    # with the margin set to the minimal detectable drop it should pass ~80% of the time,
    # and one truly `margin` worse should pass only ~alpha = 5% of the time.
    n, psi = 1319, 0.08
    margin = stats.paired_min_detectable_difference(n, round(psi * n), 0.05, 0.8)
    p_equal = _simulate_gate(n, psi / 2, psi / 2, margin, sims=1500, seed=1)
    assert abs(p_equal - 0.80) < 0.05
    worse = _simulate_gate(n, psi / 2 + margin / 2, psi / 2 - margin / 2, margin, sims=1500, seed=2)
    assert worse < 0.08


def test_unpaired_power_and_stderr() -> None:
    mdd = stats.unpaired_min_detectable_difference(0.8, 1319, 0.8, 1319, 0.05, 0.8)
    assert mdd == pytest.approx(2.4865 * math.sqrt(2 * 0.16 / 1319), rel=1e-3)
    # a 0% / 100% sample is not treated as noise-free
    assert stats.unpaired_standard_error(1.0, 100, 1.0, 100) > 0
    assert stats.mean_stderr(6, 12) == pytest.approx(
        np.std([1] * 6 + [0] * 6, ddof=1) / math.sqrt(12)
    )
    assert stats.mean_stderr(1, 1) is None


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        stats.wilson_interval(5, 4, 0.9)
    with pytest.raises(ValueError):
        stats.newcombe_paired_interval(0, 0, 0, 0, 0.9)
    with pytest.raises(ValueError):
        stats.two_sided_confidence(0.6)
