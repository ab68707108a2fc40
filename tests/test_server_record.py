"""`serve --record`: the recorder's file (lines, headers, rotation, a full disk, a writer that
falls behind), and a server recording what it accepts: the body as received, arrival times,
labels from API keys and `metadata.label`, never the key, outputs only when asked."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.server import record
from specdecode.server.middleware import ApiKey, check_keys
from specdecode.server.record import HEADER_KEY, REPLAY_HEADER, Recorder, RecordOptions
from tests.test_server import NO_EOS, serving, tiny  # noqa: F401  (the fixture)

MODEL = {"id": "tiny", "weights": "w", "tokenizer": "t"}


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_lines_follow_a_header_and_are_readable_before_close(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    rec = Recorder(RecordOptions(path), MODEL)
    rec.start()
    assert rec.arrival() == 0.0
    rec.record({"request": {"messages": [{"role": "user", "content": "hi"}]}, "arrival_s": 0.0})
    assert _eventually(lambda: path.exists() and len(lines(path)) == 2)  # flushed per line
    header, line = lines(path)
    assert header[HEADER_KEY] == 1 and header["model"] == MODEL and header["part"] == 0
    assert line["session"] == header["session"] and line["request"]["messages"][0]["content"] \
        == "hi"
    rec.close()
    assert rec.counts == {"written": 1, "dropped": 0, "failed": 0}
    assert os.stat(path).st_mode & 0o777 == 0o600  # user data: the server's user only


def test_a_second_session_appends_its_own_header(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    for _ in range(2):
        rec = Recorder(RecordOptions(path), MODEL)
        rec.start()
        rec.record({"arrival_s": rec.arrival()})
        rec.close()
    got = lines(path)
    assert [HEADER_KEY in x for x in got] == [True, False, True, False]
    assert got[0]["session"] != got[2]["session"]


def test_rotation_keeps_each_part_whole_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    rec = Recorder(RecordOptions(path, max_bytes=4096, keep=2), MODEL)
    rec.start()
    for i in range(60):
        rec.record({"arrival_s": float(i), "request": {"prompt": "x" * 200}})
    rec.close()
    parts = [path, path.with_name("rec.jsonl.1"), path.with_name("rec.jsonl.2")]
    assert all(p.exists() for p in parts) and not path.with_name("rec.jsonl.3").exists()
    for part in parts:
        got = lines(part)
        assert HEADER_KEY in got[0] and all(HEADER_KEY not in x for x in got[1:])
        assert part.stat().st_size <= 4096
    newest = [x["arrival_s"] for x in lines(path)[1:]]
    assert newest[-1] == 59.0 and newest == sorted(newest)
    assert rec.counts["written"] == 60


def test_a_full_disk_is_counted_and_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    seen: list[str] = []
    rec = Recorder(RecordOptions(Path("/dev/full")), MODEL, seen.append)
    rec.start()
    for i in range(3):
        rec.record({"arrival_s": float(i)})
    rec.close()
    assert rec.counts == {"written": 0, "dropped": 0, "failed": 3} and seen == ["failed"] * 3
    warnings = [r for r in caplog.records if "--record" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()  # once per kind


def test_a_writer_that_falls_behind_drops_lines_without_blocking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """record() only queues: with the writer stuck, 50 calls take no time and the lines the
    queue cannot hold are dropped and counted (broken variant: a blocking put would hang)."""
    monkeypatch.setattr(record, "QUEUE_LINES", 10)
    rec = Recorder(RecordOptions(tmp_path / "rec.jsonl"), MODEL)
    stuck = threading.Event()
    monkeypatch.setattr(rec, "_write", lambda line: stuck.wait(30))
    rec.start()
    start = time.perf_counter()
    for i in range(50):
        rec.record({"arrival_s": float(i)})
    assert time.perf_counter() - start < 1.0
    assert rec.counts["dropped"] >= 39
    stuck.set()
    rec.close()


def test_unusable_paths_are_refused_before_serving(tmp_path: Path) -> None:
    for path, why in ((tmp_path / "missing" / "rec.jsonl", "cannot write"),
                      (tmp_path, "is a folder")):
        with pytest.raises(SpecDecodeError, match=why):
            RecordOptions(path).check()
    readonly = tmp_path / "ro.jsonl"
    readonly.write_text("")
    readonly.chmod(0o400)
    if os.geteuid() != 0:  # root writes anyway
        with pytest.raises(SpecDecodeError, match="cannot write"):
            RecordOptions(readonly).check()
    with pytest.raises(SpecDecodeError, match="record-keep"):
        RecordOptions(tmp_path / "x", keep=0).check()


def test_api_key_labels_parse() -> None:
    assert ApiKey.parse("team-a=s3cret") == ApiKey("s3cret", "team-a")
    assert ApiKey.parse("s3cret") == ApiKey("s3cret", None)
    assert ApiKey.parse("=abc==") == ApiKey("abc==", None)  # a key holding "="
    assert ApiKey.parse("ops=abc==") == ApiKey("abc==", "ops")
    assert ApiKey.parse("a b=c") == ApiKey("a b=c", None)  # not a label: the whole is the key
    assert "s3cret" not in repr(ApiKey.parse("team-a=s3cret"))
    for bad in ("", "team-a=", "  "):
        with pytest.raises(SpecDecodeError, match="must not be empty"):
            ApiKey.parse(bad)
    with pytest.raises(SpecDecodeError, match="twice"):
        check_keys([ApiKey("k", "a"), ApiKey("k", "b")])


def test_the_server_records_what_it_accepts_with_labels_never_keys(
        tiny: LoadedModel, tmp_path: Path) -> None:  # noqa: F811
    """Two keys with labels: each request's line holds its body as sent, its arrival time,
    its key's label joined with metadata.label, its finish reason and lengths, and no key;
    a refused request (400), an unauthenticated one (401) and a replay (bench --endpoint's
    header) are not recorded."""
    path = tmp_path / "rec.jsonl"
    keys = (ApiKey("key-one", "team-a"), ApiKey("key-two", "team-b"))
    with serving(tiny, drafter="none", api_keys=keys, record=RecordOptions(path)) as (srv, _):
        bodies = [
            ("key-one", {"model": "tiny", "prompt": "t3 t4", "max_tokens": 4,
                         "logit_bias": NO_EOS, "temperature": 0}),
            ("key-two", {"model": "tiny", "messages": [{"role": "user", "content": "t5 t6"}],
                         "max_tokens": 3, "stream": True, "logit_bias": NO_EOS,
                         "metadata": {"label": "app1", "category": "code"}}),
        ]
        for key, body in bodies:
            route = "chat/completions" if "messages" in body else "completions"
            response = httpx.post(f"{srv.url}/v1/{route}", json=body, timeout=30,
                                  headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
            time.sleep(0.05)
        refused = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                             json={"model": "tiny", "prompt": "t3", "max_tokens": 0},
                             headers={"Authorization": "Bearer key-one"})
        assert refused.status_code == 400
        assert httpx.post(f"{srv.url}/v1/completions", json=bodies[0][1],
                          timeout=30).status_code == 401
        replayed = httpx.post(f"{srv.url}/v1/completions", json=bodies[0][1], timeout=30,
                              headers={"Authorization": "Bearer key-one",
                                       REPLAY_HEADER: "1"})  # bench --endpoint's: not again
        assert replayed.status_code == 200
    text = path.read_text(encoding="utf-8")
    assert "key-one" not in text and "key-two" not in text
    header, first, second = lines(path)
    assert header["model"]["id"] == "tiny" and len(header["model"]["tokenizer"]) == 64
    assert first["request"] == bodies[0][1] and first["route"] == "/v1/completions"
    assert first["label"] == "team-a" and first["finish_reason"] == "length"
    assert first["output_tokens"] == 4 and first["prompt_tokens"] == 2 and "output" not in first
    assert first["arrival_s"] == 0.0 < second["arrival_s"] < 10
    assert second["request"] == bodies[1][1] and second["label"] == "team-b/app1"
    assert second["route"] == "/v1/chat/completions" and second["output_tokens"] == 3


def test_outputs_are_recorded_only_when_asked(tiny: LoadedModel,  # noqa: F811
                                              tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    body = {"model": "tiny", "prompt": "t3 t4", "max_tokens": 5, "temperature": 0,
            "logit_bias": NO_EOS}
    with serving(tiny, drafter="none", record=RecordOptions(path, outputs=True)) as (srv, _):
        reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30).json()
    line = lines(path)[1]
    assert line["output"] == reply["choices"][0]["text"] and line["label"] is None


def _eventually(condition: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())
