"""Verification: exact greedy cases, reproducibility, and the distribution test for losslessness.

The distribution test ("audit") decodes the first two tokens of a toy bigram target many times
with a drafter and a verifier, and checks with chi-square tests that the first token and the
first-two-token sequence are distributed exactly as the target's. The SAME audit is run on
deliberately broken verifiers and drafter pipelines, and must catch every one of them: a test
that cannot fail proves nothing (docs/design.md).

Sample size: required_samples(DESIGN_TV, FALSE_ALARM, POWER, V * V) draws, so that any output
distribution at TV >= DESIGN_TV from the target's is caught with probability >= POWER (under the
noncentral chi-square approximation; see stats.required_samples), while a correct verifier fails
a given chi-square test with probability FALSE_ALARM. Each broken variant's exact TV gap on the
first token (a lower bound for the two-token gap) is computed and asserted >= DESIGN_TV.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from specdecode.audit_stats import chi_square_gof, required_samples, tv_distance
from specdecode.sampling import SamplingParams, probs_from_logits, sample
from specdecode.verify import (
    VerifyResult,
    acceptance_probability,
    verify_chain,
    verify_greedy,
)

V = 6  # toy vocabulary
START = V  # row of the toy tables used before any token
FALSE_ALARM = 1e-4
POWER = 0.999
DESIGN_TV = 0.1
N_AUDIT = required_samples(DESIGN_TV, FALSE_ALARM, POWER, num_cells=V * V)

Verifier = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None], VerifyResult
]
# (p_row, q_row, x) -> (acceptance probability of x, recovered-token distribution)
Rule = Callable[[torch.Tensor, torch.Tensor, int], tuple[float, torch.Tensor]]


# ---------------------------------------------------------------------------------------------
# Exact cases
# ---------------------------------------------------------------------------------------------


def _one_hot(tokens: list[int], vocab: int = V) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab)  # (T, V)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return out


def test_verify_greedy_all_accepted_gives_bonus() -> None:
    result = verify_greedy(torch.tensor([3, 1, 4, 5]), torch.tensor([3, 1, 4]))
    assert result.num_accepted == 3
    assert result.tokens.tolist() == [3, 1, 4, 5]


def test_verify_greedy_first_mismatch_gives_target_token() -> None:
    result = verify_greedy(torch.tensor([3, 2, 4, 5]), torch.tensor([3, 1, 4]))
    assert result.num_accepted == 1
    assert result.tokens.tolist() == [3, 2]
    result = verify_greedy(torch.tensor([0, 1, 4, 5]), torch.tensor([3, 1, 4]))
    assert (result.num_accepted, result.tokens.tolist()) == (0, [0])


def test_verify_greedy_k0_and_shape_check() -> None:
    result = verify_greedy(torch.tensor([2]), torch.tensor([], dtype=torch.int64))
    assert (result.num_accepted, result.tokens.tolist()) == (0, [2])
    with pytest.raises(ValueError):
        verify_greedy(torch.tensor([1, 2]), torch.tensor([1, 2]))


@pytest.mark.parametrize("use_q", [True, False])
def test_verify_chain_on_one_hot_rows_is_greedy(use_q: bool) -> None:
    """One-hot p and q (greedy params): accept exactly the matching prefix, whatever the seed."""
    target = [3, 1, 4, 5]
    p = _one_hot(target)  # (4, V)
    for draft, expected in [([3, 1, 4], [3, 1, 4, 5]), ([3, 2, 4], [3, 1]), ([0, 1, 4], [3])]:
        q = _one_hot(draft) if use_q else None
        for seed in range(5):
            gen = torch.Generator().manual_seed(seed)
            result = verify_chain(p, q, torch.tensor(draft), gen)
            assert result.tokens.tolist() == expected
            assert result.num_accepted == len(expected) - 1


def test_verify_chain_k0_draws_from_p0() -> None:
    p = _one_hot([4])
    result = verify_chain(p, None, torch.tensor([], dtype=torch.int64), None)
    assert (result.num_accepted, result.tokens.tolist()) == (0, [4])
    result = verify_chain(p, torch.zeros(0, V), torch.tensor([], dtype=torch.int64), None)
    assert result.tokens.tolist() == [4]


def test_verify_chain_shape_checks() -> None:
    with pytest.raises(ValueError):
        verify_chain(torch.ones(2, V), None, torch.tensor([1, 2]), None)
    with pytest.raises(ValueError):
        verify_chain(torch.ones(3, V), torch.ones(2, V + 1), torch.tensor([1, 2]), None)


def test_verify_chain_q_zero_on_proposed_token_uses_one_hot_rule() -> None:
    """q(x) = 0: no division by zero; x is accepted with probability p(x) (here 1 or 0)."""
    q = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0]])
    p_sure = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1.0]])
    p_never = torch.tensor([[0, 0, 0, 1.0, 0, 0], [0, 0, 0, 0, 0, 1.0]])
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        assert verify_chain(p_sure, q, torch.tensor([0]), gen).tokens.tolist() == [0, 5]
        assert verify_chain(p_never, q, torch.tensor([0]), gen).tokens.tolist() == [3]


def test_verify_chain_zero_mass_residual_falls_back_to_p() -> None:
    """p <= q everywhere (p == q up to rounding): a rejection draws from p instead of crashing."""
    p = torch.tensor([[0.4, 0.5, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])  # row 0 sums to 0.9
    q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0]])
    rejected = 0
    for seed in range(60):
        result = verify_chain(p, q, torch.tensor([0]), torch.Generator().manual_seed(seed))
        if result.num_accepted == 0:
            rejected += 1
            assert result.tokens.tolist()[0] in (0, 1)
    assert rejected > 0  # the fallback path ran


def test_verify_chain_is_reproducible_with_a_seed() -> None:
    gen = torch.Generator().manual_seed(123)
    p = torch.softmax(torch.randn(4, V, generator=gen), dim=-1)  # (4, V)
    q = torch.softmax(torch.randn(3, V, generator=gen), dim=-1)  # (3, V)
    draft = torch.tensor([1, 5, 2])
    runs = []
    for seed in (7, 7, 8):
        g = torch.Generator().manual_seed(seed)
        runs.append([verify_chain(p, q, draft, g).tokens.tolist() for _ in range(50)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_acceptance_probability_is_overlap() -> None:
    p = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2, 0], [1.0, 0, 0, 0, 0, 0]])
    q = torch.tensor([[0.25, 0, 0.75, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2, 0]])
    alpha = acceptance_probability(p, q)
    assert torch.allclose(alpha, torch.tensor([0.25, 1.0]))
    assert torch.allclose(acceptance_probability(p[:2], q), alpha)


# ---------------------------------------------------------------------------------------------
# Broken verifiers (test-only): each must be caught by the audit
# ---------------------------------------------------------------------------------------------


def _normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = float(weights.sum())
    return weights / total if total > 0 else fallback / float(fallback.sum())


def correct_rule(p: torch.Tensor, q: torch.Tensor, x: int) -> tuple[float, torch.Tensor]:
    """The rule verify_chain implements, written independently as the audit's exact oracle."""
    if float(q[x]) <= 0:  # one-hot rule
        without_x = p.clone()
        without_x[x] = 0.0
        return float(p[x]), _normalise(without_x, p)
    return min(1.0, float(p[x] / q[x])), _normalise(torch.clamp(p - q, min=0.0), p)


def no_residual_rule(p: torch.Tensor, q: torch.Tensor, x: int) -> tuple[float, torch.Tensor]:
    """BROKEN: forgets the residual; the recovered token is drawn from p."""
    return correct_rule(p, q, x)[0], p / float(p.sum())


def ignores_q_rule(p: torch.Tensor, q: torch.Tensor, x: int) -> tuple[float, torch.Tensor]:
    """BROKEN: accepts with probability p(x), ignoring q; keeps the max(0, p - q) residual."""
    return float(p[x]), correct_rule(p, q, x)[1]


def rule_verifier(rule: Rule) -> Verifier:
    """A chain verifier built from a per-position rule (same contract as verify_chain)."""

    def verify(
        p: torch.Tensor,
        q: torch.Tensor | None,
        draft_tokens: torch.Tensor,
        generator: torch.Generator | None,
    ) -> VerifyResult:
        draft = draft_tokens.tolist()
        assert q is not None
        for i, x in enumerate(draft):
            accept, residual = rule(p[i], q[i], x)
            if float(torch.rand(1, generator=generator, dtype=torch.float64)) >= accept:
                recovered = int(sample(residual, generator))
                return VerifyResult(i, torch.tensor([*draft[:i], recovered]))
        bonus = int(sample(p[len(draft)], generator))
        return VerifyResult(len(draft), torch.tensor([*draft, bonus]))

    return verify


# ---------------------------------------------------------------------------------------------
# Toy models: bigram tables, row START is the distribution of the first token
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToyPair:
    """A target and a drafter. The drafter draws from `sampled` and reports `reported` to the
    verifier (None: reports no q). A correct drafter has reported == sampled."""

    target: torch.Tensor  # (V + 1, V)
    sampled: torch.Tensor  # (V + 1, V)
    reported: torch.Tensor | None  # (V + 1, V)


def _table(
    seed: int, scale: float, zero_columns: tuple[int, ...] = (), start: list[float] | None = None
) -> torch.Tensor:
    """A (V + 1, V) table of random rows (softmax of N(0, scale^2) logits), with `zero_columns`
    impossible everywhere and, if given, the hand-built first-token distribution `start`."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(V + 1, V, generator=gen) * scale  # (V + 1, V)
    logits[:, list(zero_columns)] = -torch.inf
    table = torch.softmax(logits, dim=-1)
    if start is not None:
        table[START] = torch.tensor(start)
    return table


def _processed(seed: int, start: list[float], params: SamplingParams) -> torch.Tensor:
    """A (V + 1, V) table through the shared sampling pipeline: random logits (scale 2) with
    `start` as the first-token logits."""
    logits = torch.randn(V + 1, V, generator=torch.Generator().manual_seed(seed)) * 2.0
    logits[START] = torch.tensor(start)
    empty = torch.zeros(0, dtype=torch.int64)
    return probs_from_logits(logits, params, empty, 0, torch.zeros(V, dtype=torch.int64))


def _pair(target: torch.Tensor, draft: torch.Tensor, report: bool = True) -> ToyPair:
    return ToyPair(target, draft, draft if report else None)


HOT = SamplingParams(temperature=0.7)
HOT_TOP_P = SamplingParams(temperature=0.7, top_p=0.7)
# hand-built first-token distributions: the first-token gap of each broken variant depends on these
P_START = [0.45, 0.25, 0.15, 0.1, 0.05, 0.0]
Q_FAR_START = [0.0, 0.05, 0.1, 0.15, 0.3, 0.4]  # zero where p has mass, mass where p has none
Q_NEAR_START = [0.3, 0.3, 0.3, 0.05, 0.05, 0.0]
TARGET = _table(1, 1.5, start=P_START)
FAR = _pair(TARGET, _table(3, 3.0, start=Q_FAR_START))
NEAR = _pair(TARGET, _table(2, 1.5, start=Q_NEAR_START))
TARGET_LOGITS_START = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
DRAFT_LOGITS_START = [2.0, 2.0, 1.0, 1.0, 0.0, 0.0]

CORRECT_CASES: dict[str, tuple[ToyPair, int]] = {
    "k0": (NEAR, 0),
    "q_far_k1": (FAR, 1),
    "q_near_k3": (NEAR, 3),
    "q_zero_where_p_has_mass_k2": (_pair(TARGET, _table(4, 1.0, (0, 1))), 2),
    "p_zero_where_q_has_mass_k3": (_pair(_table(5, 1.5, (4, 5)), _table(6, 1.0)), 3),
    "q_equals_p_k2": (_pair(TARGET, TARGET), 2),
    "no_q_reported_k2": (_pair(TARGET, _table(7, 2.0), report=False), 2),
    "shared_pipeline_top_p_k2": (
        _pair(
            _processed(8, TARGET_LOGITS_START, HOT_TOP_P),
            _processed(9, DRAFT_LOGITS_START, HOT_TOP_P),
        ),
        2,
    ),
    # q reported WITH top-p but sampled without: still lossless, by the one-hot rule at q(x) = 0
    "sampled_unfiltered_reported_filtered_k2": (
        ToyPair(
            _processed(8, TARGET_LOGITS_START, HOT_TOP_P),
            _processed(9, DRAFT_LOGITS_START, HOT),
            _processed(9, DRAFT_LOGITS_START, HOT_TOP_P),
        ),
        2,
    ),
}

BROKEN_CASES: dict[str, tuple[ToyPair, Rule, int]] = {
    "no_residual": (FAR, no_residual_rule, 2),
    "ignores_q_on_acceptance": (NEAR, ignores_q_rule, 2),
    # the drafter samples at temperature 0.7 but reports q computed at temperature 1
    "q_without_temperature": (
        ToyPair(
            _processed(8, [2.0, 1.5, 1.0, 0.5, 0.0, 0.0], HOT),
            _processed(9, [3.0, 1.5, 1.0, 0.5, 0.0, 0.0], HOT),
            _processed(9, [3.0, 1.5, 1.0, 0.5, 0.0, 0.0], SamplingParams(temperature=1.0)),
        ),
        correct_rule,
        2,
    ),
    # top-p applied to p and to the drafter's sampler, but not to the q given to the verifier
    "top_p_missing_from_reported_q": (
        ToyPair(
            _processed(8, TARGET_LOGITS_START, HOT_TOP_P),
            _processed(9, DRAFT_LOGITS_START, HOT_TOP_P),
            _processed(9, DRAFT_LOGITS_START, HOT),
        ),
        correct_rule,
        2,
    ),
    # draft tokens sampled from model a's q, model b's q passed to the verifier
    "q_from_another_model": (ToyPair(TARGET, _table(10, 2.0), _table(11, 2.0)), correct_rule, 2),
}


# ---------------------------------------------------------------------------------------------
# The audit
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Audit:
    first_p_value: float  # chi-square GOF of the first token against the target
    pair_p_value: float  # chi-square GOF of the first two tokens against the target
    first_step_accept_rate: float  # fraction of first steps accepting >= 1 draft token


class InverseCdfDrafter:
    """Draws from the rows of a table by inverse CDF (pure Python: fast for a toy vocabulary)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.cumulative = [torch.cumsum(row.double(), 0).tolist() for row in table]
        self.last_positive = [max(i for i in range(V) if row[i] > 0) for row in table]

    def draw(self, previous: int, k: int, gen: torch.Generator) -> list[int]:
        """A chain of k tokens following `previous` (a token id, or START)."""
        tokens = []
        for u in torch.rand(k, generator=gen, dtype=torch.float64).tolist():
            cum = self.cumulative[previous]
            previous = min(bisect.bisect_right(cum, u * cum[-1]), self.last_positive[previous])
            tokens.append(previous)
        return tokens


def audit(pair: ToyPair, k: int, verifier: Verifier, n: int, seed: int) -> Audit:
    """Decode the first two tokens n times (speculative steps until two are emitted)."""
    gen = torch.Generator().manual_seed(seed)
    drafter = InverseCdfDrafter(pair.sampled)
    pair_counts = torch.zeros(V * V)
    first_step_accepts = 0
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            context = [out[-1] if out else START]
            context += drafter.draw(context[0], k, gen)
            p = pair.target[context]  # (k + 1, V)
            q = None if pair.reported is None else pair.reported[context[:-1]]  # (k, V)
            result = verifier(p, q, torch.tensor(context[1:], dtype=torch.int64), gen)
            first_step_accepts += int(not out and result.num_accepted > 0)
            out += result.tokens.tolist()
        pair_counts[out[0] * V + out[1]] += 1
    first = pair.target[START]  # (V,)
    joint = (first[:, None] * pair.target[:V]).reshape(-1)  # (V * V,)
    return Audit(
        chi_square_gof(pair_counts.view(V, V).sum(dim=1), first).p_value,
        chi_square_gof(pair_counts, joint).p_value,
        first_step_accepts / n,
    )


def exact_first_token(pair: ToyPair, rule: Rule) -> torch.Tensor:
    """Exact distribution of the first emitted token (k >= 1), (V,):
    sum_x sampled(x) * [accept(x) * e_x + (1 - accept(x)) * residual_x]."""
    p, q_sampled = pair.target[START], pair.sampled[START]
    # no reported q: all-zero row, which makes correct_rule use its one-hot rule
    q_reported = torch.zeros(V) if pair.reported is None else pair.reported[START]
    out = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        accept, residual = rule(p, q_reported, x)
        out += float(q_sampled[x]) * (1 - accept) * residual.double()
        out[x] += float(q_sampled[x]) * accept
    return out


def test_audit_sample_size_is_moderate() -> None:
    assert 1000 < N_AUDIT < 5000  # keeps the suite fast; see the module docstring


@pytest.mark.parametrize("name", sorted(CORRECT_CASES))
def test_verify_chain_output_distribution_is_the_targets(name: str) -> None:
    pair, k = CORRECT_CASES[name]
    if k > 0:  # the oracle agrees: exactly lossless
        exact = exact_first_token(pair, correct_rule)
        assert torch.allclose(exact, pair.target[START].double(), atol=1e-6)
    result = audit(pair, k, verify_chain, N_AUDIT, seed=1000 + len(name))
    assert result.first_p_value > FALSE_ALARM
    assert result.pair_p_value > FALSE_ALARM
    if k > 0 and pair.reported is pair.sampled:  # the acceptance rate is alpha_0
        alpha = float(acceptance_probability(pair.target[START:], pair.sampled[START:])[0])
        tolerance = 5 * (alpha * (1 - alpha) / N_AUDIT) ** 0.5 + 1e-9
        assert abs(result.first_step_accept_rate - alpha) <= tolerance


@pytest.mark.parametrize("name", sorted(BROKEN_CASES))
def test_audit_catches_broken_variant(name: str) -> None:
    pair, rule, k = BROKEN_CASES[name]
    gap = tv_distance(exact_first_token(pair, rule), pair.target[START])
    assert gap >= DESIGN_TV  # so N_AUDIT gives the audit power >= POWER on this variant
    result = audit(pair, k, rule_verifier(rule), N_AUDIT, seed=2000 + len(name))
    assert result.first_p_value < FALSE_ALARM
    assert result.pair_p_value < FALSE_ALARM


def test_rule_verifier_with_correct_rule_passes_the_audit() -> None:
    """The broken variants fail because of their rule, not because of the test harness."""
    pair = FAR
    result = audit(pair, 2, rule_verifier(correct_rule), N_AUDIT, seed=3000)
    assert min(result.first_p_value, result.pair_p_value) > FALSE_ALARM
