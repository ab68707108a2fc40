"""When each request of a benchmark starts: `--arrivals closed|recorded|poisson:RATE`, `--speed`.

- `closed` (the default): batches of `--batch-sizes` prompts, the next when all have ended
  (bench.harness): the batch size is set, the arrival times follow from it.
- `recorded`: open loop at the arrival times the workload carries (a `serve --record`
  recording, or a log with timestamps: bench.requests), divided by `--speed` (2: twice as fast).
- `poisson:RATE`: open loop, a Poisson process of RATE requests per second (times `--speed`),
  drawn from `--seed`: the workload's prompts in its order at exponential gaps.

Open loop (bench.openloop), requests start when they are due whether or not the earlier ones
have ended, so queueing, the batch sizes and the tails are the traffic's own; `--batch-sizes`
is then the engine's rows (the server's --max-batch), and the report shows the batch sizes the
traffic produced. A conversation's later turns start as soon as the reply to the turn before
has arrived.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from specdecode.bench.workloads import Prompt
from specdecode.errors import SpecDecodeError

KINDS = ("closed", "recorded", "poisson")


@dataclass(frozen=True)
class Arrivals:
    """How requests arrive: `kind`, the Poisson `rate` (requests/s) and the `speed` factor."""

    kind: Literal["closed", "recorded", "poisson"] = "closed"
    rate: float | None = None
    speed: float = 1.0

    @property
    def open_loop(self) -> bool:
        return self.kind != "closed"

    def describe(self) -> str:
        if self.kind == "closed":
            return "closed loop: batches of --batch-sizes concurrent requests"
        speed = "" if self.speed == 1.0 else f", {self.speed:g}x speed"
        what = "the recorded arrival times" if self.kind == "recorded" else \
            f"a Poisson process of {self.rate:g} requests/s"
        return f"open loop at {what}{speed}"


def parse_arrivals(text: str | None, speed: float = 1.0) -> Arrivals:
    """`--arrivals` and `--speed` checked: SpecDecodeError naming the value."""
    if not (math.isfinite(speed) and speed > 0):
        raise SpecDecodeError(f"--speed must be a number > 0, got {speed}")
    kind, _, rate_text = (text or "closed").strip().partition(":")
    if kind not in KINDS:
        raise SpecDecodeError(f"--arrivals {text!r}: expected closed, recorded or "
                              "poisson:RATE (requests per second)")
    if kind != "poisson":
        if rate_text:
            raise SpecDecodeError(f"--arrivals {text!r}: only poisson takes a rate")
        if kind == "closed" and speed != 1.0:
            raise SpecDecodeError("--speed applies to open-loop arrivals (--arrivals recorded "
                                  "or poisson:RATE)")
        return Arrivals("recorded" if kind == "recorded" else "closed", None, speed)
    try:
        rate = float(rate_text)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise SpecDecodeError(f"--arrivals {text!r}: the rate must be a number of requests "
                              f"per second > 0, got {rate_text!r}")
    return Arrivals("poisson", rate, speed)


def offsets(prompts: Sequence[Prompt], arrivals: Arrivals, seed: int = 0) -> list[float]:
    """Each prompt's start in seconds from the first (open loop), in the prompts' order, which
    for recorded arrivals is already arrival order (bench.workloads sorts recordings)."""
    if arrivals.kind == "recorded":
        missing = [p.id for p in prompts if p.arrival_s is None]
        if missing:
            raise SpecDecodeError(
                f"--arrivals recorded: {len(missing)} of {len(prompts)} prompts have no "
                f"arrival time (first: {missing[0]}); replay a recording (serve --record) or "
                "a log with timestamps, or use --arrivals poisson:RATE or closed")
        first = min(p.arrival_s or 0.0 for p in prompts)
        return [((p.arrival_s or 0.0) - first) / arrivals.speed for p in prompts]
    if arrivals.kind == "poisson":
        assert arrivals.rate is not None
        gaps = np.random.default_rng(seed).exponential(1.0 / (arrivals.rate * arrivals.speed),
                                                       len(prompts))
        return [0.0, *np.cumsum(gaps[1:]).tolist()]
    raise SpecDecodeError("closed-loop arrivals have no schedule")
