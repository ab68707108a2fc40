"""Is speculation paying, live: per drafter and request label, on the traffic being served.

After every engine step the worker hands the monitor the step's batch size, its time (the
speculative move only: admission and prefill left out, `BatchEngine.last_step_ns`) and, per
row, the request's label, the tokens it drafted, accepted and emitted. Per (drafter, label)
the monitor keeps integer counters and summed seconds, from which everything is derived:

- tokens per step: tokens emitted per row-step (accepted drafts + the verified token);
- no-draft share: the row-steps that drafted nothing (k = 0: the controller held speculation
  off, or a lookup found nothing);
- step cost: the measured step time in units of the *calibrated plain step* at that batch
  size (`PlainSteps`: whole greedy plain decoding steps of this server's engine, timed when it
  starts, interpolated between the batch sizes measured);
- realised speedup estimate = tokens per step / step cost: the tokens emitted against those
  plain decoding would have emitted in the same time, by the calibration. With a calibration
  that is current, plain decoding scores about 1.0. It is an estimate: the reference is the
  calibrated greedy step (sampled plain steps cost a little more, so sampled traffic reads a
  little low), and a machine that got slower since the start reads low too, which the drift
  check below tells apart where the server runs plain steps.

Every `window_s` seconds (the monitor is driven by the engine thread's steps and by reads, so
an idle server closes its window at the next step or scrape), each label's window is judged:
with at least `min_steps` row-steps, a realised speedup below 1.0 sets the label's
`not_paying` state and logs a warning (once, when it turns; an info line when it recovers),
unless the label drafted in fewer than MIN_DRAFTING of them (speculation is then off: its
no-draft share says so, and a low estimate is the machine's, which the drift check judges).
The server-wide window also compares its plain steps (no row drafted) with the calibration: a
step cost above DRIFT_LIMIT means the target or the machine is not what was calibrated
(another load, a swapped target), a `stale` reason ("step_cost"). `--calibration REPORT`
adds the reasons found at start: the target's weights, precision or the drafter differ from
those of the bench report the deployment was chosen by ("re-measure after every target swap").

Labels come from API keys and from clients (`metadata.label`): at most MAX_LABELS distinct
ones are kept, later ones count under OTHER_LABEL, so a client cannot grow /metrics without
bound. Thread safety: the engine thread writes, /metrics and /v1/speculation read, under one
lock.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdecode.engine import BatchEngine, Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.models.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams

log = logging.getLogger("specdecode.server")

WINDOW_S = 60.0
MIN_WINDOW_STEPS = 64  # row-steps a window needs before it is judged
DRIFT_LIMIT = 1.25  # plain steps costing this many calibrated ones: the calibration is stale
MIN_DRAFTING = 0.1  # a label drafting in fewer of its steps is not judged "not paying"
MAX_LABELS = 32
OTHER_LABEL = "other"
NO_LABEL = "none"
CALIBRATION_CONTEXT = 128  # prompt tokens of the calibration's plain requests
CALIBRATION_STEPS = 8  # timed steps per batch size (after WARM_STEPS)
WARM_STEPS = 3


# ------------------------------------------------------------------------- the calibration


@dataclass(frozen=True)
class PlainSteps:
    """Seconds of one whole plain decoding step at each measured batch size; `at(b)` between
    them linearly, beyond the largest in proportion to the batch (never below the last)."""

    seconds: dict[int, float]

    def at(self, batch: int) -> float:
        sizes = sorted(self.seconds)
        if not sizes:
            return math.nan
        if batch <= sizes[0]:
            return self.seconds[sizes[0]]
        for low, high in itertools.pairwise(sizes):
            if batch <= high:
                share = (batch - low) / (high - low)
                return self.seconds[low] + share * (self.seconds[high] - self.seconds[low])
        last = sizes[-1]
        return self.seconds[last] * batch / last


def calibrate_plain_steps(model: Target, tokenizer: Tokenizer | None, batches: Sequence[int],
                          context: int = CALIBRATION_CONTEXT,
                          steps: int = CALIBRATION_STEPS) -> PlainSteps:
    """Time whole greedy plain steps of a BatchEngine (forward, sampling, text, bookkeeping)
    over `batch` rows of `context` prompt tokens each, for each batch size: the median of
    `steps` steps after WARM_STEPS. Random prompt ids from a fixed seed; no end of sequence."""
    context = max(2, min(context, int(model.cfg.max_position) - steps - WARM_STEPS - 2))
    rng = random.Random(0)
    seconds: dict[int, float] = {}
    for batch in sorted(set(batches)):
        engine = BatchEngine(model, batch, context + steps + WARM_STEPS + 2)
        prompt = [rng.randrange(int(model.cfg.vocab_size)) for _ in range(context)]
        params = SamplingParams(max_tokens=steps + WARM_STEPS + 1)
        for _ in range(batch):
            engine.submit(Generation(model, tokenizer, list(prompt), params))
        while engine.waiting or engine.joining:  # prefill every row first
            engine.step()
        times = []
        for i in range(steps + WARM_STEPS):
            engine.step()
            if i >= WARM_STEPS:
                times.append(engine.last_step_ns / 1e9)
        while engine.busy:
            engine.step()
        seconds[batch] = statistics.median(times)
    return PlainSteps(seconds)


# ---------------------------------------------------------------------------- the counters


@dataclass
class Tally:
    """Counters of row-steps (one request in one engine step) and their derived rates."""

    row_steps: int = 0
    no_draft: int = 0  # row-steps that drafted nothing
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens emitted: accepted drafts and the verified token
    step_s: float = 0.0  # measured seconds of the steps, once per row-step
    plain_equivalent: float = 0.0  # tokens plain decoding would have emitted meanwhile

    def add(self, other: Tally) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def since(self, before: Tally) -> Tally:
        return Tally(**{name: value - getattr(before, name)
                        for name, value in asdict(self).items()})

    def copy(self) -> Tally:
        return Tally(**asdict(self))

    @property
    def tokens_per_step(self) -> float:
        return _ratio(self.emitted, self.row_steps)

    @property
    def no_draft_share(self) -> float:
        return _ratio(self.no_draft, self.row_steps)

    @property
    def accepted_per_step(self) -> float:
        return _ratio(self.accepted, self.row_steps)

    @property
    def step_cost(self) -> float:
        """Mean measured step time in calibrated plain steps of the same batch size."""
        return _ratio(self.plain_equivalent, self.row_steps)

    @property
    def speedup(self) -> float:
        """Realised speedup estimate: tokens emitted over those plain decoding would have."""
        return _ratio(self.emitted, self.plain_equivalent)

    def rates(self) -> dict[str, float | int | None]:
        """The counters and the rates derived from them (NaN -> None for JSON)."""
        out: dict[str, float | int] = dict(asdict(self))
        out.update(tokens_per_step=self.tokens_per_step, no_draft_share=self.no_draft_share,
                   accepted_per_step=self.accepted_per_step, step_cost=self.step_cost,
                   speedup=self.speedup)
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in out.items()}


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


@dataclass(frozen=True)
class Row:
    """One request's part of an engine step."""

    label: str | None
    drafted: int
    accepted: int
    emitted: int


@dataclass
class LabelState:
    """A label's totals, its totals when the current window began, and its last verdict."""

    total: Tally = field(default_factory=Tally)
    at_window: Tally = field(default_factory=Tally)
    last_window: Tally | None = None  # the last window judged (enough row-steps)
    not_paying: bool = False


# ---------------------------------------------------------------------------- the monitor


class SpeculationMonitor:
    """Live speculation figures per (drafter, label); see the module docstring."""

    def __init__(self, drafter: str, plain: PlainSteps, window_s: float = WINDOW_S,
                 min_steps: int = MIN_WINDOW_STEPS, stale: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.drafter = drafter
        self.plain = plain
        self.window_s, self.min_steps, self.clock = window_s, min_steps, clock
        self.speculating = drafter != "none"
        self.stale_at_start = dict(stale or {})  # reason -> why, found at start (--calibration)
        self.drift: float = math.nan  # the last window's plain-step cost (calibrated = 1)
        self._labels: dict[str, LabelState] = {}
        self._plain = Tally()  # whole steps in which no row drafted
        self._plain_at_window = Tally()
        self._window_start = clock()
        self._lock = threading.Lock()

    # ---------------------------------------------------------- the engine thread's side

    def observe_step(self, seconds: float, batch: int, rows: Sequence[Row]) -> None:
        """One engine step over `batch` rows that took `seconds`; `rows` the requests of it
        this server follows (a request cancelled meanwhile is in the batch, not in `rows`)."""
        if not rows:
            return
        plain = self.plain.at(batch)
        equivalent = seconds / plain if plain > 0 else math.nan
        with self._lock:
            for row in rows:
                tally = self._state(row.label).total
                tally.row_steps += 1
                tally.no_draft += row.drafted == 0
                tally.drafted += row.drafted
                tally.accepted += row.accepted
                tally.emitted += row.emitted
                tally.step_s += seconds
                tally.plain_equivalent += equivalent
            if all(row.drafted == 0 for row in rows):
                self._plain.row_steps += batch
                self._plain.plain_equivalent += equivalent * batch
                self._plain.step_s += seconds * batch
            self._roll()

    def _state(self, label: str | None) -> LabelState:
        name = label or NO_LABEL
        if name not in self._labels and len(self._labels) >= MAX_LABELS:
            name = OTHER_LABEL
        return self._labels.setdefault(name, LabelState())

    def _roll(self) -> None:
        """Judge the window when it is over (under the lock)."""
        now = self.clock()
        if now - self._window_start < self.window_s:
            return
        self._window_start = now
        for name, state in self._labels.items():
            window = state.total.since(state.at_window)
            state.at_window = state.total.copy()
            if window.row_steps >= self.min_steps:
                state.last_window = window
                self._judge(name, state, window)
        plain = self._plain.since(self._plain_at_window)
        self._plain_at_window = self._plain.copy()
        if plain.row_steps >= self.min_steps:
            self._judge_drift(plain.step_cost)

    def _judge(self, name: str, state: LabelState, window: Tally) -> None:
        if not self.speculating:
            return
        # drafting in fewer than MIN_DRAFTING of its steps, speculation is off for this label
        # (the controller holds it off, or nothing matched): an estimate below 1.0 then says
        # the machine is slower than calibrated (the drift check's business), not that
        # speculation costs more than it brings
        losing = window.speedup < 1.0 and 1.0 - window.no_draft_share >= MIN_DRAFTING
        if losing and not state.not_paying:
            log.warning("speculation is not paying for label %s (drafter %s): realised speedup "
                        "estimate %.2f over the last %g s (%d row-steps, %.2f tokens per step, "
                        "%.0f%% of steps drafted nothing, step cost %.2f calibrated plain "
                        "steps); see GET /v1/speculation", name, self.drafter, window.speedup,
                        self.window_s, window.row_steps, window.tokens_per_step,
                        100 * window.no_draft_share, window.step_cost)
        elif not losing and state.not_paying:
            log.info("speculation pays again for label %s (drafter %s): realised speedup "
                     "estimate %.2f over the last %g s", name, self.drafter, window.speedup,
                     self.window_s)
        state.not_paying = losing

    def _judge_drift(self, cost: float) -> None:
        was_stale = self.drift > DRIFT_LIMIT
        self.drift = cost
        if cost > DRIFT_LIMIT and not was_stale:
            log.warning("plain decoding steps cost %.2f times the calibrated ones over the last "
                        "%g s: the machine or the target is not what was calibrated (other "
                        "load, a swapped target); re-measure with specdecode bench", cost,
                        self.window_s)

    # ---------------------------------------------------------------------- reading

    def stale_reasons(self) -> dict[str, str]:
        """Why the calibration may not describe what is served now, by reason (STALE_REASONS;
        empty when it does)."""
        with self._lock:
            self._roll()
            drift = self.drift
        out = dict(self.stale_at_start)
        if drift > DRIFT_LIMIT:
            out["step_cost"] = (f"plain steps cost {drift:.2f} times the calibrated ones (other "
                                "load on the machine, or another target): re-measure with "
                                "specdecode bench")
        return out

    def labels(self) -> dict[str, tuple[Tally, Tally | None, bool]]:
        """Per label: its totals, its last judged window (None: none yet), not paying."""
        with self._lock:
            self._roll()
            return {name: (s.total.copy(), s.last_window.copy() if s.last_window else None,
                           s.not_paying) for name, s in sorted(self._labels.items())}

    def summary(self) -> dict[str, Any]:
        """GET /v1/speculation: the calibration, the stale reasons, totals and windows."""
        labels = self.labels()
        everything = Tally()
        for total, _, _ in labels.values():
            everything.add(total)
        return {
            "drafter": self.drafter, "window_s": self.window_s,
            "min_window_steps": self.min_steps,
            "calibration": {"plain_step_s": {str(b): s for b, s in
                                             sorted(self.plain.seconds.items())},
                            "stale": self.stale_reasons(),
                            "plain_step_cost": None if math.isnan(self.drift) else self.drift},
            "total": everything.rates(),
            "labels": [{"label": name, "not_paying": losing, "total": total.rates(),
                        "last_window": window.rates() if window else None}
                       for name, (total, window, losing) in labels.items()],
            "warnings": self.warnings(labels),
        }

    def warnings(self, labels: dict[str, tuple[Tally, Tally | None, bool]] | None = None
                 ) -> list[str]:
        """The warnings in force, as sentences."""
        labels = self.labels() if labels is None else labels
        out = [f"label {name}: speculation is not paying (realised speedup estimate "
               f"{window.speedup:.2f} over the last window)"
               for name, (_, window, losing) in labels.items() if losing and window]
        out += list(self.stale_reasons().values())
        return out


# ----------------------------------------------------------------- --calibration REPORT


STALE_REASONS = ("target", "precision", "drafter", "step_cost")


def read_report(path: Path) -> dict[str, Any]:
    """A bench report.json (or the run folder holding one), decoded; SpecDecodeError naming
    the file when it cannot be read or is not a report."""
    file = path / "report.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SpecDecodeError(f"--calibration {file}: cannot read it as a bench report.json "
                              f"({exc})") from None
    model = data.get("header", {}).get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or not isinstance(data.get("recommendation"), dict):
        raise SpecDecodeError(f"--calibration {file}: not a specdecode bench report.json (no "
                              "header.model or recommendation)")
    return data


def calibration_mismatches(report: dict[str, Any], name: str, weights: str, precision: str,
                           drafter: str) -> dict[str, str]:
    """What differs between the target and drafter served and those the bench `report` chose
    them by: its measured target's weights (sha256) and precision, and the drafter it
    recommended (plain decoding: "none"). Reason -> why."""
    model, rec = report["header"]["model"], report["recommendation"]
    out: dict[str, str] = {}
    theirs = str(model.get("weight_hash", ""))
    if len(theirs) == 64 and theirs != weights:  # a report over HTTP has no hash to compare
        out["target"] = (f"the target's weights (sha256 {weights[:16]}) are not those the "
                         f"calibration report measured ({theirs[:16]}, {model.get('name')}): "
                         "re-measure with specdecode bench after a target swap")
    if model.get("precision") not in (None, precision):
        out["precision"] = (f"serving precision {precision}, the calibration report measured "
                            f"{model.get('precision')}: re-measure with specdecode bench")
    wanted = str(rec.get("drafter") or "none") if rec.get("enable") else "none"
    if wanted != drafter:
        out["drafter"] = (f"serving drafter {drafter}, the calibration report recommended "
                          f"{'plain decoding' if wanted == 'none' else wanted} for {name}: "
                          "re-measure with specdecode bench, or serve what it recommends")
    return out
