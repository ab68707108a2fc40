"""The harness loop: warm-up, interleaving with rotation, validation, outputs."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from specdecode.bench.harness import RunOptions, config_grid, make_header, run_bench, schedule
from specdecode.bench.records import AuditVerdict, ConfigSpec, RequestSample
from specdecode.bench.runner import RunnerDescription
from specdecode.bench.workloads import Prompt
from specdecode.errors import SpecDecodeError
from tests.fakes import FakeRunner, make_prompts, ngram, plain, workload_of


def options(tmp_path: Path, **kw: object) -> RunOptions:
    return RunOptions(tmp_path / "out", progress=False, n_resamples=200, **kw)  # type: ignore[arg-type]


def test_warm_up_then_configs_interleaved_and_rotated(tmp_path: Path) -> None:
    runner = FakeRunner()
    configs = [plain(), ngram(), ngram(k=2, name="ngram-k2")]
    prompts = make_prompts(3, multi_turn_every=99)
    run_bench(runner, workload_of(prompts), configs, options(tmp_path), out=io.StringIO())
    warm, timed = runner.calls[:3], runner.calls[3:]
    assert [c[0] for c in warm] == ["plain", "ngram-k4", "ngram-k2"]
    assert all(ids == ["warmup-p0"] for _, _, ids in warm)
    assert [(name, ids[0]) for name, _, ids in timed] == [
        ("plain", "p0"), ("ngram-k4", "p0"), ("ngram-k2", "p0"),
        ("ngram-k4", "p1"), ("ngram-k2", "p1"), ("plain", "p1"),
        ("ngram-k2", "p2"), ("plain", "p2"), ("ngram-k4", "p2"),
    ]


def test_warm_up_requests_are_short_single_turn_and_not_recorded(tmp_path: Path) -> None:
    seen: list[Prompt] = []

    class Spy(FakeRunner):
        def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
            seen.extend(prompts)
            return super().run(prompts, config)

    prompts = [Prompt(id="c", category="chat", turns=["a", "b"], max_tokens=40)]
    outcome = run_bench(Spy(), workload_of(prompts), [plain()], options(tmp_path),
                        out=io.StringIO())
    assert (seen[0].id, seen[0].turns, seen[0].max_tokens) == ("warmup-c", ["a"], 16)
    assert {s.prompt_id for s in outcome.analysis.results.samples} == {"c"}


def test_batches_group_prompts_and_samples_carry_the_group(tmp_path: Path) -> None:
    prompts = make_prompts(5, multi_turn_every=99)
    tasks = schedule(prompts, config_grid([plain(), ngram()], [2]))
    assert [(g, [p.id for p in ps], c.name) for g, ps, c in tasks] == [
        (0, ["p0", "p1"], "plain"), (0, ["p0", "p1"], "ngram-k4"),
        (1, ["p2", "p3"], "ngram-k4"), (1, ["p2", "p3"], "plain"),
        (2, ["p4"], "plain"), (2, ["p4"], "ngram-k4"),
    ]
    outcome = run_bench(FakeRunner(), workload_of(prompts), config_grid([plain(), ngram()], [2]),
                        options(tmp_path), out=io.StringIO())
    groups = {(s.config, s.prompt_id): s.group for s in outcome.analysis.results.samples}
    assert groups[("plain", "p3")] == 1 and groups[("ngram-k4", "p4")] == 2


def test_outputs_written_and_summary_printed(tmp_path: Path) -> None:
    class WithAudit(FakeRunner):
        def audit(self, config: ConfigSpec) -> list[AuditVerdict]:
            return [AuditVerdict(config.name, True, "distribution-test", 1000, 0, p_value=0.4)]

    out = io.StringIO()
    outcome = run_bench(WithAudit(), workload_of(make_prompts(5)), [plain(), ngram()],
                        options(tmp_path), out=out)
    report = json.loads(outcome.report_json.read_text())
    assert len(report["samples"]) == 2 * 6  # 5 prompts, one with two turns, two configs
    assert {"analysis", "recommendation", "header", "memory", "audits"} <= set(report)
    assert len(report["memory"]) == 2
    assert [a["method"] for a in report["audits"]] == ["distribution-test"]
    assert report["audits"][0]["batch_size"] == 1
    assert "<html" in outcome.report_html.read_text()
    printed = out.getvalue()
    assert "batch size 1:" in printed and "ngram-k4" in printed and "report:" in printed


def test_invalid_configuration_sets_are_refused(tmp_path: Path) -> None:
    w = workload_of(make_prompts(2))
    cases = [
        ([], "no configurations"),
        ([plain(), plain()], "twice"),
        ([ngram()], "no plain configuration"),
        ([plain(), ngram(batch=2)], "no plain configuration"),
        ([plain(), dataclasses.replace(ngram(), temperature=1.0)], "no plain configuration"),
        ([plain(), ConfigSpec("bad", drafter="ngram", k=-1)], "k must be"),
    ]
    for configs, message in cases:
        runner = FakeRunner()
        with pytest.raises(SpecDecodeError, match=message):
            run_bench(runner, w, configs, options(tmp_path), out=io.StringIO())
        assert runner.calls == []


def test_a_runner_returning_wrong_samples_is_stopped(tmp_path: Path) -> None:
    class Dropper(FakeRunner):
        def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
            return super().run(prompts, config)[:-1]

    class Liar(FakeRunner):
        def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
            return [dataclasses.replace(s, accepted=s.accepted + 1)
                    for s in super().run(prompts, config)]

    w = workload_of(make_prompts(2))
    with pytest.raises(SpecDecodeError, match="expected"):
        run_bench(Dropper(), w, [plain()], options(tmp_path, warmup=False), out=io.StringIO())
    with pytest.raises(SpecDecodeError, match="inconsistent"):
        run_bench(Liar(), w, [plain(), ngram()],
                  options(tmp_path / "2", warmup=False), out=io.StringIO())


def test_header_states_the_runners_hardware_when_it_is_remote(tmp_path: Path) -> None:
    class Remote(FakeRunner):
        def describe(self) -> RunnerDescription:
            return {**super().describe(), "hardware": {
                "cpu_model": "Server CPU", "cpu_cores": 64, "torch_threads": None,
                "accelerator": "1x H200", "platform": "Linux", "python": "3.12"}}

    local = make_header(FakeRunner().describe(), workload_of(make_prompts(1)), [plain()], 0)
    assert local.hardware.torch_threads == 2 and local.hardware.cpu_cores >= 1
    remote = make_header(Remote().describe(), workload_of(make_prompts(1)), [plain()], 0)
    assert (remote.hardware.cpu_model, remote.hardware.accelerator) == ("Server CPU", "1x H200")


def test_a_repeat_group_warms_up_on_a_text_of_its_own(tmp_path: Path) -> None:
    """A drafter that stores earlier requests must not see a measured prompt in the warm-up."""
    from specdecode.bench.harness import WARMUP_TEXT

    seen: list[list[str]] = []

    class Spy(FakeRunner):
        def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
            seen.extend(p.turns for p in prompts if p.id.startswith("warmup-"))
            return super().run(prompts, config)

    prompts = [Prompt("a", "rag", ["document A, question 1"], repeat_group="A"),
               Prompt("b", "qa", ["a question of its own"])]
    run_bench(Spy(), workload_of(prompts), [plain(2), ngram(2)], options(tmp_path),
              out=io.StringIO())
    assert seen == [[WARMUP_TEXT], ["a question of its own"]] * 2
