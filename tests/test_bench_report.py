"""The HTML report and the terminal summary: sections present, user strings escaped."""

from __future__ import annotations

import dataclasses
import io
import math
import re
import shlex
from pathlib import Path

import pytest
from markupsafe import Markup

from specdecode.bench.harness import RunOptions, make_header, run_bench
from specdecode.bench.records import AuditVerdict, ConfigSpec, CostCurve, RequestSample
from specdecode.bench.store import Results
from specdecode.bench.workloads import Prompt, load_repetitive_workload
from specdecode.cli import build_parser
from specdecode.report.analysis import analyze, arrival_slices, warmup_summary
from specdecode.report.audit import audit_command, audit_power
from specdecode.report.cells import fmt_bytes
from specdecode.report.figures import boundary_figures, line_figure, speedup_histograms
from specdecode.report.html import SUMMARY_COLUMNS, render_html, warmup_rows
from specdecode.report.recommend import recommend
from specdecode.report.summary import render_summary
from specdecode.report.svg import Series, nice_ticks
from tests.fakes import FakeRunner, make_prompts, ngram, plain, workload_of

SECTIONS = ("recommendation", "summary", "latency", "acceptance", "speedup", "boundary",
            "categories", "audit", "memory", "costs", "glossary", "workload")
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
    # 4 latency CDFs (TTFT, TPOT, inter-chunk gap, latency), 1 acceptance, 2 histograms, 2
    # boundary maps (k=4 and k=2); speedup against batch size at one batch size: a note
    assert html.count("<svg") == 4 + 1 + 2 + 2
    assert "Measured at one batch size (1)" in html
    for figure in ("TTFT CDF", "TPOT CDF", "Inter-chunk gap CDF", "Request latency CDF"):
        assert f"{figure}, batch size 1" in html
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


def test_the_summary_table_keeps_to_the_key_columns_and_the_rest_is_still_there() -> None:
    """The main table: config, batch, tok/s, the two speedups, audit; the latency, acceptance
    and detail tables hold the rest, each figure once under its own name."""
    html = html_of(evil_results())
    assert [c.header for c in SUMMARY_COLUMNS] == [
        "config", "batch size", "throughput (tok/s)", "speedup (CI)",
        "speedup after the first token (CI)", "audit"]
    for header in ("TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "inter-chunk gap p50 / p99 (ms)",
                   "request latency p50 / p99 (s)", "per-token ITL p50 / p99 (ms)",
                   "accepted / drafted", "mean acceptance length", "predicted speedup",
                   "speedup (median ratio, CI)", "machine load"):
        assert f">{header}</a></th>" in html, header
    assert "<details" in html
    for term in ("tpot", "chunk-gap", "itl", "ttft", "alpha"):  # the headers' glossary entries
        assert f'href="#term-{term}"' in html and f'id="term-{term}"' in html
    assert "per-token ITL</dt>" in html and "m - 1 zeros" in html


def test_terminal_summary_shows_tpot_and_chunk_gaps_not_per_token_itl() -> None:
    analysis = analyze(evil_results(), n_resamples=50)
    text = render_summary(analysis, recommend(analysis))
    assert "TPOT p50/p99" in text and "inter-chunk gap p50/p99" in text and "ITL" not in text


def test_a_chart_of_one_x_value_is_a_table_or_a_note() -> None:
    one = [Series("a<b", [4.0, 4.0], [0.5, 1.0]), Series("c", [4.0], [0.7])]
    table = str(line_figure(one, title="T", x_label="x", y_label="y"))
    assert "<svg" not in table and "<caption>T</caption>" in table and "a&lt;b" in table
    assert str(line_figure(one, title="T", x_label="x", y_label="y",
                           fallback=Markup("<p>note</p>"))) == "<p>note</p>"
    two = [Series("a", [1.0, 2.0], [0.5, 1.0])]
    assert str(line_figure(two, title="T", x_label="x", y_label="y")).startswith("<svg")


def test_chart_labels_are_never_cut() -> None:
    """The legend shows each label in full and a chart widens to hold a long one (the old
    legend cut labels at 22 characters: "ngram+w4a16-k3 (S=2.93")."""
    long_name = "ngram-lookup-over-the-whole-conversation-so-far-k2"
    results = evil_results()
    results.header.configs.append(ConfigSpec(long_name, drafter="ngram", k=2))
    for sample in list(results.samples_of(("we<ird>", 1))):
        results.add(dataclasses.replace(sample, config=long_name))
    analysis = analyze(results, n_resamples=50)
    maps = [str(m) for m in boundary_figures(analysis)]
    label = next(m for m in maps if long_name in m)
    s = analysis.summary(long_name, 1)
    assert s is not None and f"{long_name} (S={s.predicted_speedup:.2f})</text>" in label
    hist = next(str(h) for h in speedup_histograms(analysis) if long_name in str(h))
    width = int(re.search(r'width="(\d+)"', hist).group(1))  # type: ignore[union-attr]
    assert width > 560  # its title would not fit the default width


def test_the_audit_section_states_its_power_and_the_command_for_a_real_audit() -> None:
    results = evil_results()
    results.header.runner["details"] = {"backend": "native", "source": "/models/my model",
                                        "chat_template": True}
    results.add(AuditVerdict(config="ngram-k4", passed=True, method="sampled-chi-square",
                             n_compared=60, n_failed=0, batch_size=1, p_value=0.5,
                             detectable_tv=0.76, samples_needed=3391, false_alarm=1e-3,
                             temperature=0.8, prompt_id="p4", turn=1))
    analysis = analyze(results, n_resamples=50)
    [power] = audit_power(analysis)
    assert power["smoke"] and power["tv"] == "0.76" and power["needed"] == 3391
    assert power["command"] == (
        "specdecode audit --model '/models/my model' --precision fp32 --backend native "
        "--threads 2 --drafter ngram --k 4 --temperature 0.8 --prompt 'first question' "
        "--samples 3391 --false-alarm 0.001")
    args = build_parser().parse_args(shlex.split(power["command"])[1:])  # flags audit takes
    assert (args.command, args.samples, args.prompt) == ("audit", 3391, "first question")
    # the drafter options the audit has flags for go on its command line, as flags it takes
    spec = ConfigSpec("dm-k3", drafter="draft-model", k="auto",
                      options={"model": "/d m", "kmax": 5, "max_step_cost": 2.0})
    verdict = dataclasses.replace(results.audits[-1], config="dm-k3", turn=0)
    command, caveats = audit_command(results.header, spec, verdict, None)
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert (args.draft_model, args.kmax, args.max_step_cost, args.k) == ("/d m", 5, 2.0, "auto")
    assert caveats == []
    assert power["caveats"] == [  # the fake ngram config's options, the conversation's turn
        "the drafter option ngram_max=3 is not a flag of specdecode audit: it audits the "
        "drafter's default",
        "the drafter option ngram_min=1 is not a flag of specdecode audit: it audits the "
        "drafter's default",
        "the run audited turn 2 of conversation p4; the command audits its first turn"]
    html = html_of(results)
    assert "This is a smoke check" in html and "60 samples per side detect" in html
    assert "needs 3391 samples per side" in html
    # a verdict written before the power was recorded: no power statement, no command
    results.audits[-1] = dataclasses.replace(results.audits[-1], detectable_tv=None,
                                             samples_needed=None)
    assert audit_power(analyze(results, n_resamples=50)) == []


def test_small_helpers() -> None:
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0.013, 0.05, 4) == [0.02, 0.03, 0.04, 0.05]
    assert fmt_bytes(0) == "–" and fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(3 << 30) == "3.0 GiB"


def test_a_config_keeps_its_colour_in_every_chart() -> None:
    """The acceptance chart has no plain line: its colours must not shift against the CDFs."""
    from specdecode.report.figures import acceptance_figures, latency_figures

    analysis = analyze(evil_results(), n_resamples=50)

    def legend(svg_text: str) -> dict[str, str]:
        pairs = re.findall(r'fill="(#[0-9a-f]{6})"/><text x="[\d.]+" y="[\d.]+">([^<]+)</text>',
                           svg_text)
        return {label: color for color, label in pairs}

    cdf = legend(str(latency_figures(analysis)[0]["figures"][0]))
    accepted = legend(str(acceptance_figures(analysis)[0]))
    assert "plain" in cdf and "plain" not in accepted and accepted
    assert all(cdf[name] == color for name, color in accepted.items())


# ------------------------------------------------------------------------- cold to warm


def hand_sample(config: str, arrival: int, accepted: int, latency: float) -> RequestSample:
    """Request `arrival` of 8: groups g0..g3 at places (0, 4), (1, 5), (2, 6), (3, 7); 10
    verification steps, 4 tokens drafted a step, `accepted` (at most 20) of them accepted (so
    mean acceptance length = 1 + accepted / 10)."""
    steps, drafted = 10, (0 if config == "plain" else 4)
    n = accepted + steps + 1
    return RequestSample(
        config=config, batch_size=1, prompt_id=f"q{arrival}", category="rag", turn=0,
        prompt_tokens=50, output_tokens=n, ttft_s=latency, itl_s=[0.0] * (n - 1),
        latency_s=latency, drafted=drafted * steps, accepted=accepted,
        accepted_per_pos=[min(accepted, steps), accepted - min(accepted, steps)] if drafted
        else [],
        drafted_per_pos=[steps] * drafted, rejections=steps if drafted else 0, steps=steps,
        draft_s=0.0, target_s=0.0, verify_s=0.0, output_token_ids=list(range(n)), text="",
        arrival=arrival, repeat_group=f"g{arrival % 4}", repeat_index=arrival // 4)


def hand_results(grouped: bool = True) -> Results:
    prompts = [Prompt(f"q{i}", "rag", ["x"], repeat_group=f"g{i % 4}" if grouped else None)
               for i in range(8)]
    results = Results(header=make_header(FakeRunner().describe(), workload_of(prompts),
                                         [plain(), ngram()], 0))
    for i in range(8):
        # acceptance grows with the place in the run; repeats take half plain's time
        spec = hand_sample("ngram-k4", i, accepted=2 * i, latency=1.0 if i < 4 else 0.5)
        base = hand_sample("plain", i, accepted=2 * i, latency=1.0)
        base.accepted, base.accepted_per_pos, base.steps = 0, [], base.output_tokens - 1
        if not grouped:
            spec.repeat_group = base.repeat_group = ""
            spec.repeat_index = base.repeat_index = 0
        assert spec.problems() == [] and base.problems() == []
        results.add(base)
        results.add(spec)
    return results


def test_arrival_slices_cover_the_run() -> None:
    assert arrival_slices(8) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert arrival_slices(10) == [(0, 1), (2, 4), (5, 6), (7, 9)]
    assert arrival_slices(3) == [(0, 0), (1, 1), (2, 2)]
    assert arrival_slices(36) == [(0, 8), (9, 17), (18, 26), (27, 35)]


def test_cold_to_warm_slices_from_hand_built_samples() -> None:
    analysis = analyze(hand_results(), n_resamples=50)
    assert analysis.summary("plain", 1).warmup is None  # type: ignore[union-attr]
    w = analysis.summary("ngram-k4", 1).warmup  # type: ignore[union-attr]
    assert w is not None and w.n_arrivals == 8
    # accepted per slice: 0+2, 4+6, 8+10, 12+14 over 20 steps and 80 drafted tokens
    expected = [1.1, 1.5, 1.9, 2.3]
    assert [x.acceptance.mean_acceptance_length for x in w.by_arrival] == \
        [pytest.approx(e) for e in expected]
    assert [x.acceptance.rate for x in w.by_arrival] == \
        [pytest.approx(a / 80) for a in (2, 10, 18, 26)]
    assert [x.n_requests for x in w.by_arrival] == [2, 2, 2, 2]
    assert [x.label for x in w.by_arrival] == ["requests 1-2", "requests 3-4", "requests 5-6",
                                               "requests 7-8"]
    assert [x.speedup for x in w.by_arrival] == [pytest.approx(v) for v in (1, 1, 2, 2)]
    assert (w.first.n_requests, w.repeats.n_requests) == (4, 4)
    assert w.first.acceptance.mean_acceptance_length == pytest.approx(1 + 12 / 40)
    assert w.repeats.acceptance.mean_acceptance_length == pytest.approx(1 + 44 / 40)
    assert w.first.acceptance.alpha == pytest.approx(12 / (12 + 40))  # i.i.d. estimate
    assert (w.first.speedup, w.repeats.speedup) == (pytest.approx(1.0), pytest.approx(2.0))
    assert analysis.to_dict()["configs"][1]["warmup"]["repeats"]["n_requests"] == 4
    # no baseline: acceptance without speedups; slices keep the workload's length
    alone = warmup_summary(analysis.results.samples_of(("ngram-k4", 1))[:5], [], 8)
    assert alone is not None and [x.n_requests for x in alone.by_arrival] == [2, 2, 1, 0]
    assert math.isnan(alone.first.speedup) and math.isnan(alone.by_arrival[3].acceptance.rate)
    short = warmup_summary(analysis.results.samples_of(("ngram-k4", 1))[:3], [], 3)
    assert short is not None and [x.label for x in short.by_arrival] == [
        "request 1", "request 2", "request 3"]


def test_cold_to_warm_in_the_summary_and_the_html() -> None:
    analysis = analyze(hand_results(), n_resamples=50)
    text = render_summary(analysis, recommend(analysis))
    assert "cold to warm, by arrival (requests 1-2 / 3-4 / 5-6 / 7-8 of 8): mean acceptance " \
           "length 1.10 / 1.50 / 1.90 / 2.30" in text
    assert "first of their group (4 requests): mean acceptance length 1.30" in text
    assert "repeats (4): 2.10" in text and "speedup 2.00x" in text
    html = render_html(analysis, recommend(analysis))
    assert 'id="warmup"' in html and "4 repeat groups" in html
    rows = warmup_rows(analysis)
    assert [r["slice"] for r in rows] == ["requests 1-2 of 8", "requests 3-4 of 8",
                                          "requests 5-6 of 8", "requests 7-8 of 8",
                                          "first of its group", "repeats"]
    assert [r["mal"] for r in rows] == ["1.10", "1.50", "1.90", "2.30", "1.30", "2.10"]
    assert "Cold to warm, batch size 1" in html and "repeat group</th>" in html


def test_no_cold_to_warm_section_without_repeat_groups() -> None:
    for results in (hand_results(grouped=False), evil_results()):
        analysis = analyze(results, n_resamples=50)
        assert all(c.warmup is None for c in analysis.configs)
        assert "cold to warm" not in render_summary(analysis, recommend(analysis))
        html = render_html(analysis, recommend(analysis))
        assert 'id="warmup"' not in html and "repeat group" not in html
        assert warmup_rows(analysis) == []


def test_a_repetitive_run_records_arrivals_and_reports_cold_to_warm(tmp_path: Path) -> None:
    workload = load_repetitive_workload(categories=["rag", "coding"])  # 5 documents, 15 prompts
    outcome = run_bench(FakeRunner(), workload, [plain(), ngram()],
                        RunOptions(tmp_path, progress=False, n_resamples=50), out=io.StringIO())
    samples = outcome.analysis.results.samples
    order = {p.id: i for i, p in enumerate(workload.prompts)}
    assert all(s.arrival == order[s.prompt_id] for s in samples)
    assert all(s.repeat_group == s.prompt_id.rsplit("-r", 1)[0] for s in samples)
    assert all(s.repeat_index == int(s.prompt_id.rsplit("-r", 1)[1]) for s in samples)
    w = outcome.analysis.summary("ngram-k4", 1).warmup
    assert w is not None and w.n_arrivals == 15
    assert sum(x.n_requests for x in w.by_arrival) == 17  # 2 coding conversations: 2 turns
    assert (w.first.n_requests, w.repeats.n_requests) == (7, 10)
    assert "cold to warm" in outcome.summary and 'id="warmup"' in \
        outcome.report_html.read_text(encoding="utf-8")
