"""Issue 47's loop end to end, on a real `specdecode serve` process: serve with --record and a
labelled key, send traffic on a Poisson schedule, replay the recording open loop against the
server and in process, read the reports. The scheduling check: every replayed request's
scheduled start against its actual start in the replay's own log (results.jsonl), within a
generous 250 ms (a correctness check, not a speed target)."""

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.cli_run import run_cli
from tests.conftest import make_checkpoint
from tests.test_server import wait_for

SERVE = "from specdecode.cli import main; raise SystemExit(main())"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
KEY = "e2e-secret-key"
TOLERANCE_S = 0.25
REQUESTS = 16
RATE = 6.0  # requests per second


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path, Path]]:
    """`specdecode serve --record` of a tiny checkpoint (ngram drafter, k 3, 4 rows)."""
    folder = make_checkpoint(tmp_path / "tiny")
    (folder / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    record = tmp_path / "recorded.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", "--model", str(folder), "--drafter", "ngram",
         "--k", "3", "--port", "0", "--max-batch", "4", "--max-seq-len", "256",
         "--log-level", "warning", "--record", str(record), "--api-key", f"team-a={KEY}",
         "--threads", "1"],
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
    assert any("recording every request accepted" in x for x in lines), lines

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_for(healthy, 60)
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    try:
        yield proc, url, record, folder
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def send(url: str, i: int, at: float, start: float, client: httpx.Client
         ) -> tuple[int, float]:
    """Send request i when due; (status, when it was sent, from `start`)."""
    time.sleep(max(0.0, start + at - time.monotonic()))
    sent = time.monotonic() - start
    body: dict[str, Any] = {
        "model": "tiny", "max_tokens": 12 + i % 5, "temperature": 0,
        "messages": [{"role": "user", "content": " ".join(f"t{3 + (i + j) % 7}"
                                                          for j in range(6 + i % 4))}],
        "logit_bias": {"1": -100, "2": -100},
        "metadata": {"category": ["code", "qa", "chat"][i % 3], "label": "app"}}
    return client.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"}).status_code, sent


def scheduling_check(out: Path) -> list[dict[str, Any]]:
    """Every sample of the replay's log: started within TOLERANCE_S of when it was due."""
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    samples = [x["data"] for x in lines if x["kind"] == "sample"]
    for s in samples:
        assert s["scheduled_s"] is not None and s["sent_s"] is not None, s
        assert abs(s["sent_s"] - s["scheduled_s"]) <= TOLERANCE_S, s
    return samples


@pytest.mark.slow  # a `specdecode serve` process
def test_record_then_replay_open_loop_then_report(
        served: tuple[subprocess.Popen[str], str, Path, Path], tmp_path: Path) -> None:
    proc, url, record, folder = served
    gaps = np.random.default_rng(3).exponential(1 / RATE, REQUESTS)
    times = [0.0, *np.cumsum(gaps[1:]).tolist()]
    limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=REQUESTS)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(REQUESTS) as pool:
        start = time.monotonic()
        sent = list(pool.map(lambda a: send(url, a[0], a[1], start, client), enumerate(times)))
    assert [code for code, _ in sent] == [200] * REQUESTS

    # readable while the server runs: one line per request after the header, labelled
    assert wait_for(lambda: len(record.read_text().splitlines()) == REQUESTS + 1, 10)
    recorded = [json.loads(x) for x in record.read_text().splitlines()]
    assert "specdecode_recording" in recorded[0] and KEY not in record.read_text()
    assert {x["label"] for x in recorded[1:]} == {"team-a/app"}
    offsets = sorted(x["arrival_s"] for x in recorded[1:])
    sends = sorted(t for _, t in sent)
    assert offsets[0] == 0.0  # arrivals as the client sent them (its connection setup aside)
    assert np.allclose(np.array(offsets) - offsets[0], np.array(sends) - sends[0], atol=0.15)

    live = httpx.get(f"{url}/v1/speculation", timeout=10,
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [x["label"] for x in live["labels"]] == ["team-a/app"]
    assert live["labels"][0]["total"]["row_steps"] > 0

    # replay against the live server, open loop at the recorded times
    out = tmp_path / "endpoint"
    code, stdout, err = run_cli([
        "bench", "--endpoint", f"served={url}", "--api-key", KEY, "--workload", str(record),
        "--arrivals", "recorded", "--batch-sizes", "4", "--out", str(out), "--quiet",
        "--resamples", "200", "--slo", "ttft=1,tpot=0.2"])
    assert code == 0, err
    samples = scheduling_check(out)
    assert len(samples) == REQUESTS
    report = json.loads((out / "report.json").read_text())
    (traffic,) = report["traffic"]["configs"]
    assert traffic["measured_rate"] == pytest.approx(traffic["scheduled_rate"], rel=0.2)
    assert traffic["batch_source"] == "server engine_steps_total"
    assert "traffic (open loop at the recorded arrival times" in stdout

    # and in process: plain against the lookup on the same recorded traffic, a recommendation
    out = tmp_path / "inprocess"
    code, stdout, err = run_cli([
        "bench", "--model", str(folder), "--workload", str(record), "--arrivals", "recorded",
        "--configs", "plain;ngram:k=3", "--batch-sizes", "4", "--threads", "1", "--out",
        str(out), "--quiet", "--resamples", "200"])
    assert code == 0, err
    assert len(scheduling_check(out)) == 2 * REQUESTS
    assert re.search(r"^(Enable|Do not enable) speculative decoding", stdout, re.M), stdout

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) in (0, -signal.SIGTERM)
    # the replay against the server (and its probe) was not recorded again
    after = [json.loads(x) for x in record.read_text().splitlines()]
    assert len([x for x in after if "request" in x]) == REQUESTS
