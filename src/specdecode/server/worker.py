"""The engine thread: the one thread that touches the BatchEngine.

Request handlers never call the engine. They send commands (submit, cancel) through a
thread-safe queue; the engine thread applies every pending command between two steps, so a
cancelled request's cache row is freed before the next step runs. Outputs go back through the
`deliver` callback given at submission (the server's wraps `loop.call_soon_threadsafe`).

A failure inside a step is logged and fails only the requests that were in that step (their
clients get an error event); the thread keeps serving the others. Engine-side metrics (the
speculation counters, the running/waiting and KV gauges, the steps by batch size) and the live
speculation monitor (per request label: server.speculation) are updated here after every step.

A request ended unfinished (cancelled: its client left or the server shut down; or failed)
leaves nothing in a `suffix` drafter's store of earlier requests: only requests generated to
their end (stop, length) are stored, so the store never holds half a reply, nor text a failed
step may have left inconsistent.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Literal

from specdecode.engine import BatchEngine, Generation, StepOutput
from specdecode.errors import SpecDecodeError
from specdecode.server.prometheus import ServerMetrics
from specdecode.server.speculation import Row, SpeculationMonitor

log = logging.getLogger("specdecode.server")


@dataclass(frozen=True)
class EngineFailure:
    """A request ended by the server, not by generation: an HTTP status, a message, and the
    error code the client sees (None: the status's default)."""

    message: str
    status: int = 500
    code: str | None = None


Event = StepOutput | EngineFailure
Deliver = Callable[[Event], None]


@dataclass(frozen=True)
class _Command:
    kind: Literal["submit", "cancel", "stop", "fail_all"]
    gen: Generation | None = None
    deliver: Deliver | None = None
    failure: EngineFailure | None = None
    label: str | None = None


@dataclass
class _Tracked:
    """A request the engine holds: where its outputs go and its counters at the last step."""

    deliver: Deliver
    label: str | None = None  # the request's label (server.speculation)
    drafted: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)


class EngineWorker:
    """Runs `engine.step()` in a loop on its own thread while there is work."""

    def __init__(self, engine: BatchEngine, metrics: ServerMetrics,
                 monitor: SpeculationMonitor | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.monitor = monitor
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._tracked: dict[Generation, _Tracked] = {}
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is None:
            self._publish()
            self._thread = threading.Thread(target=self._run, name="specdecode-engine",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the current step, fail every request still held with 503, end the thread."""
        if self._thread is not None:
            self._commands.put(_Command("stop"))
            self._thread.join(timeout)

    def submit(self, gen: Generation, deliver: Deliver, label: str | None = None) -> None:
        """Queue `gen`; its StepOutputs (or one EngineFailure) will be passed to `deliver`;
        its steps count under `label` in the live speculation metrics."""
        self._commands.put(_Command("submit", gen, deliver, label=label))

    def cancel(self, gen: Generation) -> None:
        """Stop `gen` and free its cache row before the next step (no-op once it finished)."""
        self._commands.put(_Command("cancel", gen))

    def fail_all(self, failure: EngineFailure) -> None:
        """End every request the engine holds (running or queued) with `failure`, before the
        next step; requests submitted later are served as usual."""
        self._commands.put(_Command("fail_all", failure=failure))

    def _run(self) -> None:
        running = True
        while running:
            try:
                running = self._drain(block=not self.engine.busy)
                if running and self.engine.busy:
                    self._step()
                self._publish()
            except Exception:  # the loop must survive anything; the step handles its own
                log.exception("engine thread: unexpected error")
        self._fail(list(self._tracked), EngineFailure("the server is shutting down", 503))
        self._publish()

    def _drain(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when idle); False on stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._apply(command):
                return False
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Command) -> bool:
        if command.kind == "fail_all" and command.failure is not None:
            self._fail(list(self._tracked), command.failure)
            return True
        gen = command.gen
        if command.kind == "stop" or gen is None:
            return False
        if command.kind == "cancel":
            if self._tracked.pop(gen, None) is not None:  # else it finished (and was stored)
                _discard(gen)
                self.engine.cancel(gen)
            return True
        assert command.deliver is not None
        try:
            self.engine.submit(gen)
        except SpecDecodeError as exc:
            _deliver(command.deliver, EngineFailure(str(exc), 400, "invalid_value"))
            return True
        self._tracked[gen] = _Tracked(command.deliver, command.label)
        return True

    def _step(self) -> None:
        """One engine step; outputs go to their requests, a failure fails that step's requests."""
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing the requests in that step")
            queued = set(map(id, self.engine.waiting))  # untouched by the failed step
            held = [gen for gen in self._tracked if id(gen) not in queued]
            self._fail(held, EngineFailure("the engine failed while running this request "
                                           "(logged on the server)"))
            return
        rows = []
        for gen, out in outputs:
            tracked = self._tracked.get(gen)
            if tracked is None:
                continue
            rows.append(self._observe(gen, tracked, len(out.tokens)))
            if out.finish_reason is not None:
                del self._tracked[gen]
            _deliver(tracked.deliver, out)
        if outputs:
            self.metrics.observe_batch(len(outputs))
            if self.monitor is not None:
                self.monitor.observe_step(self.engine.last_step_ns / 1e9, len(outputs), rows)

    def _observe(self, gen: Generation, tracked: _Tracked, emitted: int) -> Row:
        """Feed this step's speculation counts (the change since the last step) to metrics;
        the request's part of the step, for the monitor."""
        c = gen.counters
        per_pos = [now - before for now, before in
                   zip_longest(c.accepted_per_pos, tracked.per_pos, fillvalue=0)]
        drafted, accepted = c.drafted - tracked.drafted, c.accepted - tracked.accepted
        self.metrics.observe_step(drafted, accepted, per_pos)
        tracked.drafted, tracked.accepted = c.drafted, c.accepted
        tracked.per_pos = list(c.accepted_per_pos)
        return Row(tracked.label, drafted, accepted, emitted)

    def _fail(self, gens: list[Generation], failure: EngineFailure) -> None:
        """Remove `gens` from the engine and tell their clients why."""
        for gen in gens:
            tracked = self._tracked.pop(gen, None)
            try:
                _discard(gen)  # a failed step may have left its text half committed
                self.engine.cancel(gen)
            except Exception:
                log.exception("engine thread: could not cancel a failed request")
            if tracked is not None:
                _deliver(tracked.deliver, failure)

    def _publish(self) -> None:
        e = self.engine
        self.metrics.set_engine_state(
            running=len(e.active) + len(e.joining), waiting=len(e.waiting),
            used_rows=len(e.active), rows=e.max_batch, used_tokens=sum(e.cache.lengths),
            capacity_tokens=e.max_batch * e.max_seq_len,
        )


def _discard(gen: Generation) -> None:
    """Make gen's drafter forget its request before the engine ends it (the engine's release
    would have it stored, as for a request that finished)."""
    if gen.drafter is not None:
        gen.drafter.discard()


def _deliver(deliver: Deliver, event: Event) -> None:
    """Hand an event to a request; a closed event loop (shutdown) must not stop the engine."""
    try:
        deliver(event)
    except Exception:
        log.warning("engine thread: could not deliver an output (client side closed)")
