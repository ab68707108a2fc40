"""The benchmark loop: interleave configurations over the same prompts, write as you measure.

Order of work in `run_bench`:

1. check the output folder (before anything is measured) and the configurations (every
   speculative configuration needs a plain one at its batch size and temperature);
2. open the results file (new, or resumed: units already measured are skipped);
3. one untimed warm-up batch per configuration that still has work (short: 16 new tokens);
4. for each batch size, for each group of `batch_size` prompts: every configuration in turn,
   the order rotated by one per group so slow drift (thermal, background load) spreads evenly
   over configurations; the machine's CPU counters are read before and after each batch and the
   difference (`interference.LoadReading`) is stored on its samples, with each request's place
   in the workload's order and its repeat group (`workloads.arrivals`); each sample is written
   (fsync'd) as soon as it is returned;
5. cost curves, memory and audit verdicts from the runner (unless already stored);
6. report.json and report.html, assembled from the results file, and the terminal summary
   (both flag the configurations measured under interference, see `interference`).

With open-loop arrivals (`RunOptions.arrivals`: recorded or Poisson, bench.arrivals) steps
3-4 are bench.openloop's instead: windows of the schedule replayed by every configuration in
turn, each request started when it is due, each sample written as it ends.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from specdecode.bench.arrivals import Arrivals
from specdecode.bench.hardware import detect_hardware
from specdecode.bench.interference import Probe, assess, between, read_cpu_times
from specdecode.bench.openloop import REPLAY_WINDOW_S, measure_replay
from specdecode.bench.peers import is_peer
from specdecode.bench.records import (
    SCHEMA_VERSION,
    ConfigSpec,
    HardwareInfo,
    ModelInfo,
    RequestSample,
    RunHeader,
)
from specdecode.bench.requests import notes_for
from specdecode.bench.runner import Runner, RunnerDescription
from specdecode.bench.store import (
    REPORT_HTML,
    REPORT_JSON,
    ResultStore,
    UnitKey,
    build_report,
    open_store,
    preflight,
    read_results,
    write_report_json,
)
from specdecode.bench.workloads import (
    Prompt,
    Workload,
    arrivals,
    describe_workload,
    prompts_from_description,
)
from specdecode.errors import SpecDecodeError
from specdecode.report.analysis import DEFAULT_RESAMPLES, Analysis, analyze, find_baseline
from specdecode.report.html import write_html
from specdecode.report.recommend import Recommendation, recommend
from specdecode.report.summary import render_summary
from specdecode.report.traffic import Slo, html_context, traffic, traffic_lines
from specdecode.version import __version__

WARMUP_TOKENS = 16
# what a prompt with a repeat group warms up on instead of its own text (see warm_up)
WARMUP_TEXT = "Count from one to twenty in words."
Task = tuple[int, list[Prompt], ConfigSpec]  # (group index, prompts, config)


@dataclass
class RunOptions:
    """How to run: where to write, resume or not, seeds, bootstrap size, progress bar."""

    out_dir: Path
    resume: bool = False
    seed: int = 0
    n_resamples: int = DEFAULT_RESAMPLES
    progress: bool = True
    warmup: bool = True
    load_probe: Probe = read_cpu_times  # the CPU counters read around each measured batch
    fidelity: str | None = None  # several targets: the rule to recommend under (None: the run's)
    arrivals: Arrivals = field(default_factory=Arrivals)  # closed loop, or an open-loop replay
    replay_window_s: float = REPLAY_WINDOW_S  # open loop: seconds of arrivals per window
    slo: Slo | None = None  # --slo: the goodput's bounds (an analysis choice, like fidelity)


@dataclass
class BenchOutcome:
    """What a finished run produced."""

    results_path: Path
    report_json: Path
    report_html: Path
    analysis: Analysis
    recommendation: Recommendation
    summary: str
    measured: int  # samples written by this run
    resumed: int  # samples found already measured


def config_grid(configs: Sequence[ConfigSpec], batch_sizes: Sequence[int]) -> list[ConfigSpec]:
    """Every config at every batch size (the batch size of the inputs is replaced)."""
    return [dataclasses.replace(c, batch_size=b) for b in batch_sizes for c in configs]


def validate_configs(configs: Sequence[ConfigSpec]) -> None:
    """Unique (name, batch size), valid fields, and a plain baseline for each speculative one
    (a peer, llama-cpp-python's own decoding, may stand alone: `bench --targets` measures it
    beside targets it is not one of)."""
    if not configs:
        raise SpecDecodeError("no configurations to measure")
    seen: set[tuple[str, int]] = set()
    for c in configs:
        c.validate()
        if c.key in seen:
            raise SpecDecodeError(f"config {c.name} appears twice at batch size {c.batch_size}")
        seen.add(c.key)
        if not c.is_plain and not is_peer(c.drafter) and find_baseline(c, configs) is None:
            raise SpecDecodeError(
                f"config {c.name} at batch size {c.batch_size} has no plain configuration "
                "at the same batch size and temperature to measure its speedup against"
            )


def make_header(
    description: RunnerDescription, workload: Workload, configs: Sequence[ConfigSpec], seed: int
) -> RunHeader:
    """The run header from the runner's description, the hardware and the workload.

    The hardware is the runner's own description when it gives one (a remote server), else
    this machine's.
    """
    remote = description.get("hardware")
    return RunHeader(
        schema_version=SCHEMA_VERSION,
        specdecode_version=__version__,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        hardware=HardwareInfo.from_dict(remote) if remote else detect_hardware(
            description.get("torch_threads"), description.get("accelerator")),
        model=ModelInfo(
            name=description.get("model_name", "unknown"),
            precision=description.get("precision", "unknown"),
            weight_hash=description.get("weight_hash", "unknown"),
        ),
        workload=describe_workload(workload),
        configs=list(configs),
        runner=dict(description),
        seed=seed,
    )


def schedule(prompts: Sequence[Prompt], configs: Sequence[ConfigSpec]) -> list[Task]:
    """All (group, prompts, config) tasks: batch sizes ascending, configs rotated per group."""
    tasks: list[Task] = []
    for batch in sorted({c.batch_size for c in configs}):
        at_batch = [c for c in configs if c.batch_size == batch]
        for g, start in enumerate(range(0, len(prompts), batch)):
            group = list(prompts[start:start + batch])
            shift = g % len(at_batch)
            tasks += [(g, group, c) for c in at_batch[shift:] + at_batch[:shift]]
    return tasks


def task_units(task: Task) -> set[UnitKey]:
    """The units a task measures."""
    _, prompts, config = task
    return {(config.name, p.id, turn, config.batch_size)
            for p in prompts for turn in range(len(p.turns))}


def _check_samples(task: Task, samples: Sequence[RequestSample]) -> None:
    expected = task_units(task)
    got = [s.unit for s in samples]
    if sorted(got) != sorted(expected):
        raise SpecDecodeError(f"runner returned samples for {sorted(got)}, expected "
                              f"{sorted(expected)} (config {task[2].name})")
    for s in samples:
        problems = s.problems()
        if problems:
            raise SpecDecodeError(f"runner returned an inconsistent sample for {s.unit}: "
                                  + "; ".join(problems))


def warm_up(runner: Runner, tasks: Sequence[Task]) -> None:
    """One short untimed batch per configuration that has work left, on its first prompts; a
    prompt with a repeat group warms up on WARMUP_TEXT instead: a drafter that stores earlier
    requests (suffix) would otherwise start the run holding that prompt and the opening of its
    reply, and the report's first requests would not be cold."""
    warmed: set[tuple[str, int]] = set()
    for _, prompts, config in tasks:
        if config.key in warmed:
            continue
        warmed.add(config.key)
        short = [dataclasses.replace(p, id=f"warmup-{p.id}",
                                     turns=[WARMUP_TEXT] if p.repeat_group else p.turns[:1],
                                     max_tokens=WARMUP_TOKENS) for p in prompts]
        runner.run(short, config)


def measure(runner: Runner, store: ResultStore, tasks: Sequence[Task], progress: bool,
            probe: Probe = read_cpu_times) -> int:
    """Run the tasks, writing every new sample as it arrives, each with the machine's load
    over its batch and its place in the run (from the stored header's workload, the order the
    tasks follow); returns the count written."""
    placed = arrivals(prompts_from_description(store.results.header.workload))
    written = 0
    with tqdm(total=len(tasks), unit="batch", disable=not progress, file=sys.stderr) as bar:
        for task in tasks:
            group, prompts, config = task
            bar.set_postfix_str(f"{config.name} bs={config.batch_size}")
            started = time.time()
            before = probe()
            samples = runner.run(prompts, config)
            reading = between(before, probe())
            load = reading.to_dict() if reading is not None else {}
            _check_samples(task, samples)
            done = store.done_units()
            for s in samples:
                if s.unit not in done:
                    s = dataclasses.replace(s, group=group, load=load,
                                            started_at=s.started_at or started)
                    at = placed.get(s.prompt_id)
                    if at is not None:
                        s = dataclasses.replace(s, arrival=at.index, repeat_group=at.repeat_group,
                                                repeat_index=at.repeat_index)
                    store.append(s)
                    written += 1
            bar.update(1)
    return written


def collect_extras(runner: Runner, store: ResultStore, configs: Sequence[ConfigSpec]) -> None:
    """Store the runner's cost curves, memory records and audit verdicts not yet stored."""
    results = store.results
    if not results.cost_curves:
        for curve in runner.cost_curves(configs):
            store.append(curve)
    have_memory = {(m.config, m.batch_size) for m in results.memory}
    have_audit = {(a.config, a.batch_size) for a in results.audits}
    for config in configs:
        record = runner.memory(config) if config.key not in have_memory else None
        if record is not None:
            store.append(record)
        if config.key not in have_audit and not config.is_plain:
            for verdict in runner.audit(config):
                store.append(dataclasses.replace(verdict, batch_size=config.batch_size))


def finish(results_path: Path, options: RunOptions, measured: int, resumed: int
           ) -> BenchOutcome:
    """Analyze the results file and write report.json and report.html beside it."""
    results = read_results(results_path)
    analysis = analyze(results, n_resamples=options.n_resamples, seed=options.seed)
    rec = recommend(analysis, options.fidelity)
    report_json = results_path.parent / REPORT_JSON
    report_html = results_path.parent / REPORT_HTML
    load = assess(results.header, results.samples)
    flow = traffic(analysis, options.slo)  # open loop, or an SLO: report.traffic
    write_report_json(report_json, build_report(results, {
        "analysis": analysis.to_dict(), "recommendation": rec.to_dict(),
        "load": load.to_dict(), "traffic": flow.to_dict() if flow else None}))
    write_html(report_html, analysis, rec, html_context(flow))
    notes = [f"workload note: {n}" for n in results.header.workload.get("notes", [])]
    summary = render_summary(analysis, rec, str(report_html),
                             notes + (traffic_lines(flow) if flow else []))
    return BenchOutcome(results_path, report_json, report_html, analysis, rec, summary,
                        measured, resumed)


def run_bench(
    runner: Runner, workload: Workload, configs: Sequence[ConfigSpec], options: RunOptions,
    out: TextIO | None = None,
) -> BenchOutcome:
    """Measure every config on the workload, write results and reports, print the summary.

    Callers that load a model first should call `store.preflight(out_dir, resume)` before
    loading it, so a bad output folder fails fast; this function checks it again.
    """
    out = out if out is not None else sys.stdout
    preflight(options.out_dir, options.resume)
    validate_configs(configs)
    description = runner.describe()
    header = make_header(description, workload, configs, options.seed)
    mismatch = notes_for(workload.recorded_with, dict(description))  # another model's traffic
    for note in mismatch:
        print(f"specdecode: note: {workload.path}: {note}", file=sys.stderr)
    header.workload["notes"] = [*header.workload.get("notes", []), *mismatch]
    if options.arrivals.open_loop:  # how the requests arrived: resume refuses another way
        header.workload["arrivals"] = {**dataclasses.asdict(options.arrivals),
                                       "window_s": None if math.isinf(options.replay_window_s)
                                       else options.replay_window_s,
                                       "described": options.arrivals.describe()}
    with open_store(options.out_dir, header, options.resume) as store:
        resumed = len(store.results.samples)
        tasks = [t for t in schedule(workload.prompts, configs)
                 if not task_units(t) <= store.done_units()]
        try:
            if options.arrivals.open_loop:
                measured = measure_replay(
                    runner, store, workload, configs, options.arrivals, options.seed,
                    options.replay_window_s, options.progress, options.load_probe,
                    (lambda t: warm_up(runner, t)) if options.warmup else None)
            else:
                if options.warmup and tasks:
                    warm_up(runner, tasks)
                measured = measure(runner, store, tasks, options.progress, options.load_probe)
            collect_extras(runner, store, configs)
        except KeyboardInterrupt:
            print(f"\ninterrupted: {len(store.results.samples)} samples are saved in "
                  f"{store.path}; rerun with --resume to continue", file=out)
            raise
    outcome = finish(store.path, options, measured, resumed)
    print(outcome.summary, file=out)
    return outcome
