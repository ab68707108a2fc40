"""The report's section of a run of several targets (`bench --targets`): where each target runs,
its invariance and fidelity, its plain and fastest lossless speed against llama.cpp's, the
speed-fidelity frontier, and the CPU features its precision runs faster with."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from markupsafe import Markup

from specdecode.models import backends, precision
from specdecode.report import frontier, svg
from specdecode.report.analysis import Analysis, ConfigSummary
from specdecode.report.cells import DASH, Column, ci, num
from specdecode.report.figures import line_figure
from specdecode.report.recommend import Recommendation

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
                     "plain": num(p.plain.throughput_tok_s, 1),
                     "plain_ref": ci(p.plain_vs_reference),
                     "plain_decode_ref": ci(p.plain_decode_vs_reference),
                     "best": p.best.spec.name if spec else "plain (no win shown)",
                     "best_tok_s": num(p.tok_s, 1), "speedup": ci(p.speedup),
                     "best_ref": ci(p.vs_reference), "decode_ref": ci(p.decode_vs_reference)})
    if reference is not None:
        rows.append({"target": f"{reference.spec.name} (reference)", "reference": True,
                     "plain": num(reference.throughput_tok_s, 1), "plain_ref": "1.00x",
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


