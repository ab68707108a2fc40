"""Open-loop replay: requests start at their scheduled times (bench.arrivals), whatever the
earlier ones are doing, so the queueing, batch sizes and tails are the traffic's own.

The schedule is cut into windows of `window_s` seconds of arrivals (REPLAY_WINDOW_S; the
whole schedule when `window_s` is infinite). Each window is replayed by every configuration in
turn, the order rotated by one per window, as closed-loop batch groups are, so slow drift on
the machine spreads over the configurations; a window starts at its first arrival on an idle
engine (or server) and ends when its last request has, so each window has a ramp-up and a
drain of a request's length. The runner (`Replayer.replay`) submits each request when it is
due and hands each finished one to `emit` at once: a writer thread appends it to results.jsonl
(fsync'd) off the replay's own loop, so a crash loses nothing already measured and the disk
never delays a step or a send. After the window, its `ReplayRecord` (the batch sizes, the
scheduled and the measured span, how late the latest submission was) is appended.

Resume: a window counts as measured under a configuration when every turn of it is; one that is
not is replayed whole (its traffic must be the same), and the new samples replace the old.

Statistics: every sample's `group` is the time block of its scheduled start (the schedule cut
into up to BLOCKS equal spans), the same for every configuration, so the bootstrap resamples
blocks of requests that ran together rather than requests one by one (report.analysis).
"""

from __future__ import annotations

import dataclasses
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tqdm import tqdm

from specdecode.bench.arrivals import Arrivals, offsets
from specdecode.bench.interference import Probe, between, read_cpu_times
from specdecode.bench.records import ConfigSpec, ReplayRecord, RequestSample
from specdecode.bench.store import ResultStore, UnitKey
from specdecode.bench.workloads import Prompt, Workload, arrivals
from specdecode.errors import SpecDecodeError

REPLAY_WINDOW_S = 60.0
BLOCKS = 20
MIN_BLOCK_REQUESTS = 5  # fewer requests than this per block on average: fewer blocks

Emit = Callable[[RequestSample], None]


@dataclass(frozen=True)
class Scheduled:
    """A prompt due `at` seconds after its window's first arrival."""

    prompt: Prompt
    at: float


@dataclass(frozen=True)
class Window:
    """Requests replayed together: the `index`-th window, its first arrival `start` seconds
    after the schedule's first."""

    index: int
    start: float
    requests: tuple[Scheduled, ...]


@runtime_checkable
class Replayer(Protocol):
    """A runner that replays open loop (bench.inprocess, bench.http_runner)."""

    def replay(self, requests: Sequence[Scheduled], config: ConfigSpec,
               emit: Emit) -> ReplayRecord:
        """Submit each request when due; `emit` each finished turn's sample (times from its
        scheduled start); return the window's record (window and start_s are the caller's)."""
        ...


def make_windows(prompts: Sequence[Prompt], times: Sequence[float],
                 window_s: float = REPLAY_WINDOW_S) -> list[Window]:
    """The schedule cut at multiples of `window_s` seconds (infinite: one window)."""
    by_index: dict[int, list[tuple[Prompt, float]]] = {}
    for prompt, t in zip(prompts, times, strict=True):
        index = 0 if math.isinf(window_s) else int(t // window_s)
        by_index.setdefault(index, []).append((prompt, t))
    windows = []
    for n, index in enumerate(sorted(by_index)):
        items = sorted(by_index[index], key=lambda item: item[1])
        start = items[0][1]
        windows.append(Window(n, start, tuple(Scheduled(p, t - start) for p, t in items)))
    return windows


def blocks(times: Sequence[float]) -> list[int]:
    """Each scheduled start's time block: the schedule's span cut into up to BLOCKS equal
    parts, fewer when there are fewer than MIN_BLOCK_REQUESTS requests a block."""
    n = max(1, min(BLOCKS, len(times) // MIN_BLOCK_REQUESTS))
    span = max(times, default=0.0) - min(times, default=0.0)
    if span <= 0:
        return [0] * len(times)
    first = min(times)
    return [min(n - 1, int((t - first) / span * n)) for t in times]


def window_units(window: Window, config: ConfigSpec) -> set[UnitKey]:
    return {(config.name, s.prompt.id, turn, config.batch_size)
            for s in window.requests for turn in range(len(s.prompt.turns))}


def plan(workload: Workload, configs: Sequence[ConfigSpec], arrival: Arrivals, seed: int,
         window_s: float) -> tuple[list[tuple[Window, ConfigSpec]], dict[str, int]]:
    """Every (window, configuration) to replay, batch sizes ascending, configurations rotated
    per window; and each prompt's time block."""
    times = offsets(workload.prompts, arrival, seed)
    windows = make_windows(workload.prompts, times, window_s)
    tasks: list[tuple[Window, ConfigSpec]] = []
    for batch in sorted({c.batch_size for c in configs}):
        at_batch = [c for c in configs if c.batch_size == batch]
        for window in windows:
            shift = window.index % len(at_batch)
            tasks += [(window, c) for c in at_batch[shift:] + at_batch[:shift]]
    block = dict(zip((p.id for p in workload.prompts), blocks(times), strict=True))
    return tasks, block


class _Writer:
    """Appends samples to the store from a thread of its own, in the order emitted."""

    def __init__(self, store: ResultStore) -> None:
        self.store = store
        self.written = 0
        self.error: BaseException | None = None
        self._queue: queue.Queue[RequestSample | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="specdecode-replay-writer",
                                        daemon=True)
        self._thread.start()

    def put(self, sample: RequestSample) -> None:
        self._queue.put(sample)

    def _run(self) -> None:
        while (sample := self._queue.get()) is not None:
            try:
                self.store.append(sample)
                self.written += 1
            except BaseException as exc:  # re-raised by close(), on the harness's thread
                self.error = self.error or exc

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error


def replay_window(runner: Replayer, store: ResultStore, window: Window, config: ConfigSpec,
                  block: dict[str, int], placed: dict[str, int], probe: Probe) -> int:
    """Replay one window under one configuration, writing each sample as it ends; returns the
    samples written."""
    before, started = probe(), time.time()
    writer = _Writer(store)

    def emit(sample: RequestSample) -> None:  # on the replay's own loop: queue it and go on
        reading = between(before, probe())
        problems = sample.problems()
        if problems:
            raise SpecDecodeError(f"runner returned an inconsistent sample for {sample.unit}: "
                                  + "; ".join(problems))
        writer.put(dataclasses.replace(
            sample, group=block.get(sample.prompt_id, 0), window=window.index,
            scheduled_s=_shift(sample.scheduled_s, window.start),
            sent_s=_shift(sample.sent_s, window.start),
            load=reading.to_dict() if reading is not None else {},
            started_at=sample.started_at or started, arrival=placed.get(sample.prompt_id, -1)))

    try:
        record = runner.replay(window.requests, config, emit)
    finally:
        writer.close()
    store.append(dataclasses.replace(record, window=window.index, start_s=window.start))
    return writer.written


def _shift(value: float | None, by: float) -> float | None:
    return None if value is None else value + by


def measure_replay(runner: object, store: ResultStore, workload: Workload,
                   configs: Sequence[ConfigSpec], arrival: Arrivals, seed: int = 0,
                   window_s: float = REPLAY_WINDOW_S, progress: bool = False,
                   probe: Probe = read_cpu_times,
                   warm_up: Callable[[list[tuple[int, list[Prompt], ConfigSpec]]], None]
                   | None = None) -> int:
    """Replay the workload open loop under every configuration (see the module docstring);
    returns the samples written."""
    if not isinstance(runner, Replayer):
        raise SpecDecodeError(f"{arrival.describe()}: this runner cannot replay open loop "
                              "(in process or --endpoint only; not --targets)")
    tasks, block = plan(workload, configs, arrival, seed, window_s)
    done = store.done_units()
    tasks = [(w, c) for w, c in tasks if not window_units(w, c) <= done]
    if warm_up is not None and tasks:
        warm_up([(0, [w.requests[0].prompt], c) for w, c in tasks])
    placed = {p: a.index for p, a in arrivals(workload.prompts).items()}
    written = 0
    with tqdm(total=len(tasks), unit="window", disable=not progress, file=sys.stderr) as bar:
        for window, config in tasks:
            bar.set_postfix_str(f"{config.name} max batch {config.batch_size}")
            written += replay_window(runner, store, window, config, block, placed, probe)
            bar.update(1)
    return written
