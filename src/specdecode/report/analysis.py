"""Benchmark statistics: percentiles, bootstrap intervals and per-configuration aggregates.

Choices, stated once:

- Percentiles interpolate linearly between order statistics (numpy's "linear" method, Hyndman
  and Fan's type 7): p50 of [1, 2, 3, 4] is 2.5. An empty input gives NaN.
- Confidence intervals are percentile bootstraps (default 2000 resamples, 95 %) drawn from a
  seeded `numpy.random.Generator`, so a report is reproducible. Speedups resample paired units
  (the same prompt and turn measured plain and speculative), at batch > 1 whole batch groups
  of them (the requests of one batch share its timing, `batch_clusters`); inter-token
  latencies resample whole requests (tokens of one request are not independent).
- Latency: TTFT and request latency per request; TPOT (time per output token) per request,
  (latency - TTFT) / (tokens - 1), over requests of two tokens or more; inter-chunk gaps, every
  gap between successive chunks of output a client receives (the tokens of one speculative step
  arrive together: one chunk); per-token ITL, every output token after the first (a chunk of m
  tokens counts its gap and m - 1 zeros, so its median is 0 where most steps accept a draft).
  Percentiles of TPOT are over requests, of gaps and ITL over all gaps or tokens pooled.
- A configuration's throughput is its output tokens divided by its wall time, the wall time
  being the sum, over its batch groups and turns, of the slowest request's latency.
- Speedup of a speculative configuration is measured against the plain configuration at the
  same batch size and temperature, on the units both measured. "median ratio": median plain
  time per output token / median speculative time per output token; "total ratio": speculative
  tokens/s over plain tokens/s summed over those units. Recommendations use the total ratio.
- Cold to warm (workloads with repeat groups): a speculative configuration's requests by their
  place in the run, in ARRIVAL_SLICES near-equal slices of the workload's order, and the first
  request of each group against the later ones (a request without a group counts as a first),
  each with its acceptance and speedup (total ratio, point estimate) from the samples measured.
- alpha is the engine's direct measure E[sum_x min(p(x), q(x))] over verified draft positions
  where the samples carry it, else accepted / (accepted + rejections), the maximum-likelihood
  estimate under i.i.d. acceptance; accepted / drafted (the acceptance rate) is reported
  separately.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from specdecode.bench.records import AuditVerdict, ConfigSpec, CostCurve, RequestSample
from specdecode.bench.store import Results
from specdecode.control import expected_tokens

Statistic = Callable[[np.ndarray], np.ndarray]
DEFAULT_RESAMPLES = 2000
DEFAULT_CONFIDENCE = 0.95


# ---------------------------------------------------------------------------- basic statistics


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (0 <= q <= 100), linear interpolation; NaN for no values."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return math.nan
    return float(np.percentile(arr, q, method="linear"))


@dataclass(frozen=True)
class Distribution:
    """Summary of a set of values: count, mean and the percentiles reports show."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def distribution(values: Sequence[float] | np.ndarray) -> Distribution:
    """Count, mean, p50 / p90 / p99 (linear interpolation) and max; NaNs when empty."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return Distribution(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99], method="linear")
    return Distribution(int(arr.size), float(arr.mean()), float(p50), float(p90), float(p99),
                        float(arr.max()))


@dataclass(frozen=True)
class Histogram:
    """Counts of values in `len(edges) - 1` bins; the last bin includes its right edge."""

    edges: list[float]
    counts: list[int]


def histogram(
    values: Sequence[float] | np.ndarray, bins: int = 20, lo: float | None = None,
    hi: float | None = None,
) -> Histogram:
    """Equal-width histogram over [lo, hi] (the data's range by default)."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return Histogram([], [])
    low = float(arr.min()) if lo is None else lo
    high = float(arr.max()) if hi is None else hi
    if high <= low:
        high = low + 1e-9
    counts, edges = np.histogram(arr, bins=bins, range=(low, high))
    return Histogram([float(e) for e in edges], [int(c) for c in counts])


def ecdf(values: Sequence[float] | np.ndarray) -> tuple[list[float], list[float]]:
    """The empirical CDF as step points: sorted values and the fraction <= each."""
    arr = np.sort(np.asarray(values, dtype=float))
    n = arr.size
    return [float(x) for x in arr], [float(i + 1) / n for i in range(n)]


# ------------------------------------------------------------------------------------ bootstrap


@dataclass(frozen=True)
class Interval:
    """A point estimate with a bootstrap confidence interval."""

    estimate: float
    low: float
    high: float
    confidence: float = DEFAULT_CONFIDENCE

    def excludes(self, value: float) -> bool:
        """True when `value` lies outside [low, high] (the difference is beyond noise)."""
        return value < self.low or value > self.high


def bootstrap_replicates(
    data: np.ndarray, statistic: Statistic, n_resamples: int, rng: np.random.Generator,
    clusters: Sequence[int] | None = None,
) -> np.ndarray:
    """The statistic over `n_resamples` resamples (with replacement) of the rows of `data`.

    `data` has one row per unit, shape (n,) or (n, m); `statistic` maps an array of
    resamples, shape (R, n) or (R, n, m), to R values. With `clusters` (one label per row),
    whole clusters are drawn instead of rows: rows that share a cluster's timing (the requests
    of one batch share its slow spells) are one unit of evidence, not several.
    """
    n = data.shape[0]
    if clusters is None:
        idx = rng.integers(0, n, size=(n_resamples, n))
        return np.asarray(statistic(data[idx]), dtype=float)
    _, owner = np.unique(np.asarray(clusters), return_inverse=True)
    members = [np.flatnonzero(owner == c) for c in range(int(owner.max()) + 1)]
    draws = rng.integers(0, len(members), size=(n_resamples, len(members)))
    return np.array([float(statistic(data[np.concatenate([members[c] for c in row])][None])[0])
                     for row in draws])


def interval_from(
    estimate: float, replicates: np.ndarray, confidence: float = DEFAULT_CONFIDENCE
) -> Interval:
    """Percentile interval of bootstrap replicates (non-finite replicates dropped)."""
    finite = replicates[np.isfinite(replicates)]
    if finite.size == 0 or not math.isfinite(estimate):
        return Interval(estimate, math.nan, math.nan, confidence)
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(finite, [tail, 100.0 - tail], method="linear")
    return Interval(estimate, float(low), float(high), confidence)


def bootstrap_ci(
    data: Sequence[float] | np.ndarray,
    statistic: Statistic,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
    clusters: Sequence[int] | None = None,
) -> Interval:
    """Percentile-bootstrap interval of `statistic` (see bootstrap_replicates; `clusters`:
    resample whole clusters of rows)."""
    arr = np.asarray(data, dtype=float)
    if arr.shape[0] == 0:
        return Interval(math.nan, math.nan, math.nan, confidence)
    estimate = float(statistic(arr[None, ...])[0])
    rng = np.random.default_rng(seed)
    return interval_from(estimate,
                         bootstrap_replicates(arr, statistic, n_resamples, rng, clusters),
                         confidence)


def resample_counts(n: int, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """How often each of n units is drawn in each resample, shape (R, n).

    Uses the same draws as `bootstrap_replicates`, so equal seeds give paired resamples.
    """
    idx = rng.integers(0, n, size=(n_resamples, n))
    flat = (idx + n * np.arange(n_resamples)[:, None]).ravel()
    return np.bincount(flat, minlength=n_resamples * n).reshape(n_resamples, n)


def _weighted_percentiles(values: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """Per row of integer `weights` (R, N) over sorted `values` (N,): the linear-interpolation
    percentile of the data set holding values[j] weights[r, j] times."""
    cum = np.cumsum(weights, axis=1)
    total = cum[:, -1]
    h = (total - 1) * q / 100.0
    lo = np.floor(h)
    hi = np.minimum(lo + 1, total - 1)
    i_lo = np.minimum((cum <= lo[:, None]).sum(axis=1), values.size - 1)
    i_hi = np.minimum((cum <= hi[:, None]).sum(axis=1), values.size - 1)
    out = values[i_lo] + (h - lo) * (values[i_hi] - values[i_lo])
    return np.where(total > 0, out, math.nan)


def pooled_percentile_replicates(
    groups: Sequence[np.ndarray], qs: Sequence[float], n_resamples: int,
    rng: np.random.Generator, chunk: int = 64,
) -> np.ndarray:
    """Percentiles of pooled values after resampling whole groups: shape (R, len(qs)).

    Used for inter-token latencies, resampled request by request. Equal to concatenating the
    drawn groups and taking linear-interpolation percentiles, computed without copying.
    """
    out = np.full((n_resamples, len(qs)), math.nan)
    n = len(groups)
    if n == 0:
        return out
    counts = resample_counts(n, n_resamples, rng)
    values = np.concatenate([np.asarray(g, dtype=float) for g in groups])
    if values.size == 0:
        return out
    owner = np.repeat(np.arange(n), [len(g) for g in groups])
    order = np.argsort(values, kind="stable")
    values, owner = values[order], owner[order]
    for start in range(0, n_resamples, chunk):
        weights = counts[start:start + chunk][:, owner]
        for col, q in enumerate(qs):
            out[start:start + chunk, col] = _weighted_percentiles(values, weights, q)
    return out


def ratio_of_sums(numerator_col: int, denominator_col: int) -> Statistic:
    """Statistic: sum of one column over sum of another, per resample (columns of (R, n, m))."""

    def stat(x: np.ndarray) -> np.ndarray:
        num = x[..., numerator_col].sum(axis=-1)
        den = x[..., denominator_col].sum(axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.asarray(num / den, dtype=float)

    return stat


def column_percentile(col: int, q: float) -> Statistic:
    """Statistic: the q-th percentile of one column, per resample."""
    return lambda x: np.percentile(x[..., col], q, axis=-1, method="linear")


# ----------------------------------------------------------------------------------- acceptance


@dataclass(frozen=True)
class Acceptance:
    """Acceptance counters of a set of requests and the rates derived from them.

    `rate` = accepted / drafted; `alpha_mle` = accepted / (accepted + rejections); `alpha` =
    the engine's sum of min(p, q) over its positions when measured (`alpha_source` "min(p,q)"),
    else `alpha_mle` (`alpha_source` "mle"); `mean_acceptance_length` = (accepted + steps) /
    steps, tokens per target pass (bonus and recovered tokens included); `by_position[i]` =
    accepted_per_pos[i] / drafted_per_pos[i].
    """

    drafted: int
    accepted: int
    steps: int
    rejections: int
    rate: float
    alpha: float
    alpha_mle: float
    alpha_source: str
    mean_acceptance_length: float
    drafted_per_pos: list[int]
    accepted_per_pos: list[int]
    by_position: list[float]


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def _sum_positions(rows: Sequence[Sequence[int]]) -> list[int]:
    width = max((len(r) for r in rows), default=0)
    return [sum(r[i] for r in rows if i < len(r)) for i in range(width)]


class Counted(Protocol):
    """What acceptance is summed from: a request's counters (RequestSample), or an open-loop
    window's read from a server's /metrics (ReplayRecord)."""

    @property
    def drafted(self) -> int: ...
    @property
    def accepted(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def rejections(self) -> int: ...
    @property
    def drafted_per_pos(self) -> list[int]: ...
    @property
    def accepted_per_pos(self) -> list[int]: ...
    @property
    def alpha_micro(self) -> int: ...
    @property
    def alpha_positions(self) -> int: ...


def acceptance(samples: Sequence[Counted]) -> Acceptance:
    """Sum the counters of `samples` and derive the rates (NaN where undefined)."""
    drafted = sum(s.drafted for s in samples)
    accepted = sum(s.accepted for s in samples)
    steps = sum(s.steps for s in samples)
    rejections = sum(s.rejections for s in samples)
    dpp = _sum_positions([s.drafted_per_pos for s in samples])
    app = _sum_positions([s.accepted_per_pos for s in samples])
    app += [0] * (len(dpp) - len(app))
    positions = sum(s.alpha_positions for s in samples)
    alpha_mle = _ratio(accepted, accepted + rejections)
    direct = _ratio(sum(s.alpha_micro for s in samples) / 1e6, positions)
    return Acceptance(
        drafted=drafted, accepted=accepted, steps=steps, rejections=rejections,
        rate=_ratio(accepted, drafted),
        alpha=direct if positions else alpha_mle,
        alpha_mle=alpha_mle,
        alpha_source="min(p,q)" if positions else "mle",
        mean_acceptance_length=_ratio(accepted + steps, steps),
        drafted_per_pos=dpp, accepted_per_pos=app,
        by_position=[_ratio(a, d) for a, d in zip(app, dpp, strict=True)],
    )


# ------------------------------------------------------------------------ speedup and predicted


def predicted_speedup(alpha: float, k: float, c: float, v: float) -> float:
    """S = (1 - alpha^(k+1)) / ((1 - alpha)(k c + v)); alpha = 1 gives (k + 1) / (k c + v)."""
    if not (math.isfinite(alpha) and math.isfinite(c) and math.isfinite(v)) or k < 0:
        return math.nan
    cost = k * c + v
    if cost <= 0:
        return math.nan
    return expected_tokens(alpha, k) / cost


def break_even_c(alpha: float, k: float, v: float) -> float:
    """The per-token draft cost c at which predicted speedup is exactly 1 (the boundary)."""
    if k < 1:
        return math.nan
    return (expected_tokens(alpha, k) - v) / k


def cost_at(curve: CostCurve, k: float) -> tuple[float, float]:
    """(c, v) of a cost curve at draft length k, interpolated linearly, clamped at the ends."""
    if not curve.k:
        return math.nan, math.nan
    order = np.argsort(curve.k)
    ks = np.asarray(curve.k, dtype=float)[order]
    c = float(np.interp(k, ks, np.asarray(curve.c, dtype=float)[order]))
    v = float(np.interp(k, ks, np.asarray(curve.v, dtype=float)[order]))
    return c, v


@dataclass(frozen=True)
class Speedup:
    """Measured speedup of a configuration over its plain baseline on paired units."""

    baseline: str
    n_pairs: int
    median_ratio: Interval
    total_ratio: Interval
    per_request: list[float]  # plain / speculative time per output token, one per pair
    # total_ratio after each request's first token: its prefill (the same work on both sides,
    # which dilutes the ratio of long prompts) left out, as generation tok/s is usually quoted
    decode_ratio: Interval


def _pairs(
    spec: Sequence[RequestSample], plain: Sequence[RequestSample]
) -> list[tuple[RequestSample, RequestSample]]:
    by_unit = {(s.prompt_id, s.turn): s for s in plain if s.output_tokens > 0}
    out = []
    for s in spec:
        base = by_unit.get((s.prompt_id, s.turn))
        if base is not None and s.output_tokens > 0:
            out.append((base, s))
    return out


def _time_per_token(s: RequestSample) -> float:
    """Latency over output tokens, time to first token included (the median ratio's unit)."""
    return s.latency_s / s.output_tokens


def tpot(s: RequestSample) -> float:
    """Time per output token after the first: (latency - TTFT) / (tokens - 1), NaN for a
    request of fewer than two tokens (vLLM's benchmark defines it the same way)."""
    return (s.latency_s - s.ttft_s) / (s.output_tokens - 1) if s.output_tokens > 1 else math.nan


def chunk_gaps(s: RequestSample) -> list[float]:
    """The gaps between successive chunks of output the client received after the first: the
    tokens of one step (or one streamed event) arrive together as one chunk, recorded as one
    interval followed by zeros (see `records`), so the chunk gaps are the non-zero intervals."""
    return [x for x in s.itl_s if x > 0]


def _median_ratio(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(np.median(x[..., 0], axis=-1) / np.median(x[..., 1], axis=-1))


def _throughput_ratio(x: np.ndarray, col: int) -> np.ndarray:
    # columns col..col+3: plain tokens, plain seconds, spec tokens, spec seconds
    with np.errstate(divide="ignore", invalid="ignore"):
        plain = x[..., col].sum(axis=-1) / x[..., col + 1].sum(axis=-1)
        spec = x[..., col + 2].sum(axis=-1) / x[..., col + 3].sum(axis=-1)
        return np.asarray(spec / plain)


def _total_ratio(x: np.ndarray) -> np.ndarray:
    return _throughput_ratio(x, 2)  # whole requests


def _decode_ratio(x: np.ndarray) -> np.ndarray:
    return _throughput_ratio(x, 6)  # the tokens after the first, over the time after it


def measure_speedup(
    spec: Sequence[RequestSample], plain: Sequence[RequestSample], baseline: str,
    n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
) -> Speedup | None:
    """Speedup of `spec` over `plain` on the (prompt, turn) units both measured; None if none."""
    pairs = _pairs(spec, plain)
    if not pairs:
        return None
    data = np.array([[_time_per_token(p), _time_per_token(s), p.output_tokens, p.latency_s,
                      s.output_tokens, s.latency_s, p.output_tokens - 1, p.latency_s - p.ttft_s,
                      s.output_tokens - 1, s.latency_s - s.ttft_s] for p, s in pairs],
                    dtype=float)
    per_request = [float(a / b) if b > 0 else math.nan for a, b in data[:, :2]]
    clusters = batch_clusters(pairs)
    return Speedup(
        baseline=baseline,
        n_pairs=len(pairs),
        median_ratio=bootstrap_ci(data, _median_ratio, n_resamples=n_resamples, seed=seed,
                                  clusters=clusters),
        total_ratio=bootstrap_ci(data, _total_ratio, n_resamples=n_resamples, seed=seed + 1,
                                 clusters=clusters),
        per_request=per_request,
        decode_ratio=bootstrap_ci(data, _decode_ratio, n_resamples=n_resamples, seed=seed + 2,
                                  clusters=clusters),
    )


def batch_clusters(pairs: Sequence[tuple[RequestSample, RequestSample]]) -> list[int] | None:
    """The resampling unit of each pair: at batch 1 the pair itself (None); at batch > 1 its
    batch group and turn on both sides (open loop: its time block, bench.openloop), since the
    requests that ran together share one timing. Resampling them as independent pairs gave
    intervals far narrower than the run-to-run spread (docs/measurements/code-figures.md)."""
    if all(p.batch_size <= 1 and s.batch_size <= 1 and s.scheduled_s is None
           for p, s in pairs):  # (open loop: requests overlap at any batch size)
        return None
    labels: dict[tuple[int, int, int], int] = {}
    return [labels.setdefault((p.group, s.group, s.turn), len(labels)) for p, s in pairs]


LOOP_SHARE = 0.5  # an output at least this repetitive "loops" (see self_repeat)


def self_repeat(tokens: Sequence[int] | Sequence[str], n: int = 4) -> float:
    """The share of an output's n-grams that repeat its own earlier n-grams: near 1 for a small
    model looping at greedy (as SmolLM2-135M does on most Spec-Bench summarization prompts:
    docs/measurements/code-figures.md), low for an answer that ends by itself (copying a passage
    of the prompt once does not count). A lookup drafts a loop for free, so speedups measured
    on looping outputs overstate those on outputs that end by themselves."""
    seen: set[tuple[object, ...]] = set()
    repeated = 0
    for i in range(len(tokens) - n + 1):
        gram: tuple[object, ...] = tuple(tokens[i:i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated / max(1, len(tokens) - n + 1)


def loops(sample: RequestSample) -> bool:
    return self_repeat(sample.output_units()) >= LOOP_SHARE


# ------------------------------------------------------------------------ per-config aggregates


@dataclass(frozen=True)
class CategorySummary:
    """Acceptance and speedup (total ratio, point estimate) of one category in one config."""

    n_requests: int
    acceptance: Acceptance
    speedup: float


@dataclass
class StructuredSummary:
    """Structured output of one configuration's constrained requests: how many outputs satisfy
    their constraint, the tokens it forced (emitted unscored) and its own cost, the time spent
    computing masks against the requests' time. `forced_tokens` and `mask_s` are None (unknown,
    and their shares NaN) when any of the requests did not record them (a remote server's)."""

    n_constrained: int
    n_valid: int
    output_tokens: int
    forced_tokens: int | None
    mask_s: float | None
    request_s: float

    @property
    def valid_share(self) -> float:
        return _ratio(self.n_valid, self.n_constrained)

    @property
    def forced_share(self) -> float:
        return math.nan if self.forced_tokens is None else \
            _ratio(self.forced_tokens, self.output_tokens)

    @property
    def mask_share(self) -> float:
        """Mask time / request time (the constraint's cost against the whole request)."""
        return math.nan if self.mask_s is None else _ratio(self.mask_s, self.request_s)

    @property
    def mask_per_token_s(self) -> float:
        return math.nan if self.mask_s is None else _ratio(self.mask_s, self.output_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "valid_share": self.valid_share,
                "forced_share": self.forced_share, "mask_share": self.mask_share,
                "mask_per_token_s": self.mask_per_token_s}


def structured_summary(samples: Sequence[RequestSample]) -> StructuredSummary | None:
    """Validity, forced tokens and mask cost of the constrained samples; None without any."""
    constrained = [s for s in samples if s.valid is not None]
    if not constrained:
        return None
    forced = [s.forced for s in constrained]
    masks = [s.mask_s for s in constrained]
    return StructuredSummary(
        n_constrained=len(constrained),
        n_valid=sum(1 for s in constrained if s.valid),
        output_tokens=sum(s.output_tokens for s in constrained),
        forced_tokens=None if None in forced else sum(f for f in forced if f is not None),
        mask_s=None if None in masks else sum(m for m in masks if m is not None),
        request_s=sum(s.latency_s for s in constrained),
    )


ARRIVAL_SLICES = 4  # cold to warm: quarters of the run


@dataclass(frozen=True)
class WarmupSlice:
    """Acceptance and speedup (total ratio, point estimate; NaN without a baseline) of some of
    a configuration's requests: those that arrived in [first_arrival, last_arrival] (0-based
    places in the run; -1 when the slice is not one of places)."""

    label: str
    n_requests: int
    acceptance: Acceptance
    speedup: float
    first_arrival: int = -1
    last_arrival: int = -1


@dataclass(frozen=True)
class WarmupSummary:
    """Acceptance as traffic accumulates: by place in the run (`by_arrival`, earliest first) and
    for the first request of each repeat group against the later ones (`first`, `repeats`)."""

    n_arrivals: int
    by_arrival: list[WarmupSlice]
    first: WarmupSlice
    repeats: WarmupSlice


def arrival_slices(n: int, slices: int = ARRIVAL_SLICES) -> list[tuple[int, int]]:
    """[first, last] places of `slices` near-equal consecutive slices of 0..n-1 (one per place
    when n is smaller)."""
    k = min(slices, n)
    bounds = [i * n // k for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(k)]


def warmup_summary(
    samples: Sequence[RequestSample], plain: Sequence[RequestSample], n_arrivals: int = 0
) -> WarmupSummary | None:
    """Cold to warm for one configuration (`plain`: its baseline's samples, for speedups); None
    when no sample belongs to a repeat group (the workload has none, or it predates them).
    `n_arrivals` is the workload's number of prompts (the slices cover the whole run even where
    its last requests failed); samples without a recorded place are left out of the slices."""
    if not any(s.repeat_group for s in samples):
        return None
    placed = [s for s in samples if s.arrival >= 0]
    n = max([n_arrivals, *(s.arrival + 1 for s in placed)])

    def part(label: str, mine: Sequence[RequestSample], lo: int = -1, hi: int = -1
             ) -> WarmupSlice:
        return WarmupSlice(label, len(mine), acceptance(mine), _category_speedup(mine, plain),
                           lo, hi)

    by_arrival = [part(f"requests {lo + 1}-{hi + 1}" if hi > lo else f"request {lo + 1}",
                       [s for s in placed if lo <= s.arrival <= hi], lo, hi)
                  for lo, hi in arrival_slices(n)]
    return WarmupSummary(
        n_arrivals=n, by_arrival=by_arrival,
        first=part("first of its group", [s for s in samples if s.repeat_index == 0]),
        repeats=part("repeats", [s for s in samples if s.repeat_index > 0]))


@dataclass
class ConfigSummary:
    """Everything the report says about one configuration at one batch size."""

    spec: ConfigSpec
    n_requests: int
    output_tokens: int
    wall_s: float
    throughput_tok_s: float
    ttft: Distribution
    itl: Distribution  # per output token: a step of m tokens is one interval and m - 1 zeros
    latency: Distribution
    tpot: Distribution  # per request: (latency - TTFT) / (tokens - 1)
    chunk_gap: Distribution  # between chunks of output as the client receives them
    acceptance: Acceptance
    by_category: dict[str, CategorySummary] = field(default_factory=dict)
    speedup: Speedup | None = None
    c: float = math.nan  # per-token draft cost / plain step (cost curve, else in-run estimate)
    v: float = math.nan  # verify cost / plain step
    cost_source: str = ""  # "cost curve" | "in-run timings" | ""
    k_effective: float = math.nan  # k, or mean drafted per step for k = "auto"
    predicted_speedup: float = math.nan
    structured: StructuredSummary | None = None  # None: no constrained request
    warmup: WarmupSummary | None = None  # None: plain, or a workload without repeat groups

    @property
    def key(self) -> tuple[str, int]:
        return self.spec.key

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields; `structured` with its shares (valid, forced, mask time)."""
        out = asdict(self)
        out["structured"] = self.structured.to_dict() if self.structured else None
        return out


def wall_time(samples: Sequence[RequestSample]) -> float:
    """Sum over (batch group, turn) of the slowest request's latency; for an open-loop replay,
    over its windows, from the first scheduled start to the last end."""
    if samples and all(s.scheduled_s is not None for s in samples):
        spans: dict[int, tuple[float, float]] = {}
        for s in samples:
            start, end = s.scheduled_s or 0.0, (s.scheduled_s or 0.0) + s.latency_s
            low, high = spans.get(s.window, (start, end))
            spans[s.window] = (min(low, start), max(high, end))
        return sum(high - low for low, high in spans.values())
    slowest: dict[tuple[int, int], float] = {}
    for s in samples:
        key = (s.group, s.turn)
        slowest[key] = max(slowest.get(key, 0.0), s.latency_s)
    return sum(slowest.values())


def _base_summary(spec: ConfigSpec, samples: Sequence[RequestSample]) -> ConfigSummary:
    tokens = sum(s.output_tokens for s in samples)
    wall = wall_time(samples)
    return ConfigSummary(
        spec=spec,
        n_requests=len(samples),
        output_tokens=tokens,
        wall_s=wall,
        throughput_tok_s=_ratio(tokens, wall),
        ttft=distribution([s.ttft_s for s in samples]),
        itl=distribution([x for s in samples for x in s.itl_s]),
        latency=distribution([s.latency_s for s in samples]),
        tpot=distribution([tpot(s) for s in samples if s.output_tokens > 1]),
        chunk_gap=distribution([x for s in samples for x in chunk_gaps(s)]),
        acceptance=acceptance(samples),
        structured=structured_summary(samples),
    )


def find_baseline(spec: ConfigSpec, configs: Sequence[ConfigSpec]) -> ConfigSpec | None:
    """The plain configuration of the same target at the same batch size and temperature as
    `spec`, if any."""
    for c in configs:
        if c.is_plain and c.batch_size == spec.batch_size and c.temperature == spec.temperature \
                and c.target == spec.target:
            return c
    return None


def find_curve(spec: ConfigSpec, curves: Sequence[CostCurve]) -> CostCurve | None:
    """The cost curve measured for this config (by name, else by drafter) at its batch size."""
    same_batch = [c for c in curves if c.batch_size == spec.batch_size]
    for curve in same_batch:
        if curve.config == spec.name:
            return curve
    return next((c for c in same_batch if c.drafter == spec.drafter and not c.config), None)


def in_run_costs(
    spec: Sequence[RequestSample], plain: Sequence[RequestSample]
) -> tuple[float, float]:
    """(c, v) estimated from the run's own timings, relative to a plain decode step.

    c = draft time per drafted token; v = decode time that is not drafting, per step (both
    divided by plain decoding's time per step after the first token).
    """
    plain_steps = sum(s.steps for s in plain)
    plain_decode = sum(max(s.latency_s - s.ttft_s, 0.0) for s in plain)
    step_s = _ratio(plain_decode, plain_steps)
    drafted = sum(s.drafted for s in spec)
    steps = sum(s.steps for s in spec)
    draft_s = sum(s.draft_s for s in spec)
    decode = sum(max(s.latency_s - s.ttft_s, 0.0) for s in spec)
    c = _ratio(_ratio(draft_s, drafted), step_s)
    v = _ratio(_ratio(decode - draft_s, steps), step_s)
    return c, v


def step_overheads(
    spec: Sequence[RequestSample], plain: Sequence[RequestSample]
) -> tuple[float, float, float]:
    """In-run seconds per step: plain decoding's whole step P, plain's forward t1, and the
    speculative config's step outside its forward and its drafting o_s (choosing, proposing a
    lookup, verification, bookkeeping), each after the first token. NaN where unmeasured."""
    plain_steps = sum(s.steps for s in plain)
    plain_decode = sum(max(s.latency_s - s.ttft_s, 0.0) for s in plain)
    steps = sum(s.steps for s in spec)
    decode = sum(max(s.latency_s - s.ttft_s, 0.0) for s in spec)
    other = decode - sum(s.target_s + s.draft_s for s in spec)
    t1 = _ratio(sum(s.target_s for s in plain), plain_steps)
    return _ratio(plain_decode, plain_steps), t1, _ratio(max(other, 0.0), steps)


def with_overhead(c: float, v: float, spec: Sequence[RequestSample],
                  plain: Sequence[RequestSample]) -> tuple[float, float] | None:
    """A cost curve's (c, v), relative to plain's forward pass, turned into costs relative to
    plain's whole step, with the step's measured fixed cost: c * t1 / P and (v t1 + o_s) / P
    (step_overheads). The curve alone leaves out what a step costs besides its forward, which
    plain pays too but on fewer tokens: on a fast target it overrated speculation by a third
    (docs/measurements/code-figures.md). None where the run has no such timings."""
    whole, t1, other = step_overheads(spec, plain)
    if not all(math.isfinite(x) and x > 0 for x in (whole, t1)) or not math.isfinite(other):
        return None
    return c * t1 / whole, (v * t1 + other) / whole


def _add_costs(
    summary: ConfigSummary, plain: Sequence[RequestSample], samples: Sequence[RequestSample],
    curves: Sequence[CostCurve],
) -> None:
    acc = summary.acceptance
    k = summary.spec.k
    summary.k_effective = float(k) if isinstance(k, int) else _ratio(acc.drafted, acc.steps)
    curve = find_curve(summary.spec, curves)
    if curve is not None and math.isfinite(summary.k_effective):
        summary.c, summary.v = cost_at(curve, summary.k_effective)
        summary.cost_source = "cost curve"
        adjusted = with_overhead(summary.c, summary.v, samples, plain) if plain else None
        if adjusted is not None:
            summary.c, summary.v = adjusted
            summary.cost_source = "cost curve + in-run step overhead"
    elif plain:
        summary.c, summary.v = in_run_costs(samples, plain)
        summary.cost_source = "in-run timings"
    summary.predicted_speedup = predicted_speedup(acc.alpha, summary.k_effective, summary.c,
                                                  summary.v)


def _category_speedup(spec: Sequence[RequestSample], plain: Sequence[RequestSample]) -> float:
    pairs = _pairs(spec, plain)
    if not pairs:
        return math.nan
    data = np.array([[0, 0, p.output_tokens, p.latency_s, s.output_tokens, s.latency_s]
                     for p, s in pairs], dtype=float)
    return float(_total_ratio(data[None, ...])[0])


def by_category(
    samples: Sequence[RequestSample], plain: Sequence[RequestSample]
) -> dict[str, CategorySummary]:
    """Acceptance and speedup per category (speedup NaN without a baseline)."""
    out: dict[str, CategorySummary] = {}
    for cat in sorted({s.category for s in samples}):
        mine = [s for s in samples if s.category == cat]
        theirs = [s for s in plain if s.category == cat]
        out[cat] = CategorySummary(len(mine), acceptance(mine), _category_speedup(mine, theirs))
    return out


def _paired(a: RequestSample, b: RequestSample) -> bool:
    """Whether a and b must give the same tokens: both greedy, or both sampled at the same
    temperature with the same seed under the drafter-invariant rule."""
    if a.temperature == 0.0 or b.temperature == 0.0:
        return a.temperature == b.temperature
    return a.rule == b.rule == "invariant" and a.seed is not None and a.seed == b.seed and \
        a.temperature == b.temperature


def token_identity_audit(
    spec: ConfigSpec, baseline: ConfigSpec, samples: Sequence[RequestSample],
    plain: Sequence[RequestSample],
) -> AuditVerdict | None:
    """Token-id identity with plain decoding on greedy units and on seeded sampled units under
    the invariant rule (per-token paired outputs); None if there are none."""
    by_unit = {(s.prompt_id, s.turn): s for s in plain}
    pairs = [(by_unit[(s.prompt_id, s.turn)], s) for s in samples
             if (s.prompt_id, s.turn) in by_unit and _paired(by_unit[(s.prompt_id, s.turn)], s)]
    if not pairs:
        return None
    failed = [(p, s) for p, s in pairs if p.output_units() != s.output_units()]
    sampled = sum(s.temperature > 0 for _, s in pairs)
    details = (f"{len(pairs) - sampled} greedy" + (f" and {sampled} seeded sampled" if sampled
               else "") + f" requests compared with {baseline.name}")
    if failed:
        p, s = failed[0]
        a_units, b_units = p.output_units(), s.output_units()
        pos = next((i for i, (a, b) in enumerate(zip(a_units, b_units, strict=False)) if a != b),
                   min(len(a_units), len(b_units)))
        unit = "token" if a_units is p.output_token_ids else "text piece"
        details += f"; first difference: prompt {s.prompt_id} turn {s.turn} at {unit} {pos}"
    method = "seeded-token-identity" if sampled else "greedy-token-identity"
    return AuditVerdict(config=spec.name, passed=not failed, method=method,
                        n_compared=len(pairs), n_failed=len(failed), details=details,
                        batch_size=spec.batch_size)


# ------------------------------------------------------------------------------------- analysis


@dataclass
class Analysis:
    """Aggregates of a whole results file: one ConfigSummary per (config, batch size)."""

    results: Results
    configs: list[ConfigSummary]
    audits: list[AuditVerdict]
    n_resamples: int = DEFAULT_RESAMPLES
    seed: int = 0

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({c.spec.batch_size for c in self.configs})

    def summary(self, name: str, batch_size: int) -> ConfigSummary | None:
        """The summary of config `name` at `batch_size`, if measured."""
        return next((c for c in self.configs if c.key == (name, batch_size)), None)

    def audit_passed(self, name: str, batch_size: int) -> bool | None:
        """All verdicts for the config at that batch size passed; None when there is none."""
        verdicts = [a for a in self.audits if a.config == name
                    and a.batch_size in (None, batch_size)]
        return all(a.passed for a in verdicts) if verdicts else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready aggregates (non-finite numbers become null)."""
        return jsonable({
            "n_resamples": self.n_resamples,
            "seed": self.seed,
            "configs": [c.to_dict() for c in self.configs],
            "audits": [a.to_dict() for a in self.audits],
        })


def is_on(analysis: Analysis, s: ConfigSummary) -> bool:
    """A demonstrated lossless win: the speedup's CI lower bound is above 1 and the
    configuration's audit passed (what the recommendations require)."""
    if s.speedup is None or not math.isfinite(s.speedup.total_ratio.low):
        return False
    audit = analysis.audit_passed(s.spec.name, s.spec.batch_size)
    return s.speedup.total_ratio.low > 1.0 and audit is True


def jsonable(obj: Any) -> Any:
    """A copy of `obj` (dicts, lists, scalars) with NaN and infinities replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


def _summarize(
    spec: ConfigSpec, results: Results, n_resamples: int, seed: int
) -> tuple[ConfigSummary, AuditVerdict | None]:
    samples = results.samples_of(spec.key)
    summary = _base_summary(spec, samples)
    windows = [r for r in results.replays if (r.config, r.batch_size) == spec.key and r.steps]
    if windows:  # an open-loop replay over HTTP: the windows' counters (bench.openloop)
        summary.acceptance = acceptance([*samples, *windows])
    base = None if spec.is_plain else find_baseline(spec, results.header.configs)
    n_prompts = results.header.workload.get("n_prompts")
    n_arrivals = n_prompts if isinstance(n_prompts, int) else 0
    if base is None:
        summary.by_category = by_category(samples, [])
        if not spec.is_plain:
            summary.warmup = warmup_summary(samples, [], n_arrivals)
        return summary, None
    plain = results.samples_of(base.key)
    summary.by_category = by_category(samples, plain)
    summary.warmup = warmup_summary(samples, plain, n_arrivals)
    summary.speedup = measure_speedup(samples, plain, base.name, n_resamples, seed)
    _add_costs(summary, plain, samples, results.cost_curves)
    return summary, token_identity_audit(spec, base, samples, plain)


def analyze(
    results: Results, *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> Analysis:
    """Aggregate every configuration of the header; greedy audits join the stored verdicts."""
    summaries: list[ConfigSummary] = []
    audits = list(results.audits)
    for spec in sorted(results.header.configs, key=lambda c: (c.batch_size, not c.is_plain)):
        summary, verdict = _summarize(spec, results, n_resamples, seed)
        summaries.append(summary)
        if verdict is not None:
            audits.append(verdict)
    return Analysis(results, summaries, audits, n_resamples, seed)
