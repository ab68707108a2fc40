"""The controller: per step, per request, how many tokens to draft (0 = speculation off).

It maximises the expected tokens per second of the whole batch from three measured inputs:

- alpha_i: a running estimate per request of the probability that one draft token is accepted
  (exponentially weighted over its verified draft positions, seeded by a per-category prior);
- draft cost: seconds to draft one token (a running average of measured drafting time);
- target cost t(B, T): seconds of one target forward over B rows of T positions, from a table
  measured before serving (costs.forward_costs) and refreshed by every measured step.

With a common verification width T = K + 1 for the batch, request i drafting k_i <= K tokens
emits E(k_i) = (1 - alpha_i^(k_i+1)) / (1 - alpha_i) tokens in expectation (Leviathan et al. 2023),
so the batch rate is sum_i E(k_i) / (draft_s * sum_i k_i + t(B, K + 1)). For each K the controller
picks each k_i by its marginal value against the current best rate, then keeps the best K. K = 0 is
plain decoding, chosen whenever nothing else is expected to pay: at low alpha, or when the batch
is large enough that scoring more positions is no longer nearly free. A request whose speculation
is off drafts one token every `probe_every` steps (all such requests in the same step, so a
probe widens one batch step, not many) so its alpha keeps being measured and speculation comes
back when it pays again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PRIOR = 0.6


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by one step drafting k tokens at per-token acceptance alpha."""
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class CostModel:
    """Measured seconds of a target forward t(B, T) and of drafting one token."""

    target_s: dict[tuple[int, int], float] = field(default_factory=dict)
    draft_token_s: float | None = None
    smoothing: float = 0.2

    def target(self, batch: int, width: int) -> float:
        if (batch, width) in self.target_s:
            return self.target_s[(batch, width)]
        if not self.target_s:
            return 1.0 * width ** 0.5 * batch ** 0.5  # uninformed: only the ordering matters
        # nearest measured batch, then linear in width between measured widths
        batches = sorted({b for b, _ in self.target_s})
        b = min(batches, key=lambda x: (abs(x - batch), x))
        widths = sorted(w for bb, w in self.target_s if bb == b)
        lo = max([w for w in widths if w <= width], default=widths[0])
        hi = min([w for w in widths if w >= width], default=widths[-1])
        t_lo, t_hi = self.target_s[(b, lo)], self.target_s[(b, hi)]
        frac = 0.0 if hi == lo else (width - lo) / (hi - lo)
        return (t_lo + frac * (t_hi - t_lo)) * batch / b

    def observe_target(self, batch: int, width: int, seconds: float) -> None:
        old = self.target_s.get((batch, width))
        self.target_s[(batch, width)] = seconds if old is None else (
            (1 - self.smoothing) * old + self.smoothing * seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        per = seconds / tokens
        old = self.draft_token_s
        self.draft_token_s = per if old is None else (1 - self.smoothing) * old + \
            self.smoothing * per


@dataclass
class AlphaEstimate:
    """Running estimate of one request's per-token acceptance."""

    value: float = DEFAULT_PRIOR
    weight: float = 0.1  # how much one verified position moves the estimate

    def observe(self, samples: list[float]) -> None:
        for s in samples:
            self.value += self.weight * (s - self.value)


@dataclass
class Controller:
    kmax: int
    costs: CostModel = field(default_factory=CostModel)
    probe_every: int = 16
    priors: dict[str, float] = field(default_factory=dict)
    steps: int = 0

    def new_estimate(self, category: str | None = None) -> AlphaEstimate:
        return AlphaEstimate(self.priors.get(category or "", DEFAULT_PRIOR))

    def choose(self, alphas: list[AlphaEstimate]) -> list[int]:
        """Draft length per request for the next step (0 = off)."""
        batch = len(alphas)
        self.steps += 1
        draft_s = self.costs.draft_token_s
        if batch == 0 or self.kmax == 0:
            return [0] * batch
        if draft_s is None:  # nothing measured yet: draft once to learn the drafting cost
            return [1] * batch
        best_rate = batch / self.costs.target(batch, 1)
        best = [0] * batch
        for width_k in range(1, self.kmax + 1):
            ks = [_best_k(a.value, width_k, best_rate * draft_s) for a in alphas]
            if max(ks) == 0:
                continue
            emitted = sum(expected_tokens(a.value, k) for a, k in zip(alphas, ks, strict=True))
            rate = emitted / (draft_s * sum(ks) + self.costs.target(batch, max(ks) + 1))
            if rate > best_rate:
                best_rate, best = rate, ks
        if self.steps % self.probe_every == 0:  # all requests that are off probe together,
            return [max(k, 1) for k in best]  # so a probe widens one step, not many
        return best


def _best_k(alpha: float, width_k: int, token_cost: float) -> int:
    """k <= width_k maximising E(k) - token_cost * k (token_cost: tokens forgone per draft)."""
    values = [expected_tokens(alpha, k) - token_cost * k for k in range(width_k + 1)]
    return max(range(width_k + 1), key=lambda k: (values[k], -k))


def calibrated_costs(model: object, batches: list[int], kmax: int, context: int = 128,
                     repeats: int = 2) -> CostModel:
    """A CostModel whose t(B, T) table is measured now for T = 1..kmax+1 at each batch size."""
    from specdecode.costs import forward_costs

    costs = CostModel()
    for batch in batches:
        for row in forward_costs(model, batch, context, kmax + 1, repeats):
            costs.target_s[(batch, int(row["k"]))] = float(row["median_s"])
    return costs
