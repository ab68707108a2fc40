"""How busy the machine was while the benchmark measured, and which measurements it disturbed.

Other work on the machine does not only add noise: a speculative step's multi-position forward
uses every torch thread for longer than a one-token step, so when another process takes a core
the threads oversubscribe and speculation loses more than plain decoding does (issue 26). The
harness therefore reads the CPU counters around every measured batch (`read_cpu_times` before
and after `Runner.run`) and stores the difference on each of the batch's samples
(`RequestSample.load`, a `LoadReading` as a dict):

- `other_cores`: CPU time that processes other than this one used on the CPUs this process may
  run on (its affinity mask; /proc/stat per CPU, minus this process's own CPU time), per second
  of wall time: the average number of those cores other work kept busy;
- `steal_cores`: the same for time the hypervisor gave to other guests (/proc/stat "steal");
- `own_cores`: this process's CPU time per second; `load1`: /proc/loadavg at the end; `cores`.

A sample is *disturbed* when, over a batch of at least `MIN_JUDGED_WALL_S`, other work took
more than `DISTURBED_CORES` beyond the cores this run leaves free (cores - torch threads). Work
on the free cores does not oversubscribe this process's threads; beyond them, a quiet machine's
background (kernel threads, a shell) stays far under half a core, while one busy process takes a
whole one. The verdict applies to in-process runs only: over HTTP (`bench --endpoint`) a local
server's own work counts as other processes. Readings are kept
raw, so a later threshold can be applied to an old results file; a results file written before
this module holds no readings, which read as "not recorded", never as quiet or disturbed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdecode.bench.records import RequestSample, RunHeader

DISTURBED_CORES = 0.5
# /proc/stat counts whole clock ticks per CPU, so over a short batch one tick more or less moves
# a reading by a large fraction of a core: batches shorter than this are recorded, not judged.
MIN_JUDGED_WALL_S = 0.5
PROC = Path("/proc")
BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq (guest time is inside user)
STEAL_FIELD = 7
UNJUDGED_RUNNERS = ("http",)  # the measured work runs in another process (see above)


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU counters at one instant (seconds), over the CPUs this process may use."""

    at: float  # time.monotonic()
    busy_s: float  # CPU time those CPUs spent running anything, steal excluded
    steal_s: float
    own_s: float  # this process's CPU time, all threads
    load1: float
    cores: int


@dataclass(frozen=True)
class LoadReading:
    """The machine's load over one measured batch (see the module docstring)."""

    wall_s: float
    other_cores: float
    steal_cores: float
    own_cores: float
    load1: float
    cores: int

    @property
    def taken_cores(self) -> float:
        """Cores other processes and other guests kept busy, on average."""
        return self.other_cores + self.steal_cores

    def to_dict(self) -> dict[str, float]:
        return {key: float(value) for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadReading | None:
        """The reading stored on a sample; None when it holds none (or a malformed one)."""
        try:
            return cls(wall_s=float(data["wall_s"]), other_cores=float(data["other_cores"]),
                       steal_cores=float(data["steal_cores"]),
                       own_cores=float(data["own_cores"]), load1=float(data["load1"]),
                       cores=int(data["cores"]))
        except (KeyError, TypeError, ValueError):
            return None


Probe = Callable[[], CpuTimes | None]


# ------------------------------------------------------------------------------- reading /proc


def allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on, or None where the affinity mask cannot be read."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def parse_proc_stat(text: str, cpus: set[int] | None) -> tuple[int, int, int] | None:
    """(busy ticks, steal ticks, CPUs counted) summed over the `cpuN` lines of `cpus` (all
    CPUs when None); None when the text has no such line."""
    busy = steal = counted = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit():
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in rest.split()]
        busy += sum(values[i] for i in BUSY_FIELDS if i < len(values))
        steal += values[STEAL_FIELD] if len(values) > STEAL_FIELD else 0
        counted += 1
    return (busy, steal, counted) if counted else None


def read_cpu_times(proc: Path = PROC) -> CpuTimes | None:
    """The counters now, or None where /proc cannot be read (then nothing is recorded)."""
    try:
        stat = (proc / "stat").read_text(encoding="ascii")
        load_text = (proc / "loadavg").read_text(encoding="ascii")
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    parsed = parse_proc_stat(stat, allowed_cpus())
    if parsed is None or ticks <= 0:
        return None
    busy, steal, cores = parsed
    times = os.times()
    try:
        load1 = float(load_text.split()[0])
    except (IndexError, ValueError):
        load1 = 0.0
    return CpuTimes(at=time.monotonic(), busy_s=busy / ticks, steal_s=steal / ticks,
                    own_s=times.user + times.system, load1=load1, cores=cores)


def between(before: CpuTimes | None, after: CpuTimes | None) -> LoadReading | None:
    """The reading over the interval between two snapshots (None if either is missing)."""
    if before is None or after is None:
        return None
    wall = after.at - before.at
    if wall <= 0:
        return None
    own = max(after.own_s - before.own_s, 0.0)
    other = max(after.busy_s - before.busy_s - own, 0.0)
    steal = max(after.steal_s - before.steal_s, 0.0)
    return LoadReading(wall_s=wall, other_cores=other / wall, steal_cores=steal / wall,
                       own_cores=own / wall, load1=after.load1, cores=after.cores)


# ---------------------------------------------------------------------------------- verdicts


def judged(header: RunHeader) -> bool:
    """Whether interference is judged for this run (not over HTTP: see the module docstring)."""
    return header.runner.get("runner") not in UNJUDGED_RUNNERS


def threshold_cores(header: RunHeader, cores: int) -> float:
    """The cores other work may keep busy before a measurement counts as disturbed: the cores
    the run leaves free (its CPUs minus its torch threads; none when the thread count is
    unknown) plus DISTURBED_CORES."""
    threads = header.hardware.torch_threads
    free = max(cores - threads, 0) if threads else 0
    return free + DISTURBED_CORES


def is_disturbed(sample: RequestSample, header: RunHeader) -> bool:
    """True when the sample was measured while other work took more than DISTURBED_CORES
    beyond the cores the run leaves free (False without a reading or for an unjudged run)."""
    reading = LoadReading.from_dict(sample.load)
    if reading is None or not judged(header) or reading.wall_s < MIN_JUDGED_WALL_S:
        return False
    return reading.taken_cores > threshold_cores(header, reading.cores)


@dataclass
class ConfigLoad:
    """The load over one configuration's measured requests (at one batch size)."""

    config: str
    batch_size: int
    n_requests: int
    n_read: int  # requests carrying a reading
    n_disturbed: int
    mean_taken_cores: float  # other processes + steal, weighted by each reading's wall time
    max_taken_cores: float
    mean_own_cores: float
    max_load1: float

    @property
    def disturbed(self) -> bool:
        return self.n_disturbed > 0


@dataclass
class LoadReport:
    """The load through a run: per configuration, and whether interference was judged."""

    judged: bool
    cores: int
    torch_threads: int | None
    configs: list[ConfigLoad] = field(default_factory=list)

    @property
    def recorded(self) -> bool:
        """Whether any sample carries a reading (results written before this module: none)."""
        return any(c.n_read for c in self.configs)

    @property
    def flagged(self) -> list[ConfigLoad]:
        """The configurations with at least one disturbed request."""
        return [c for c in self.configs if c.disturbed] if self.judged else []

    def of(self, config: str, batch_size: int) -> ConfigLoad | None:
        return next((c for c in self.configs if (c.config, c.batch_size) ==
                     (config, batch_size)), None)

    def to_dict(self) -> dict[str, Any]:
        return {"judged": self.judged, "cores": self.cores, "torch_threads": self.torch_threads,
                "disturbed_cores": DISTURBED_CORES,
                "configs": [{**asdict(c), "disturbed": c.disturbed} for c in self.configs]}


def _weighted_mean(pairs: Sequence[tuple[float, float]]) -> float:
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else 0.0


def config_load(header: RunHeader, key: tuple[str, int],
                samples: Sequence[RequestSample]) -> ConfigLoad:
    """The load of one (config, batch size) from its samples."""
    readings = [r for r in (LoadReading.from_dict(s.load) for s in samples) if r is not None]
    return ConfigLoad(
        config=key[0], batch_size=key[1], n_requests=len(samples), n_read=len(readings),
        n_disturbed=sum(is_disturbed(s, header) for s in samples),
        mean_taken_cores=_weighted_mean([(r.taken_cores, r.wall_s) for r in readings]),
        max_taken_cores=max((r.taken_cores for r in readings), default=0.0),
        mean_own_cores=_weighted_mean([(r.own_cores, r.wall_s) for r in readings]),
        max_load1=max((r.load1 for r in readings), default=0.0),
    )


def assess(header: RunHeader, samples: Sequence[RequestSample]) -> LoadReport:
    """The load report of a run: one ConfigLoad per configuration of the header."""
    by_key: dict[tuple[str, int], list[RequestSample]] = {}
    for s in samples:
        by_key.setdefault((s.config, s.batch_size), []).append(s)
    return LoadReport(
        judged=judged(header), cores=header.hardware.cpu_cores,
        torch_threads=header.hardware.torch_threads,
        configs=[config_load(header, c.key, by_key.get(c.key, [])) for c in header.configs],
    )


# ------------------------------------------------------------------------------------ wording


def describe(c: ConfigLoad, cores: int) -> str:
    """One clause: how many requests of a configuration were disturbed, and by how much."""
    return (f"{c.config} at batch size {c.batch_size}: {c.n_disturbed} of {c.n_requests} "
            f"requests measured while other processes kept {c.max_taken_cores:.1f} of {cores} "
            f"cores busy at worst ({c.mean_taken_cores:.1f} on average over its requests)")


def warning(report: LoadReport) -> str | None:
    """The recommendation's warning when any configuration was disturbed, else None."""
    flagged = report.flagged
    if not flagged:
        return None
    return ("measured under interference: " + "; ".join(describe(c, report.cores)
                                                          for c in flagged)
            + ". Other work on the machine slows speculation's wide steps more than plain "
            "decoding's one-token steps, so a speedup measured under it reads low (and high "
            "when only its plain baseline was disturbed): re-measure the flagged requests "
            "(--resume) on a quiet machine before deciding")


def rerun_advice(out_dir: str | Path | None) -> str:
    """How to re-measure the disturbed requests."""
    where = f" --out {out_dir}" if out_dir is not None else " --out <this run's folder>"
    return (f"To re-measure only the disturbed requests, stop the other load and rerun the same "
            f"command with --resume{where} (the new measurements replace the disturbed ones). "
            "If the load cannot be stopped, measure with fewer torch threads than cores, e.g. "
            "--threads 1, in a new output folder, so the other work has a core of its own.")
