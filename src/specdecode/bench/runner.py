"""The `Runner` protocol: what produces measurements for the benchmark harness.

The in-process engine runner (`bench.inprocess`) and the HTTP runner (`bench.http_runner`, any
OpenAI-compatible server) implement it; the harness only calls these methods and never reaches
into an engine, drafter or cache.

Contract of `Runner.run(prompts, config)`:

- `prompts` (1 to `config.batch_size` of them) run concurrently, as one batch.
- Each prompt's turns run in order: after each user turn the runner generates the assistant's
  reply and appends it to the conversation before the next user turn (chat template applied by
  the runner).
- Sampling: temperature `effective_temperature(prompt, config)`, at most
  `prompt.max_tokens` new tokens (the runner's default when None), random seed
  `request_seed(prompt, turn, seed)` with the `seed` passed to the runner's constructor, so a
  rerun repeats its choices.
- It returns exactly one `RequestSample` per (prompt, turn), with `config=config.name`,
  `batch_size=config.batch_size`, `temperature` set to the temperature used, and times and
  counters attributed as `records` documents. `group` and `started_at` may be left at their
  defaults: the harness sets `group`.
- Errors the user can fix raise SpecDecodeError; samples already returned are kept. A request
  that fails mid-run (e.g. an HTTP 500) may instead be returned as a sample with `error` set,
  holding what it measured: the results file keeps it, every statistic leaves it out.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Protocol, TypedDict

from specdecode.bench.records import (
    AuditVerdict,
    ConfigSpec,
    CostCurve,
    MemoryRecord,
    RequestSample,
)
from specdecode.bench.workloads import Prompt


class RunnerDescription(TypedDict, total=False):
    """What `Runner.describe()` returns, for the run header. Missing keys read as unknown."""

    runner: str  # "in-process", "http", ...
    model_name: str
    precision: str
    weight_hash: str  # sha256 of the target's weight file(s): detects a target swap
    torch_threads: int
    accelerator: str | None  # e.g. "NVIDIA H200", None for CPU only
    hardware: dict[str, object]  # remote runners: the server's HardwareInfo fields
    details: dict[str, object]  # anything else worth keeping (versions, endpoint, ...)


class Runner(Protocol):
    """Produces `RequestSample`s for the harness; see the module docstring for the contract."""

    def describe(self) -> RunnerDescription:
        """The model, precision, weight hash and threads, for the run header."""
        ...

    def run(self, prompts: Sequence[Prompt], config: ConfigSpec) -> list[RequestSample]:
        """Run `prompts` as one batch under `config`; one sample per (prompt, turn)."""
        ...

    def cost_curves(self, configs: Sequence[ConfigSpec]) -> list[CostCurve]:
        """Measure c(k) and v(k) per batch size for these configs ([] if not supported)."""
        ...

    def memory(self, config: ConfigSpec) -> MemoryRecord | None:
        """Memory use of `config` (weights, KV caches, peak RSS), or None if not measured."""
        ...

    def audit(self, config: ConfigSpec) -> list[AuditVerdict]:
        """Losslessness verdicts beyond the harness's greedy token check ([] if none)."""
        ...


def effective_temperature(prompt: Prompt, config: ConfigSpec) -> float:
    """The config's temperature if set, else the prompt's, else 0.0 (greedy)."""
    if config.temperature is not None:
        return config.temperature
    return prompt.temperature if prompt.temperature is not None else 0.0


def request_seed(prompt: Prompt, turn: int, seed: int) -> int:
    """A stable 31-bit seed for one request, the same for every configuration."""
    return zlib.crc32(f"{seed}:{prompt.id}:{turn}".encode()) & 0x7FFFFFFF
