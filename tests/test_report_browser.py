"""The report as a person sees it: report.html of a real `specdecode bench` run (a tiny random
checkpoint, the CLI in process), rendered by headless Chromium at 1200 and 800 px
(`scripts/report_browser.py`). The page must not scroll sideways, every chart must draw at least
two x values, and no chart text may be clipped; full-page screenshots of both widths are kept in
the run folder (screenshots/report-<width>.png; with SPECDECODE_BROWSER_ARTIFACTS=DIR, copied
there with the report). Broken variants (the old 20-column summary table, a chart of one batch
size, charts that do not widen for their labels) must be caught.

Without Chromium these tests skip (bash scripts/install_chromium.sh; Debian: apt-get install -y
chromium fonts-liberation), unless SPECDECODE_REQUIRE_BROWSER=1 (CI sets it): then a missing
browser fails them.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from markupsafe import Markup

from scripts.report_browser import INSTALL, PageCheck, check_report, find_chromium, main
from specdecode.bench.store import read_results
from specdecode.report import figures, svg
from specdecode.report import html as report_html
from specdecode.report.analysis import analyze
from specdecode.report.cells import Column
from specdecode.report.recommend import recommend
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint

CHROMIUM = find_chromium()
if CHROMIUM is None:
    if os.environ.get("SPECDECODE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"SPECDECODE_REQUIRE_BROWSER=1 but no Chromium: {INSTALL}", pytrace=False)
    pytest.skip(f"no Chromium ({INSTALL})", allow_module_level=True)

WIDTHS = (1200, 800)
# a name as long as a user may give one: its chart titles need more than the default width
LONG = "ngram-lookup-over-the-whole-conversation-k3"
CONFIGS = f"plain;ngram+int8:k=3;ngram:k=3,name={LONG}"
PROMPTS = [  # four categories, one sampled (so the run has a sampled audit to state)
    {"prompt": "t5 t6 t7 t8 t9 t5 t6 t7 t8 t9 t5 t6", "category": "code"},
    {"prompt": "t20 t21 t22 t23 t20 t21 t22", "category": "code"},
    {"prompt": "t30 t31 t32 t33 t34 t35 t36 t37", "category": "chat"},
    {"prompt": "t40 t41 t42 t43 t44 t40 t41 t42 t43", "category": "summarization"},
    {"prompt": "t50 t51 t52 t53 t50 t51 t52 t53 t50", "category": "rag"},
    {"prompt": "t60 t61 t62 t60 t61 t62", "category": "chat", "temperature": 0.8},
]
# The summary table as it was (2026-12-04): 20 columns, cut off at 1200 px.
OLD_SUMMARY_COLUMNS = (
    report_html.CONFIG, report_html.BATCH, Column("drafter", "drafter", text=True),
    Column("k", "k"), Column("temperature", "temp."), Column("n", "requests"),
    Column("tokens", "output tokens"), Column("throughput", "throughput (tok/s)"),
    Column("ttft", "TTFT p50 / p99 (ms)"), Column("itl", "ITL p50 / p99 (ms)"),
    Column("latency", "latency p50 / p99 (s)"), Column("rate", "accepted / drafted"),
    Column("alpha", "alpha"), Column("mal", "mean acceptance length"),
    Column("speedup", "speedup (total ratio, CI)"),
    Column("median_speedup", "speedup (median ratio, CI)"),
    Column("decode_speedup", "speedup after the first token (CI)"),
    Column("predicted", "predicted speedup"), Column("audit", "audit", css="audit_class"),
    Column("load", "machine load", css="load_class"))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The run folder of `specdecode bench` on a tiny checkpoint, one batch size (as the
    default run), three configurations."""
    tmp = tmp_path_factory.mktemp("browser")
    ckpt = make_checkpoint(tmp / "ck")
    workload = tmp / "w.jsonl"
    workload.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    threads = torch.get_num_threads()
    try:
        code, _, err = run_cli(["bench", "--model", str(ckpt), "--workload", str(workload),
                                  "--out", str(tmp / "run"), "--quiet", "--threads", "1",
                                  "--max-tokens", "16", "--resamples", "200",
                                  "--audit-samples", "30", "--configs", CONFIGS])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    yield tmp / "run"


@pytest.fixture(scope="module")
def targets_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The run folder of `specdecode bench --targets fp32,bf16,w4a16` on a tiny checkpoint
    (scaled so that its w4a16 copy's top-1 agreement differs from fp32's: the frontier chart
    has two x values)."""
    tmp = tmp_path_factory.mktemp("browser-targets")
    ckpt = make_checkpoint(tmp / "ck", scale=1.0)
    workload = tmp / "w.jsonl"
    workload.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:4]), encoding="utf-8")
    threads = torch.get_num_threads()
    try:
        code, _, err = run_cli(["bench", "--model", str(ckpt), "--workload", str(workload),
                                  "--out", str(tmp / "run"), "--quiet", "--threads", "1",
                                  "--max-tokens", "16", "--resamples", "200",
                                  "--audit-samples", "0", "--targets", "fp32,bf16,w4a16"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    yield tmp / "run"


def test_a_targets_report_reads_well_at_1200_and_800_px(targets_run: Path) -> None:
    html = (targets_run / "report.html").read_text(encoding="utf-8")
    assert 'id="targets"' in html and 'aria-label="Speed against fidelity, batch size 1"' in html
    for check in check_report(targets_run / "report.html", WIDTHS,
                              shots=targets_run / "screenshots"):
        print(check.render())
        assert check.problems == [], check.render()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_the_report_reads_well_at_1200_and_800_px(run: Path) -> None:
    checks = check_report(run / "report.html", WIDTHS, shots=run / "screenshots")
    for check in checks:
        print(check.render())  # the findings, in the test's output
    artifacts = os.environ.get("SPECDECODE_BROWSER_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copytree(run / "screenshots", Path(artifacts), dirs_exist_ok=True)
        shutil.copy(run / "report.html", Path(artifacts) / "report.html")
    for check, width in zip(checks, WIDTHS, strict=True):
        assert check.problems == [], check.render()
        assert check.document_width == width
        # 4 latency CDFs, acceptance by position, 2 speedup histograms, 2 alpha x c maps,
        # the machine load; no speedup-vs-batch-size chart at one batch size
        assert check.charts >= 9 and check.tables >= 9 and check.texts > 100, check.render()
        assert check.screenshot == run / "screenshots" / f"report-{width}.png"
        shot_width, shot_height = png_size(check.screenshot)
        assert shot_width == width and shot_height == check.height > 3000
    html = (run / "report.html").read_text(encoding="utf-8")
    assert "Measured at one batch size (1)" in html and "This is a smoke check" in html
    assert f"{LONG} (S=" in html  # the alpha x c map's legend, in full


def render_variant(run: Path, name: str) -> Path:
    """The run's report rendered again (by the code as patched by the caller)."""
    analysis = analyze(read_results(run / "results.jsonl"), n_resamples=200)
    path = run / f"broken-{name}.html"
    report_html.write_html(path, analysis, recommend(analysis))
    return path


def problems_at(path: Path, width: int) -> list[str]:
    [check] = check_report(path, (width,))
    assert isinstance(check, PageCheck)
    return check.problems


def test_the_old_wide_summary_table_is_caught(run: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    monkeypatch.setattr(report_html, "SUMMARY_COLUMNS", OLD_SUMMARY_COLUMNS)
    problems = problems_at(render_variant(run, "table"), 1200)
    assert any(p.startswith("the page scrolls sideways") for p in problems), problems
    assert any(p.startswith('a table under "Summary per configuration" ends at')
               for p in problems), problems


def test_a_chart_of_one_batch_size_is_caught(run: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """The old report drew speedup against batch size with one batch size: an axis from 1
    to 2 with bars at 1."""

    def always_drawn(series: list[svg.Series], *, fallback: Markup | None = None,
                     **options: object) -> Markup:
        return Markup(svg.line_chart(series, **options))  # type: ignore[arg-type]

    monkeypatch.setattr(figures, "line_figure", always_drawn)
    problems = problems_at(render_variant(run, "chart"), 800)
    assert 'chart "Speedup vs batch size (95% CI)" draws 1 x value: a chart needs at least ' \
           "two" in problems, problems


def test_chart_text_cut_by_its_box_is_caught(run: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """Charts of a fixed width, not widened for their text (400 px here, so that the test
    does not depend on the fonts' exact widths): the long configuration's title runs out of
    its histogram's box."""
    monkeypatch.setattr(svg, "fitted_width", lambda *args, **kwargs: 400)
    problems = problems_at(render_variant(run, "clipped"), 1200)
    title = f"{LONG}, batch size 1: per-request speedup"
    assert f'text "{title}" of chart "{title}" is clipped by its box' in " ".join(problems), \
        problems


def test_the_command_line_check(run: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(report_html, "SUMMARY_COLUMNS", OLD_SUMMARY_COLUMNS)
    broken = render_variant(run, "cli")
    assert main([str(broken), "--widths", "1200", "--shots", str(run / "cli-shots")]) == 1
    out = capsys.readouterr().out
    assert "1200 px: page" in out and "the page scrolls sideways" in out
    assert png_size(run / "cli-shots" / "report-1200.png")[0] == 1200
    assert main([str(run / "missing.html"), "--widths", "800"]) == 2
    assert "missing.html" in capsys.readouterr().err
    assert main([str(broken), "--widths", "wide"]) == 2
