"""What the traffic did in an open-loop replay, and the goodput at a service-level objective.

Per configuration (from its samples, failures and bench.openloop's window records):

- arrival rates: the scheduled one (turns due over the scheduled span of each window, summed)
  and the measured one (over the span from the first submission to the last): a replay that
  keeps up measures the schedule's rate;
- lateness: how long after it was due each request was submitted (in process: the rest of the
  engine step running when it came due; over HTTP: the client's own delay);
- the batch-size distribution the traffic produced: the share of engine steps that decoded b
  requests (exact in process; over HTTP from the server's engine_steps_total, or else the
  share of time b requests were in flight, as the client saw them);
- the tails (TTFT, TPOT, latency: p50 / p90 / p99 / max, from report.analysis, here run from each
  request's scheduled start);
- with `--slo ttft=0.5,tpot=0.05[,latency=S]`: the requests that met every bound (a failed
  request meets none), their share, and the goodput, those requests per second of the
  configuration's wall time (report.analysis.wall_time). In a closed-loop run too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specdecode.bench.records import ReplayRecord, RequestSample
from specdecode.errors import SpecDecodeError
from specdecode.report.analysis import (
    Analysis,
    ConfigSummary,
    Distribution,
    distribution,
    jsonable,
    tpot,
)

SLO_KEYS = ("ttft", "tpot", "latency")


@dataclass(frozen=True)
class Slo:
    """Upper bounds in seconds on TTFT, TPOT and request latency (None: no bound)."""

    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None

    def met(self, s: RequestSample) -> bool:
        """Whether a request met every bound (TPOT: requests of one token have none)."""
        per_token = tpot(s)
        return ((self.ttft is None or s.ttft_s <= self.ttft)
                and (self.tpot is None or math.isnan(per_token) or per_token <= self.tpot)
                and (self.latency is None or s.latency_s <= self.latency))

    def describe(self) -> str:
        return ", ".join(f"{k} <= {v * 1000:g} ms" if k != "latency" else f"{k} <= {v:g} s"
                         for k, v in asdict(self).items() if v is not None)


def parse_slo(text: str | None) -> Slo | None:
    """`--slo ttft=0.5,tpot=0.05,latency=10` (seconds) checked: SpecDecodeError naming the
    key or value."""
    if text is None:
        return None
    bounds: dict[str, float] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise SpecDecodeError(f"--slo {text!r}: expected KEY=SECONDS pairs with KEY one of "
                                  f"{', '.join(SLO_KEYS)}, got {pair!r}")
        if key in bounds:
            raise SpecDecodeError(f"--slo {text!r}: {key} given twice")
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise SpecDecodeError(f"--slo {text!r}: {key} must be a number of seconds > 0, "
                                  f"got {value.strip()!r}")
        bounds[key] = seconds
    if not bounds:
        raise SpecDecodeError("--slo is empty (e.g. --slo ttft=0.5,tpot=0.05)")
    return Slo(**bounds)


@dataclass(frozen=True)
class Goodput:
    """Requests that met the SLO, of all (failed ones included), and per second."""

    met: int
    requests: int
    share: float
    per_s: float


@dataclass
class TrafficSummary:
    """What one configuration's replay saw (see the module docstring); rates NaN when not an
    open-loop replay."""

    config: str
    batch_size: int
    requests: int
    failed: int
    scheduled_rate: float = math.nan
    measured_rate: float = math.nan
    late: Distribution = field(default_factory=lambda: distribution([]))
    batch_source: str = ""
    batch_shares: list[float] = field(default_factory=list)  # [b - 1]: share at batch b
    mean_batch: float = math.nan
    ttft: Distribution = field(default_factory=lambda: distribution([]))
    tpot: Distribution = field(default_factory=lambda: distribution([]))
    latency: Distribution = field(default_factory=lambda: distribution([]))
    goodput: Goodput | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(jsonable(asdict(self)))


def batch_distribution(records: Sequence[ReplayRecord]) -> tuple[str, list[float], float]:
    """(source, share at each batch size, mean batch) over a configuration's windows."""
    if not records:
        return "", [], math.nan
    width = max(len(r.steps_by_batch) for r in records)
    totals = [sum(r.steps_by_batch[i] for r in records if i < len(r.steps_by_batch))
              for i in range(width)]
    whole = sum(totals)
    if whole <= 0:
        return records[0].batch_source, [], math.nan
    shares = [t / whole for t in totals]
    mean = sum((i + 1) * share for i, share in enumerate(shares))
    return records[0].batch_source, shares, mean


def rates(records: Sequence[ReplayRecord]) -> tuple[float, float]:
    """(scheduled, measured) arrivals per second over the windows: the arrivals after each
    window's first, over its scheduled or its measured span."""
    gaps = sum(max(r.requests - 1, 0) for r in records)
    scheduled = sum(r.span_s for r in records)
    measured = sum(r.sent_span_s for r in records)
    return (gaps / scheduled if scheduled > 0 else math.nan,
            gaps / measured if measured > 0 else math.nan)


def summarize(s: ConfigSummary, samples: Sequence[RequestSample],
              failures: Sequence[RequestSample], records: Sequence[ReplayRecord],
              slo: Slo | None) -> TrafficSummary:
    """One configuration's traffic summary."""
    out = TrafficSummary(s.spec.name, s.spec.batch_size, len(samples) + len(failures),
                         len(failures), ttft=s.ttft, tpot=s.tpot, latency=s.latency)
    if records:
        out.scheduled_rate, out.measured_rate = rates(records)
        out.late = distribution([x.sent_s - x.scheduled_s for x in samples
                                 if x.sent_s is not None and x.scheduled_s is not None
                                 and x.turn == 0])
        out.batch_source, out.batch_shares, out.mean_batch = batch_distribution(records)
    if slo is not None:
        met = sum(slo.met(x) for x in samples)
        out.goodput = Goodput(met, out.requests, met / out.requests if out.requests else
                              math.nan, met / s.wall_s if s.wall_s > 0 else math.nan)
    return out


@dataclass
class Traffic:
    """The report's traffic section: how requests arrived, the SLO, one summary per
    configuration and batch size."""

    arrivals: str
    slo: str
    configs: list[TrafficSummary]

    def to_dict(self) -> dict[str, Any]:
        return {"arrivals": self.arrivals, "slo": self.slo,
                "configs": [c.to_dict() for c in self.configs]}


def traffic(analysis: Analysis, slo: Slo | None) -> Traffic | None:
    """The traffic section of a run: None for a closed-loop run without an SLO."""
    results = analysis.results
    arrivals = results.header.workload.get("arrivals")
    if arrivals is None and slo is None:
        return None
    configs = []
    for s in analysis.configs:
        failures = [f for f in results.failures if (f.config, f.batch_size) == s.key
                    and f.unit not in results.done_units()]
        records = [r for r in results.replays if (r.config, r.batch_size) == s.key]
        configs.append(summarize(s, results.samples_of(s.key), failures, records, slo))
    described = arrivals.get("described", "open loop") if arrivals else \
        "closed loop: batches of --batch-sizes concurrent requests"
    return Traffic(described, slo.describe() if slo else "", configs)


# ------------------------------------------------------------------------- presentation


def _ms(d: Distribution, which: str) -> str:
    value = getattr(d, which)
    return f"{value * 1000:.0f}" if math.isfinite(value) else "-"


def _pair_ms(d: Distribution) -> str:
    return f"{_ms(d, 'p50')} / {_ms(d, 'p99')}"


def _rate(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else "-"


def batch_text(t: TrafficSummary) -> str:
    """'b1 40%, b2 31%, ... (mean 2.1)': the batch sizes with at least half a percent."""
    if not t.batch_shares:
        return "-"
    parts = [f"b{i + 1} {share:.0%}" for i, share in enumerate(t.batch_shares)
             if share >= 0.005]
    unit = "of time in flight" if t.batch_source == "in flight" else "of steps"
    return f"{', '.join(parts)} {unit} (mean {t.mean_batch:.2f})"


def goodput_text(t: TrafficSummary) -> str:
    g = t.goodput
    if g is None:
        return "-"
    return f"{g.met}/{g.requests} ({g.share:.0%}), {_rate(g.per_s)} req/s"


def traffic_lines(t: Traffic) -> list[str]:
    """The terminal summary's traffic block."""
    head = f"traffic ({t.arrivals}" + (f"; SLO {t.slo}" if t.slo else "") + "):"
    lines = [head]
    for c in t.configs:
        where = f"  {c.config:<18} max batch {c.batch_size}:"
        if math.isfinite(c.scheduled_rate):
            lines.append(f"{where} {_rate(c.scheduled_rate)} req/s scheduled, "
                         f"{_rate(c.measured_rate)} measured (submitted late by p99 "
                         f"{_ms(c.late, 'p99')} ms); batch sizes {batch_text(c)}")
            where = f"  {'':<18}"
        lines.append(f"{where} TTFT p50/p99 {_pair_ms(c.ttft)} ms, TPOT p50/p99 "
                     f"{_pair_ms(c.tpot)} ms, latency p50/p99 {c.latency.p50:.2f}/"
                     f"{c.latency.p99:.2f} s, {c.requests} requests ({c.failed} failed)"
                     + (f"; goodput {goodput_text(c)}" if c.goodput else ""))
    return lines


def html_context(t: Traffic | None) -> dict[str, Any]:
    """The HTML report's traffic section: a table and one batch-size chart per
    configuration (empty without a traffic section)."""
    from markupsafe import Markup

    from specdecode.report import svg
    from specdecode.report.cells import Column

    if t is None:
        return {"traffic": None}
    columns = (Column("name", "config", text=True), Column("batch", "max batch"),
               Column("requests", "requests (failed)"),
               Column("rates", "arrivals /s: scheduled, measured"),
               Column("late", "submitted late p50 / p99 (ms)"),
               Column("ttft", "TTFT p50 / p99 (ms)", term="ttft"),
               Column("tpot", "TPOT p50 / p99 (ms)", term="tpot"),
               Column("latency", "latency p90 / p99 / max (s)", term="latency"),
               Column("mean_batch", "mean batch"),
               Column("goodput", "goodput: met SLO, req/s", text=True))
    rows = [{"name": c.config, "batch": c.batch_size, "requests": f"{c.requests} ({c.failed})",
             "rates": f"{_rate(c.scheduled_rate)}, {_rate(c.measured_rate)}",
             "late": _pair_ms(c.late), "ttft": _pair_ms(c.ttft), "tpot": _pair_ms(c.tpot),
             "latency": " / ".join(f"{getattr(c.latency, q):.2f}" if
                                   math.isfinite(getattr(c.latency, q)) else "-"
                                   for q in ("p90", "p99", "max")),
             "mean_batch": _rate(c.mean_batch), "goodput": goodput_text(c)}
            for c in t.configs]
    figures = []
    for c in t.configs:
        if len(c.batch_shares) > 1:
            edges = [i + 0.5 for i in range(len(c.batch_shares) + 1)]
            unit = "time in flight" if c.batch_source == "in flight" else "steps"
            counts = [round(share * 1000) for share in c.batch_shares]
            figures.append(Markup(svg.bar_chart(
                edges, counts, x_label="batch size (requests decoded together)",
                y_label=f"per mille of {unit}",
                title=f"{c.config}, max batch {c.batch_size}: batch sizes")))
    return {"traffic": {"arrivals": t.arrivals, "slo": t.slo,
                        "open_loop": any(math.isfinite(c.scheduled_rate) for c in t.configs),
                        "source": sorted({c.batch_source for c in t.configs if c.batch_source})},
            "traffic_columns": columns, "traffic_rows": rows, "traffic_figures": figures}
