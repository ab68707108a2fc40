"""Shutdown with a real signal to a real `specdecode serve` process (issue 26, item 3).

On SIGTERM the server stops admitting (503 with Retry-After, /health 503), lets the requests
in flight finish for up to --shutdown-timeout, then ends the rest explicitly: a stream gets an
error event and `data: [DONE]`, a non-streamed request a 503 body. Then the process exits.

The server serves a tiny random checkpoint on a free loopback port with one torch thread;
every request and wait is bounded in time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import make_checkpoint
from tests.test_server import metric, wait_for

NO_EOS = {"1": -100, "2": -100}
SHUTDOWN_TIMEOUT_S = 3.0
SERVE = "from specdecode.cli import main; raise SystemExit(main())"


class _Url:
    def __init__(self, url: str) -> None:
        self.url = url


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`specdecode serve` of a tiny checkpoint with room for 4000-token generations."""
    folder = make_checkpoint(tmp_path / "tiny", max_position_embeddings=4096)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", "--model", str(folder), "--drafter", "none",
         "--port", "0", "--max-batch", "8", "--max-seq-len", "4096", "--log-level", "warning",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
        stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    lines: list[str] = []
    url = None
    deadline = time.monotonic() + 120
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stderr.readline()
        lines.append(line)
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        url = match.group(1) if match else None
    assert url is not None, "".join(lines)

    def healthy() -> bool:  # the banner comes before uvicorn listens
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_for(healthy, 60)
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining its log
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _stream(url: str, max_tokens: int, events: list[str], started: threading.Event) -> None:
    """A streamed greedy completion; every `data:` payload lands in `events`."""
    body = {"model": "tiny", "prompt": "t3 t4 t5", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logit_bias": NO_EOS}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as exc:
        events.append(f"client error: {type(exc).__name__}")
    finally:
        started.set()


def _whole(url: str, out: list[Any]) -> None:
    body = {"model": "tiny", "prompt": "t3 t4", "max_tokens": 4000, "temperature": 0,
            "logit_bias": NO_EOS}
    try:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        out.append((response.status_code, response.json()))
    except (httpx.HTTPError, ValueError) as exc:
        out.append(("client error", type(exc).__name__))


@pytest.mark.slow  # a `specdecode serve` process, signalled
def test_sigterm_drains_then_ends_the_rest_explicitly(
        server: tuple[subprocess.Popen[str], str]) -> None:
    proc, url = server
    srv = _Url(url)
    long_events: list[list[str]] = [[] for _ in range(3)]
    short_events: list[str] = []
    whole: list[Any] = []
    threads = []
    for events in long_events:
        started = threading.Event()
        threads.append(threading.Thread(target=_stream, args=(url, 4000, events, started)))
        threads[-1].start()
        assert started.wait(30)
    threads.append(threading.Thread(target=_whole, args=(url, whole)))
    threads[-1].start()
    assert wait_for(lambda: metric(srv, "num_requests_running") == 4, 20), (  # type: ignore[arg-type]
        metric(srv, "num_requests_running"), whole, [e[-1:] for e in long_events])  # type: ignore[arg-type]
    short_started = threading.Event()
    threads.append(threading.Thread(target=_stream, args=(url, 150, short_events, short_started)))
    threads[-1].start()
    assert short_started.wait(30)

    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.3)  # the server sees the signal within its 0.1 s tick
    refused = httpx.post(f"{url}/v1/completions", timeout=10,
                         json={"model": "tiny", "prompt": "t3", "max_tokens": 2})
    health = httpx.get(f"{url}/health", timeout=10)
    for thread in threads:
        thread.join(30)
    ended = time.monotonic() - signalled
    exit_code = proc.wait(30)
    exited = time.monotonic() - signalled
    report = (f"after SIGTERM: new request {refused.status_code}, /health "
              f"{health.status_code}; last events: short stream {short_events[-2:]}, long "
              f"streams {[e[-1] for e in long_events]}, whole {whole}; all ended {ended:.1f} s "
              f"after the signal; exit {exit_code} after {exited:.1f} s")
    print("\n" + report)

    assert refused.status_code == 503 and refused.headers.get("Retry-After"), refused.text
    assert refused.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503
    # finished within the drain time: a normal end
    assert short_events[-1] == "[DONE]", short_events[-3:]
    assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    # still running when it ran out: an explicit error event, then [DONE]
    for events in long_events:
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    status, body = whole[0]
    assert status == 503 and body["error"]["code"] == "shutting_down", whole
    assert SHUTDOWN_TIMEOUT_S - 0.5 < ended < SHUTDOWN_TIMEOUT_S + 8, report
    assert exit_code in (0, -signal.SIGTERM) and exited < SHUTDOWN_TIMEOUT_S + 15, report
