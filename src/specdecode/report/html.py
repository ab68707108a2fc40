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
from pathlib import Path
from typing import Any

import jinja2

from specdecode.bench import interference
from specdecode.bench.hardware import describe_hardware
from specdecode.bench.workloads import prompts_from_description
from specdecode.files import atomic_write_text
from specdecode.limits import AUDIT_POWER, AUDIT_REAL_TV
from specdecode.report import figures
from specdecode.report.analysis import Analysis, ConfigSummary
from specdecode.report.audit import audit_power
from specdecode.report.cells import DASH, UNKNOWN, Column, ci, fmt_bytes, num, pair
from specdecode.report.recommend import Recommendation
from specdecode.report.targets import (
    BEST_SPEED_COLUMNS,
    FIDELITY_COLUMNS,
    PLAIN_SPEED_COLUMNS,
    targets_context,
)

TEMPLATE = "report_template.html.j2"

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


# `bench --targets` (report.frontier): each target's fidelity, then its speed per batch size

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
            "throughput": num(s.throughput_tok_s, 1),
            "ttft": pair(s.ttft.p50, s.ttft.p99, 1000, 0),
            "tpot": pair(s.tpot.p50, s.tpot.p99, 1000, 1),
            "chunk_gap": pair(s.chunk_gap.p50, s.chunk_gap.p99, 1000, 1),
            "itl": pair(s.itl.p50, s.itl.p99, 1000, 1),
            "latency": pair(s.latency.p50, s.latency.p99, 1, 2),
            "rate": num(a.rate), "alpha": num(a.alpha), "mal": num(a.mean_acceptance_length),
            "speedup": ci(spd.total_ratio) if spd else DASH,
            "median_speedup": ci(spd.median_ratio) if spd else DASH,
            "decode_speedup": ci(spd.decode_ratio) if spd else DASH,
            # the cost source in a column of its own: as text it wraps, and "cost curve + in-run
            # step overhead" beside the figure widened the table past 800 px
            "predicted": num(s.predicted_speedup), "cost_source": s.cost_source or DASH,
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
                         "n": c.n_requests, "rate": num(c.acceptance.rate),
                         "alpha": num(c.acceptance.alpha),
                         "mal": num(c.acceptance.mean_acceptance_length),
                         "speedup": num(c.speedup) + ("x" if math.isfinite(c.speedup) else "")})
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
                     "valid_share": num(st.valid_share * 100, 1),
                     "valid_class": "pass" if st.n_valid == st.n_constrained else "fail",
                     "forced": UNKNOWN if st.forced_tokens is None
                     else f"{st.forced_tokens}/{st.output_tokens}",
                     "forced_share": num(st.forced_share * 100, 1),
                     "mask": UNKNOWN if st.mask_s is None else num(st.mask_s, 3),
                     "request": num(st.request_s, 2),
                     "mask_share": num(st.mask_share * 100, 2),
                     "mask_per_token": num(st.mask_per_token_s * 1000, 3)})
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
                         "n": x.n_requests, "rate": num(a.rate), "alpha": num(a.alpha),
                         "mal": num(a.mean_acceptance_length),
                         "speedup": num(x.speedup) + ("x" if math.isfinite(x.speedup) else "")})
    return rows


def load_rows(load: interference.LoadReport) -> list[dict[str, Any]]:
    """One formatted row per (config, batch size) for the machine-load table."""
    return [{"name": c.config, "batch": c.batch_size, "n_requests": c.n_requests,
             "n_read": c.n_read, "n_disturbed": c.n_disturbed,
             "disturbed_class": "fail" if c.n_disturbed else "",
             "mean": num(c.mean_taken_cores), "worst": num(c.max_taken_cores),
             "own": num(c.mean_own_cores), "load1": num(c.max_load1)} for c in load.configs]


def _load_context(analysis: Analysis) -> dict[str, Any]:
    results = analysis.results
    load = interference.assess(results.header, results.samples)
    return {"load": load, "load_rows": load_rows(load),
            "load_figure": figures.load_figure(analysis),
            "load_flagged": "; ".join(interference.describe(c, load.cores)
                                      for c in load.flagged),
            "load_advice": interference.rerun_advice(None),
            "disturbed_cores": interference.DISTURBED_CORES,
            "threshold_cores": interference.threshold_cores(results.header, load.cores)}


def _table_rows(analysis: Analysis) -> dict[str, list[dict[str, Any]]]:
    audits = [{**a.to_dict(), "name": a.config,
               "batch": a.batch_size if a.batch_size is not None else "all",
               "verdict": "PASS" if a.passed else "FAIL",
               "verdict_class": "pass" if a.passed else "fail",
               "p_value": num(a.p_value, 4)} for a in analysis.audits]
    memory = [{"name": m.config, "batch": m.batch_size,
               **{key: fmt_bytes(getattr(m, key)) for key in (
                   "target_weights", "draft_weights", "target_kv", "draft_kv", "draft_store",
                   "peak_rss")}}
              for m in analysis.results.memory]
    costs = [{"drafter": c.drafter, "config": c.config or DASH, "batch": c.batch_size, "k": k,
              "c": num(cv), "v": num(vv), "step": num(c.target_step_s * 1000, 1)}
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
    """The full report page as a string; `extra`: more sections' context (report.traffic)."""
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
        "warmup_rows": warmup_rows(analysis),
        "warmup_figures": figures.warmup_figures(analysis),
        "latency_figures": figures.latency_figures(analysis),
        "acceptance_figures": figures.acceptance_figures(analysis),
        "speedup_figure": figures.speedup_figure(analysis),
        "speedup_histograms": figures.speedup_histograms(analysis),
        "boundary_figures": figures.boundary_figures(analysis),
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
