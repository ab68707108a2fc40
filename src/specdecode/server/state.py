"""What a running server holds: the served model, the engine thread, metrics and limits.

`build_state` turns a loaded model and the serve options into that state: the drafter factory,
the batch engine over one shared KV cache (with the controller and its measured costs under
`--k auto`), the calibrated plain step the live speculation monitor measures against (and,
with `--calibration`, what differs from the bench report the deployment was chosen by), the
recorder (`--record`), and the engine thread (started by the app's lifespan).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdecode.calibration import calibrated_costs
from specdecode.control import CostModel, auto_controller
from specdecode.drafters.base import DrafterFactory
from specdecode.drafters.options import DrafterOptions
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import BatchEngine
from specdecode.errors import SpecDecodeError
from specdecode.limits import SUFFIX_ISOLATION
from specdecode.memory import weight_bytes
from specdecode.models.loading import LoadedModel
from specdecode.models.target import Target
from specdecode.server.connections import HEADER_TIMEOUT_S
from specdecode.server.isolation import Isolation
from specdecode.server.middleware import ApiKey, check_keys
from specdecode.server.openai_errors import APIError
from specdecode.server.prepare import ServedModel
from specdecode.server.prometheus import ServerMetrics
from specdecode.server.record import Recorder, RecordOptions, tokenizer_digest
from specdecode.server.speculation import (
    WINDOW_S,
    SpeculationMonitor,
    calibrate_plain_steps,
    calibration_mismatches,
    read_report,
)
from specdecode.server.tokens import PromptEncoder
from specdecode.server.worker import EngineWorker

log = logging.getLogger("specdecode.server")

MAX_BODY_BYTES = 1 << 20  # 1 MiB
BODY_TIMEOUT_S = 60.0  # a whole body of MAX_BODY_BYTES then needs >= 17 kB/s
SHUTDOWN_TIMEOUT_S = 30.0  # see specdecode.server.shutdown
RETRY_AFTER_S = 1  # Retry-After of a 429: a slot frees when any running request ends
# Prompts over this many bytes of text are tokenized one at a time on a thread of their own
# (tens of milliseconds of work at this size), at a lower CPU priority: a burst of long prompts
# then takes one core at most, yields it to the engine and the event loop, and never queues
# ahead of short prompts, which go to the shared worker threads.
LONG_PROMPT_BYTES = 32 * 1024
LONG_PROMPT_NICE = 10


def _lower_priority() -> None:
    """Run this thread at a higher nice value (Linux: per thread; elsewhere a no-op)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LONG_PROMPT_NICE)


@dataclass(frozen=True)
class ServeOptions:
    """Everything `specdecode serve` takes besides the model and the network address."""

    # the drafter, its draft length (k "auto" by default: the controller picks 0..kmax per
    # step, each step at most max_step_cost plain steps) and its options; the suffix drafter's
    # store caps and isolation (whose earlier text a request drafts from, server.isolation:
    # "user", the default, closes the timing side channel between users; "shared": one scope
    # for all) among them
    drafter: DrafterOptions = field(default_factory=DrafterOptions)
    max_batch: int = 8
    max_seq_len: int = 2048
    max_queue: int = 64
    # keys a client may present (none: no key needed), each with the label its traffic goes
    # under in the live speculation metrics and in a recording
    api_keys: tuple[ApiKey, ...] = ()
    served_model_name: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    # parse special-token strings in chat message contents as control tokens (trusted callers)
    allow_special_tokens_in_content: bool = False
    # prompt text over this many UTF-8 bytes is refused before tokenizing (None: the window x
    # the vocabulary's longest token, a size no prompt that fits can exceed)
    max_prompt_bytes: int | None = None
    rule: str = "invariant"  # how sampled drafts are verified (SamplingParams.rule)
    header_timeout: float = HEADER_TIMEOUT_S  # seconds for a request's complete headers
    body_timeout: float = BODY_TIMEOUT_S  # seconds for its complete body (then 408)
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S  # on SIGTERM: for in-flight requests to end
    record: RecordOptions | None = None  # --record: append the traffic accepted to a file
    speculation_window: float = WINDOW_S  # seconds per judged window of the live metrics
    calibration: Path | None = None  # the bench report.json the deployment was chosen by

    def check(self) -> None:
        """Raise SpecDecodeError naming the first out-of-range option."""
        if not 1 <= self.max_batch <= 256:
            raise SpecDecodeError(f"--max-batch must be in 1..256, got {self.max_batch}")
        if self.max_seq_len < 16:
            raise SpecDecodeError(f"--max-seq-len must be >= 16, got {self.max_seq_len}")
        if self.max_queue < 0:
            raise SpecDecodeError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_prompt_bytes is not None and self.max_prompt_bytes < 1:
            raise SpecDecodeError(f"--max-prompt-bytes must be >= 1, got {self.max_prompt_bytes}")
        for flag, value in (("--header-timeout", self.header_timeout),
                            ("--body-timeout", self.body_timeout)):
            if not value > 0:
                raise SpecDecodeError(f"{flag} must be > 0 seconds, got {value}")
        if not self.shutdown_timeout >= 0:
            raise SpecDecodeError(f"--shutdown-timeout must be >= 0 seconds, got "
                                  f"{self.shutdown_timeout}")
        check_keys(self.api_keys)
        if not self.speculation_window > 0:
            raise SpecDecodeError(f"--speculation-window must be > 0 seconds, got "
                                  f"{self.speculation_window}")
        if self.record is not None:
            self.record.check()
        if self.calibration is not None:
            read_report(self.calibration)
        self.drafter.check()


@dataclass
class ServerState:
    served: ServedModel
    worker: EngineWorker
    metrics: ServerMetrics
    monitor: SpeculationMonitor
    max_inflight: int  # requests decoding + queued; one more is refused with 429
    max_body_bytes: int
    api_keys: tuple[ApiKey, ...]
    header_timeout: float = HEADER_TIMEOUT_S
    body_timeout: float = BODY_TIMEOUT_S
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S
    inflight: int = field(default=0)
    draining: bool = False  # shutting down: new requests get 503 (see server.shutdown)
    recorder: Recorder | None = None  # --record
    long_prompts: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="specdecode-tokenize", initializer=_lower_priority))

    def admit(self) -> None:
        """Count one more request in flight, or refuse it with 429 when the server is full.

        Called on the event loop only, so the count needs no lock.
        """
        if self.inflight >= self.max_inflight:
            raise APIError(429, f"the server is full ({self.inflight} requests running or "
                                "queued); retry later",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1


def build_state(loaded: LoadedModel, options: ServeOptions,
                costs: CostModel | None = None) -> ServerState:
    """The state of a server for `loaded`: drafter, engine (+ controller), engine thread.

    Under `auto`, the controller starts from `costs`, or from forward costs measured now.
    """
    options.check()
    model, tok = loaded.model, loaded.tokenizer
    factory = drafter_factory(options.drafter, model, capacity=options.max_seq_len,
                              tokenizer=tok)
    store = factory.store if factory is not None else None
    isolation = Isolation(factory.isolation if factory is not None else SUFFIX_ISOLATION[0])
    k = options.drafter.draft_length if factory is not None else 0
    window = min(int(model.cfg.max_position), options.max_seq_len - k - 1)
    if window < 2:
        raise SpecDecodeError(f"--max-seq-len {options.max_seq_len} leaves no room for a "
                              f"request with k={k}")
    controller = None
    if factory is not None and options.drafter.auto:
        controller = auto_controller(
            k, costs or calibrated_costs(model, _calibration_batches(options.max_batch), k),
            options.drafter.max_step_cost)
    engine = BatchEngine(model, options.max_batch, options.max_seq_len, controller=controller)
    name = options.served_model_name or loaded.name
    prompts = PromptEncoder(tok, options.allow_special_tokens_in_content)
    served = ServedModel(
        name=name, loaded_name=loaded.name, model=model, tokenizer=tok,
        eos_ids=loaded.eos_ids,
        make_drafter=factory, k=k, window=window, created=int(time.time()),
        prompts=prompts,
        max_prompt_bytes=options.max_prompt_bytes or window * prompts.longest_token_bytes,
        rule=options.rule, isolation=isolation,
    )
    metrics = ServerMetrics(name)
    metrics.set_backend(loaded.backend, loaded.backend_version(), loaded.exactness())
    if controller is not None and controller.guard is not None:
        guard = controller.guard
        metrics.watch_guard(lambda: float(guard.holds))
    metrics.set_memory(weight_bytes(model), _draft_weight_bytes(factory, model),
                       engine.cache.nbytes())
    if store is not None:
        metrics.watch_suffix_store(store, isolation.mode)
    monitor = speculation_monitor(loaded, options)
    metrics.watch_speculation(monitor)
    recorder = None
    if options.record is not None:
        recorder = Recorder(options.record, recorded_model(loaded, name),
                            metrics.observe_recorded)
    return ServerState(served, EngineWorker(engine, metrics, monitor), metrics, monitor,
                       options.max_batch + options.max_queue, options.max_body_bytes,
                       options.api_keys, options.header_timeout, options.body_timeout,
                       options.shutdown_timeout, recorder=recorder)


def speculation_monitor(loaded: LoadedModel, options: ServeOptions) -> SpeculationMonitor:
    """The live speculation monitor: the plain step calibrated now at batch 1 and the largest
    batch, and what differs from the --calibration report (checked before anything loads:
    `ServeOptions.check`)."""
    from specdecode.bench.inprocess import weights_digest

    plain = calibrate_plain_steps(loaded.model, loaded.tokenizer,
                                  _calibration_batches(options.max_batch))
    stale: dict[str, str] = {}
    if options.calibration is not None:
        report = read_report(options.calibration)
        stale = calibration_mismatches(report, loaded.name, weights_digest(loaded.source),
                                       loaded.precision, options.drafter.name)
        for why in stale.values():
            log.warning("--calibration: %s", why)
    return SpeculationMonitor(options.drafter.name, plain, options.speculation_window,
                              stale=stale)


def recorded_model(loaded: LoadedModel, served_name: str) -> dict[str, Any]:
    """What a recording names its model by: the id served, the checkpoint's name, precision
    and backend, its weights' and its tokenizer's sha256 (bench compares them)."""
    from specdecode.bench.inprocess import weights_digest

    return {"id": served_name, "name": loaded.name, "precision": loaded.precision,
            "backend": loaded.backend, "weights": weights_digest(loaded.source),
            "tokenizer": tokenizer_digest(loaded.tokenizer)}


def _draft_weight_bytes(factory: DrafterFactory | None, model: Target) -> int:
    """Bytes of the drafter's own weights (none for a drafter without a model)."""
    if factory is None:
        return 0
    module = factory().weights()
    return 0 if module is None else weight_bytes(module, shared=model)


def _calibration_batches(max_batch: int) -> list[int]:
    """Batch sizes whose forward cost is measured before serving: 1 and the largest (the cost
    model scales between them, and every served step refines the table)."""
    return sorted({1, max_batch})
