"""`serve --record FILE`: the traffic a server accepts, one workload line per request.

Every request the server accepts (it passed validation and admission; a 4xx refusal is not
recorded) is appended, when it ends, as one JSON line that `specdecode bench --workload FILE`
replays (bench.requests reads it):

    {"request": BODY, "route": "/v1/chat/completions", "arrival_s": 12.345, "session": "...",
     "id": "chatcmpl-...", "label": "team-a", "finish_reason": "stop", "prompt_tokens": 57,
     "output_tokens": 120, "latency_s": 1.9}

- `request` is the body as received (messages or prompt, sampling parameters, response_format,
  stop, metadata, user), `arrival_s` the time it was accepted, in seconds after the first
  request this server process recorded (`session`); `label` the presented API key's label
  and the request's `metadata.label` ("KEY/META" when both; null without either). Never the
  key. `output` (the text returned) only with `--record-outputs`.
- Each file begins, and each server start continues it, with a header line naming the session
  and the model it was recorded with (`{"specdecode_recording": 1, "session", "part", "model":
  {"id", "name", "precision", "backend", "weights", "tokenizer"}}`): a replay on another model
  or tokenizer says so.
- Lines are written in the order requests end, not arrive: a reader sorts them by arrival.
- Requests sent by `specdecode bench --endpoint` (header REPLAY_HEADER) are not recorded.

Written off the event loop: `Recorder.record` only queues the line (bounded: a writer that falls
behind drops lines, counted); a thread appends and flushes each one, so the file is readable
while the server runs, and `close` (at shutdown) writes what is queued and fsyncs. Bounded on
disk: past `max_bytes` the file is rotated (FILE -> FILE.1 -> ... -> FILE.<keep>, the oldest
deleted) and a new part begins with its header. A disk that is full or a file that cannot be
written is logged (once per kind of error, then every ERROR_LOG_EVERY-th) and counted in
/metrics (record_lines_total{outcome}), never a failed request: the request was served.

Prompts and outputs are user data: the file holds them in clear, readable by whoever can read
it; it is created with mode 0600 (docs/serving.md, "Record your traffic").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from specdecode.errors import SpecDecodeError
from specdecode.models.tokenizer import Tokenizer

log = logging.getLogger("specdecode.server")

RECORD_FORMAT = 1
HEADER_KEY = "specdecode_recording"  # the key that marks a header line
# The header `bench --endpoint` sends: a replay is not recorded again (replaying a recording
# against the server recording it would otherwise feed it back into its own file)
REPLAY_HEADER = "x-specdecode-replay"
DEFAULT_MAX_MIB = 256.0
DEFAULT_KEEP = 3  # rotated parts kept beside the file
QUEUE_LINES = 10_000  # lines waiting for the writer; more are dropped (and counted)
ERROR_LOG_EVERY = 1000  # after the first error of a kind, log every this-many-th
FILE_MODE = 0o600  # prompts are user data: readable by the server's user only
# outcomes record_lines_total counts: written, dropped (the queue was full), failed (the disk)
OUTCOMES = ("written", "dropped", "failed")


@dataclass(frozen=True)
class RecordOptions:
    """Where and how to record: the file, whether outputs are kept, the rotation size and how
    many rotated parts stay."""

    path: Path
    outputs: bool = False
    max_bytes: int = int(DEFAULT_MAX_MIB * 2**20)
    keep: int = DEFAULT_KEEP

    def check(self) -> None:
        """SpecDecodeError naming the flag when the file cannot be recorded to: its folder
        missing or not writable, a folder in its place, a size or count out of range."""
        if self.max_bytes < 4096:
            raise SpecDecodeError(f"--record-max-mib must be at least 1/256 (4 KiB), got "
                                  f"{self.max_bytes / 2**20:g}")
        if not 1 <= self.keep <= 100:
            raise SpecDecodeError(f"--record-keep must be in 1..100, got {self.keep}")
        if self.path.is_dir():
            raise SpecDecodeError(f"--record {self.path}: is a folder, not a file")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
            os.close(fd)
        except OSError as exc:
            raise SpecDecodeError(f"--record {self.path}: cannot write it "
                                  f"({exc.strerror or exc})") from None


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's definition and chat template: two prompts render to the same
    ids exactly when these are equal (bench compares a recording's with its target's)."""
    digest = hashlib.sha256(tokenizer.to_json().encode("utf-8"))
    digest.update(b"\0" + (tokenizer.chat_template or "").encode("utf-8"))
    return digest.hexdigest()


class Recorder:
    """Appends recorded requests to a file from a thread of its own (see the module docstring).

    `observe(outcome)` is told of every line: "written", "dropped" or "failed" (the server
    counts them in /metrics).
    """

    def __init__(self, options: RecordOptions, model: dict[str, Any],
                 observe: Callable[[str], None] = lambda outcome: None) -> None:
        self.options = options
        self.session = uuid.uuid4().hex
        self.model = model
        self.observe = observe
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self._first: float | None = None  # monotonic time of the first request recorded
        self._lines: queue.Queue[bytes | None] = queue.Queue(QUEUE_LINES)
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._size = 0
        self._part = 0
        self._errors: dict[str, int] = {}
        self._count_lock = threading.Lock()

    # ------------------------------------------------------------------- the event loop's side

    def arrival(self) -> float:
        """Seconds since the first request of this session (0.0 for the first one)."""
        now = time.monotonic()
        if self._first is None:
            self._first = now
        return round(now - self._first, 6)

    def record(self, entry: dict[str, Any]) -> None:
        """Queue one request's line; never blocks, never raises (a full queue drops it)."""
        try:
            line = json.dumps({**entry, "session": self.session}, ensure_ascii=False,
                              separators=(",", ":"), allow_nan=False).encode("utf-8") + b"\n"
            self._lines.put_nowait(line)
        except queue.Full:
            self._count("dropped", "the writer is behind: a line was dropped")
        except (TypeError, ValueError) as exc:  # not JSON-able: a bug, but not a failed request
            self._count("failed", f"a line could not be encoded ({exc})")

    # ---------------------------------------------------------------------- lifetime

    def start(self) -> None:
        """Start the writer thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specdecode-record",
                                             daemon=True)
            self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Write every queued line, fsync and close the file (at shutdown)."""
        if self._thread is not None:
            self._lines.put(None)
            self._thread.join(timeout)
            self._thread = None

    # ---------------------------------------------------------------------- the writer

    def _run(self) -> None:
        while (line := self._lines.get()) is not None:
            self._write(line)
        self._close_fd(sync=True)

    def _write(self, line: bytes) -> None:
        try:
            fd = self._open()
            if self._size > 0 and self._size + len(line) > self.options.max_bytes:
                fd = self._rotate()
            _write_all(fd, line)  # unbuffered: readable by a reader while the server runs
            self._size += len(line)
        except OSError as exc:
            self._cut_back()
            self._close_fd(sync=False)  # reopened (and the header written) on the next line
            self._count("failed", f"cannot write {self.options.path}: {exc.strerror or exc}")
            return
        self._count("written")

    def _open(self) -> int:
        """The open file; opening it writes this part's header line first."""
        if self._fd is None:
            fd = os.open(self.options.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
            try:
                self._size = os.fstat(fd).st_size
                _write_all(fd, self._header())
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
            self._size = os.fstat(fd).st_size
        return self._fd

    def _cut_back(self) -> None:
        """Drop what a failed write left of its line (a full disk may take half of one), so
        the file stays whole lines; where it cannot be cut, the reader names the line."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)

    def _header(self) -> bytes:
        data = {HEADER_KEY: RECORD_FORMAT, "session": self.session, "part": self._part,
                "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "outputs": self.options.outputs, "model": self.model}
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    def _rotate(self) -> int:
        """FILE -> FILE.1 -> ... -> FILE.<keep> (the oldest deleted); a new part begins."""
        self._close_fd(sync=True)
        path = self.options.path
        for n in range(self.options.keep, 0, -1):
            older = path.with_name(f"{path.name}.{n}")
            newer = path if n == 1 else path.with_name(f"{path.name}.{n - 1}")
            if newer.exists():
                os.replace(newer, older)
        self._part += 1
        return self._open()

    def _close_fd(self, sync: bool) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if sync:
                os.fsync(fd)
        except OSError as exc:
            self._count("failed", f"cannot sync {self.options.path}: {exc.strerror or exc}",
                        count=False)
        finally:
            os.close(fd)

    def _count(self, outcome: str, problem: str = "", count: bool = True) -> None:
        """Count a line's outcome (and tell `observe`); log a problem the first time its kind
        is seen, then every ERROR_LOG_EVERY-th time."""
        with self._count_lock:  # the event loop (dropped) and the writer (the rest) count
            if count:
                self.counts[outcome] += 1
            seen = self._errors.get(problem, 0)
            if problem:
                self._errors[problem] = seen + 1
        if count:
            self.observe(outcome)
        if problem and seen % ERROR_LOG_EVERY == 0:
            log.warning("--record: %s (the request was served; %d such lines so far)",
                        problem, seen + 1)


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a write may take part of them)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
