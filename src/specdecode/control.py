"""The controller: per step, per request, how many tokens to draft (0 = speculation off).

It maximises the expected tokens per second of the whole batch from three measured inputs:

- alpha_i: a running estimate per request of the probability that one draft token is accepted
  (exponentially weighted over its verified draft positions), seeded by the running alpha of
  its category (every request's verified positions also update its category's estimate, more
  slowly), so a short request starts from what its kind of traffic has shown, not a guess;
- draft cost: seconds to draft one token (a running average of measured drafting time, kept
  per batch size too: a copy drafting in the target's cache drafts a batch's rows in one forward
  per position, so its cost per token falls as the batch grows);
- target cost t(B, T): seconds of one step over B rows of T positions, from a table of forward
  passes measured before serving (calibration.forward_costs), refreshed by every step the engine
  runs, timed from the forward to the end of every row's verification and commit (per-row work that
  grows with B and T, and that a forward-only table leaves out).

With a common verification width T = K + 1 for the batch, request i drafting k_i <= K tokens emits
E(k_i) = (1 - alpha_i^(k_i+1)) / (1 - alpha_i) tokens in expectation (Leviathan et al. 2023), so
the batch rate is sum_i E(k_i) / (draft_s * sum_i k_i + t(B, K + 1) + o_s(B)), against plain
decoding's B / (t(B, 1) + o_p(B)), where o_s and o_p are the measured seconds of a speculative and
a plain step outside the forward and the model's drafting (CostModel.overhead). For each K the
controller picks each k_i by its marginal value against the current best rate, then keeps the best
K. K = 0 is plain decoding, chosen whenever nothing else is expected to beat it by PAY_MARGIN: at
low alpha, or when the batch is large enough that scoring more positions is no longer nearly free.
A request whose speculation is off drafts one token every `probe_every` steps (all such requests in
the same step, so a probe widens one batch step, not many) so its alpha keeps being measured and
speculation comes back when it pays again. Probes cost something (a wider step, and a draft model
catching up with the tokens committed meanwhile), so they back off: each probe after which
speculation stays off doubles the interval (up to `max_probe_every`), unless its drafts were
accepted well above the requests' estimates (they are still learning: the interval stays), and none
is made while even a draft accepted with probability `PROBE_ALPHA` could not pay at this batch
size.
The drafting cost counts draft steps only: a draft model's catching up with the context (its
prompt, or the tokens committed while it was off) is a one-off cost of turning speculation on,
not a cost per token, and is left out of `draft_token_s`.

All of that is a model, and a model can be wrong (acceptance overrated, per-row work it does not
see, a machine busier than when it was calibrated). `PayGuard` checks the outcome: per batch
size, the realized tokens per second of the steps that speculated against those of plain steps,
and it holds speculation off (with back-off, then a fresh trial) where they do not pay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from specdecode.acceptance import PAY_MARGIN, expected_accepted, expected_tokens

DEFAULT_PRIOR = 0.6
PRIOR_SLOPE = 0.1  # past the widest measured width: each more position costs this x t(B, 1)
PROBE_ALPHA = 0.95  # the acceptance a probe hopes to find; if even it cannot pay, no probe
LEARNING_GAP = 0.1  # a probe accepted this much above the estimates: they are still learning
# A request seeded from its category's running alpha counts that start as up to this many
# samples (a request's acceptance varies around its category's: 8 samples is the weight of
# a Beta prior whose spread across requests is ~0.1 at alpha ~0.9)
SEEDED_COUNT = 8.0


def best_width(confidences: Sequence[Sequence[float]], width_cost: Callable[[int], float],
               floor: int = 1, fixed_tokens: float = 0.0, margin: float = PAY_MARGIN) -> int:
    """The verification width T for a batch step whose drafts carry per-token confidences
    (confidence[j]: probability token j is accepted given the ones before it were).

    One target forward scores every row at the widest row's width, so the choice is one T for
    the batch: the T >= floor maximising expected tokens per unit of cost,
    (fixed_tokens + sum_i E_i(min(len_i, T - 1))) / width_cost(T), where
    E(k) = 1 + sum_{i<=k} prod_{j<=i} confidence[j] and width_cost(T) is the cost of the
    forward at width T, provided it beats the least width by `margin`. `floor` and
    `fixed_tokens` account for rows whose drafts are kept whole
    (drafts without confidences: T at least their width; their tokens a constant). Each draft
    is then cut to T - 1 tokens. For one request this is the draft length that pays best; in a
    batch a row widens everyone's step, so a draft must pay for the whole batch's extra cost.
    """
    longest = max((len(c) for c in confidences), default=0)
    rates = {}
    for t in range(floor, max(floor, longest + 1) + 1):
        emitted = fixed_tokens + sum(1.0 + expected_accepted(c[: t - 1]) for c in confidences)
        rates[t] = emitted / width_cost(t)
    best_t = max(rates, key=lambda t: (rates[t], -t))
    return best_t if rates[best_t] > rates[floor] * (1 + margin) else floor


@dataclass
class CostModel:
    """Measured seconds of a target forward t(B, T) and of drafting one token."""

    target_s: dict[tuple[int, int], float] = field(default_factory=dict)
    draft_token_s: float | None = None  # over every batch size
    smoothing: float = 0.2
    draft_batch_s: dict[int, float] = field(default_factory=dict)  # per batch size
    # per (batch size, speculative): seconds of a step outside the forward, the verification
    # and the model drafter's tokens: choosing, a lookup's proposing, bookkeeping, sampling.
    # On a fast target this is a sizeable share of a step (a step of 8 ms pays ~1 ms of it), and
    # leaving it out overrates speculation: the speculative step pays more of it than the plain
    overhead_s: dict[tuple[int, bool], float] = field(default_factory=dict)

    def overhead(self, batch: int, speculative: bool) -> float:
        """Per-step seconds outside the forward and the model's drafting (0 until measured;
        a speculative step not yet measured takes the plain one's)."""
        own = self.overhead_s.get((batch, speculative))
        if own is not None:
            return own
        return self.overhead_s.get((batch, False), 0.0)

    def step(self, batch: int, width: int, speculative: bool) -> float:
        """Seconds of a whole step but its model drafting: t(B, T) plus the step's overhead."""
        return self.target(batch, width) + self.overhead(batch, speculative)

    def observe_overhead(self, batch: int, speculative: bool, seconds: float) -> None:
        key = (batch, speculative)
        old = self.overhead_s.get(key)
        seconds = max(0.0, seconds)
        self.overhead_s[key] = seconds if old is None else (
            (1 - self.smoothing) * old + self.smoothing * seconds)

    def draft(self, batch: int) -> float | None:
        """Seconds per draft token at this batch size (where measured, else overall)."""
        return self.draft_batch_s.get(batch, self.draft_token_s)

    def target(self, batch: int, width: int) -> float:
        """t(B, T): the measured figure where there is one, else an estimate (`_estimate`)."""
        measured = self.target_s.get((batch, width))
        if measured is not None:
            return measured
        if not self.target_s:
            return 1.0 * width ** 0.5 * batch ** 0.5  # uninformed: only the ordering matters
        return self._estimate(batch, width)

    def _estimate(self, batch: int, width: int) -> float:
        """t(B, T) unmeasured: T's cost relative to the narrowest width, from the nearest batch
        size whose measurements start at width 1 and reach T (interpolated linearly), times
        this batch's own narrowest step where measured (else the reference's, scaled by the
        batch ratio).

        The reference is chosen by coverage first, distance second, because the engine fills the
        table as steps come: a batch size seen at one or two widths (a batch draining from 8 to
        7 rows, its first step a wide one) would otherwise stand for every width it has not
        seen, and widths it has not seen looked free (t(7, 1..5) all equal to the one measured
        t(7, 5)), so wide steps were chosen where they lose."""
        widths: dict[int, list[int]] = {}
        for b, w in self.target_s:
            widths.setdefault(b, []).append(w)
        ref = min(widths, key=lambda b: (min(widths[b]) > 1, max(widths[b]) < width,
                                         abs(b - batch), b))
        ws = sorted(widths[ref])
        narrowest = self.target_s[(ref, ws[0])]
        own = self.target_s.get((batch, ws[0]))
        base = own if own is not None else narrowest * batch / ref
        return base * self._curve(ref, ws, width) / narrowest

    def _curve(self, batch: int, widths: list[int], width: int) -> float:
        """t(batch, width) through the measured `widths` of this batch (sorted): linear between
        them; past the widest, the last measured segment's slope (at least PRIOR_SLOPE of the
        narrowest step per position); below the narrowest, the narrowest."""
        t = [self.target_s[(batch, w)] for w in widths]
        if width >= widths[-1]:
            slope = PRIOR_SLOPE * t[0]
            if len(widths) > 1:
                slope = max(slope, (t[-1] - t[-2]) / (widths[-1] - widths[-2]))
            return t[-1] + (width - widths[-1]) * slope
        if width <= widths[0]:
            return t[0]
        hi = next(i for i, w in enumerate(widths) if w >= width)
        frac = (width - widths[hi - 1]) / (widths[hi] - widths[hi - 1])
        return t[hi - 1] + frac * (t[hi] - t[hi - 1])

    def observe_target(self, batch: int, width: int, seconds: float) -> None:
        old = self.target_s.get((batch, width))
        self.target_s[(batch, width)] = seconds if old is None else (
            (1 - self.smoothing) * old + self.smoothing * seconds)

    def observe_draft(self, tokens: int, seconds: float, batch: int | None = None) -> None:
        if tokens <= 0:
            return
        per = seconds / tokens
        old = self.draft_token_s
        self.draft_token_s = per if old is None else (1 - self.smoothing) * old + \
            self.smoothing * per
        if batch is not None:
            old = self.draft_batch_s.get(batch)
            self.draft_batch_s[batch] = per if old is None else (1 - self.smoothing) * old + \
                self.smoothing * per


@dataclass
class AlphaEstimate:
    """Running estimate of one request's per-token acceptance.

    The start value counts as `prior_count` samples: the first observations move the estimate
    as a mean would (1 / (prior_count + n)), so a short request whose drafts are rejected stops
    speculating after a few steps instead of trusting the prior for dozens; later ones move it
    by at least `weight` (an exponentially weighted average that follows bursts).
    """

    value: float = DEFAULT_PRIOR
    weight: float = 0.1  # the least one verified position moves the estimate
    prior_count: float = 2.0
    count: int = 0

    def observe(self, samples: list[float]) -> None:
        for s in samples:
            self.count += 1
            step = max(self.weight, 1.0 / (self.prior_count + self.count))
            self.value += step * (s - self.value)


@dataclass
class PayGuard:
    """Whether the steps that speculated actually paid, measured, per batch size.

    The controller's choices come from a model (alpha estimates or drafters' confidences, the
    t(B, T) table, the drafting cost); where the model is wrong (acceptance overrated, per-row
    work it does not see, a busy machine), speculation can lose while its predictions say it
    wins. The guard checks the outcome instead: per batch size, the realized tokens per second
    of speculative steps (committed tokens over the step's wall time, drafting included; a
    step is speculative when drafters were asked to draft, whatever was verified) against that
    of plain steps (nothing proposed) of the same batch size. Speculative steps are judged in
    windows of `window` steps: at the end of each, if their rate (a ratio of sums over the
    window) is below plain's, speculation is held off at that batch size for `backoff` steps
    (plain steps, which refresh plain's rate), then tried on a fresh window; each failed window
    doubles the hold (up to `max_backoff`), one that pays resets it. One verdict per window, not
    one per step: a test repeated after every step would, on this noisy machine, sooner or
    later find speculation "losing" by chance where it pays a few percent (a first version did:
    4 holds in a batch-8 cell where speculation measured 1.07x without the guard).

    Plain's rate is a decayed ratio of sums over measured plain steps (where fewer than
    `min_plain` are in, from the t(B, 1) table), and while speculation runs without a break
    one step in `refresh_every` is plain, so the comparison is with plain decoding at today's
    context lengths and load, not the calibration's. Selection does not bias it: a plain step's
    rate does not depend on the drafts it skipped, so the question asked is exactly "did the
    steps we chose to speculate on beat a plain step".
    """

    window: int = 16
    min_plain: int = 3
    decay: float = 0.9
    base_backoff: int = 16
    max_backoff: int = 512
    refresh_every: int = 32
    # per batch size: [tokens, seconds, steps] of the current speculative window, and decayed
    # [tokens, seconds, steps] of plain steps
    spec: dict[int, list[float]] = field(default_factory=dict)
    plain: dict[int, list[float]] = field(default_factory=dict)
    hold_until: dict[int, int] = field(default_factory=dict)
    backoff: dict[int, int] = field(default_factory=dict)
    since_plain: dict[int, int] = field(default_factory=dict)
    holds: int = 0  # times speculation was held off (a counter for reports and tests)

    def allows(self, batch: int, step: int) -> bool:
        """May this step (the controller's step number) speculate at this batch size?"""
        if step < self.hold_until.get(batch, 0):
            return False
        return self.since_plain.get(batch, 0) < self.refresh_every

    def plain_rate(self, batch: int, costs: CostModel) -> float | None:
        sums = self.plain.get(batch)
        if sums is not None and sums[2] >= self.min_plain:
            return sums[0] / sums[1]
        return batch / costs.step(batch, 1, False) if costs.target_s else None

    def observe(self, batch: int, speculative: bool, tokens: int, seconds: float, step: int,
                costs: CostModel) -> None:
        """One step's outcome: committed tokens over its wall time (drafting included)."""
        if seconds <= 0 or batch <= 0:
            return
        self.since_plain[batch] = self.since_plain.get(batch, 0) + 1 if speculative else 0
        if not speculative:
            sums = self.plain.setdefault(batch, [0.0, 0.0, 0.0])
            sums[0] = self.decay * sums[0] + tokens
            sums[1] = self.decay * sums[1] + seconds
            sums[2] += 1  # steps seen (not decayed)
            return
        window = self.spec.setdefault(batch, [0.0, 0.0, 0.0])
        window[0], window[1], window[2] = window[0] + tokens, window[1] + seconds, window[2] + 1
        plain = self.plain_rate(batch, costs)
        if window[2] < self.window or plain is None:
            return
        del self.spec[batch]  # the verdict on this window; the next one starts empty
        if window[0] / window[1] < plain:  # it did not pay: plain for a while, then a trial
            hold = self.backoff.get(batch, self.base_backoff)
            self.hold_until[batch] = step + 1 + hold  # the next `hold` steps are plain
            self.backoff[batch] = min(2 * hold, self.max_backoff)
            self.holds += 1
        else:
            self.backoff[batch] = self.base_backoff


@dataclass(frozen=True)
class StepObservation:
    """What one batch step of the engine measured, for Controller.learn. Times leave out the
    drafters' one-off catching up with the context (see the module docstring)."""

    batch: int  # rows
    width: int  # verification width T: positions scored per row
    proposed: bool  # some drafter was asked to draft (the step is speculative)
    committed: int  # tokens committed over every row (EOS included)
    draft_tokens: int  # tokens drafted without confidences: a model drafter's, which set its cost
    draft_s: float  # seconds of proposing
    target_s: float  # seconds from the forward to the end of every row's verification and commit
    step_s: float  # seconds of the whole step, choosing and drafting included
    # per row drafted without confidences: its running estimate, its category and the alpha
    # samples of its verified positions (drafts with confidences are fitted by those instead)
    alphas: tuple[tuple[AlphaEstimate, str | None, list[float]], ...] = ()


@dataclass
class Controller:
    kmax: int
    costs: CostModel = field(default_factory=CostModel)
    probe_every: int = 16
    priors: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    max_probe_every: int = 256
    _interval: int = 0  # current probe interval (backs off from probe_every)
    _since_probe: int = 0
    _probed: bool = False  # the last step was a probe
    _probe_samples: list[float] = field(default_factory=list)  # what the last probe saw

    categories: dict[str, AlphaEstimate] = field(default_factory=dict)
    category_weight: float = 0.02
    # Tail-latency cap: no step may cost more than this many plain steps of the same batch
    # (None: no cap). A step's time is every request's inter-token latency that step, so the
    # cap bounds the ITL tail that wide steps make, at the price of the throughput they bring.
    max_step_cost: float | None = None
    # Realized goodput of speculative against plain steps, per batch size (None: no check)
    guard: PayGuard | None = field(default_factory=PayGuard)

    def allows(self, batch: int) -> bool:
        """May the next step of `batch` rows speculate? False while the guard holds it off, or
        when the guard wants a plain step to refresh plain decoding's measured rate."""
        return self.guard is None or self.guard.allows(batch, self.steps)

    def learn(self, step: StepObservation) -> None:
        """Everything a finished batch step teaches: each row's alpha (and its category's),
        the cost per draft token, t(B, T), and the guard's realized rates."""
        for estimate, category, samples in step.alphas:
            estimate.observe(samples)
            self.observe(category, samples)
        if step.draft_tokens:
            self.costs.observe_draft(step.draft_tokens, step.draft_s, step.batch)
        self.costs.observe_target(step.batch, step.width, step.target_s)
        model_draft = step.draft_s if step.draft_tokens else 0.0  # a lookup's is overhead
        self.costs.observe_overhead(step.batch, step.proposed,
                                    step.step_s - step.target_s - model_draft)
        self.observe_step(step.batch, step.proposed, step.committed, step.step_s)

    def observe_step(self, batch: int, proposed: bool, tokens: int, seconds: float) -> None:
        """A finished step: `tokens` committed over `batch` rows in `seconds` of wall time,
        drafting included; `proposed`: some drafter was asked to draft. Such a step is
        speculative whatever was then verified: a draft cut to nothing still cost its proposing
        (prompt lookups over 32 rows, every step), and plain decoding pays none of it. Probes
        are the controller's exploration, not its choice to speculate: left out."""
        if self.guard is None or (proposed and self._probed):
            return
        self.guard.observe(batch, proposed, tokens, seconds, self.steps, self.costs)

    def max_width(self, batch: int) -> int:
        """The widest verification width T (1 + draft tokens) a step of `batch` rows may take:
        kmax + 1, or less under max_step_cost (from the measured t(B, T))."""
        if self.max_step_cost is None:
            return self.kmax + 1
        limit = self.max_step_cost * self.costs.target(batch, 1)
        width = 1
        while width <= self.kmax and self.costs.target(batch, width + 1) <= limit:
            width += 1
        return width

    def new_estimate(self, category: str | None = None) -> AlphaEstimate:
        """A request's starting estimate: its category's running alpha, else the prior.

        A start taken from a category counts as more samples the more that category has seen
        (up to SEEDED_COUNT): the pooled acceptance of many requests is better evidence than
        a guess. With the prior's weight of 2 samples, one rejected token took a fresh request
        of a category accepted 98% of the time from 0.98 to 0.65, below where the 4-bit copy
        pays at batch 1, and the request decoded plain until probes brought it back."""
        seen = self.categories.get(category or "")
        if seen is not None:
            weight = min(SEEDED_COUNT, AlphaEstimate.prior_count + seen.count)
            return AlphaEstimate(seen.value, prior_count=weight)
        return AlphaEstimate(self.priors.get(category or "", DEFAULT_PRIOR))

    def observe(self, category: str | None, samples: list[float]) -> None:
        """A request's verified alpha samples, pooled into its category's running estimate."""
        if not samples:
            return
        if self._probed:
            self._probe_samples.extend(samples)
        key = category or ""
        if key not in self.categories:
            self.categories[key] = AlphaEstimate(self.priors.get(key, DEFAULT_PRIOR),
                                                 self.category_weight, prior_count=8.0)
        self.categories[key].observe(samples)

    def choose(self, alphas: list[AlphaEstimate]) -> list[int]:
        """Draft length per request for the next step (0 = off)."""
        batch = len(alphas)
        self.steps += 1
        draft_s = self.costs.draft(batch)
        if batch == 0 or self.kmax == 0:
            return [0] * batch
        if not self.allows(batch):  # the guard holds speculation off, or wants a plain step
            self._probed, self._probe_samples = False, []
            return [0] * batch
        if draft_s is None:  # nothing measured yet: draft once to learn the drafting cost
            return [1] * batch
        best = self._best([a.value for a in alphas], draft_s)
        self._interval = self._interval or self.probe_every
        if self._probed and not any(best) and not self._still_learning(alphas):
            # the last probe did not turn speculation on, and not for want of samples
            self._interval = min(2 * self._interval, self.max_probe_every)
        elif any(best) or self._probed:
            self._interval = self.probe_every
        self._probed, self._probe_samples = False, []
        if all(best):
            return best
        self._since_probe += 1
        if self._since_probe >= self._interval and any(self._best([PROBE_ALPHA] * batch,
                                                                  draft_s)):
            self._since_probe, self._probed = 0, True  # all requests that are off probe
            return [max(k, 1) for k in best]  # together, so a probe widens one step, not many
        return best

    def _still_learning(self, alphas: list[AlphaEstimate]) -> bool:
        """The last probe's drafts were accepted more often (by LEARNING_GAP) than the requests'
        estimates say: speculation stayed off because the estimates have not caught up with the
        traffic yet (they start at a prior and move a little per sample), not because what the
        probe found cannot pay. Backing off then would starve the estimates of samples (a
        4-bit copy accepted 98% of the time at batch 2 was estimated at 0.73 for ~120 steps)."""
        if not self._probe_samples:
            return False
        seen = sum(self._probe_samples) / len(self._probe_samples)
        return seen > sum(a.value for a in alphas) / len(alphas) + LEARNING_GAP

    def _best(self, alphas: list[float], draft_s: float) -> list[int]:
        """The k per request maximising the batch's expected tokens per second."""
        batch = len(alphas)
        plain_rate = batch / self.costs.step(batch, 1, False)
        best_rate, best = plain_rate, [0] * batch
        for width_k in range(1, self.max_width(batch)):
            ks = [_best_k(a, width_k, best_rate * draft_s) for a in alphas]
            if max(ks) == 0:
                continue
            emitted = sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
            rate = emitted / (draft_s * sum(ks) + self.costs.step(batch, max(ks) + 1, True))
            if rate > best_rate:
                best_rate, best = rate, ks
        return best if best_rate > plain_rate * (1 + PAY_MARGIN) else [0] * batch


def auto_controller(kmax: int, costs: CostModel | Mapping[tuple[int, int], float],
                    max_step_cost: float | None) -> Controller:
    """The controller under --k auto, the one way every front end builds it (generate and the
    API, serve, bench): drafting at most `kmax` tokens a step, starting from t(B, T) measured
    before the first token (`costs`: a CostModel, or calibration's table of t(B, T)), no step
    costlier than `max_step_cost` plain steps of its batch (None: no cap)."""
    model = costs if isinstance(costs, CostModel) else CostModel(target_s=dict(costs))
    return Controller(kmax=kmax, costs=model, max_step_cost=max_step_cost)


def _best_k(alpha: float, width_k: int, token_cost: float) -> int:
    """k <= width_k maximising E(k) - token_cost * k (token_cost: tokens forgone per draft)."""
    values = [expected_tokens(alpha, k) - token_cost * k for k in range(width_k + 1)]
    return max(range(width_k + 1), key=lambda k: (values[k], -k))
