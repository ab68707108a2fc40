"""`BenchOptions`: what `bench` and `tune` are asked, in one frozen value that every front end
builds (the command line from its flags: cli.args.bench_options; the Python API from its
keywords: Specdecode.bench; `tune` with its `TuneOptions`) and bench.plan alone reads, checked
once (`check`) before anything loads. A field left at its default is the command's default; the
command line's flags take their defaults from here, so the API and the command line cannot
drift apart.

Like drafters.options.DrafterOptions, it imports nothing heavy: the command line builds and
checks it before torch loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.errors import SpecDecodeError
from specdecode.limits import K_RANGE, MAX_K
from specdecode.models import backends
from specdecode.models import precision as precisions

DEFAULT_AUDIT_SAMPLES = 60  # sampled audit: generations per side (2 tokens each)
DEFAULT_REQUEST_TIMEOUT_S = 300.0  # --endpoint: seconds a request may wait for its next byte
CLOSED_LOOP = "closed"  # --arrivals' default: batches of --batch-sizes requests
TUNE_K_VALUES = (1, 2, 3, 4, 6, 8)
TUNE_PROMPTS = 3
TUNE_MAX_TOKENS = 32


@dataclass(frozen=True)
class TuneOptions:
    """`tune`'s own options: the drafters tried (None: every registered drafter that needs no
    option it lacks), a draft checkpoint for those that read one, the draft lengths, and how
    many calibration prompts."""

    drafters: tuple[str, ...] | None = None
    draft_model: str | None = None
    k_values: tuple[int, ...] = TUNE_K_VALUES
    prompts: int = TUNE_PROMPTS

    def check(self) -> None:
        if self.prompts < 1:
            raise SpecDecodeError(f"--prompts must be >= 1, got {self.prompts}")
        if not self.k_values or not all(1 <= k <= MAX_K for k in self.k_values):
            raise SpecDecodeError(f"--k-values must be in {K_RANGE}, got "
                                  f"{','.join(map(str, self.k_values)) or '(none)'}")


@dataclass(frozen=True)
class BenchOptions:
    """The target and how it runs (model, precision, backend, threads, chat_template), the
    workload (workload, specbench, categories, limit_per_category, strict, constraint: a
    constraints.ConstraintSpec for every prompt without its own), what is measured (configs,
    targets, fidelity, batch_sizes, max_tokens, audit_samples), how requests arrive (arrivals,
    speed, replay_window, slo), the servers measured instead of the engine (endpoints, api_key,
    request_timeout), the run (out, resume, seed, resamples, progress), and `tune`'s options
    (None: a bench run). Strings that spell a small language (configs, targets, fidelity,
    arrivals, slo) are parsed by bench.plan with the errors naming them."""

    model: str | None = None
    precision: str = precisions.AUTO
    backend: str = backends.AUTO
    threads: int | None = None
    chat_template: bool = True
    workload: str | None = None
    specbench: str | None = None
    categories: tuple[str, ...] | None = None
    limit_per_category: int | None = None
    strict: bool = False
    constraint: Any = None
    configs: str | None = None
    targets: str | None = None
    fidelity: str | None = None
    batch_sizes: tuple[int, ...] = (1,)
    max_tokens: int | None = None
    audit_samples: int = DEFAULT_AUDIT_SAMPLES
    arrivals: str = CLOSED_LOOP
    speed: float = 1.0
    replay_window: float | None = None
    slo: str | None = None
    endpoints: tuple[str, ...] = ()
    api_key: str | None = None
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    out: Path | None = None
    resume: bool = False
    seed: int = 0
    resamples: int | None = None
    progress: bool = True
    tune: TuneOptions | None = None

    def check(self) -> BenchOptions:
        """Every check that needs no file and no model, in one place; returns self."""
        for name, low in (("threads", 1), ("max_tokens", 1), ("audit_samples", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < low):
                raise SpecDecodeError(f"{flag(name)} must be >= {low}, got {value}")
        if not self.batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                       for b in self.batch_sizes):
            raise SpecDecodeError(f"--batch-sizes must be integers >= 1, got "
                                  f"{list(self.batch_sizes)!r}")
        if self.categories is not None and not self.categories:
            raise SpecDecodeError("--categories is empty")
        if self.resume and self.out is None:
            raise SpecDecodeError("--resume needs --out DIR (the folder of the run to continue)")
        self._check_modes()
        if self.tune is not None:
            self.tune.check()
        return self

    def _check_modes(self) -> None:
        """--targets, --endpoint and --fidelity: which may go together."""
        if self.endpoints and self.configs:
            raise SpecDecodeError("--configs selects in-process drafters; with --endpoint each "
                                  "server's own setting is measured: list several --endpoint "
                                  "NAME=URL to compare servers (the first is the baseline)")
        if self.endpoints and not self.request_timeout > 0:
            raise SpecDecodeError(f"--request-timeout must be > 0, got {self.request_timeout}")
        if self.targets and self.endpoints:
            raise SpecDecodeError("--targets measures targets in process; --endpoint measures "
                                  "servers: use one or the other")
        if self.targets and not (precisions.is_auto(self.precision)
                                 and backends.is_auto(self.backend)):
            raise SpecDecodeError("--targets names each target's precision and backend (e.g. "
                                  "--targets fp32,bf16,w4a16,llama.cpp): leave --precision and "
                                  "--backend out")
        if self.fidelity is not None and not self.targets:
            raise SpecDecodeError("--fidelity chooses among the targets of --targets; a run of "
                                  "one target has its own fidelity")
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise SpecDecodeError(f"--speed must be a number > 0, got {self.speed}")


def flag(name: str) -> str:
    """A field as the command line spells it: `max_tokens` -> `--max-tokens`."""
    return "--" + name.replace("_", "-")
