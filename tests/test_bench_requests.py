"""Workloads of OpenAI requests (bench.requests, bench.workloads): recordings of `serve
--record` and bare request bodies, checked as the server checks them, in arrival order, read a
line at a time; every bad input of issue 47 named."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from specdecode.bench.requests import CHAT, COMPLETIONS, SESSION_GAP_S
from specdecode.bench.workloads import load_workload, read_prompts, workload_fingerprint
from specdecode.errors import SpecDecodeError
from specdecode.server.record import HEADER_KEY

MODEL = {"id": "SmolLM2-135M-Instruct", "weights": "a" * 64, "tokenizer": "b" * 64}


def chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": text}], **fields}


def recorded(text: str, at: float, session: str = "s1", **fields: Any) -> dict[str, Any]:
    return {"request": chat(text, max_tokens=16), "route": CHAT, "arrival_s": at,
            "session": session, "id": f"chatcmpl-{text}", "label": "team-a",
            "finish_reason": "stop", "output_tokens": 9, **fields}


def header(session: str = "s1", model: dict[str, Any] | None = None) -> dict[str, Any]:
    return {HEADER_KEY: 1, "session": session, "part": 0, "model": model or MODEL}


def write(path: Path, lines: list[Any], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + tail, encoding="utf-8")
    return path


def test_a_recording_reads_as_requests_in_arrival_order(tmp_path: Path) -> None:
    """Lines written as requests ended come back sorted by arrival, from 0, with their bodies
    as sent, their label as category, the models they were recorded with, and a note."""
    path = write(tmp_path / "rec.jsonl", [header(), recorded("b", 2.5), recorded("a", 1.0),
                                          recorded("c", 4.0)])
    w = load_workload(path)
    assert [p.id for p in w.prompts] == ["chatcmpl-a", "chatcmpl-b", "chatcmpl-c"]
    assert [p.arrival_s for p in w.prompts] == [0.0, 1.5, 3.0]
    first = w.prompts[0]
    assert first.request == chat("a", max_tokens=16) and first.route == CHAT
    assert first.turns == ["a"] and first.category == "team-a" and first.max_tokens == 16
    assert first.temperature == 1.0  # OpenAI's default, as the server samples
    assert w.recorded_with == [MODEL] and any("out of arrival order" in n for n in w.notes)


def test_bare_bodies_and_plain_lines_are_told_apart(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    path = write(tmp_path / "log.jsonl", [
        chat("hi", temperature=0, metadata={"category": "qa"},
             response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                     "schema": schema}}),
        {"model": "m", "prompt": "Once upon", "max_tokens": 8, "stop": ["\n"]},
        {"prompt": "plain format", "category": "code"},
    ])
    a, b, c = load_workload(path).prompts
    assert a.route == CHAT and a.category == "qa" and a.temperature == 0.0
    assert a.constraint is not None and a.constraint["kind"] == "json_schema"
    assert b.route == COMPLETIONS and b.request is not None and b.turns == ["Once upon"]
    assert c.request is None and c.category == "code" and c.arrival_s is None


def test_lines_the_server_would_refuse_are_named_and_skipped_or_strict(tmp_path: Path) -> None:
    bad = [chat("x", n=2), chat("x", temperature=3), chat("x", tools=[{"type": "function"}]),
           chat("x", frobnicate=1), {"request": {"model": "m"}},
           chat("x", response_format={"type": "json_schema"}),
           {"request": chat("x"), "route": "/v1/embeddings"},
           chat("x", metadata={"label": "has space"})]
    path = write(tmp_path / "bad.jsonl", [recorded("ok", 0.0), *bad])
    prompts, skipped = read_prompts(path)
    assert [p.turns for p in prompts] == [["ok"]]
    assert len(skipped) == len(bad)
    for line, words in zip(skipped, ["n = 2", "temperature", "tools", "frobnicate",
                                     "neither", "json_schema", "route", "metadata"],
                           strict=True):
        assert f"{path}:" in line and words in line, line
    with pytest.raises(SpecDecodeError, match=r"bad.jsonl:2: n = 2"):
        load_workload(path, strict=True)


def test_a_recording_cut_mid_line_replays_the_rest(tmp_path: Path) -> None:
    cut = json.dumps(recorded("d", 9.0))[:40]
    path = write(tmp_path / "rec.jsonl", [header(), recorded("a", 0.0), recorded("b", 1.0)],
                 tail=cut)
    for strict in (False, True):  # a crash artifact, not a malformed file
        w = load_workload(path, strict=strict)
        assert [p.turns for p in w.prompts] == [["a"], ["b"]]
        assert w.skipped == [f"{path}:4: cut short: the file ends mid-line (a recording "
                             "truncated, or still being written)"]
    middle = write(tmp_path / "mid.jsonl", [recorded("a", 0.0)], tail=cut + "\n")
    assert "invalid JSON" in read_prompts(middle)[1][0]  # mid-file: an ordinary bad line


def test_arrival_offsets_negative_or_malformed_are_named(tmp_path: Path) -> None:
    path = write(tmp_path / "rec.jsonl", [recorded("a", 0.0), recorded("b", -2.0),
                                          recorded("c", "soon"), recorded("d", 1.0)])
    prompts, skipped = read_prompts(path)
    assert [p.turns[0] for p in prompts] == ["a", "d"]
    assert "negative" in skipped[0] and ":2:" in skipped[0]
    assert "arrival_s" in skipped[1] and ":3:" in skipped[1]


def test_sessions_replay_back_to_back_and_timestamps_count_from_the_first(
        tmp_path: Path) -> None:
    path = write(tmp_path / "rec.jsonl", [
        header("s1"), recorded("a", 0.0), recorded("b", 2.0),
        header("s2"), recorded("c", 5.0, session="s2"), recorded("d", 6.0, session="s2")])
    w = load_workload(path)
    assert [p.arrival_s for p in w.prompts] == [0.0, 2.0, 2.0 + SESSION_GAP_S,
                                                3.0 + SESSION_GAP_S]
    assert any("2 recording sessions" in n for n in w.notes)
    logged = write(tmp_path / "proxy.jsonl", [
        {"timestamp": "2026-12-07T10:00:02Z", "request": chat("b")},
        {"timestamp": "2026-12-07T10:00:00.500Z", "request": chat("a")}])
    w = load_workload(logged)
    assert [(p.turns[0], p.arrival_s) for p in w.prompts] == [("a", 0.0), ("b", 1.5)]


def test_the_fingerprint_covers_what_is_sent_and_when(tmp_path: Path) -> None:
    one = load_workload(write(tmp_path / "a.jsonl", [recorded("a", 0.0), recorded("b", 1.0)]))
    two = load_workload(write(tmp_path / "b.jsonl", [recorded("a", 0.0), recorded("b", 2.0)]))
    assert workload_fingerprint(one.prompts) != workload_fingerprint(two.prompts)


def test_a_large_recording_is_streamed_not_loaded_whole(tmp_path: Path) -> None:
    """A 20 MB recording read with a limit of 10 requests peaks far below the file's size
    (broken variant: reading the bytes whole, as the reader did, peaks at the file's size)."""
    path = tmp_path / "big.jsonl"
    pad = "x" * 2000
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(header()) + "\n")
        for i in range(10000):
            f.write(json.dumps(recorded(f"{i} {pad}", i * 0.01, id=f"r{i}")) + "\n")
    size = path.stat().st_size
    assert size > 20e6
    load_workload(write(tmp_path / "small.jsonl", [recorded("a", 0.0)]))  # imports, untraced
    tracemalloc.start()
    try:
        w = load_workload(path, limit_per_category=10)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        whole = path.read_bytes()
        _, whole_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(w.prompts) == 10 and len(whole) == size
    assert peak < 2e6 < size <= whole_peak, (peak, whole_peak)


def test_an_overlong_line_is_malformed_not_loaded(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from specdecode.bench import workloads

    monkeypatch.setattr(workloads, "MAX_LINE_BYTES", 1000)
    path = write(tmp_path / "rec.jsonl", [recorded("x" * 2000, 0.0), recorded("b", 1.0)])
    prompts, skipped = read_prompts(path)
    assert [p.turns for p in prompts] == [["b"]] and "longer than 1000 bytes" in skipped[0]
