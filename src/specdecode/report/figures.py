"""The report's figures (SVG, inline): CDFs of latency, acceptance by position, speedups,
the alpha x c boundary maps, cold-to-warm acceptance and the machine's load through the run. A
chart with fewer than two x values is drawn as a small table instead (`line_figure`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from markupsafe import Markup, escape

from specdecode.bench import interference
from specdecode.report import svg
from specdecode.report.analysis import Analysis, ConfigSummary, chunk_gaps, ecdf, histogram, tpot
from specdecode.report.cells import num


def line_figure(series: Sequence[svg.Series], *, title: str, x_label: str, y_label: str,
                fallback: Markup | None = None, **options: Any) -> Markup:
    """A line chart, or where its series have fewer than two distinct x values (one batch
    size, one draft position, one measured batch: an axis around a single point reads as a
    broken chart) `fallback`, by default a small table of the points."""
    if len(svg.x_values(series)) >= 2:
        return Markup(svg.line_chart(series, title=title, x_label=x_label, y_label=y_label,
                                     **options))
    if fallback is not None:
        return fallback
    rows = "".join(f'<tr><td class="l">{escape(s.label)}</td><td>{num(x, 3)}</td>'
                   f"<td>{num(y, 3)}</td></tr>"
                   for s in series for x, y in zip(s.xs, s.ys, strict=True))
    return Markup(f'<table class="points"><caption>{escape(title)}</caption><tr>'
                  f'<th class="l">series</th><th>{escape(x_label)}</th>'
                  f"<th>{escape(y_label)}</th></tr>{rows}</table>")


def warmup_figures(analysis: Analysis) -> list[Markup]:
    """Per batch size: mean acceptance length of each slice of the run by arrival (at the
    slice's middle request), one line per speculative configuration with repeat groups."""
    out = []
    for batch in analysis.batch_sizes:
        series = []
        for s in analysis.configs:
            if s.spec.batch_size != batch or s.warmup is None:
                continue
            slices = s.warmup.by_arrival
            series.append(svg.Series(
                s.spec.name, [(x.first_arrival + x.last_arrival) / 2 + 1 for x in slices],
                [x.acceptance.mean_acceptance_length for x in slices],
                color_index=slot(analysis, s.spec.name)))
        if series:
            out.append(line_figure(
                series, title=f"Cold to warm, batch size {batch}",
                x_label="request in arrival order (middle of each slice)",
                y_label="mean acceptance length", y_range=(1.0, None)))
    return out


def slot(analysis: Analysis, name: str) -> int:
    """A configuration's palette slot: the same colour in every chart of the report."""
    names = list(dict.fromkeys(c.spec.name for c in analysis.configs))
    return names.index(name) if name in names else len(names)


# (title, x label, y label, values of one request) of each latency CDF, in the report's order
LATENCY_CDFS: tuple[tuple[str, str, str, Any], ...] = (
    ("TTFT", "time to first token (ms)", "fraction of requests",
     lambda x: [x.ttft_s * 1000]),
    ("TPOT", "time per output token after the first (ms)", "fraction of requests",
     lambda x: [t * 1000 for t in [tpot(x)] if math.isfinite(t)]),
    ("Inter-chunk gap", "gap between chunks of output received (ms)", "fraction of gaps",
     lambda x: [t * 1000 for t in chunk_gaps(x)]),
    ("Request latency", "request latency (s)", "fraction of requests",
     lambda x: [x.latency_s]),
)


def latency_figures(analysis: Analysis) -> list[dict[str, Any]]:
    """Per batch size: CDFs of TTFT, TPOT, inter-chunk gaps and request latency, one line per
    config."""
    groups = []
    for batch in analysis.batch_sizes:
        configs = [s for s in analysis.configs if s.spec.batch_size == batch]
        figures = []
        for title, x_label, y_label, get in LATENCY_CDFS:
            series = []
            for s in configs:
                values = [v for x in analysis.results.samples_of(s.key) for v in get(x)]
                xs, ys = ecdf(values)
                series.append(svg.Series(s.spec.name, xs, ys, step=True,
                                         color_index=slot(analysis, s.spec.name)))
            figures.append(line_figure(
                series, title=f"{title} CDF, batch size {batch}", x_label=x_label,
                y_label=y_label, y_range=(0.0, 1.0)))
        groups.append({"batch": batch, "figures": figures})
    return groups


def acceptance_figures(analysis: Analysis) -> list[Markup]:
    """Acceptance by draft position, one chart per batch size, one line per config."""
    out = []
    for batch in analysis.batch_sizes:
        series = [svg.Series(s.spec.name, [float(i + 1) for i in range(len(
            s.acceptance.by_position))], s.acceptance.by_position,
            color_index=slot(analysis, s.spec.name))
            for s in analysis.configs if s.spec.batch_size == batch and not s.spec.is_plain
            and s.acceptance.by_position]
        if series:
            out.append(line_figure(
                series, title=f"Acceptance by position, batch size {batch}",
                x_label="draft position", y_label="accepted / drafted there",
                y_range=(0.0, 1.0)))
    return out


def speedup_figure(analysis: Analysis) -> Markup:
    """Measured speedup (total ratio, CI bars) against batch size, one line per config; a note
    instead where one batch size was measured."""
    by_name: dict[str, list[ConfigSummary]] = {}
    for s in analysis.configs:
        if s.speedup is not None:
            by_name.setdefault(s.spec.name, []).append(s)
    series = []
    for name, runs in by_name.items():
        runs.sort(key=lambda s: s.spec.batch_size)
        ivs = [s.speedup.total_ratio for s in runs if s.speedup is not None]
        series.append(svg.Series(name, [float(s.spec.batch_size) for s in runs],
                                 [iv.estimate for iv in ivs], err_low=[iv.low for iv in ivs],
                                 err_high=[iv.high for iv in ivs],
                                 color_index=slot(analysis, name)))
    if not series:
        return Markup("<p>No speculative configuration with a plain baseline.</p>")
    sizes = ", ".join(str(b) for b in analysis.batch_sizes)
    note = Markup(f"<p>Measured at one batch size ({sizes}): the speedup is in the summary "
                  "above. Measure several (<code>--batch-sizes 1,4,8</code>) to see how it "
                  "changes with batch size.</p>")
    return line_figure(series, title="Speedup vs batch size (95% CI)", x_label="batch size",
                       y_label="speedup over plain (x)", hline=1.0, fallback=note)


def speedup_histograms(analysis: Analysis) -> list[Markup]:
    """Per config and batch size: histogram of per-request speedups (marker at 1)."""
    out = []
    for s in analysis.configs:
        if s.speedup is None:
            continue
        ratios = [r for r in s.speedup.per_request if math.isfinite(r)]
        h = histogram(ratios, bins=20)
        out.append(Markup(svg.bar_chart(
            h.edges, h.counts, marker=1.0, x_label="per-request speedup (x)",
            title=f"{s.spec.name}, batch size {s.spec.batch_size}: per-request speedup")))
    return out


def boundary_figures(analysis: Analysis) -> list[Markup]:
    """One alpha x c map per (k, batch size), with every matching config's measured point."""
    groups: dict[tuple[int, int], list[ConfigSummary]] = {}
    for s in analysis.configs:
        k = s.spec.k
        if isinstance(k, int) and k >= 1 and math.isfinite(s.c) and math.isfinite(s.v):
            groups.setdefault((k, s.spec.batch_size), []).append(s)
    out = []
    for (k, batch), runs in sorted(groups.items()):
        v = sum(s.v for s in runs) / len(runs)
        points = [(f"{s.spec.name} (S={num(s.predicted_speedup)})", s.acceptance.alpha, s.c)
                  for s in runs]
        out.append(Markup(svg.boundary_map(
            float(k), v, points, title=f"k = {k}, v(k) = {v:.2f}, batch size {batch}")))
    return out




def load_figure(analysis: Analysis) -> Markup:
    """Cores other work kept busy through the run, one point per measured batch, per config."""
    samples = [s for s in analysis.results.samples if s.load and s.started_at]
    if not samples:
        return Markup("")
    start = min(s.started_at for s in samples)
    header = analysis.results.header
    series = []
    for c in analysis.configs:
        points = sorted({(s.started_at - start, r.taken_cores) for s in samples
                         if (s.config, s.batch_size) == c.key
                         and (r := interference.LoadReading.from_dict(s.load)) is not None})
        if points:
            series.append(svg.Series(f"{c.spec.name} (batch {c.spec.batch_size})",
                                     [x for x, _ in points], [y for _, y in points],
                                     color_index=slot(analysis, c.spec.name)))
    return line_figure(series, title="Other processes + steal through the run",
                       x_label="seconds since the first measured batch",
                       y_label="cores busy with other work", y_range=(0.0, None),
                       hline=interference.threshold_cores(header, header.hardware.cpu_cores))


