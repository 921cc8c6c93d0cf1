"""Statistics for the GSM8K gate: pure functions, scipy only.

Everything here works on counts. Conventions:

* A *two-sided* interval at confidence ``1 - 2*alpha`` is computed with ``z = z_{1-alpha}``;
  its lower end is therefore a *one-sided* ``1 - alpha`` lower confidence bound. The gate
  uses exactly that lower end (non-inferiority), so "90% two-sided" and "95% one-sided"
  describe the same number.
* Paired tables follow Newcombe (1998b): ``n11`` both succeed, ``n12`` only the first
  succeeds, ``n21`` only the second succeeds, ``n22`` both fail. The difference is
  ``p1 - p2 = (n12 - n21) / n``.

References
----------
* Wilson, E.B. (1927). Probable inference, the law of succession, and statistical inference.
  JASA 22, 209-212.
* Newcombe, R.G. (1998a). Interval estimation for the difference between independent
  proportions: comparison of eleven methods. Stat. Med. 17, 873-890 (method 10: hybrid score).
* Newcombe, R.G. (1998b). Improved confidence intervals for the difference between binomial
  proportions based on paired data. Stat. Med. 17, 2635-2650 (method 10: square-and-add of
  Wilson intervals with a correlation correction).
* Fagerland, M.W., Lydersen, S., Laake, P. (2013). The McNemar test for binary matched-pairs
  data: mid-p and asymptotic are better than exact conditional. BMC Med. Res. Methodol. 13:91.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from scipy import stats as _st


@dataclass(frozen=True)
class Interval:
    """A two-sided confidence interval ``[lower, upper]`` around ``estimate``."""

    estimate: float
    lower: float
    upper: float
    confidence: float  # two-sided coverage, e.g. 0.90

    def contains(self, value: float) -> bool:
        return self.lower <= value <= self.upper


@lru_cache(maxsize=64)
def z_two_sided(confidence: float) -> float:
    """Standard normal quantile ``z_{1-(1-confidence)/2}`` for a two-sided interval."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    return float(_st.norm.ppf(1.0 - (1.0 - confidence) / 2.0))


def two_sided_confidence(alpha_one_sided: float) -> float:
    """Two-sided confidence whose lower end is a one-sided ``1 - alpha`` bound."""
    if not 0.0 < alpha_one_sided < 0.5:
        raise ValueError(f"one-sided alpha must lie in (0, 0.5), got {alpha_one_sided}")
    return 1.0 - 2.0 * alpha_one_sided


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def wilson_interval(successes: int, n: int, confidence: float) -> Interval:
    """Wilson score interval for a single proportion ``successes / n``."""
    _check_count("successes", successes)
    if n <= 0 or successes > n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    z = z_two_sided(confidence)
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half), confidence)


def newcombe_paired_interval(n11: int, n12: int, n21: int, n22: int, confidence: float) -> Interval:
    """Newcombe (1998b) method 10 interval for the paired difference ``p1 - p2``.

    ``p1 = (n11 + n12) / n`` and ``p2 = (n11 + n21) / n``. With Wilson intervals
    ``[l1, u1]`` for p1 and ``[l2, u2]`` for p2 at the same confidence::

        L = D - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)
        U = D + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2)

    where ``phi`` estimates the correlation between the two margins:
    ``A = n11 n22 - n12 n21``; ``phi = (A - n/2) / sqrt(r1 r2 c1 c2)`` if ``A > n/2``,
    ``0`` if ``0 <= A <= n/2``, ``A / sqrt(r1 r2 c1 c2)`` if ``A < 0``; ``phi = 0`` when any
    margin is empty (Newcombe's convention, as implemented by Fagerland, Lydersen & Laake,
    *Statistical Analysis of Contingency Tables*, 2017, ch. 8).
    """
    for name, value in (("n11", n11), ("n12", n12), ("n21", n21), ("n22", n22)):
        _check_count(name, value)
    n = n11 + n12 + n21 + n22
    if n == 0:
        raise ValueError("empty paired table")
    row1, row2 = n11 + n12, n21 + n22
    col1, col2 = n11 + n21, n12 + n22
    p1, p2 = row1 / n, col1 / n
    w1 = wilson_interval(row1, n, confidence)
    w2 = wilson_interval(col1, n, confidence)
    if min(row1, row2, col1, col2) == 0:
        phi = 0.0
    else:
        a = n11 * n22 - n12 * n21
        denom = math.sqrt(row1 * row2 * col1 * col2)
        if a > n / 2:
            phi = (a - n / 2) / denom
        elif a >= 0:
            phi = 0.0
        else:
            phi = a / denom
    d = p1 - p2
    dl1, du2 = p1 - w1.lower, w2.upper - p2
    du1, dl2 = w1.upper - p1, p2 - w2.lower
    lower = d - math.sqrt(max(0.0, dl1 * dl1 - 2 * phi * dl1 * du2 + du2 * du2))
    upper = d + math.sqrt(max(0.0, du1 * du1 - 2 * phi * du1 * dl2 + dl2 * dl2))
    return Interval(d, max(-1.0, lower), min(1.0, upper), confidence)


def newcombe_unpaired_interval(x1: int, n1: int, x2: int, n2: int, confidence: float) -> Interval:
    """Newcombe (1998a) method 10 (hybrid score) interval for ``x1/n1 - x2/n2``.

    ``L = D - sqrt((p1 - l1)^2 + (u2 - p2)^2)``, ``U = D + sqrt((u1 - p1)^2 + (p2 - l2)^2)``
    with Wilson intervals ``[l1, u1]``, ``[l2, u2]``.
    """
    w1 = wilson_interval(x1, n1, confidence)
    w2 = wilson_interval(x2, n2, confidence)
    p1, p2 = w1.estimate, w2.estimate
    d = p1 - p2
    lower = d - math.hypot(p1 - w1.lower, w2.upper - p2)
    upper = d + math.hypot(w1.upper - p1, p2 - w2.lower)
    return Interval(d, max(-1.0, lower), min(1.0, upper), confidence)


def mcnemar_exact_p(b: int, c: int) -> float:
    """Exact conditional (binomial) two-sided McNemar p-value: ``min(1, 2 P(X <= min(b,c)))``
    with ``X ~ Bin(b + c, 1/2)``."""
    _check_count("b", b)
    _check_count("c", c)
    n = b + c
    if n == 0:
        return 1.0
    return float(min(1.0, 2.0 * _st.binom.cdf(min(b, c), n, 0.5)))


def mcnemar_midp(b: int, c: int) -> float:
    """Mid-p McNemar test (Fagerland et al. 2013), two-sided.

    ``p_mid = 2 [P(X <= k) - P(X = k) / 2]`` with ``k = min(b, c)``, ``X ~ Bin(b + c, 1/2)``,
    i.e. the exact conditional p-value minus the point probability of the observed table
    (when the exact p-value is not capped at 1; for ``b == c`` both equal 1).
    """
    _check_count("b", b)
    _check_count("c", c)
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    p = 2.0 * (_st.binom.cdf(k, n, 0.5) - 0.5 * _st.binom.pmf(k, n, 0.5))
    return float(min(1.0, p))


def _z_one_sided(alpha: float) -> float:
    return float(_st.norm.ppf(1.0 - alpha))


def paired_min_detectable_difference(n: int, discordant: int, alpha: float, power: float) -> float:
    """Smallest true paired difference the gate resolves.

    One-sided level ``alpha`` and power ``power`` for a paired design of ``n`` pairs with
    discordant-pair rate ``psi``::

        delta_min = (z_{1-alpha} + z_{power}) * sqrt(psi / n)

    ``sqrt(psi / n)`` is the standard error of the paired difference when the true difference
    is near 0 (``Var = (psi - Delta^2) / n``). ``psi`` is the observed ``discordant / n``,
    floored at ``1 / n`` so that identical runs do not claim infinite resolution.
    """
    if n <= 0:
        raise ValueError("n must be > 0")
    _check_count("discordant", discordant)
    psi = max(discordant, 1) / n
    return (_z_one_sided(alpha) + float(_st.norm.ppf(power))) * math.sqrt(psi / n)


def unpaired_standard_error(p1: float, n1: int, p2: float, n2: int) -> float:
    """Standard error of ``p1 - p2`` for independent samples,
    ``sqrt(p1 (1-p1) / n1 + p2 (1-p2) / n2)``, each ``p (1-p)`` floored at that of one
    success or failure, ``(1/n)(1 - 1/n)``, so that a 0% or 100% sample is not treated as
    noise-free."""
    if n1 <= 0 or n2 <= 0:
        raise ValueError("sample sizes must be > 0")

    def var(p: float, n: int) -> float:
        floor = (1 / n) * (1 - 1 / n) if n > 1 else 0.25
        return max(p * (1 - p), floor) / n

    return math.sqrt(var(p1, n1) + var(p2, n2))


def unpaired_min_detectable_difference(
    p1: float, n1: int, p2: float, n2: int, alpha: float, power: float
) -> float:
    """Smallest true difference two independent samples resolve at one-sided level
    ``alpha`` and power ``power``: ``(z_{1-alpha} + z_{power}) * se`` with ``se`` from
    :func:`unpaired_standard_error` (observed proportions)."""
    se = unpaired_standard_error(p1, n1, p2, n2)
    return (_z_one_sided(alpha) + float(_st.norm.ppf(power))) * se


def prob_pass_if_equal(margin: float, standard_error: float, alpha: float) -> float:
    """Probability that a candidate with true difference 0 passes the non-inferiority gate:
    ``Phi(margin / se - z_{1-alpha})`` (normal approximation; the gate passes when
    ``D_hat - z_{1-alpha} se > -margin``)."""
    if standard_error <= 0:
        return 1.0
    return float(_st.norm.cdf(margin / standard_error - _z_one_sided(alpha)))


def paired_standard_error(n: int, discordant: int) -> float:
    """``sqrt(psi / n)`` with ``psi = max(discordant, 1) / n`` (see
    :func:`paired_min_detectable_difference`)."""
    if n <= 0:
        raise ValueError("n must be > 0")
    return math.sqrt(max(discordant, 1) / n / n)


def mean_stderr(successes: int, n: int) -> float | None:
    """Standard error of a mean of 0/1 scores, as lm-eval computes it (sample standard
    deviation with ``ddof=1`` over ``sqrt(n)``); ``None`` for ``n < 2``."""
    if n < 2:
        return None
    p = successes / n
    return math.sqrt(p * (1 - p) / (n - 1))
