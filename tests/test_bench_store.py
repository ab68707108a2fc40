"""The results file: durable appends, crash tolerance, resume, refusals, report.json."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path

import pytest

from specdecode.bench.harness import RunOptions, make_header, run_bench, schedule
from specdecode.bench.records import (
    SCHEMA_VERSION,
    AuditVerdict,
    ConfigSpec,
    CostCurve,
    MemoryRecord,
    RequestSample,
    RunHeader,
)
from specdecode.bench.store import (
    RESULTS_FILE,
    build_report,
    check_writable,
    load_report,
    open_store,
    preflight,
    read_results,
    results_from_report,
)
from specdecode.errors import SpecDecodeError
from specdecode.files import atomic_write_text
from tests.fakes import FakeRunner, make_prompts, ngram, plain, workload_of

CONFIGS = [plain(), ngram()]


def header(weight_hash: str = "a" * 64, n_prompts: int = 4) -> RunHeader:
    runner = FakeRunner(weight_hash=weight_hash)
    return make_header(runner.describe(), workload_of(make_prompts(n_prompts)), CONFIGS, 0)


def samples(n_prompts: int = 4) -> list[RequestSample]:
    runner = FakeRunner()
    prompts = make_prompts(n_prompts)
    return [s for c in CONFIGS for p in prompts for s in runner.run([p], c)]


def test_records_round_trip_through_the_file(tmp_path: Path) -> None:
    extra = [CostCurve("ngram", 1, [1, 2], [0.05, 0.05], [1.0, 1.1], 0.01),
             MemoryRecord("plain", 1, 10, 0, 5, 0, 99),
             AuditVerdict("ngram-k4", True, "greedy-token-identity", 4, 0, batch_size=1)]
    with open_store(tmp_path, header()) as store:
        for record in [*samples(), *extra]:
            store.append(record)
    results = read_results(tmp_path / RESULTS_FILE)
    assert results.header == header().__class__.from_dict(results.header.to_dict())
    assert results.samples == samples()
    assert (results.cost_curves, results.memory, results.audits) == ([extra[0]], [extra[1]],
                                                                     [extra[2]])
    assert not results.truncated_tail


def test_each_line_is_on_disk_before_append_returns(tmp_path: Path) -> None:
    with open_store(tmp_path, header()) as store:
        store.append(samples()[0])
        # read through a separate handle while the store is still open
        lines = (tmp_path / RESULTS_FILE).read_bytes().splitlines()
        assert len(lines) == 2 and json.loads(lines[1])["kind"] == "sample"


def test_every_append_is_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    with open_store(tmp_path, header()) as store:
        for s in samples()[:3]:
            store.append(s)
    assert len(synced) == 1 + 3  # the header, then each record


def crash_mid_write(tmp_path: Path, n_complete: int) -> Path:
    """A results file with n_complete samples and a last sample cut in half."""
    with open_store(tmp_path, header()) as store:
        for s in samples()[:n_complete + 1]:
            store.append(s)
    path = tmp_path / RESULTS_FILE
    data = path.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last + (len(data) - last) // 2])
    return path


def test_truncated_last_line_is_tolerated(tmp_path: Path) -> None:
    path = crash_mid_write(tmp_path, n_complete=3)
    results = read_results(path)
    assert results.truncated_tail
    assert results.samples == samples()[:3]
    assert results.done_units() == {s.unit for s in samples()[:3]}


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = crash_mid_write(tmp_path, n_complete=3)
    lines = path.read_bytes().split(b"\n")
    lines[2] = b'{"kind": "sample", "data": '
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(SpecDecodeError, match=r"results\.jsonl:3"):
        read_results(path)


def test_resume_after_crash_appends_cleanly(tmp_path: Path) -> None:
    crash_mid_write(tmp_path, n_complete=3)
    with open_store(tmp_path, header(), resume=True) as store:
        assert store.done_units() == {s.unit for s in samples()[:3]}
        for s in samples()[3:]:
            store.append(s)
    results = read_results(tmp_path / RESULTS_FILE)
    assert results.samples == samples() and not results.truncated_tail


def test_resume_refuses_a_different_model_or_workload(tmp_path: Path) -> None:
    with open_store(tmp_path, header()) as store:
        store.append(samples()[0])
    with pytest.raises(SpecDecodeError, match="model"):
        open_store(tmp_path, header(weight_hash="b" * 64), resume=True)
    with pytest.raises(SpecDecodeError, match="workload"):
        open_store(tmp_path, header(n_prompts=5), resume=True)
    open_store(tmp_path, header(), resume=True).close()


def test_existing_results_without_resume_are_not_overwritten(tmp_path: Path) -> None:
    open_store(tmp_path, header()).close()
    with pytest.raises(SpecDecodeError, match="--resume"):
        open_store(tmp_path, header())
    with pytest.raises(SpecDecodeError, match="--resume"):
        preflight(tmp_path, resume=False)
    assert preflight(tmp_path, resume=True) == tmp_path


def test_unwritable_output_folder_is_refused_up_front(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x", encoding="utf-8")
    with pytest.raises(SpecDecodeError, match="not writable"):
        check_writable(blocker / "out")
    runner = FakeRunner()
    with pytest.raises(SpecDecodeError, match="not writable"):
        run_bench(runner, workload_of(make_prompts(2)), CONFIGS,
                  RunOptions(blocker / "out", progress=False), out=io.StringIO())
    assert runner.calls == []  # nothing was measured


def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    data = header().to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(SpecDecodeError, match="schema version"):
        RunHeader.from_dict(data)


def test_report_json_keeps_every_raw_sample(tmp_path: Path) -> None:
    with open_store(tmp_path, header()) as store:
        for s in samples():
            store.append(s)
    results = read_results(tmp_path / RESULTS_FILE)
    report = build_report(results, {"analysis": {"x": 1}})
    path = tmp_path / "report.json"
    atomic_write_text(path, json.dumps(report))
    assert results_from_report(json.loads(path.read_text())).samples == samples()
    assert load_report(path).samples == load_report(tmp_path / RESULTS_FILE).samples
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)


def test_interrupted_run_then_resume_measures_each_unit_once(tmp_path: Path) -> None:
    prompts = make_prompts(6)
    configs = [plain(), ngram(), plain(2), ngram(2)]
    devnull = io.StringIO()
    first = FakeRunner(interrupt_after=4 + 5)  # 4 warm-up calls, then 5 measured batches
    with pytest.raises(KeyboardInterrupt):
        run_bench(first, workload_of(prompts), configs,
                  RunOptions(tmp_path, progress=False, n_resamples=200), out=devnull)
    saved = read_results(tmp_path / RESULTS_FILE).samples
    assert 0 < len(saved) < len(prompts) * 4
    second = FakeRunner()
    outcome = run_bench(second, workload_of(prompts), configs,
                        RunOptions(tmp_path, resume=True, progress=False, n_resamples=200),
                        out=devnull)
    units = [s.unit for s in read_results(tmp_path / RESULTS_FILE).samples]
    n_units = sum(len(p.turns) for p in prompts) * len(configs)
    assert len(units) == len(set(units)) == n_units
    assert outcome.resumed == len(saved) and outcome.measured == n_units - len(saved)
    measured_batches = [c for c in second.calls if not c[2][0].startswith("warmup-")]
    assert len(measured_batches) == len(schedule(prompts, configs)) - 5  # done ones skipped
    assert outcome.report_json.exists() and outcome.report_html.exists()


def test_resume_refuses_changed_configurations(tmp_path: Path) -> None:
    open_store(tmp_path, header()).close()
    other = dataclasses.replace(header(), configs=[plain(), ConfigSpec("x", "ngram", 2)])
    with pytest.raises(SpecDecodeError, match="configurations"):
        open_store(tmp_path, other, resume=True)


def test_resume_writes_only_the_missing_units_of_a_partly_written_batch(tmp_path: Path) -> None:
    prompts = make_prompts(4, multi_turn_every=99)
    configs = [plain(2), ngram(2)]
    opts = RunOptions(tmp_path, progress=False, n_resamples=100)
    run_bench(FakeRunner(), workload_of(prompts), configs, opts, out=io.StringIO())
    path = tmp_path / RESULTS_FILE
    lines = path.read_bytes().splitlines(keepends=True)
    last_sample = max(i for i, line in enumerate(lines) if b'"kind": "sample"' in line)
    path.write_bytes(b"".join(lines[:last_sample]))  # crashed mid-way through the last batch
    for name in ("report.json", "report.html"):
        (tmp_path / name).unlink()
    runner = FakeRunner()
    resumed = dataclasses.replace(opts, resume=True)
    outcome = run_bench(runner, workload_of(prompts), configs, resumed, out=io.StringIO())
    assert [c for c in runner.calls if not c[2][0].startswith("warmup")] == [runner.calls[-1]]
    assert outcome.measured == 1
    units = [s.unit for s in read_results(path).samples]
    assert len(units) == len(set(units)) == 8


def test_samples_stored_before_arrivals_existed_still_read(tmp_path: Path) -> None:
    run_bench(FakeRunner(), workload_of(make_prompts(3)), CONFIGS,
              RunOptions(tmp_path, progress=False, n_resamples=50), out=io.StringIO())
    path = tmp_path / RESULTS_FILE
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = json.loads(raw)
        if line["kind"] == "sample":  # as written before the arrival fields
            assert line["data"]["arrival"] >= 0 and line["data"]["repeat_group"] == ""
            for key in ("arrival", "repeat_group", "repeat_index"):
                del line["data"][key]
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    samples = read_results(path).samples
    assert samples and all((s.arrival, s.repeat_group, s.repeat_index) == (-1, "", 0)
                           for s in samples)


def test_an_interrupted_repetitive_run_resumes_with_its_order(tmp_path: Path) -> None:
    from specdecode.bench.workloads import load_repetitive_workload

    workload = load_repetitive_workload(categories=["rag"])
    opts = RunOptions(tmp_path, progress=False, n_resamples=50)
    with pytest.raises(KeyboardInterrupt):
        run_bench(FakeRunner(interrupt_after=2 + 7), workload, CONFIGS, opts, out=io.StringIO())
    with pytest.raises(SpecDecodeError, match="workload fingerprint"):  # another seed's order
        run_bench(FakeRunner(), load_repetitive_workload(categories=["rag"], seed=1), CONFIGS,
                  dataclasses.replace(opts, resume=True), out=io.StringIO())
    outcome = run_bench(FakeRunner(), load_repetitive_workload(categories=["rag"]), CONFIGS,
                        dataclasses.replace(opts, resume=True), out=io.StringIO())
    samples = read_results(tmp_path / RESULTS_FILE).samples
    order = [p.id for p in workload.prompts]
    assert len(samples) == 2 * 9 and outcome.resumed > 0
    assert all(s.arrival == order.index(s.prompt_id) for s in samples)
    warm = outcome.analysis.summary("ngram-k4", 1).warmup
    assert warm is not None and (warm.first.n_requests, warm.repeats.n_requests) == (3, 6)
