"""The self-contained HTML report: inline CSS and SVG, no scripts, no external resources.

The page is rendered by jinja2 with autoescaping on, so every user-provided string (prompts,
category and config names, model names) is HTML-escaped; the SVG figures escape their own
labels (see `svg`), and with the small tables that stand in for charts (`line_figure`, built
with markupsafe's escape) are the only markup inserted unescaped.

Layout, for a reader on a laptop or a narrow window (the browser test renders it at 1200 and
800 px): tables are declared as columns (`Column`) and drawn by one template macro, each narrow
enough to fit; a chart with fewer than two x values is not drawn (a table or a note instead).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup, escape

from specdecode.bench import frontier, interference, svg
from specdecode.bench.analysis import (
    Analysis,
    ConfigSummary,
    Interval,
    chunk_gaps,
    ecdf,
    histogram,
    tpot,
)
from specdecode.bench.hardware import describe_hardware
from specdecode.bench.recommend import Recommendation
from specdecode.bench.records import AuditVerdict, ConfigSpec, RunHeader
from specdecode.bench.workloads import Prompt, prompts_from_description
from specdecode.drafters.options import ALIASES as OPTION_ALIASES
from specdecode.drafters.options import FLAGS as OPTION_FLAGS
from specdecode.files import atomic_write_text
from specdecode.limits import AUDIT_POWER, AUDIT_REAL_TV
from specdecode.models import backends, precision

TEMPLATE = "report_template.html.j2"
DASH = "–"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Column:
    """One column of a report table: the row's `key` it shows, its header, whether it holds
    text (left-aligned), the row key holding its cells' CSS class (if any), and the glossary
    entry its header links to (`term-<term>` in the page; "" for none). Every table of the
    report is drawn from its columns by the template's one macro, `data_table`."""

    key: str
    header: str
    text: bool = False
    css: str = ""
    term: str = ""
    wrap: bool = False  # long text: may break anywhere rather than widen the table


CONFIG = Column("name", "config", text=True)
BATCH = Column("batch", "batch size")
# The summary's key figures; the others are split into narrower tables that fit beside them.
SUMMARY_COLUMNS = (CONFIG, BATCH, Column("throughput", "throughput (tok/s)", term="throughput"),
                   Column("speedup", "speedup (CI)", term="speedup"),
                   Column("decode_speedup", "speedup after the first token (CI)",
                          term="after-first"),
                   Column("audit", "audit", css="audit_class", term="audit"))
LATENCY_COLUMNS = (CONFIG, BATCH, Column("n", "requests"),
                   Column("ttft", "TTFT p50 / p99 (ms)", term="ttft"),
                   Column("tpot", "TPOT p50 / p99 (ms)", term="tpot"),
                   Column("chunk_gap", "inter-chunk gap p50 / p99 (ms)", term="chunk-gap"),
                   Column("latency", "request latency p50 / p99 (s)", term="latency"))
ACCEPTANCE_COLUMNS = (CONFIG, BATCH, Column("drafter", "drafter", text=True), Column("k", "k"),
                      Column("temperature", "temp."),
                      Column("rate", "accepted / drafted", term="rate"),
                      Column("alpha", "alpha", term="alpha"),
                      Column("mal", "mean acceptance length", term="mal"),
                      Column("predicted", "predicted speedup", term="predicted"),
                      Column("cost_source", "c and v from", text=True))
DETAIL_COLUMNS = (CONFIG, BATCH, Column("tokens", "output tokens"),
                  Column("median_speedup", "speedup (median ratio, CI)", term="median"),
                  Column("itl", "per-token ITL p50 / p99 (ms)", term="itl"),
                  Column("load", "machine load", css="load_class", term="load"))
STRUCTURED_COLUMNS = (CONFIG, BATCH, Column("valid", "outputs valid", css="valid_class"),
                      Column("valid_share", "valid (%)"),
                      Column("forced", "tokens forced / output tokens"),
                      Column("forced_share", "forced (%)"), Column("mask", "mask time (s)"),
                      Column("request", "request time (s)"),
                      Column("mask_share", "mask time / request time (%)"),
                      Column("mask_per_token", "mask time per token (ms)"))
LOAD_COLUMNS = (CONFIG, BATCH, Column("n_requests", "requests"),
                Column("n_read", "with a reading"),
                Column("n_disturbed", "disturbed", css="disturbed_class"),
                Column("mean", "other processes + steal, mean (cores)"),
                Column("worst", "worst batch (cores)"), Column("own", "this process (cores)"),
                Column("load1", "1-min load average, max"))
WARMUP_COLUMNS = (CONFIG, BATCH, Column("slice", "slice", text=True), Column("n", "requests"),
                  Column("rate", "accepted / drafted", term="rate"),
                  Column("alpha", "alpha", term="alpha"),
                  Column("mal", "mean acceptance length", term="mal"),
                  Column("speedup", "speedup (total ratio)", term="speedup"))
AUDIT_COLUMNS = (CONFIG, BATCH, Column("method", "method", text=True),
                 Column("verdict", "verdict", css="verdict_class"),
                 Column("n_compared", "compared"), Column("n_failed", "failed"),
                 Column("p_value", "p-value"),
                 Column("details", "details", text=True, wrap=True))
MEMORY_COLUMNS = (CONFIG, BATCH, Column("target_weights", "target weights"),
                  Column("draft_weights", "draft weights"), Column("target_kv", "target KV"),
                  Column("draft_kv", "draft KV"), Column("draft_store", "draft store"),
                  Column("peak_rss", "peak RSS"))
COST_COLUMNS = (Column("drafter", "drafter", text=True), Column("config", "config", text=True),
                BATCH, Column("k", "k"), Column("c", "c(k)"), Column("v", "v(k)"),
                Column("step", "target step (ms)"))
CATEGORY_COLUMNS = (CONFIG, BATCH, Column("category", "category", text=True),
                    Column("n", "requests"), Column("rate", "accepted / drafted", term="rate"),
                    Column("alpha", "alpha", term="alpha"),
                    Column("mal", "mean acceptance length", term="mal"),
                    Column("speedup", "speedup (total ratio)", term="speedup"))


# `bench --targets` (bench.frontier): each target's fidelity, then its speed per batch size
TARGET = Column("target", "target", text=True)
FIDELITY_COLUMNS = (TARGET, Column("runs_on", "runs on", text=True),
                    Column("invariance", "batch invariance", text=True, term="invariance"),
                    Column("top1", "top-1 agreement with fp32", term="top1"),
                    Column("kl", "mean KL from fp32 (nats)", term="kl"),
                    Column("same", "same greedy output as fp32 plain", term="same-output"),
                    Column("speculation", "speculation", text=True, wrap=True))
PLAIN_SPEED_COLUMNS = (TARGET, Column("plain", "plain decoding (tok/s)", term="throughput"),
                       Column("plain_ref", "vs llama.cpp plain (CI)", term="vs-llamacpp"),
                       Column("plain_decode_ref", "after the first token (CI)",
                              term="after-first"))
BEST_SPEED_COLUMNS = (TARGET, Column("best", "fastest lossless", text=True, term="lossless"),
                      Column("best_tok_s", "tok/s", term="throughput"),
                      Column("speedup", "vs its plain (CI)", term="speedup"),
                      Column("best_ref", "vs llama.cpp plain (CI)", term="vs-llamacpp"),
                      Column("decode_ref", "after the first token (CI)", term="after-first"))


def _num(x: float | None, digits: int = 2) -> str:
    return DASH if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _ci(iv: Interval | None) -> str:
    if iv is None or not math.isfinite(iv.estimate):
        return DASH
    return f"{iv.estimate:.2f}x [{_num(iv.low)}, {_num(iv.high)}]"


def _pair(a: float, b: float, scale: float, digits: int) -> str:
    return f"{_num(a * scale, digits)} / {_num(b * scale, digits)}"


def fmt_bytes(n: int) -> str:
    """Bytes in binary units (MiB, GiB), or a dash for 0."""
    if n <= 0:
        return DASH
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.1f} {unit}"


def _audit_cell(analysis: Analysis, s: ConfigSummary) -> tuple[str, str]:
    if s.spec.is_plain:
        return "baseline", ""
    passed = analysis.audit_passed(s.spec.name, s.spec.batch_size)
    return {True: ("pass", "pass"), False: ("FAIL", "fail"), None: ("none", "fail")}[passed]


def _load_cell(load: interference.LoadReport, s: ConfigSummary) -> tuple[str, str]:
    c = load.of(s.spec.name, s.spec.batch_size)
    if c is None or not c.n_read:
        return DASH, ""
    if not load.judged:
        return "not judged", ""
    if c.disturbed:
        return f"disturbed ({c.n_disturbed} of {c.n_requests})", "fail"
    return "quiet", ""


def summary_rows(analysis: Analysis) -> list[dict[str, Any]]:
    """One formatted row per (config, batch size) for the summary table."""
    rows = []
    load = interference.assess(analysis.results.header, analysis.results.samples)
    for s in analysis.configs:
        a, spd = s.acceptance, s.speedup
        audit, audit_class = _audit_cell(analysis, s)
        load_text, load_class = _load_cell(load, s)
        rows.append({
            "name": s.spec.name, "batch": s.spec.batch_size, "drafter": s.spec.drafter,
            "k": s.spec.k, "n": s.n_requests, "tokens": s.output_tokens,
            "temperature": "per prompt" if s.spec.temperature is None else s.spec.temperature,
            "throughput": _num(s.throughput_tok_s, 1),
            "ttft": _pair(s.ttft.p50, s.ttft.p99, 1000, 0),
            "tpot": _pair(s.tpot.p50, s.tpot.p99, 1000, 1),
            "chunk_gap": _pair(s.chunk_gap.p50, s.chunk_gap.p99, 1000, 1),
            "itl": _pair(s.itl.p50, s.itl.p99, 1000, 1),
            "latency": _pair(s.latency.p50, s.latency.p99, 1, 2),
            "rate": _num(a.rate), "alpha": _num(a.alpha), "mal": _num(a.mean_acceptance_length),
            "speedup": _ci(spd.total_ratio) if spd else DASH,
            "median_speedup": _ci(spd.median_ratio) if spd else DASH,
            "decode_speedup": _ci(spd.decode_ratio) if spd else DASH,
            # the cost source in a column of its own: as text it wraps, and "cost curve + in-run
            # step overhead" beside the figure widened the table past 800 px
            "predicted": _num(s.predicted_speedup), "cost_source": s.cost_source or DASH,
            "audit": audit, "audit_class": audit_class, "load": load_text,
            "load_class": load_class, "plain": s.spec.is_plain,
        })
    return rows


def category_rows(analysis: Analysis) -> list[dict[str, Any]]:
    """One row per (config, batch size, category), speculative configs only."""
    rows = []
    for s in analysis.configs:
        if s.spec.is_plain:
            continue
        for cat, c in s.by_category.items():
            rows.append({"name": s.spec.name, "batch": s.spec.batch_size, "category": cat,
                         "n": c.n_requests, "rate": _num(c.acceptance.rate),
                         "alpha": _num(c.acceptance.alpha),
                         "mal": _num(c.acceptance.mean_acceptance_length),
                         "speedup": _num(c.speedup) + ("x" if math.isfinite(c.speedup) else "")})
    return rows


def structured_rows(analysis: Analysis) -> list[dict[str, Any]]:
    """One row per (config, batch size) with constrained requests: outputs valid against their
    constraint, tokens forced (unscored), and the mask time against the request time ("unknown"
    where not recorded: an endpoint's; their shares a dash)."""
    rows = []
    for s in analysis.configs:
        st = s.structured
        if st is None:
            continue
        rows.append({"name": s.spec.name, "batch": s.spec.batch_size,
                     "valid": f"{st.n_valid}/{st.n_constrained}",
                     "valid_share": _num(st.valid_share * 100, 1),
                     "valid_class": "pass" if st.n_valid == st.n_constrained else "fail",
                     "forced": UNKNOWN if st.forced_tokens is None
                     else f"{st.forced_tokens}/{st.output_tokens}",
                     "forced_share": _num(st.forced_share * 100, 1),
                     "mask": UNKNOWN if st.mask_s is None else _num(st.mask_s, 3),
                     "request": _num(st.request_s, 2),
                     "mask_share": _num(st.mask_share * 100, 2),
                     "mask_per_token": _num(st.mask_per_token_s * 1000, 3)})
    return rows


def warmup_rows(analysis: Analysis) -> list[dict[str, Any]]:
    """Cold to warm: per speculative (config, batch size) of a workload with repeat groups, one
    row per slice of the run by arrival, then the groups' first requests and their repeats."""
    rows = []
    for s in analysis.configs:
        w = s.warmup
        if w is None:
            continue
        for kind, x in [*(("arrival", x) for x in w.by_arrival), ("group", w.first),
                        ("group", w.repeats)]:
            a = x.acceptance
            rows.append({"name": s.spec.name, "batch": s.spec.batch_size, "kind": kind,
                         "slice": f"{x.label} of {w.n_arrivals}" if kind == "arrival"
                         else x.label,
                         "n": x.n_requests, "rate": _num(a.rate), "alpha": _num(a.alpha),
                         "mal": _num(a.mean_acceptance_length),
                         "speedup": _num(x.speedup) + ("x" if math.isfinite(x.speedup) else "")})
    return rows


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
    rows = "".join(f'<tr><td class="l">{escape(s.label)}</td><td>{_num(x, 3)}</td>'
                   f"<td>{_num(y, 3)}</td></tr>"
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
                color_index=_slot(analysis, s.spec.name)))
        if series:
            out.append(line_figure(
                series, title=f"Cold to warm, batch size {batch}",
                x_label="request in arrival order (middle of each slice)",
                y_label="mean acceptance length", y_range=(1.0, None)))
    return out


def _slot(analysis: Analysis, name: str) -> int:
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
                                         color_index=_slot(analysis, s.spec.name)))
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
            color_index=_slot(analysis, s.spec.name))
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
                                 color_index=_slot(analysis, name)))
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
        points = [(f"{s.spec.name} (S={_num(s.predicted_speedup)})", s.acceptance.alpha, s.c)
                  for s in runs]
        out.append(Markup(svg.boundary_map(
            float(k), v, points, title=f"k = {k}, v(k) = {v:.2f}, batch size {batch}")))
    return out


def _invariance_cell(facts: dict[str, Any]) -> str:
    if facts.get("exact") is None:
        return "not measured"
    worst = facts.get("max_logit_difference")
    diff = f" (max {worst:.2g})" if isinstance(worst, float) and worst else ""
    return "exact (0.0)" if facts["exact"] else f"not exact{diff}"


def fidelity_rows(analysis: Analysis, points: Sequence[frontier.TargetPoint]
                  ) -> list[dict[str, Any]]:
    """One row per target the run loaded (the reference's runtime included): where it runs,
    its measured batch invariance, agreement with fp32, outputs equal to fp32's, speculation."""
    rows = []
    for name, facts in frontier.target_facts(analysis).items():
        f = frontier.fidelity_of(facts)
        same = next((p.same_output for p in points if p.target == name and p.same_output),
                    None)
        measured = facts.get("measured", True)
        speculation = str(facts.get("speculation", DASH)) if measured else \
            "not a target here: the reference's runtime"
        rows.append({"target": name if measured else f"{name} (reference)",
                     "runs_on": f"{facts.get('backend', '?')}, {facts.get('precision', '?')}",
                     "invariance": _invariance_cell(facts),
                     "top1": DASH if f is None else f"{f.top1:.2%}",
                     "kl": DASH if f is None else f"{f.mean_kl:.3g}",
                     "same": DASH if same is None else f"{same[0]} / {same[1]}",
                     "speculation": speculation})
    return rows


def target_speed_rows(points: Sequence[frontier.TargetPoint], batch: int,
                      reference: ConfigSummary | None) -> list[dict[str, Any]]:
    """One row per target at `batch` (frontier points marked), then the reference."""
    rows = []
    for p in points:
        if p.batch_size != batch:
            continue
        spec = p.best is not p.plain
        rows.append({"target": p.target + (" \u2605" if p.on_frontier else ""), "reference": False,
                     "plain": _num(p.plain.throughput_tok_s, 1),
                     "plain_ref": _ci(p.plain_vs_reference),
                     "plain_decode_ref": _ci(p.plain_decode_vs_reference),
                     "best": p.best.spec.name if spec else "plain (no win shown)",
                     "best_tok_s": _num(p.tok_s, 1), "speedup": _ci(p.speedup),
                     "best_ref": _ci(p.vs_reference), "decode_ref": _ci(p.decode_vs_reference)})
    if reference is not None:
        rows.append({"target": f"{reference.spec.name} (reference)", "reference": True,
                     "plain": _num(reference.throughput_tok_s, 1), "plain_ref": "1.00x",
                     "plain_decode_ref": "1.00x",
                     "best": DASH, "best_tok_s": DASH, "speedup": DASH, "best_ref": DASH,
                     "decode_ref": DASH})
    return rows


def frontier_figure(points: Sequence[frontier.TargetPoint], batch: int) -> Markup:
    """Speed against fidelity at `batch`: per target a segment from its plain decoding to its
    fastest lossless configuration at its top-1 agreement with fp32; y is the ratio to
    llama.cpp's plain decoding (CI bars, reference dashed at 1) where it was measured, else
    tokens/s; the frontier joins the points no other beats on both."""
    mine = [p for p in points if p.batch_size == batch and p.fidelity is not None]
    by_ratio = bool(mine) and all(p.vs_reference is not None and p.plain_vs_reference
                                  is not None for p in mine)
    series = []
    for i, p in enumerate(mine):
        assert p.fidelity is not None
        x = p.fidelity.top1 * 100
        ivs = [p.plain_vs_reference, p.vs_reference] if by_ratio else []
        ys = [iv.estimate for iv in ivs if iv] if by_ratio else \
            [p.plain.throughput_tok_s, p.tok_s]
        label = f"{p.target}: plain" + (f" to {p.best.spec.name}" if p.best is not p.plain
                                        else "")
        best = p.vs_reference if by_ratio else None  # bars on the fastest lossless point only:
        # the plain point's sit on the same vertical line and would read as one long bar
        series.append(svg.Series(label, [x, x], ys,
                                 err_low=[math.nan, best.low] if best else [],
                                 err_high=[math.nan, best.high] if best else [],
                                 color_index=i))
    front = sorted((p for p in mine if p.on_frontier), key=lambda p: p.fidelity.top1)  # type: ignore[union-attr]
    if len(front) > 1:
        series.append(svg.Series("speed-fidelity frontier (fastest lossless)",
                                 [p.fidelity.top1 * 100 for p in front],  # type: ignore[union-attr]
                                 [(p.vs_reference.estimate if by_ratio and p.vs_reference
                                   else p.tok_s) for p in front],
                                 color_index=len(mine)))
    xs = [p.fidelity.top1 * 100 for p in mine]  # type: ignore[union-attr]
    pad = max((max(xs) - min(xs)) * 0.08, 0.05) if xs else 0.0
    return line_figure(
        series, title=f"Speed against fidelity, batch size {batch}",
        x_label="top-1 agreement with fp32 (%)",
        y_label="tok/s over llama.cpp plain (x)" if by_ratio else "tokens/s",
        hline=1.0 if by_ratio else None,
        x_range=(min(xs, default=0.0) - pad, min(max(xs, default=100.0) + pad, 100.0 + pad)),
        y_range=(0.0, None))


def targets_context(analysis: Analysis, recommendation: Recommendation) -> dict[str, Any]:
    """The report's targets section (empty for a run of one target); the fidelity rule stated
    is the one the recommendation was made under."""
    if not frontier.is_targets_run(analysis):
        return {"targets": None}
    points = frontier.target_points(analysis)
    details = analysis.results.header.runner.get("details") or {}
    features = details.get("cpu_features") or []
    facts = frontier.target_facts(analysis)
    cpu = ("vector features " + ", ".join(features) if features else "no vector features read")
    for feature, names in slower_without(list(facts), features).items():
        cpu += (f"; no {feature.upper()}, which {', '.join(names)} run faster with (targets and "
                "drafters of that precision): their tokens/s below is what that costs")
    refused = [(c, why) for f in facts.values() for c, why in (f.get("refused") or {}).items()]
    tables = []
    for batch in analysis.batch_sizes:
        reference = frontier.reference_summary(analysis, batch)
        tables.append({"batch": batch, "reference": reference.spec.name if reference else None,
                       "rows": target_speed_rows(points, batch, reference),
                       "figure": frontier_figure(points, batch)})
    return {"targets": {
        "fidelity_rows": fidelity_rows(analysis, points), "tables": tables, "cpu": cpu,
        "agreement_text": details.get("agreement_text", ""),
        "positions": next((frontier.fidelity_of(f).positions for f in facts.values()  # type: ignore[union-attr]
                           if frontier.fidelity_of(f) is not None), 0),
        "no_reference": details.get("no_reference"), "refused": refused,
        "invariance": [(n, f.get("invariance")) for n, f in facts.items()
                       if f.get("invariance")],
        "rule": frontier.parse_fidelity(recommendation.fidelity or details.get("fidelity"))
        .describe()}}


def load_rows(load: interference.LoadReport) -> list[dict[str, Any]]:
    """One formatted row per (config, batch size) for the machine-load table."""
    return [{"name": c.config, "batch": c.batch_size, "n_requests": c.n_requests,
             "n_read": c.n_read, "n_disturbed": c.n_disturbed,
             "disturbed_class": "fail" if c.n_disturbed else "",
             "mean": _num(c.mean_taken_cores), "worst": _num(c.max_taken_cores),
             "own": _num(c.mean_own_cores), "load1": _num(c.max_load1)} for c in load.configs]


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
                                     color_index=_slot(analysis, c.spec.name)))
    return line_figure(series, title="Other processes + steal through the run",
                       x_label="seconds since the first measured batch",
                       y_label="cores busy with other work", y_range=(0.0, None),
                       hline=interference.threshold_cores(header, header.hardware.cpu_cores))


def _load_context(analysis: Analysis) -> dict[str, Any]:
    results = analysis.results
    load = interference.assess(results.header, results.samples)
    return {"load": load, "load_rows": load_rows(load), "load_figure": load_figure(analysis),
            "load_flagged": "; ".join(interference.describe(c, load.cores)
                                      for c in load.flagged),
            "load_advice": interference.rerun_advice(None),
            "disturbed_cores": interference.DISTURBED_CORES,
            "threshold_cores": interference.threshold_cores(results.header, load.cores)}


def slower_without(targets: Sequence[str], features: Sequence[str]) -> dict[str, list[str]]:
    """The CPU features this CPU lacks that some of `targets` run faster with (their precision
    records' faster_with), each with those targets."""
    out: dict[str, list[str]] = {}
    for name in targets:
        target = backends.bench_target(name)
        record = None if target is None else precision.get(target.precision)
        for feature in () if record is None else record.faster_with:
            if feature not in features:
                out.setdefault(feature, []).append(name)
    return out


# the drafter options `specdecode audit` has flags for (cli.args.add_drafter_args; spelled as
# drafters.options.FLAGS says); it cannot repeat the others
AUDIT_OPTIONS = ("draft_model", "heads", "distilled", "kmax", "max_step_cost")


def audit_command(header: RunHeader, spec: ConfigSpec, verdict: AuditVerdict,
                  prompt: Prompt | None) -> tuple[str, list[str]]:
    """The `specdecode audit` command that repeats a sampled audit of this run with
    `verdict.samples_needed` samples per side (the target, measurement flags, drafter, k,
    temperature and prompt the run used), and what it cannot repeat."""
    details = header.runner.get("details") or {}
    argv = ["specdecode", "audit"]
    if details.get("source"):
        argv += ["--model", str(details["source"])]
    target = backends.bench_target(spec.target) if spec.target else None
    if target is not None:  # a run of several targets: this configuration's own
        argv += ["--precision", target.precision, "--backend", target.backend.name]
    else:
        argv += ["--precision", header.model.precision]
        if details.get("backend"):
            argv += ["--backend", str(details["backend"])]
    argv += ["--threads", str(header.hardware.torch_threads), "--drafter", spec.drafter,
             "--k", str(spec.k)]
    caveats = []
    for key, value in spec.options.items():
        option = OPTION_ALIASES.get(key, key)
        if option in AUDIT_OPTIONS:
            argv += [OPTION_FLAGS[option], str(value)]
        else:
            caveats.append(f"the drafter option {key}={value} is not a flag of specdecode "
                           "audit: it audits the drafter's default")
    argv += ["--temperature", f"{verdict.temperature:g}"] if verdict.temperature else []
    if prompt is not None and prompt.turns:
        argv += ["--prompt", prompt.turns[0]]
        if verdict.turn:
            caveats.append(f"the run audited turn {verdict.turn + 1} of conversation "
                           f"{prompt.id}; the command audits its first turn")
        if prompt.constraint:
            caveats.append("the prompt has a structured-output constraint: add it with "
                           "--json-schema, --regex or --grammar")
    if details.get("chat") is False:
        caveats.append("the run sent raw turns (--no-chat-template); the audit applies the "
                       "model's chat template")
    argv += ["--samples", str(verdict.samples_needed)]
    if verdict.false_alarm is not None:
        argv += ["--false-alarm", f"{verdict.false_alarm:g}"]
    return shlex.join(argv), caveats


def audit_power(analysis: Analysis) -> list[dict[str, Any]]:
    """Per sampled audit that states its power (one per config and temperature: its verdict
    is reused at every batch size): the TV distance it detects, whether that makes it a smoke
    check (it detects only distances above AUDIT_REAL_TV), and the command of an audit that
    detects AUDIT_REAL_TV."""
    header = analysis.results.header
    prompts = {p.id: p for p in prompts_from_description(header.workload)}
    specs = {c.name: c for c in header.configs}
    out, seen = [], set()
    for v in analysis.audits:
        key = (v.config, v.temperature)
        if v.detectable_tv is None or v.samples_needed is None or v.config not in specs \
                or key in seen:
            continue
        seen.add(key)
        command, caveats = audit_command(header, specs[v.config], v, prompts.get(v.prompt_id))
        out.append({"config": v.config, "samples": v.n_compared,
                    "tv": _num(v.detectable_tv), "smoke": v.detectable_tv > AUDIT_REAL_TV,
                    "false_alarm": DASH if v.false_alarm is None else f"{v.false_alarm:g}",
                    "temperature": DASH if v.temperature is None else f"{v.temperature:g}",
                    "prompt": v.prompt_id or DASH, "needed": v.samples_needed,
                    "command": command, "caveats": caveats})
    return out


def _table_rows(analysis: Analysis) -> dict[str, list[dict[str, Any]]]:
    audits = [{**a.to_dict(), "name": a.config,
               "batch": a.batch_size if a.batch_size is not None else "all",
               "verdict": "PASS" if a.passed else "FAIL",
               "verdict_class": "pass" if a.passed else "fail",
               "p_value": _num(a.p_value, 4)} for a in analysis.audits]
    memory = [{"name": m.config, "batch": m.batch_size,
               **{key: fmt_bytes(getattr(m, key)) for key in (
                   "target_weights", "draft_weights", "target_kv", "draft_kv", "draft_store",
                   "peak_rss")}}
              for m in analysis.results.memory]
    costs = [{"drafter": c.drafter, "config": c.config or DASH, "batch": c.batch_size, "k": k,
              "c": _num(cv), "v": _num(vv), "step": _num(c.target_step_s * 1000, 1)}
             for c in analysis.results.cost_curves
             for k, cv, vv in zip(c.k, c.c, c.v, strict=False)]
    return {"audit_rows": audits, "memory_rows": memory, "cost_rows": costs}


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("specdecode", "data"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )


def render_html(analysis: Analysis, recommendation: Recommendation,
                extra: dict[str, Any] | None = None) -> str:
    """The full report page as a string; `extra`: more sections' context (bench.traffic)."""
    env = _environment()
    header = analysis.results.header
    headline = recommendation.render().splitlines()[0]
    context = {
        "header": header, "model": header.model, "workload": header.workload,
        "runner": header.runner,
        "hardware_line": describe_hardware(header.hardware),
        "truncated": analysis.results.truncated_tail,
        "confidence": 0.95, "n_resamples": analysis.n_resamples, "seed": analysis.seed,
        "rec": recommendation, "rec_headline": headline, "rec_vllm": recommendation.vllm_json,
        "summary_rows": summary_rows(analysis), "category_rows": category_rows(analysis),
        "summary_columns": SUMMARY_COLUMNS, "latency_columns": LATENCY_COLUMNS,
        "acceptance_columns": ACCEPTANCE_COLUMNS, "detail_columns": DETAIL_COLUMNS,
        "category_columns": CATEGORY_COLUMNS, "structured_columns": STRUCTURED_COLUMNS,
        "load_columns": LOAD_COLUMNS, "warmup_columns": WARMUP_COLUMNS,
        "audit_columns": AUDIT_COLUMNS, "memory_columns": MEMORY_COLUMNS,
        "cost_columns": COST_COLUMNS, "audit_power": audit_power(analysis),
        "fidelity_columns": FIDELITY_COLUMNS, "plain_speed_columns": PLAIN_SPEED_COLUMNS,
        "best_speed_columns": BEST_SPEED_COLUMNS,
        **targets_context(analysis, recommendation),
        "audit_real_tv": AUDIT_REAL_TV, "audit_power_level": AUDIT_POWER,
        "structured_rows": structured_rows(analysis),
        "warmup_rows": warmup_rows(analysis), "warmup_figures": warmup_figures(analysis),
        "latency_figures": latency_figures(analysis),
        "acceptance_figures": acceptance_figures(analysis),
        "speedup_figure": speedup_figure(analysis),
        "speedup_histograms": speedup_histograms(analysis),
        "boundary_figures": boundary_figures(analysis),
        "prompts": prompts_from_description(header.workload),
        **_table_rows(analysis),
        **_load_context(analysis),
        "traffic": None, **(extra or {}),
    }
    return env.get_template(TEMPLATE).render(**context)


def write_html(path: str | Path, analysis: Analysis, recommendation: Recommendation,
               extra: dict[str, Any] | None = None) -> None:
    """Render the report and write it atomically to `path`."""
    atomic_write_text(path, render_html(analysis, recommendation, extra))
