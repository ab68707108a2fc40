"""The bench notices a disturbed machine (issue 26, item 9): the CPU counters around each
measured batch are stored on its samples, and configurations measured while other work took
cores are flagged in the summary, the recommendation, report.json and the HTML report, with
how to re-measure them; --resume re-measures exactly those requests."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from specdecode.bench import interference
from specdecode.bench.harness import RunOptions, run_bench
from specdecode.bench.interference import (
    CpuTimes,
    LoadReading,
    assess,
    between,
    is_disturbed,
    parse_proc_stat,
    read_cpu_times,
)
from specdecode.bench.records import AuditVerdict, ConfigSpec, RequestSample, RunHeader
from specdecode.bench.runner import RunnerDescription
from specdecode.bench.store import RESULTS_FILE, read_results
from specdecode.bench.workloads import Prompt
from tests.fakes import FakeRunner, make_prompts, ngram, plain, workload_of

PROC_STAT = """cpu  400 0 100 900 0 0 0 50 0 0
cpu0 100 0 50 450 0 0 0 10 0 0
cpu1 300 0 50 450 0 0 0 40 0 0
cpu2 7000 0 0 0 0 0 0 0 0 0
intr 1 2 3
"""


def test_proc_stat_is_summed_over_the_cpus_this_process_may_use() -> None:
    assert parse_proc_stat(PROC_STAT, {0, 1}) == (500, 50, 2)
    assert parse_proc_stat(PROC_STAT, {1}) == (350, 40, 1)
    assert parse_proc_stat(PROC_STAT, None) == (7500, 50, 3)  # the aggregate line is skipped
    assert parse_proc_stat("intr 1 2\n", None) is None


def test_a_reading_subtracts_this_process_from_the_busy_cpus() -> None:
    before = CpuTimes(at=10.0, busy_s=100.0, steal_s=5.0, own_s=20.0, load1=0.1, cores=2)
    after = CpuTimes(at=12.0, busy_s=104.0, steal_s=5.4, own_s=23.0, load1=1.5, cores=2)
    reading = between(before, after)
    assert reading is not None
    assert reading.wall_s == pytest.approx(2.0)
    assert reading.own_cores == pytest.approx(1.5)
    assert reading.other_cores == pytest.approx(0.5)  # 4 busy CPU seconds, 3 of them ours
    assert reading.steal_cores == pytest.approx(0.2)
    assert reading.taken_cores == pytest.approx(0.7)
    assert between(None, after) is None and between(after, before) is None
    assert LoadReading.from_dict(reading.to_dict()) == reading
    assert LoadReading.from_dict({}) is None


# ---------------------------------------------------------------- a machine with scripted load


@dataclass
class ScriptedMachine:
    """CPU counters that advance only when the runner measures: each batch takes `wall_s`,
    uses `own_cores` of this process and `other_cores` of other processes (per config)."""

    other_cores: dict[str, float] = field(default_factory=dict)
    wall_s: float = 1.0
    own_cores: float = 1.8
    background: float = 0.05  # a quiet machine's kernel threads and shells
    at: float = 0.0
    busy: float = 0.0
    own: float = 0.0

    def batch(self, config: str) -> None:
        self.at += self.wall_s
        self.own += self.own_cores * self.wall_s
        self.busy += (self.own_cores + self.other_cores.get(config, self.background)) * self.wall_s

    def probe(self) -> CpuTimes:
        return CpuTimes(at=self.at, busy_s=self.busy, steal_s=0.0, own_s=self.own, load1=0.3,
                        cores=2)


@dataclass
class MachineRunner(FakeRunner):
    machine: ScriptedMachine = field(default_factory=ScriptedMachine)

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        self.machine.batch(config.name)
        return super().run(prompts, config)

    def audit(self, config: ConfigSpec) -> list[AuditVerdict]:
        return [AuditVerdict(config.name, True, "distribution-test", 100, 0, p_value=0.5)]


def bench(tmp_path: Path, runner: MachineRunner, resume: bool = False,
          prompts: int = 4) -> tuple[str, dict[str, Any], str]:
    out = io.StringIO()
    options = RunOptions(tmp_path / "out", resume=resume, progress=False, n_resamples=200,
                           load_probe=runner.machine.probe)
    outcome = run_bench(runner, workload_of(make_prompts(prompts, multi_turn_every=99)),
                        [plain(), ngram()], options, out=out)
    report = json.loads(outcome.report_json.read_text())
    return out.getvalue(), report, outcome.report_html.read_text()


def test_a_configuration_measured_under_load_is_flagged_everywhere(tmp_path: Path) -> None:
    runner = MachineRunner(machine=ScriptedMachine(other_cores={"ngram-k4": 1.2}))
    summary, report, html = bench(tmp_path, runner)
    assert "MEASURED UNDER INTERFERENCE" in summary
    assert "ngram-k4 at batch size 1: 4 of 4 requests measured while other processes" in summary
    assert "INTERFERENCE: 4 of 4 requests" in summary
    assert f"--resume --out {tmp_path / 'out'}" in summary and "--threads 1" in summary
    rec = report["recommendation"]
    assert len(rec["warnings"]) == 1 and "ngram-k4" in rec["warnings"][0]
    assert "Warning: measured under interference" in summary
    loads = {c["config"]: c for c in report["load"]["configs"]}
    assert loads["ngram-k4"]["disturbed"] and not loads["plain"]["disturbed"]
    assert loads["ngram-k4"]["mean_taken_cores"] == pytest.approx(1.2)
    assert all(s["load"]["other_cores"] > 0 for s in report["samples"])
    assert "Measured under interference" in html and "disturbed (4 of 4)" in html
    assert "Warning: measured under interference" in html


def test_a_quiet_machine_raises_no_flag(tmp_path: Path) -> None:
    summary, report, html = bench(tmp_path, MachineRunner())
    assert "no configuration was measured under interference" in summary
    assert "INTERFERENCE" not in summary and "Warning" not in summary
    assert report["recommendation"]["warnings"] == []
    assert not any(c["disturbed"] for c in report["load"]["configs"])
    assert "No configuration was measured under interference" in html
    assert "disturbed (" not in html


def test_load_on_cores_the_run_leaves_free_is_no_interference(tmp_path: Path) -> None:
    header = run_header_with_threads(tmp_path, threads=1)
    sample = dataclasses.replace(_any_sample(), load=LoadReading(
        wall_s=1.0, other_cores=1.2, steal_cores=0.0, own_cores=1.0, load1=2.0,
        cores=2).to_dict())
    assert not is_disturbed(sample, header)  # one thread on two cores: the other core is free
    two = dataclasses.replace(header, hardware=dataclasses.replace(header.hardware,
                                                                   torch_threads=2))
    assert is_disturbed(sample, two)


def test_short_batches_and_http_runs_are_not_judged(tmp_path: Path) -> None:
    header = run_header_with_threads(tmp_path, threads=2)
    loaded = LoadReading(wall_s=1.0, other_cores=1.5, steal_cores=0.0, own_cores=0.5,
                         load1=2.0, cores=2)
    sample = dataclasses.replace(_any_sample(), load=loaded.to_dict())
    assert is_disturbed(sample, header)
    short = dataclasses.replace(sample, load=dataclasses.replace(loaded, wall_s=0.05).to_dict())
    assert not is_disturbed(short, header)
    http = dataclasses.replace(header, runner={"runner": "http"})
    assert not is_disturbed(sample, http)
    assert not assess(http, [sample]).flagged


def test_resume_remeasures_only_the_disturbed_requests(tmp_path: Path) -> None:
    noisy = MachineRunner(machine=ScriptedMachine(other_cores={"ngram-k4": 1.2}))
    bench(tmp_path, noisy)
    quiet = MachineRunner()
    summary, report, _ = bench(tmp_path, quiet, resume=True)
    timed = [(name, ids) for name, _, ids in quiet.calls if not ids[0].startswith("warmup")]
    assert timed == [("ngram-k4", [f"p{i}"]) for i in range(4)]
    assert len(report["superseded"]) == 4 and len(report["samples"]) == 8
    assert "no configuration was measured under interference" in summary
    results = read_results(tmp_path / "out" / RESULTS_FILE)
    assert len(results.superseded) == 4 and not assess(results.header, results.samples).flagged


def test_results_written_before_load_was_recorded_still_load(tmp_path: Path) -> None:
    bench(tmp_path, MachineRunner(machine=ScriptedMachine(other_cores={"ngram-k4": 1.2})))
    path = tmp_path / "out" / RESULTS_FILE
    lines = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        record["data"].pop("load", None)
        lines.append(json.dumps(record))
    old = tmp_path / "old" / RESULTS_FILE
    old.parent.mkdir()
    old.write_text("\n".join(lines) + "\n")
    results = read_results(old)
    assert len(results.samples) == 8 and all(s.load == {} for s in results.samples)
    report = assess(results.header, results.samples)
    assert not report.recorded and not report.flagged
    assert results.done_units() == {s.unit for s in results.samples}


def run_header_with_threads(tmp_path: Path, threads: int) -> RunHeader:
    bench(tmp_path, MachineRunner())
    header = read_results(tmp_path / "out" / RESULTS_FILE).header
    hardware = dataclasses.replace(header.hardware, torch_threads=threads, cpu_cores=2)
    return dataclasses.replace(header, hardware=hardware, runner={"runner": "in-process"})


def _any_sample() -> RequestSample:
    return FakeRunner().run(make_prompts(1, multi_turn_every=99), plain())[0]


# ------------------------------------------------------------------- a real synthetic load


@contextmanager
def burner(processes: int) -> Iterator[None]:
    """Processes spinning on the CPU until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(processes)]
    try:
        time.sleep(0.3)  # let them start spinning
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(read_cpu_times() is None, reason="needs /proc/stat")
def test_a_real_cpu_burning_process_is_counted_as_other_work() -> None:
    cores = len(os.sched_getaffinity(0))
    with burner(cores):
        before = read_cpu_times()
        time.sleep(1.0)  # this process idles: every busy tick is someone else's
        reading = between(before, read_cpu_times())
    assert reading is not None
    assert reading.own_cores < 0.2
    assert reading.taken_cores > 0.8 * cores  # the burners alone keep (nearly) every core busy


@pytest.mark.skipif(read_cpu_times() is None, reason="needs /proc/stat")
def test_a_bench_run_beside_a_real_cpu_burner_is_flagged(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))

    class Spinning(FakeRunner):
        """Each batch spins this process for 0.6 s of wall time, as a real measurement
        would compute, with as many torch threads as cores (none left free)."""

        def describe(self) -> RunnerDescription:
            return {**super().describe(), "runner": "in-process", "torch_threads": cores}

        def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
            end = time.monotonic() + 0.6
            while time.monotonic() < end:
                pass
            return super().run(prompts, config)

    out = io.StringIO()
    with burner(cores + 1):  # more spinners than cores: they hold most of every core
        outcome = run_bench(Spinning(), workload_of(make_prompts(2, multi_turn_every=99)),
                            [plain(), ngram()], RunOptions(tmp_path / "out", progress=False,
                                                             n_resamples=100), out=out)
    load = assess(outcome.analysis.results.header, outcome.analysis.results.samples)
    assert {c.config for c in load.flagged} == {"plain", "ngram-k4"}
    assert "MEASURED UNDER INTERFERENCE" in out.getvalue()
    assert min(c.mean_taken_cores for c in load.configs) > interference.DISTURBED_CORES
