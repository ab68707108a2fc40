"""The audit's statistics: chi-square tails against closed forms, tests on hand-built counts,
the TV confidence bound's coverage, and the sample-size formula's power, measured."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from specdecode.audit_stats import (
    chi2_isf,
    chi2_sf,
    chi_square_gof,
    chi_square_homogeneity,
    noncentral_chi2_sf,
    regularized_gamma_q,
    required_samples,
    tv_distance,
    tv_two_sample,
)


def _even_df_sf(x: float, df: int) -> float:
    """Closed form for even df: e^(-x/2) sum_{j < df/2} (x/2)^j / j!."""
    half = x / 2.0
    return math.exp(-half) * sum(half**j / math.factorial(j) for j in range(df // 2))


def test_chi2_sf_textbook_critical_values() -> None:
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(11.070497693516351, 5) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(6.634896601021214, 1) == pytest.approx(0.01, rel=1e-9)
    assert chi2_sf(0.0, 3) == 1.0


@pytest.mark.parametrize("df", [2, 4, 10, 40])
@pytest.mark.parametrize("x", [0.01, 0.5, 3.0, 9.0, 30.0, 120.0])
def test_chi2_sf_matches_closed_form_both_branches(x: float, df: int) -> None:
    assert chi2_sf(x, df) == pytest.approx(_even_df_sf(x, df), rel=1e-10, abs=1e-300)


@pytest.mark.parametrize("x", [0.001, 0.3, 2.0, 8.0, 50.0])
def test_chi2_sf_df1_is_normal_tail(x: float) -> None:
    assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2.0)), rel=1e-10)


def test_gamma_q_exponential_and_isf_inverts() -> None:
    assert regularized_gamma_q(1.0, 2.5) == pytest.approx(math.exp(-2.5), rel=1e-12)
    for df in (1, 5, 35):
        for alpha in (0.05, 1e-4):
            assert chi2_sf(chi2_isf(alpha, df), df) == pytest.approx(alpha, rel=1e-6)


@pytest.mark.parametrize("nc", [0.0, 1.0, 9.0, 60.0])
def test_noncentral_chi2_df1_closed_form(nc: float) -> None:
    """df = 1: X = (Z + sqrt(nc))^2, so P(X >= x) = P(Z >= sqrt(x) - mu) + P(Z <= -sqrt(x) - mu)."""
    normal, mu = NormalDist(), math.sqrt(nc)
    for x in (0.5, 4.0, 25.0, 90.0):
        expected = 1 - normal.cdf(math.sqrt(x) - mu) + normal.cdf(-math.sqrt(x) - mu)
        assert noncentral_chi2_sf(x, 1, nc) == pytest.approx(expected, rel=1e-8, abs=1e-15)


def test_gof_hand_computed() -> None:
    result = chi_square_gof([10, 20, 30], [1.0, 1.0, 1.0])  # expected 20 each
    assert result.statistic == pytest.approx(10.0)
    assert result.df == 2
    assert result.p_value == pytest.approx(math.exp(-5.0))


def test_gof_merges_low_expectation_cells() -> None:
    result = chi_square_gof(torch.tensor([50, 44, 4, 2]), torch.tensor([0.5, 0.44, 0.04, 0.02]))
    assert (result.df, result.statistic) == (2, pytest.approx(0.0))
    tiny = chi_square_gof([97, 1, 1, 1], [0.97, 0.01, 0.01, 0.01])  # pool 3 < 5 takes the 97
    assert tiny.df == 0 and tiny.p_value == 1.0


def test_gof_count_in_impossible_cell_rejects() -> None:
    result = chi_square_gof([10, 1], [1.0, 0.0])
    assert result.p_value == 0.0
    assert chi_square_gof([10, 0], [1.0, 0.0]).p_value == 1.0


def test_homogeneity_hand_computed() -> None:
    result = chi_square_homogeneity([30, 10], [10, 30])  # all expected 20
    assert result.statistic == pytest.approx(20.0)
    assert result.df == 1
    assert result.p_value == pytest.approx(math.erfc(math.sqrt(10.0)))
    same = chi_square_homogeneity([5, 7, 0, 9], [5, 7, 0, 9])
    assert (same.statistic, same.df, same.p_value) == (0.0, 2, 1.0)


def _draw_counts(probs: torch.Tensor, n: int, reps: int, seed: int) -> torch.Tensor:
    """(reps, m) counts of n i.i.d. draws from probs, per repetition."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(probs.expand(reps, -1), n, replacement=True, generator=gen)
    return torch.nn.functional.one_hot(draws, probs.numel()).sum(dim=1)


P0 = torch.full((6,), 1 / 6)


def _shifted(tv: float) -> torch.Tensor:
    """Worst case for the chi-square test at a given TV from uniform: chi2 = 4 TV^2 exactly."""
    return P0 + torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0]) * (2 * tv / 6)


def test_tv_upper_bound_covers_truth() -> None:
    p_b = _shifted(0.1)
    truth = tv_distance(P0, p_b)
    assert truth == pytest.approx(0.1)
    counts_a, counts_b = _draw_counts(P0, 2000, 30, 1), _draw_counts(p_b, 2000, 30, 2)
    for a, b in zip(counts_a, counts_b, strict=True):
        bound = tv_two_sample(a, b, delta=0.05)
        assert bound.estimate <= bound.upper_bound
        assert truth <= bound.upper_bound
        assert abs(bound.estimate - truth) < 0.08
    same = tv_two_sample(counts_a[0], counts_a[1], delta=0.05)
    assert same.confidence == 0.95 and 0.0 <= same.estimate < same.upper_bound


def test_required_samples_scaling() -> None:
    n = required_samples(0.1, 1e-4, 0.999, 6)
    assert required_samples(0.05, 1e-4, 0.999, 6) == pytest.approx(4 * n, rel=1e-2)
    assert required_samples(0.1, 1e-4, 0.999, 6, two_sample=True) == pytest.approx(2 * n, rel=1e-2)
    assert required_samples(0.1, 1e-4, 0.999, 36) > n
    assert required_samples(0.1, 1e-2, 0.9, 6) < n


def test_required_samples_gives_stated_power_and_false_alarm() -> None:
    """Measured: with N = required_samples(...), the worst-case alternative at that TV is caught
    at about the stated power, and the null is rejected at about the stated rate."""
    alpha, power, tv, reps = 0.01, 0.9, 0.1, 400
    n = required_samples(tv, alpha, power, 6)
    alternative, null = _draw_counts(_shifted(tv), n, reps, 3), _draw_counts(P0, n, reps, 4)
    caught = sum(chi_square_gof(c, P0).p_value < alpha for c in alternative)
    false_alarms = sum(chi_square_gof(c, P0).p_value < alpha for c in null)
    assert caught / reps >= power - 0.06
    assert false_alarms / reps <= alpha + 0.03


def test_homogeneity_test_false_alarm_and_power() -> None:
    alpha, reps = 0.01, 300
    n = required_samples(0.1, alpha, 0.9, 6, two_sample=True)
    null_a, null_b = _draw_counts(P0, n, reps, 5), _draw_counts(P0, n, reps, 6)
    alt_b = _draw_counts(_shifted(0.1), n, reps, 7)
    false_alarms = sum(
        chi_square_homogeneity(a, b).p_value < alpha for a, b in zip(null_a, null_b, strict=True)
    )
    caught = sum(
        chi_square_homogeneity(a, b).p_value < alpha for a, b in zip(null_a, alt_b, strict=True)
    )
    assert false_alarms / reps <= alpha + 0.03
    assert caught / reps >= 0.9 - 0.07
