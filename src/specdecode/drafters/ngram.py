"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
context's last n tokens, in the prompt or in the text generated so far. No model, no q.

The drafter keeps an index from every n-gram (min_n <= n <= max_n) of the context to the position
of the token that followed its most recent occurrence. The index is updated only with the tokens
added since the previous call (the engine passes the full committed context every step, and it
only grows); a context that does not extend the previous one is indexed from scratch.

Matching tries n = max_n down to min_n and takes the first (longest) n-gram found. The proposal is
the up to k tokens that followed it; when the match is so recent that they run past the end of
the context (a repeating pattern, e.g. "a b a b"), the pattern is continued by copying with the
same period. The draft is deterministic (q=None): the verifier treats it as one-hot on each
proposed token, which is lossless whatever the proposal.

How long a match is says how far to trust it: the first proposed token after a 1-token match is
accepted a fraction of the time, after a 6-token match nearly always (the rates measured on
SmolLM2: docs/measurements/code-figures.md); and once a token is accepted the match is one token
longer. So each proposal carries a confidence per token:
the running acceptance rate of matches of length n + j for its j-th token (`MatchStats`, learned
from this request's own proposals against what was committed, starting from a prior), and the
engine keeps the prefix that pays for its verification. A proposal is scored against the
committed text even when the engine drafted none of it, so the rates keep being learned while
speculation is off.

Sampling changes the rates: a one-hot draft token x is accepted with probability p(x), not 1 when
x is the argmax, so the rates fall with the temperature (measured: the same file). So the rates
are kept per sampling regime (`RegimeStats`: temperature to 0.1, top-k, top-p,
min-p), each starting from the greedy prior scaled by a factor that falls with the temperature:
greedy traffic's rates never stand in for sampled traffic's, whose drafts would otherwise be
verified at widths that a rate learned on greedy text justifies and sampled text does not.
"""

from __future__ import annotations

import torch

from specdecode.drafters.base import EMPTY, Draft, Drafter, DraftRequest
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams


class NgramIndex:
    """n-gram (as a tuple) -> position of the token after its most recent occurrence."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.follower: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; each becomes the follower of the n-grams that end just before it."""
        for tok in tokens:
            pos = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, pos) + 1):
                self.follower[tuple(self.tokens[pos - n : pos])] = pos
            self.tokens.append(tok)

    def lookup(self) -> tuple[int, int] | None:
        """(follower position, n) of the longest suffix n-gram seen earlier (its most recent
        occurrence), or None."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            pos = self.follower.get(tuple(self.tokens[end - n :]))
            if pos is not None:
                return pos, n
        return None

    def continuation(self, start: int, k: int) -> list[int]:
        """k tokens from `start`, continuing past the end by repeating with period end - start."""
        end = len(self.tokens)
        out: list[int] = []
        for i in range(k):
            pos = start + i
            out.append(self.tokens[pos] if pos < end else out[pos - end])
        return out


STATS_CAP = 8  # match lengths >= this share one rate
# The starting guess of the acceptance rate after an m-token match, greedy (index m; 0 unused):
# the rates measured on SmolLM2's greedy output, rounded down where two sets of prompts disagreed
# (docs/measurements/code-figures.md).
GREEDY_PRIOR = (0.0, 0.2, 0.45, 0.6, 0.7, 0.75, 0.8, 0.8, 0.8)


def temperature_factor(temperature: float) -> float:
    """How much lower than greedy's the acceptance rates start at this temperature: a line
    through the measured sampled / greedy rates at 0.7 and 1.0
    (docs/measurements/code-figures.md), floored at 0.3."""
    return max(0.3, 1.0 - 0.45 * temperature)


class MatchStats:
    """Acceptance rate of proposed tokens by the match length behind them (integer counts), in
    one sampling regime.

    rate(m) = (accepted + w * prior) / (proposed + w), prior GREEDY_PRIOR[m] x `prior_scale`: a
    guess that the first verified tokens correct, worth `prior_weight` observations.
    """

    def __init__(self, prior_weight: float = 4.0, prior_scale: float = 1.0) -> None:
        self.prior_weight, self.prior_scale = prior_weight, prior_scale
        self.accepted = [0] * (STATS_CAP + 1)
        self.proposed = [0] * (STATS_CAP + 1)

    def rate(self, m: int) -> float:
        m = min(m, STATS_CAP)
        prior = GREEDY_PRIOR[m] * self.prior_scale
        return (self.accepted[m] + self.prior_weight * prior) / (self.proposed[m] +
                                                                 self.prior_weight)

    def record(self, n: int, proposal: list[int], committed: list[int]) -> None:
        """Score a proposal made after an n-token match against the tokens committed after it:
        token j (match length n + j) counts as proposed, and as accepted if it was committed,
        up to the first miss; tokens past the committed text are unknown and not counted."""
        for j, (tok, real) in enumerate(zip(proposal, committed, strict=False)):
            m = min(n + j, STATS_CAP)
            self.proposed[m] += 1
            if tok != real:
                return
            self.accepted[m] += 1


Regime = tuple[float, int, float, float]


def regime(params: SamplingParams) -> Regime:
    """The sampling settings that change how often a copied token is accepted: temperature (to
    0.1; 0 = greedy, where the others do not matter), top-k, top-p, min-p."""
    if params.greedy:
        return (0.0, 0, 1.0, 0.0)
    return (round(params.temperature, 1), params.top_k, round(params.top_p, 2),
            round(params.min_p, 2))


class RegimeStats:
    """One MatchStats per sampling regime, made on first use with the regime's prior."""

    def __init__(self, prior_weight: float = 4.0) -> None:
        self.prior_weight = prior_weight
        self.by_regime: dict[Regime, MatchStats] = {}

    def for_params(self, params: SamplingParams) -> MatchStats:
        key = regime(params)
        if key not in self.by_regime:
            self.by_regime[key] = MatchStats(self.prior_weight, temperature_factor(key[0]))
        return self.by_regime[key]


class NgramDrafter(Drafter):
    """Prompt-lookup drafter (one per request): longest suffix match first, most recent match."""

    fits_width = True  # drafts carry confidences; proposing costs ~nothing (Drafter.fits_width)

    def __init__(self, max_n: int = 8, min_n: int = 1, name: str = "ngram",
                 stats: RegimeStats | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise SpecDecodeError(
                f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"
            )
        self.name = name
        self.max_n, self.min_n = max_n, min_n
        self.index = NgramIndex(max_n, min_n)
        # the acceptance rates by match length and sampling regime: they outlive a request
        # (reset keeps them), and a factory passes one object to all its drafters, as a
        # server's traffic shares them
        self.stats = stats if stats is not None else RegimeStats()
        self._last: tuple[int, int, list[int], MatchStats] | None = None  # to score

    def reset(self) -> None:
        self.index = NgramIndex(self.max_n, self.min_n)
        self._last = None

    def _sync(self, context: list[int]) -> None:
        """Index the tokens new since the last call; rebuild if `context` is not an extension."""
        seen = self.index.tokens
        if len(context) < len(seen) or context[: len(seen)] != seen:
            self.reset()
        self.index.extend(context[len(self.index.tokens) :])

    def propose(self, request: DraftRequest) -> Draft:
        """Up to k tokens copied from after the best earlier match, with a confidence per token;
        empty when nothing matches.

        The last proposal is scored here, against the text committed since (not in
        observe_result): so it is scored even when the engine verified none of it (cut by
        fit_width, or the lookup not asked on the steps between), and the rates keep being
        learned while speculation is off."""
        tokens, k, params = request.context.tolist(), request.k, request.params
        self._sync(tokens)  # a context that does not extend the last one resets the request
        if self._last is not None and len(tokens) > self._last[0]:
            at, n, proposal, scored = self._last
            scored.record(n, proposal, tokens[at:])
        self._last = None
        found = self.index.lookup() if k > 0 else None
        if found is None:
            return Draft(EMPTY, None)
        start, n = found
        proposal = self.index.continuation(start, k)
        stats = self.stats.for_params(params)
        self._last = (len(tokens), n, proposal, stats)
        confidence = tuple(stats.rate(n + j) for j in range(len(proposal)))
        return Draft(torch.tensor(proposal, dtype=torch.long), None, confidence)
