"""Statistics for the losslessness audit, in plain Python floats (no scipy).

- `chi_square_gof`: do observed counts fit an exactly known distribution (unit-level tests, where
  the target distribution p is known)?
- `chi_square_homogeneity` and `tv_two_sample`: do two samples (speculative vs plain decoding of a
  real model, whose output distribution is not known exactly) come from the same distribution?
- `required_samples`: how many samples a test needs to catch a given total-variation (TV) gap with
  a given power at a stated false-alarm rate.

The chi-square p-values come from our own regularized incomplete gamma function: the power series
of P(a, x) for x < a + 1 and Lentz's continued fraction for Q(a, x) otherwise (the method described
in Press et al., Numerical Recipes, section 6.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_EPS = 1e-15  # relative accuracy of the series and continued fraction
_TINY = 1e-300  # Lentz's guard against division by zero
_MAX_ITER = 10_000

Counts = torch.Tensor | Sequence[float]


@dataclass(frozen=True)
class ChiSquareResult:
    statistic: float
    df: int  # degrees of freedom after merging low-expectation cells
    p_value: float  # P(chi2_df >= statistic) under the null hypothesis


@dataclass(frozen=True)
class TVEstimate:
    estimate: float  # TV distance between the two empirical distributions
    upper_bound: float  # >= the true TV distance with probability >= confidence
    confidence: float  # 1 - delta


def regularized_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), the regularized upper incomplete gamma function (a > 0)."""
    if a <= 0:
        raise ValueError(f"a must be > 0, got {a}")
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)  # log(e^-x x^a / Gamma(a))
    if x < a + 1:
        return max(0.0, 1.0 - math.exp(log_prefactor) * _lower_series(a, x))
    return math.exp(log_prefactor) * _upper_continued_fraction(a, x)


def _lower_series(a: float, x: float) -> float:
    """sum_{n>=0} x^n / (a (a+1) ... (a+n)), so that P(a, x) = e^-x x^a / Gamma(a) * this."""
    term = 1.0 / a
    total = term
    for n in range(1, _MAX_ITER):
        term *= x / (a + n)
        total += term
        if abs(term) < abs(total) * _EPS:
            return total
    raise ArithmeticError(f"gamma series did not converge for a={a}, x={x}")


def _upper_continued_fraction(a: float, x: float) -> float:
    """1 / (x+1-a - 1(1-a) / (x+3-a - 2(2-a) / (x+5-a - ...))), by the modified Lentz method,
    so that Q(a, x) = e^-x x^a / Gamma(a) * this."""
    b = x + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = _TINY if abs(d) < _TINY else d
        c = b + an / c
        c = _TINY if abs(c) < _TINY else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"gamma continued fraction did not converge for a={a}, x={x}")


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with df degrees of freedom: Q(df / 2, x / 2)."""
    return regularized_gamma_q(df / 2.0, x / 2.0)


def chi2_isf(alpha: float, df: int) -> float:
    """The critical value c with chi2_sf(c, df) = alpha, by bisection (0 < alpha < 1)."""
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    lo, hi = 0.0, float(df) + 10.0
    while chi2_sf(hi, df) > alpha:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
        if hi - lo < 1e-10 * hi:
            break
    return 0.5 * (lo + hi)


def noncentral_chi2_sf(x: float, df: int, nc: float) -> float:
    """P(X >= x) for X ~ noncentral chi-square(df, noncentrality nc), as the Poisson(nc / 2)
    mixture of central chi-squares with df + 2j degrees of freedom. Uses
    Q(a + 1, y) = Q(a, y) + y^a e^-y / Gamma(a + 1) to step j; the Poisson tail beyond the last
    term (< 1e-12) is dropped."""
    mean = nc / 2.0
    y = x / 2.0
    a = df / 2.0
    q = regularized_gamma_q(a, y)
    last = int(mean + 15.0 * math.sqrt(mean) + 40.0)
    total = 0.0
    if mean == 0:
        return q
    for j in range(last + 1):
        log_weight = -mean + j * math.log(mean) - math.lgamma(j + 1.0)  # log Poisson(j; mean)
        total += math.exp(log_weight) * q
        if y > 0:
            q += math.exp((a + j) * math.log(y) - y - math.lgamma(a + j + 1.0))
    return min(1.0, total)


def chi_square_gof(observed: Counts, probs: Counts, min_expected: float = 5.0) -> ChiSquareResult:
    """Pearson's chi-square goodness-of-fit test of counts against a KNOWN distribution.

    Assumptions: the observations are i.i.d. draws from one categorical distribution; `probs` is
    the exact null distribution over the same cells (normalised here). The chi-square
    approximation needs expected counts >= ~5, so cells with expected < `min_expected` are pooled
    into one bin (plus the next-smallest cell if the pool is still below it). A count in a cell of
    null probability 0 is impossible under the null: statistic inf, p-value 0.
    """
    obs = _floats(observed)
    weights = _floats(probs)
    if len(obs) != len(weights):
        raise ValueError(f"{len(obs)} observed cells but {len(weights)} probabilities")
    n, total_weight = sum(obs), sum(weights)
    expected = [n * w / total_weight for w in weights]
    if any(o > 0 and e <= 0 for o, e in zip(obs, expected, strict=True)):
        return ChiSquareResult(math.inf, len(obs) - 1, 0.0)
    groups = _merge_groups(expected, min_expected)
    statistic = 0.0
    for group in groups:
        o = sum(obs[i] for i in group)
        e = sum(expected[i] for i in group)
        statistic += (o - e) ** 2 / e
    df = len(groups) - 1
    return ChiSquareResult(statistic, df, chi2_sf(statistic, df) if df > 0 else 1.0)


def chi_square_homogeneity(
    counts_a: Counts, counts_b: Counts, min_expected: float = 5.0
) -> ChiSquareResult:
    """Pearson's chi-square test that two samples come from the same categorical distribution.

    Assumptions: each sample is i.i.d. from its own distribution, the two are independent, and the
    cells (categories) are the same. Under the null hypothesis the 2 x m table's expected counts are
    row_total * column_total / n; columns whose smaller expected count is < `min_expected` are
    pooled into one (plus the next-smallest column while the pool is below it). Columns empty in
    both samples carry no information and are dropped.
    """
    a, b = _floats(counts_a), _floats(counts_b)
    if len(a) != len(b):
        raise ValueError(f"samples have {len(a)} and {len(b)} cells")
    n_a, n_b = sum(a), sum(b)
    n = n_a + n_b
    keep = [i for i in range(len(a)) if a[i] + b[i] > 0]
    smallest_expected = [(a[i] + b[i]) * min(n_a, n_b) / n for i in keep]
    statistic = 0.0
    groups = _merge_groups(smallest_expected, min_expected)
    for group in groups:
        obs_a = sum(a[keep[j]] for j in group)
        obs_b = sum(b[keep[j]] for j in group)
        column = obs_a + obs_b
        exp_a, exp_b = column * n_a / n, column * n_b / n
        statistic += (obs_a - exp_a) ** 2 / exp_a + (obs_b - exp_b) ** 2 / exp_b
    df = len(groups) - 1
    return ChiSquareResult(statistic, df, chi2_sf(statistic, df) if df > 0 else 1.0)


def tv_distance(probs_a: Counts, probs_b: Counts) -> float:
    """Total-variation distance 0.5 * sum |a - b| between two distributions (each normalised)."""
    a, b = _floats(probs_a), _floats(probs_b)
    sum_a, sum_b = sum(a), sum(b)
    return 0.5 * sum(abs(x / sum_a - y / sum_b) for x, y in zip(a, b, strict=True))


def tv_two_sample(counts_a: Counts, counts_b: Counts, delta: float) -> TVEstimate:
    """Empirical TV distance between two samples and a (1 - delta) upper confidence bound on the
    TV distance between the distributions they were drawn from.

    Bound (a concentration bound, not a bootstrap): for n i.i.d. draws over m categories,
    E[TV(empirical, true)] <= 0.5 * sqrt((m - 1) / n) (Cauchy-Schwarz on sum_i E|p^_i - p_i|), and
    moving one draw changes TV(empirical, true) by at most 1/n, so by McDiarmid's inequality it
    exceeds its mean by t with probability <= exp(-2 n t^2). With delta/2 for each sample and the
    triangle inequality: TV(P_a, P_b) <= TV(P^_a, P^_b) + sum_s [0.5 sqrt((m-1)/n_s) +
    sqrt(ln(2/delta) / (2 n_s))]. Assumptions: i.i.d. draws, independent samples, and m = the
    length of the count vectors is the number of categories that can occur at all (categories
    never observed still count: give the full category space).
    """
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    a, b = _floats(counts_a), _floats(counts_b)
    m = len(a)
    estimate = tv_distance(a, b)
    slack = 0.0
    for n in (sum(a), sum(b)):
        slack += 0.5 * math.sqrt((m - 1) / n) + math.sqrt(math.log(2.0 / delta) / (2.0 * n))
    return TVEstimate(estimate, min(1.0, estimate + slack), 1.0 - delta)


def required_samples(
    tv_to_detect: float,
    false_alarm: float,
    power: float,
    num_cells: int,
    two_sample: bool = False,
) -> int:
    """Samples a chi-square test needs to catch a TV gap of `tv_to_detect` with prob >= `power`
    while rejecting a true null with prob `false_alarm` (the p-value threshold).

    Derivation: the test rejects when the statistic exceeds c = chi2_isf(false_alarm, df),
    df = num_cells - 1 (cells after merging). Under an alternative P1 the Pearson statistic is
    approximately noncentral chi-square(df, lambda) (the standard large-sample approximation) with
    lambda = N * sum (p1 - p0)^2 / p0 >= N * 4 TV^2 (Cauchy-Schwarz: (sum |p1 - p0|)^2 <= sum
    (p1 - p0)^2 / p0), the worst case over alternatives at that TV. So we find the smallest lambda
    with noncentral_chi2_sf(c, df, lambda) >= power and return ceil(lambda / (4 TV^2)).
    two_sample=True: the homogeneity test with equal sizes has lambda >= n * 2 TV^2 for n draws
    per sample, so twice as many draws, per sample.
    """
    if not (0.0 < tv_to_detect <= 1.0):
        raise ValueError(f"tv_to_detect must be in (0, 1], got {tv_to_detect}")
    if not (0.0 < false_alarm < 1.0 and 0.0 < power < 1.0) or num_cells < 2:
        raise ValueError("need 0 < false_alarm, power < 1 and num_cells >= 2")
    df = num_cells - 1
    critical = chi2_isf(false_alarm, df)
    lo, hi = 0.0, 1.0
    while noncentral_chi2_sf(critical, df, hi) < power:
        hi *= 2.0
    while hi - lo > 1e-3 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if noncentral_chi2_sf(critical, df, mid) < power else (lo, mid)
    per_tv2 = 2.0 if two_sample else 4.0
    return math.ceil(hi / (per_tv2 * tv_to_detect**2))


def _merge_groups(sizes: list[float], threshold: float) -> list[list[int]]:
    """Group cell indices so every group's total size is >= threshold where possible: cells below
    it are pooled, and the pool takes the next-smallest cells while still below it."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    small = [i for i in order if sizes[i] < threshold]
    large = [i for i in order if sizes[i] >= threshold]
    if not small:
        return [[i] for i in large]
    pool = list(small)
    while large and sum(sizes[i] for i in pool) < threshold:
        pool.append(large.pop(0))
    return [pool] + [[i] for i in large]


def _floats(values: Counts) -> list[float]:
    if isinstance(values, torch.Tensor):
        return [float(v) for v in values.reshape(-1).tolist()]
    return [float(v) for v in values]
