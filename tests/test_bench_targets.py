"""`bench --targets`: several targets in one run, their speed against their fidelity, and the
recommendation of the fastest lossless configuration at the fidelity asked for (fast tier: a
fake runner of several targets; the browser test renders a real run's report)."""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from specdecode.agreement import teacher_forced_logits
from specdecode.bench.harness import RunOptions, make_header, run_bench, validate_configs
from specdecode.bench.options import BenchOptions
from specdecode.bench.plan import parse_configs
from specdecode.bench.records import ConfigSpec, CostCurve
from specdecode.bench.store import Results
from specdecode.bench.targets import (
    DEFAULT_TARGET_CONFIGS,
    PEER_NAME,
    LoadedTarget,
    TargetsRunner,
    parse_targets,
    plan_targets,
    speculation_text,
    target_configs,
)
from specdecode.errors import SpecDecodeError
from specdecode.report import analysis as analysis_mod
from specdecode.report import frontier
from specdecode.report.analysis import Analysis, ConfigSummary, analyze
from specdecode.report.html import render_html
from specdecode.report.recommend import recommend
from specdecode.report.summary import render_summary
from tests.fakes import FakeTargetsRunner, make_prompts, ngram, plain, workload_of

TARGETS = ["fp32", "bf16", "w4a16"]
# fp32 slow, bf16 fast, w4a16 fastest and least faithful; llama-cpp-python in between
STEPS = {"fp32": 0.030, "bf16": 0.010, "w4a16": 0.0075}
AGREEMENT = {"fp32": (1.0, 0.0), "bf16": (0.99, 0.002), "w4a16": (0.93, 0.05)}
DIVERGE = {"bf16": {"p1"}, "w4a16": {"p1", "p2", "p3"}}


def grid(batch_sizes: Sequence[int] = (1,), peer: bool = True) -> list[ConfigSpec]:
    """plain and ngram-k4 on every target (built here: which targets the drafter registry lets
    speculate is not this file's subject), llama-cpp-python at batch size 1."""
    configs = [dataclasses.replace(c, name=f"{t}/{c.name}", target=t, precision=t, batch_size=b)
               for b in batch_sizes for t in TARGETS for c in (plain(), ngram())]
    return configs + ([ConfigSpec(PEER_NAME, "llamacpp-generate", 1, precision="gguf",
                                  target="llama.cpp")] if peer else [])


def measure(runner: FakeTargetsRunner, configs: list[ConfigSpec], n_prompts: int = 12
            ) -> Results:
    prompts = make_prompts(n_prompts)
    results = Results(header=make_header(runner.describe(), workload_of(prompts), configs, 0))
    for c in configs:
        for start in range(0, len(prompts), c.batch_size):
            for s in runner.run(prompts[start:start + c.batch_size], c):
                results.add(dataclasses.replace(s, group=start))
    return results


def run(fidelity: str = "any", corrupt: frozenset[str] = frozenset(), peer: bool = True,
        batch_sizes: Sequence[int] = (1,)) -> Analysis:
    runner = FakeTargetsRunner(STEPS, AGREEMENT, DIVERGE, corrupt=set(corrupt),
                               fidelity=fidelity, peer_step_s=0.009 if peer else None)
    return analyze(measure(runner, grid(batch_sizes, peer)), n_resamples=300)


@pytest.fixture(scope="module")
def measured() -> Analysis:
    return run()


# ------------------------------------------------------------------------------------ planning


def test_targets_parse_and_bad_ones_are_named() -> None:
    assert parse_targets("fp32, BF16,w4a16,llamacpp") == ["fp32", "bf16", "w4a16", "llama.cpp"]
    with pytest.raises(SpecDecodeError, match=r"unknown target.*fp8"):
        parse_targets("fp32,fp8")
    with pytest.raises(SpecDecodeError, match="bf16 twice"):
        parse_targets("bf16,fp32,bf16")
    with pytest.raises(SpecDecodeError, match="unknown target"):
        parse_targets(" , ")


def test_every_config_runs_on_every_target_and_the_peer_at_batch_1_only() -> None:
    hybrid = ConfigSpec("ngram+w4a16-kauto", "ngram+w4a16", "auto")
    configs, skipped = target_configs(["fp32", "int8", "w4a16", "llama.cpp"],
                                      [plain(), hybrid], [1, 8], peer=True)
    names = {(c.name, c.batch_size) for c in configs}
    assert ("fp32/ngram+w4a16-kauto", 8) in names and ("int8/plain", 1) in names
    assert ("llama.cpp/plain", 8) in names and (PEER_NAME, 1) in names
    assert (PEER_NAME, 8) not in names  # llama-cpp-python decodes one request at a time
    fp32 = next(c for c in configs if c.name == "fp32/ngram+w4a16-kauto")
    assert (fp32.target, fp32.precision, fp32.k) == ("fp32", "fp32", "auto")
    gguf = next(c for c in configs if c.name == "llama.cpp/plain")
    assert (gguf.target, gguf.precision) == ("llama.cpp", "gguf")
    # int8 speculation is refused by construction; a w4a16 copy drafting for w4a16 is the target
    assert "int8/ngram+w4a16-kauto" in skipped["int8"]
    assert "target's own cost" in skipped["w4a16"]["w4a16/ngram+w4a16-kauto"]
    assert not any(c.name.startswith(("int8/ngram", "w4a16/ngram")) for c in configs)
    validate_configs(configs)  # each speculative one has its own target's plain


def options(**kw: Any) -> BenchOptions:
    return BenchOptions(**{"targets": "fp32,bf16", "model": "/nowhere/model-folder", **kw})


def planned(given: BenchOptions) -> tuple[Any, ...]:
    given.check()
    return plan_targets(given, [1], parse_configs(given.configs or DEFAULT_TARGET_CONFIGS,
                                                  "fp32"))


def test_plan_accepts_the_parsers_own_defaults() -> None:
    """`bench --targets` as a user types it: the parser's defaults (--precision auto) are not
    mistaken for a --precision given (a check against the old default fp32 refused every run)."""
    from specdecode.cli import build_parser
    from specdecode.cli.bench import options_of

    args = build_parser().parse_args(["bench", "--targets", "fp32,checkpoint",
                                      "--model", "/nowhere/model-folder"])
    configs, _, _ = planned(options_of(args))
    assert [c.target for c in configs][:4] == ["fp32", "fp32", "fp32", "checkpoint"]
    assert {c.precision for c in configs} == {"fp32", "checkpoint"}


def test_plan_refuses_what_cannot_be_a_targets_run() -> None:
    configs, _, no_reference = planned(options())
    assert [c.name for c in configs] == ["fp32/plain", "fp32/ngram-kauto",
                                         "fp32/ngram+w4a16-kauto", "bf16/plain",
                                         "bf16/ngram-kauto", "bf16/ngram+w4a16-kauto"]
    assert no_reference is not None and "not a GGUF" in no_reference  # so no peer measured
    for bad, message in (({"precision": "bf16"}, "leave --precision and --backend out"),
                         ({"precision": "fp32"}, "leave --precision and --backend out"),
                         ({"backend": "llama.cpp"}, "leave --precision and --backend out"),
                         ({"endpoints": ("http://x",)}, "use one or the other"),
                         ({"fidelity": "kl=-1"}, "--fidelity must be"),
                         ({"configs": "plain;llamacpp-generate"}, "leave llamacpp-generate"),
                         ({"targets": "w4a16", "configs": "plain;w4a16:k=3"},
                          "runs on none of the targets w4a16"),
                         ({"targets": "tf32"}, "unknown target")):
        with pytest.raises(SpecDecodeError, match=message):
            planned(options(**bad))


# ------------------------------------------------------------------- baselines and the points


def test_each_speculative_config_is_measured_against_its_own_targets_plain(
        measured: Analysis, monkeypatch: pytest.MonkeyPatch) -> None:
    bf16 = measured.summary("bf16/ngram-k4", 1)
    assert bf16 is not None and bf16.speedup is not None
    assert bf16.speedup.baseline == "bf16/plain" and 1.5 < bf16.speedup.total_ratio.estimate < 3
    assert measured.audit_passed("bf16/ngram-k4", 1) is True  # its own plain's tokens

    def any_target(spec: ConfigSpec, configs: Sequence[ConfigSpec]) -> ConfigSpec | None:
        """Broken: the baseline of the run's first target, whatever the config's target."""
        return next((c for c in configs if c.is_plain and c.batch_size == spec.batch_size
                     and c.temperature == spec.temperature), None)

    monkeypatch.setattr(analysis_mod, "find_baseline", any_target)
    broken = analyze(measured.results, n_resamples=100).summary("bf16/ngram-k4", 1)
    assert broken is not None and broken.speedup is not None
    assert broken.speedup.baseline == "fp32/plain" and broken.speedup.total_ratio.estimate > 4


def test_target_points_measure_speed_against_the_reference_and_fidelity(
        measured: Analysis) -> None:
    points = {p.target: p for p in frontier.target_points(measured)}
    assert list(points) == TARGETS
    fp32, bf16, w4a16 = points["fp32"], points["bf16"], points["w4a16"]
    assert [p.best.spec.name for p in (fp32, bf16, w4a16)] == [
        "fp32/ngram-k4", "bf16/ngram-k4", "w4a16/ngram-k4"]
    # the reference is llama-cpp-python at 9 ms a token: w4a16 plain 7.5 ms, fp32 plain 30 ms
    assert w4a16.plain_vs_reference is not None and fp32.plain_vs_reference is not None
    assert 1.1 < w4a16.plain_vs_reference.estimate < 1.3
    assert 0.25 < fp32.plain_vs_reference.estimate < 0.35
    assert w4a16.vs_reference is not None and w4a16.speedup is not None
    assert w4a16.vs_reference.estimate == pytest.approx(
        w4a16.plain_vs_reference.estimate * w4a16.speedup.estimate, rel=0.05)
    # after the first token: the same decoding (prefill 30 ms on every side of the fake) is
    # compared without it, so the ratio is further from 1
    assert w4a16.decode_vs_reference is not None
    assert w4a16.decode_vs_reference.estimate > w4a16.vs_reference.estimate > 1
    # fidelity: as recorded at load, and this run's outputs against fp32 plain's (12 prompts,
    # two of them two-turn: 14 requests)
    assert bf16.fidelity == frontier.Fidelity(0.99, 0.002, 0.008, 290)
    assert fp32.same_output == (14, 14) and bf16.same_output == (13, 14)
    assert w4a16.same_output == (11, 14)
    assert all(p.on_frontier for p in points.values())  # each faster and less faithful


def test_without_a_reference_the_ratios_are_absent_not_invented() -> None:
    points = frontier.target_points(run(peer=False))
    assert points and all(p.vs_reference is None and p.plain_vs_reference is None
                          for p in points)
    assert all(math.isfinite(p.tok_s) for p in points)


# ------------------------------------------------------------------------------ the frontier


@dataclasses.dataclass
class Speed:
    """What a TargetPoint reads of a ConfigSummary in the frontier: its tokens/s."""

    throughput_tok_s: float


def point(target: str, top1: float, kl: float, tok_s: float) -> frontier.TargetPoint:
    summary: Any = Speed(tok_s)
    return frontier.TargetPoint(target, 1, summary, summary,
                                frontier.Fidelity(top1, kl, kl, 100))


def frontier_of(points: list[frontier.TargetPoint]) -> set[str]:
    frontier.mark_frontier(points)
    return {p.target for p in points if p.on_frontier}


def hand_made() -> list[frontier.TargetPoint]:
    # a: fast; b: as good by top-1, better by KL, a little slower; c: worse and slower than a;
    # d: agreement not measured
    return [point("a", 0.99, 0.010, 200), point("b", 0.99, 0.002, 190),
            point("c", 0.95, 0.050, 150), point("fp32", 1.0, 0.0, 60),
            dataclasses.replace(point("d", 1, 0, 999), fidelity=None)]


def test_the_frontier_is_the_points_nothing_beats_on_fidelity_and_speed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert frontier_of(hand_made()) == {"a", "b", "fp32"}

    def by_top1_only(a: frontier.TargetPoint, b: frontier.TargetPoint) -> bool:
        """Broken: fidelity read as top-1 alone (b's lower KL is not a reason to keep it)."""
        if a.fidelity is None or b.fidelity is None:
            return False
        return a.fidelity.top1 >= b.fidelity.top1 and a.tok_s > b.tok_s

    monkeypatch.setattr(frontier, "dominates", by_top1_only)
    assert frontier_of(hand_made()) == {"a", "fp32"}  # b lost: the test above would fail

    monkeypatch.setattr(frontier, "dominates", lambda a, b: False)  # broken: keeps everything
    assert "c" in frontier_of(hand_made())


# -------------------------------------------------------------------------- the recommendation


def test_fidelity_rules_parse_and_bad_ones_are_named() -> None:
    assert frontier.parse_fidelity(None) == frontier.FidelityRule("any")
    assert frontier.parse_fidelity("FP32") == frontier.FidelityRule("fp32")
    assert frontier.parse_fidelity("kl=0.01") == frontier.FidelityRule("kl", 0.01)
    assert frontier.parse_fidelity("top1=0.98").text == "top1=0.98"
    for bad in ("kl", "kl=x", "kl=-0.1", "top1=1.5", "top1=98", "bf16", "kl=nan"):
        with pytest.raises(SpecDecodeError, match="--fidelity must be"):
            frontier.parse_fidelity(bad)


@pytest.mark.parametrize(("fidelity", "expected"), [
    ("any", "w4a16/ngram-k4"), ("fp32", "fp32/ngram-k4"), ("kl=0.01", "bf16/ngram-k4"),
    ("top1=0.95", "bf16/ngram-k4"), ("kl=0.0001", "fp32/ngram-k4"), ("top1=0.9", "w4a16/ngram-k4"),
])
def test_the_fastest_lossless_config_the_fidelity_admits_is_recommended(
        measured: Analysis, fidelity: str, expected: str) -> None:
    details = measured.results.header.runner["details"]
    details["fidelity"] = fidelity  # type: ignore[index]
    try:
        rec = recommend(measured)
    finally:
        details["fidelity"] = "any"  # type: ignore[index]
    assert rec.enable and rec.config == expected and rec.fidelity == fidelity
    assert rec.target == expected.split("/")[0] and rec.drafter == "ngram" and rec.k == 4
    text = rec.render()
    head = text.splitlines()[0]
    assert head.startswith("Fastest lossless configuration for ") and expected in head
    assert "llama.cpp's plain decoding" in head and "top-1 agreement with fp32" in head
    assert "speed-fidelity frontier at batch size 1" in text
    assert rec.vllm_config == {"method": "ngram", "num_speculative_tokens": 4,
                               "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_the_rule_given_now_wins_over_the_runs_and_the_harness_passes_it(
        measured: Analysis, tmp_path: Any) -> None:
    """--fidelity on a resumed run (or a re-analysis) applies: the header keeps the rule the run
    started with, the rule given now is the one the recommendation and the report follow."""
    assert recommend(measured).config == "w4a16/ngram-k4"  # the run's own rule: any
    assert recommend(measured, "fp32").config == "fp32/ngram-k4"
    runner = FakeTargetsRunner(STEPS, AGREEMENT, DIVERGE)  # started under "any"
    prompts = make_prompts(8)
    outcome = run_bench(runner, workload_of(prompts), grid(),
                        RunOptions(tmp_path / "run", n_resamples=200, progress=False,
                                     fidelity="kl=0.01"), out=io.StringIO())
    assert outcome.recommendation.config == "bf16/ngram-k4"
    html = outcome.report_html.read_text(encoding="utf-8")
    assert "keeps to mean KL from fp32 at most 0.01 nats" in html


def test_a_faster_config_that_is_not_lossless_is_never_recommended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    analysis = run(corrupt=frozenset({"w4a16/ngram-k4"}))
    assert analysis.audit_passed("w4a16/ngram-k4", 1) is False
    rec = recommend(analysis)
    assert rec.config == "bf16/ngram-k4"  # w4a16's fastest lossless is its plain: slower
    w4a16 = next(p for p in frontier.target_points(analysis) if p.target == "w4a16")
    assert w4a16.best is w4a16.plain

    def fastest(analysis: Analysis, plain: ConfigSummary,
                candidates: Sequence[ConfigSummary]) -> ConfigSummary:
        """Broken: the fastest configuration, lossless or not."""
        return max([plain, *candidates], key=lambda s: s.throughput_tok_s)

    monkeypatch.setattr(frontier, "fastest_lossless", fastest)
    assert recommend(analysis).config == "w4a16/ngram-k4"


def test_a_tie_within_the_noise_is_said_and_nothing_admitted_is_said() -> None:
    runner = FakeTargetsRunner({"fp32": 0.010, "bf16": 0.010}, {"fp32": (1.0, 0.0),
                                                                 "bf16": (0.99, 0.002)})
    configs, _ = target_configs(["fp32", "bf16"], [plain()], [1], peer=True)
    analysis = analyze(measure(runner, configs), n_resamples=300)
    rec = recommend(analysis)
    assert not rec.enable and rec.config in ("fp32/plain", "bf16/plain")
    assert any("within the noise, a tie" in n for n in rec.notes)
    runner.fidelity = "top1=0.999"
    strict = recommend(analyze(measure(runner, configs), n_resamples=100))
    assert strict.config == "fp32/plain"
    runner.agreement = {"fp32": (0.5, 0.1), "bf16": (0.5, 0.1)}  # fp32 itself not measured
    none = recommend(analyze(measure(runner, configs), n_resamples=100))
    assert not none.enable and none.config is None
    assert none.render().startswith("No target measured at batch size 1 meets the fidelity")


def test_refused_configs_are_in_the_notes() -> None:
    runner = FakeTargetsRunner(STEPS, AGREEMENT, refused={
        "w4a16": {"w4a16/ngram+w4a16-kauto": "drafting at the target's own cost"}})
    rec = recommend(analyze(measure(runner, grid()), n_resamples=100))
    assert any(n == "w4a16/ngram+w4a16-kauto was not measured: drafting at the target's own "
               "cost" for n in rec.notes)
    assert speculation_text({}, []) == "allowed"
    assert speculation_text({"a/x": "why"}, []) == "refused (why: below)"


# ------------------------------------------------------------------------------ the report


def test_the_report_shows_each_targets_speed_beside_its_fidelity(measured: Analysis) -> None:
    html = render_html(measured, recommend(measured))
    section = html[html.index('id="targets"'):html.index('id="summary"')]
    for text in ("top-1 agreement with fp32", "mean KL from fp32 (nats)", "99.00%", "93.00%",
                 "13 / 14", "11 / 14", "vs llama.cpp plain (CI)", "after the first token (CI)",
                 "llama-cpp-python/<wbr>generate (reference)", "w4a16 \u2605", "no AVX512_BF16",
                 'aria-label="Speed against fidelity, batch size 1"'):
        assert text in section, text
    figure = section[section.index("<svg"):section.index("</svg>")]
    assert figure.count('class="data"') >= 3 * 2  # three targets' segments and their points
    assert "speed-fidelity frontier (fastest lossless)" in figure
    assert "fp32/<wbr>ngram-k4" in html  # a target's config name may break after its target
    summary = render_summary(measured, recommend(measured))
    assert "Fastest lossless configuration for any target" in summary


def test_a_run_of_one_target_has_no_targets_section() -> None:
    from tests.fakes import FakeRunner

    runner = FakeRunner()
    prompts = make_prompts(6)
    configs = [plain(), ngram()]
    results = Results(header=make_header(runner.describe(), workload_of(prompts), configs, 0))
    for c in configs:
        for p in prompts:
            for s in runner.run([p], c):
                results.add(s)
    analysis = analyze(results, n_resamples=100)
    assert not frontier.is_targets_run(analysis)
    assert 'id="targets"' not in render_html(analysis, recommend(analysis))
    assert recommend(analysis).target is None


# ------------------------------------------------------------------------------ the runner


class Inner:
    """An InProcessRunner stand-in: records what it ran, one named cost curve per drafter."""

    def __init__(self, name: str) -> None:
        self.name, self.ran = name, []  # type: ignore[var-annotated]

    def describe(self) -> dict[str, Any]:
        return {"runner": "in-process", "precision": self.name, "details": {"exactness": "x"}}

    def run(self, prompts: Any, config: ConfigSpec) -> list[Any]:
        self.ran.append(config.name)
        return []

    def cost_curves(self, configs: Sequence[ConfigSpec]) -> list[CostCurve]:
        return [CostCurve(drafter="ngram", batch_size=1, k=[1], c=[0.01], v=[1.1],
                          target_step_s=0.01)] if configs else []


def test_the_runner_sends_each_config_to_its_target_and_names_curves_per_config() -> None:
    inner = {t: Inner(t) for t in ("fp32", "bf16", "llama.cpp")}
    runner = TargetsRunner({t: LoadedTarget(t, r, {"measured": t != "llama.cpp"})
                            for t, r in inner.items()}, "kl=0.01", None)
    configs = grid(peer=True)[:4] + [c for c in grid() if c.name == PEER_NAME]
    for c in configs:
        runner.run([], c)
    assert inner["fp32"].ran == ["fp32/plain", "fp32/ngram-k4"]
    assert inner["bf16"].ran == ["bf16/plain", "bf16/ngram-k4"]
    assert inner["llama.cpp"].ran == [PEER_NAME]
    curves = runner.cost_curves(configs)
    assert sorted(c.config for c in curves) == ["bf16/ngram-k4", "fp32/ngram-k4"]
    described = runner.describe()
    assert described["precision"] == "fp32,bf16"  # llama.cpp only ran the reference
    details = described["details"]
    assert details["fidelity"] == "kl=0.01" and set(details["targets"]) == set(inner)
    assert "exactness" not in details
    with pytest.raises(SpecDecodeError, match="no target 'w4a16'"):
        runner.run([], dataclasses.replace(configs[0], target="w4a16"))


class SharedBuffer:
    """A runner returning its logits as a view of one buffer its next call overwrites (as the
    llama.cpp backend returns llama.cpp's output buffer)."""

    def __init__(self) -> None:
        self.buffer = torch.zeros(1, 4, 5)

    def new_cache(self, batch: int, capacity: int) -> None:
        return None

    def __call__(self, tokens: torch.Tensor, cache: None) -> torch.Tensor:
        n = tokens.shape[1]
        self.buffer[0, :n] = tokens[0, :, None].float()
        return self.buffer[:, :n]


def test_agreement_copies_each_blocks_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    logits = teacher_forced_logits(SharedBuffer(), ids, chunk=4)
    assert logits[:, 0].tolist() == [float(i) for i in ids]

    def no_copy(model: Any, ids: Sequence[int], chunk: int) -> torch.Tensor:
        """Broken: the views kept as returned."""
        return torch.cat([model(torch.tensor([list(ids[i:i + chunk])]), None)[0]
                          for i in range(0, len(ids), chunk)])

    assert no_copy(SharedBuffer(), ids, 4)[:, 0].tolist() == [5.0, 6, 7, 8, 5, 6, 7, 8]
