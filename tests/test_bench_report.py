"""The HTML report and the terminal summary: sections present, user strings escaped."""

from __future__ import annotations

import re

from specdecode.bench.analysis import analyze
from specdecode.bench.harness import make_header
from specdecode.bench.recommend import recommend
from specdecode.bench.records import ConfigSpec, CostCurve
from specdecode.bench.report_html import fmt_bytes, render_html
from specdecode.bench.store import Results
from specdecode.bench.summary import render_summary
from specdecode.bench.svg import nice_ticks
from specdecode.bench.workloads import Prompt
from tests.fakes import FakeRunner, make_prompts, ngram, plain, workload_of

SECTIONS = ("recommendation", "summary", "latency", "acceptance", "speedup", "boundary",
            "categories", "audit", "memory", "costs", "workload")
EVIL = "<script>alert('x')</script>"


def evil_results(with_curve: bool = True) -> Results:
    prompts = [*make_prompts(6),
               Prompt(id="evil<1>", category="<b>cat</b>", turns=[f"Summarize {EVIL} now"])]
    configs = [plain(), ngram(), ConfigSpec("we<ird>", drafter="ngram", k=2)]
    runner = FakeRunner()
    results = Results(header=make_header(runner.describe(), workload_of(prompts), configs, 0))
    for c in configs:
        for p in prompts:
            for s in runner.run([p], c):
                results.add(s)
        memory = runner.memory(c)
        assert memory is not None
        results.add(memory)
    if with_curve:
        results.add(CostCurve("ngram", 1, [1, 2, 4], [0.05, 0.05, 0.05], [1.0, 1.03, 1.05],
                              0.01))
    return results


def html_of(results: Results) -> str:
    analysis = analyze(results, n_resamples=200)
    return render_html(analysis, recommend(analysis))


def test_report_has_every_section_and_figure() -> None:
    html = html_of(evil_results())
    for section in SECTIONS:
        assert f'id="{section}"' in html, section
    # 3 latency CDFs, 1 acceptance, 1 speedup, 2 histograms, 2 boundary maps (k=4 and k=2)
    assert html.count("<svg") == 3 + 1 + 1 + 2 + 2
    assert "batch size 1" in html
    assert "fake-135m" in html and "2 torch threads" in html
    assert "--speculative-config" in html
    assert "greedy-token-identity" in html and "PASS" in html
    assert "100.0 MiB" in html  # memory table
    assert html.count("<tr>") > 20


def test_user_strings_are_escaped_everywhere() -> None:
    html = html_of(evil_results())
    assert "<script" not in html.lower()
    assert "&lt;script&gt;" in html
    assert "<b>cat</b>" not in html and "&lt;b&gt;cat&lt;/b&gt;" in html
    assert "we<ird>" not in html and "we&lt;ird&gt;" in html
    assert "evil<1>" not in html


def test_report_is_self_contained() -> None:
    html = html_of(evil_results())
    for external in ("<link", "src=", "url(", "@import", "<iframe", "<img"):
        assert external not in html, external
    hrefs = re.findall(r'href="([^"]*)"', html)
    assert all(h.startswith("#") for h in hrefs)


def test_report_without_cost_curves_uses_in_run_estimates() -> None:
    html = html_of(evil_results(with_curve=False))
    assert "No cost curves recorded" in html and "in-run timings" in html


def test_terminal_summary_lists_every_config_at_its_batch_size() -> None:
    analysis = analyze(evil_results(), n_resamples=200)
    text = render_summary(analysis, recommend(analysis), "out/report.html")
    assert "batch size 1:" in text
    for name in ("plain", "ngram-k4", "we<ird>"):
        assert f"  {name}" in text
    assert "speedup" in text and "report: out/report.html" in text
    assert len(text.splitlines()) <= 12


def test_small_helpers() -> None:
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0.013, 0.05, 4) == [0.02, 0.03, 0.04, 0.05]
    assert fmt_bytes(0) == "–" and fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(3 << 30) == "3.0 GiB"


def test_a_config_keeps_its_colour_in_every_chart() -> None:
    """The acceptance chart has no plain line: its colours must not shift against the CDFs."""
    from specdecode.bench.report_html import acceptance_figures, latency_figures

    analysis = analyze(evil_results(), n_resamples=50)

    def legend(svg_text: str) -> dict[str, str]:
        pairs = re.findall(r'fill="(#[0-9a-f]{6})"/><text x="[\d.]+" y="[\d.]+">([^<]+)</text>',
                           svg_text)
        return {label: color for color, label in pairs}

    cdf = legend(str(latency_figures(analysis)[0]["figures"][0]))
    accepted = legend(str(acceptance_figures(analysis)[0]))
    assert "plain" in cdf and "plain" not in accepted and accepted
    assert all(cdf[name] == color for name, color in accepted.items())
