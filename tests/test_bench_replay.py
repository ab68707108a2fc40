"""Open-loop replay (bench.arrivals, bench.openloop, report.traffic): arrival schedules, windows,
the in-process and HTTP replays on a tiny model (requests start when due, queue when the rows
are full, and say so), the traffic report, goodput at an SLO, resume, and bad input."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from specdecode.bench.arrivals import Arrivals, offsets, parse_arrivals
from specdecode.bench.openloop import blocks, make_windows
from specdecode.bench.records import ReplayRecord, RequestSample
from specdecode.bench.workloads import Prompt
from specdecode.errors import SpecDecodeError
from specdecode.models import backends
from specdecode.models.loading import LoadedModel
from specdecode.report.traffic import Slo, batch_distribution, parse_slo, rates
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
NO_EOS = {"1": -100, "2": -100}
TOLERANCE_S = 0.25  # the scheduling check: generous, not a speed target


@pytest.fixture(autouse=True)
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_checkpoint(tmp_path_factory.mktemp("tiny") / "ck")
    (folder / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return folder


def recording(path: Path, times: list[float], tokens: int = 12,
              session: str = "s1") -> Path:
    """A recording of chat requests arriving at `times` (written out of order, as a server
    writes them: by when they ended)."""
    lines: list[dict[str, Any]] = [{"specdecode_recording": 1, "session": session,
                                    "model": {"id": "ck"}}]
    for i, t in sorted(enumerate(times), key=lambda x: -x[1]):
        lines.append({"request": {"model": "ck", "messages": [
            {"role": "user", "content": f"t{5 + i % 80} t6 t7 t5 t6"}], "max_tokens": tokens,
            "temperature": 0, "logit_bias": NO_EOS,
            "metadata": {"category": "code" if i % 2 else "qa"}},
            "route": "/v1/chat/completions", "arrival_s": t, "session": session,
            "id": f"r{i}"})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def run(argv: list[str]) -> tuple[int, str, str]:
    return run_cli(argv)


def samples(out: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    return [x["data"] for x in lines if x["kind"] == "sample"]


# ------------------------------------------------------------------------ schedules


def test_arrivals_parse_and_bad_values_are_named() -> None:
    assert parse_arrivals("poisson:2.5", 2.0) == Arrivals("poisson", 2.5, 2.0)
    assert parse_arrivals(None) == Arrivals() and not Arrivals().open_loop
    assert parse_arrivals("recorded").open_loop
    for text, speed, words in (("poisson:0", 1.0, "rate must be"), ("poisson:-1", 1.0, "> 0"),
                               ("poisson:fast", 1.0, "'fast'"), ("poisson", 1.0, "rate"),
                               ("gamma:2", 1.0, "expected closed"),
                               ("recorded:2", 1.0, "only poisson"),
                               ("recorded", 0.0, "--speed"), ("closed", 2.0, "--speed"),
                               ("recorded", math.inf, "--speed")):
        with pytest.raises(SpecDecodeError, match=words):
            parse_arrivals(text, speed)


def test_recorded_offsets_scale_with_speed_and_need_times() -> None:
    prompts = [Prompt(f"p{i}", "c", ["x"], arrival_s=t) for i, t in enumerate([3.0, 4.0, 7.0])]
    assert offsets(prompts, Arrivals("recorded", speed=2.0)) == [0.0, 0.5, 2.0]
    with pytest.raises(SpecDecodeError, match="1 of 2 prompts have no arrival time"):
        offsets([prompts[0], Prompt("q", "c", ["x"])], Arrivals("recorded"))


def test_poisson_offsets_are_seeded_at_the_rate() -> None:
    prompts = [Prompt(f"p{i}", "c", ["x"]) for i in range(4001)]
    a = offsets(prompts, Arrivals("poisson", 2.0), seed=1)
    assert a == offsets(prompts, Arrivals("poisson", 2.0), seed=1) != \
        offsets(prompts, Arrivals("poisson", 2.0), seed=2)
    gaps = np.diff(a)
    assert a[0] == 0.0 and all(gaps > 0)
    assert 4000 / a[-1] == pytest.approx(2.0, rel=0.06)  # 4000 gaps: sd of the rate ~1.6%
    fast = offsets(prompts, Arrivals("poisson", 2.0, speed=4.0), seed=1)
    assert fast[-1] == pytest.approx(a[-1] / 4)


def test_windows_cut_the_schedule_and_blocks_cluster_it() -> None:
    prompts = [Prompt(f"p{i}", "c", ["x"]) for i in range(6)]
    times = [0.0, 10.0, 59.0, 61.0, 62.0, 200.0]
    windows = make_windows(prompts, times, 60.0)
    assert [(w.index, w.start, [s.at for s in w.requests]) for w in windows] == [
        (0, 0.0, [0.0, 10.0, 59.0]), (1, 61.0, [0.0, 1.0]), (2, 200.0, [0.0])]
    assert len(make_windows(prompts, times, math.inf)) == 1
    assert blocks([0.0, 1.0, 2.0]) == [0, 0, 0]  # too few requests for two blocks
    many = blocks([float(t) for t in range(100)])
    assert many[0] == 0 and many[-1] == 19 and many == sorted(many)


# --------------------------------------------------------------------- traffic figures


def sample(ttft: float, latency: float, tokens: int = 11, **fields: Any) -> RequestSample:
    gap = (latency - ttft) / (tokens - 1)
    return RequestSample(
        config="c", batch_size=4, prompt_id=f"p{ttft}{latency}", category="x", turn=0,
        prompt_tokens=3, output_tokens=tokens, ttft_s=ttft, itl_s=[gap] * (tokens - 1),
        latency_s=latency, drafted=0, accepted=0, accepted_per_pos=[], drafted_per_pos=[],
        rejections=0, steps=tokens - 1, draft_s=0, target_s=0, verify_s=0,
        output_token_ids=[0] * tokens, text="", **fields)


def test_an_slo_is_met_only_within_every_bound() -> None:
    slo = parse_slo("ttft=0.5,tpot=0.05")
    assert slo == Slo(ttft=0.5, tpot=0.05)
    assert slo.met(sample(0.4, 0.4 + 10 * 0.04))
    assert not slo.met(sample(0.6, 0.6 + 10 * 0.04))  # TTFT over
    assert not slo.met(sample(0.4, 0.4 + 10 * 0.06))  # TPOT over
    assert Slo(latency=1.0).met(sample(0.1, 0.9)) and not Slo(latency=1.0).met(sample(0.1, 1.1))
    for bad, words in (("ttft", "KEY=SECONDS"), ("ttft=0", "> 0"), ("itl=1", "KEY"),
                       ("ttft=1,ttft=2", "twice"), ("", "empty"), ("tpot=nan", "> 0")):
        with pytest.raises(SpecDecodeError, match=words):
            parse_slo(bad)


def test_rates_and_batch_shares_over_windows() -> None:
    def record(window: int, requests: int, span: float, sent: float,
               steps: list[float]) -> ReplayRecord:
        return ReplayRecord("c", 4, window, 0.0, requests, span, sent, 0.0, steps, "engine")

    records = [record(0, 11, 10.0, 10.5, [10, 0, 10]), record(1, 6, 5.0, 5.0, [0, 20])]
    scheduled, measured = rates(records)
    assert scheduled == pytest.approx(15 / 15) and measured == pytest.approx(15 / 15.5)
    source, shares, mean = batch_distribution(records)
    assert source == "engine" and shares == pytest.approx([0.25, 0.5, 0.25])
    assert mean == pytest.approx(2.0)


# ----------------------------------------------------------------------- in process


def test_in_process_replay_starts_each_request_when_due_and_queues_a_burst(
        ckpt: Path, tmp_path: Path) -> None:
    """Eight requests at once, then four spread out, over 2 rows: every request is submitted
    within the tolerance of when it was due; the burst fills both rows (steps at batch 2)
    and queues, so its last requests wait (their TTFT, from when they were due, exceeds the
    first's); the report has the traffic section with the scheduled and measured rates and
    the goodput at the SLO, and the requests are greedy-identical to plain's."""
    times = [0.0] * 8 + [1.0, 1.3, 1.6, 1.9]
    rec = recording(tmp_path / "rec.jsonl", times)
    out = tmp_path / "out"
    code, stdout, err = run(["bench", "--model", str(ckpt), "--workload", str(rec), "--out",
                             str(out), "--quiet", "--threads", "1", "--resamples", "200",
                             "--configs", "plain;ngram:k=3", "--batch-sizes", "2",
                             "--arrivals", "recorded", "--slo", "ttft=5,tpot=1"])
    assert code == 0, err
    got = samples(out)
    assert len(got) == 24 and all(s["window"] == 0 for s in got)
    for s in got:
        assert 0 <= s["sent_s"] - s["scheduled_s"] < TOLERANCE_S, s
        assert s["ttft_s"] >= s["sent_s"] - s["scheduled_s"]
    plain = {s["prompt_id"]: s for s in got if s["config"] == "plain"}
    burst = sorted((plain[f"r{i}"] for i in range(8)), key=lambda s: s["ttft_s"])
    assert burst[-1]["ttft_s"] > burst[0]["ttft_s"] + 0.01  # queued behind the rows
    assert sorted(s["scheduled_s"] for s in plain.values()) == pytest.approx(times)
    report = json.loads((out / "report.json").read_text())
    replays = {r["config"]: r for r in report["replays"]}
    assert set(replays) == {"plain", "ngram-k3"} and replays["plain"]["steps_by_batch"][1] > 0
    traffic = {c["config"]: c for c in report["traffic"]["configs"]}
    assert traffic["plain"]["scheduled_rate"] == pytest.approx(11 / 1.9)
    assert traffic["plain"]["goodput"]["requests"] == 12
    assert report["traffic"]["arrivals"] == "open loop at the recorded arrival times"
    assert "traffic (open loop at the recorded arrival times; SLO ttft <= 5000 ms" in stdout
    assert "out of arrival order" in err  # the recording was written as requests ended
    audit = [a for a in report["analysis"]["audits"] if a["config"] == "ngram-k3"]
    assert audit and audit[0]["passed"] and audit[0]["n_compared"] == 12
    html = (out / "report.html").read_text()
    assert 'id="traffic"' in html and "batch sizes" in html


def test_a_replay_resumes_window_by_window_and_refuses_other_arrivals(
        ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash in the second window keeps the first window's samples (each written as it
    ended); --resume replays only the window not done, whole; resuming with other arrivals
    is refused."""
    from specdecode.bench import inprocess

    rec = recording(tmp_path / "rec.jsonl", [0.0, 0.1, 0.2, 2.0, 2.1], tokens=6)
    out = tmp_path / "out"
    argv = ["bench", "--model", str(ckpt), "--workload", str(rec), "--out", str(out),
            "--quiet", "--threads", "1", "--resamples", "100", "--configs", "plain",
            "--batch-sizes", "2", "--arrivals", "recorded", "--replay-window", "1"]
    real = inprocess.InProcessRunner.replay
    calls: list[int] = []

    def crash_second(self: Any, requests: Any, config: Any, emit: Any) -> Any:
        calls.append(len(requests))
        if len(calls) == 2:
            emit_first = real(self, requests[:1], config, emit)  # one sample, then the crash
            del emit_first
            raise RuntimeError("simulated crash")
        return real(self, requests, config, emit)

    monkeypatch.setattr(inprocess.InProcessRunner, "replay", crash_second)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_cli(argv)
    kept = samples(out)
    assert sorted(s["prompt_id"] for s in kept) == ["r0", "r1", "r2", "r3"]
    monkeypatch.setattr(inprocess.InProcessRunner, "replay", real)
    code, _, err = run([*argv, "--resume"])
    assert code == 0, err
    again = samples(out)
    assert sorted(s["prompt_id"] for s in again[len(kept):]) == ["r3", "r4"]
    code, _, err = run([*argv[:-4], "--arrivals", "poisson:5", "--resume"])
    assert code == 2 and "arrivals" in err


def test_bad_traffic_flags_fail_before_the_model_loads(
        ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(backends, "load_model", refuse)
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "t5 t6", "category": "c"}\n')
    rec = recording(tmp_path / "rec.jsonl", [0.0, 1.0])
    for extra, words in ((["--workload", str(rec), "--arrivals", "poisson:0"], "rate must be"),
                         (["--workload", str(plain), "--arrivals", "recorded"],
                          "no arrival time"),
                         (["--workload", str(rec), "--slo", "ttft=-1"], "> 0"),
                         (["--workload", str(rec), "--arrivals", "recorded", "--speed", "0"],
                          "--speed"),
                         (["--workload", str(rec), "--replay-window", "0"], "replay-window")):
        code, _, err = run(["bench", "--model", str(ckpt), "--out", str(tmp_path / "o"),
                            *extra])
        assert code == 2 and words in err and err.count("\n") == 1, err


def test_a_recording_made_with_another_model_is_noted(ckpt: Path, tmp_path: Path) -> None:
    from specdecode.bench.requests import recording_notes

    other = {"id": "ck", "weights": "f" * 64, "tokenizer": "e" * 64}
    notes = recording_notes([other], "ck", "a" * 64, "e" * 64)
    assert len(notes) == 1 and "not with the weights measured here" in notes[0]
    notes = recording_notes([other], "ck", "a" * 64, "b" * 64)
    assert "tokenizer or chat template differs" in notes[0]
    assert recording_notes([{**other, "weights": "a" * 64}], "ck", "a" * 64, "e" * 64) == []
    assert "measured on big" in recording_notes([{"id": "small"}], "big", None, None)[0]
    rec = recording(tmp_path / "rec.jsonl", [0.0, 0.5], tokens=4)
    lines = rec.read_text().splitlines()
    lines[0] = json.dumps({"specdecode_recording": 1, "session": "s1", "model": other})
    rec.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    code, stdout, err = run(["bench", "--model", str(ckpt), "--workload", str(rec), "--out",
                             str(out), "--quiet", "--threads", "1", "--resamples", "100",
                             "--configs", "plain"])
    assert code == 0, err
    assert "tokenizer or chat template differs" in err and "workload note: recorded with ck," \
        in stdout
    header = json.loads((out / "report.json").read_text())["header"]
    assert any("tokenizer" in n for n in header["workload"]["notes"])
    assert "tokenizer or chat template differs" in (out / "report.html").read_text()


def loaded_tiny(ckpt: Path) -> LoadedModel:
    return backends.load_model(str(ckpt))


def test_http_replay_against_a_server(ckpt: Path, tmp_path: Path) -> None:
    """Record a server's traffic, replay it against the server at twice the speed: each request
    is sent within the tolerance of when it was due, the rate is twice the recording's, and the
    batch sizes are the server's own (engine_steps_total)."""
    import time

    import httpx

    from specdecode.server.record import RecordOptions
    from tests.test_server import serving

    rec = tmp_path / "rec.jsonl"
    with serving(loaded_tiny(ckpt), drafter="none", max_batch=2,
                 record=RecordOptions(rec)) as (srv, _):
        for i in range(6):
            body = {"model": "ck", "messages": [{"role": "user", "content": f"t{5 + i} t6"}],
                    "max_tokens": 8, "temperature": 0, "logit_bias": NO_EOS}
            assert httpx.post(f"{srv.url}/v1/chat/completions", json=body,
                              timeout=30).status_code == 200
            time.sleep(0.2)
        time.sleep(0.2)  # the last line written
        recorded_span = max(json.loads(x).get("arrival_s", 0)
                            for x in rec.read_text().splitlines())
        out = tmp_path / "out"  # (the replay is recorded too: the span is read before it)
        code, stdout, err = run(["bench", "--endpoint", f"plain={srv.url}", "--workload",
                                 str(rec), "--out", str(out), "--quiet", "--resamples", "100",
                                 "--arrivals", "recorded", "--speed", "2", "--batch-sizes",
                                 "2", "--slo", "ttft=2"])
    assert code == 0, err
    got = samples(out)
    assert len(got) == 6
    assert all(0 <= s["sent_s"] - s["scheduled_s"] < TOLERANCE_S for s in got)
    report = json.loads((out / "report.json").read_text())
    (replay,) = report["replays"]
    assert replay["batch_source"] == "server engine_steps_total" and replay["steps_by_batch"]
    assert replay["span_s"] == pytest.approx(recorded_span / 2, rel=1e-6)
    traffic = report["traffic"]["configs"][0]
    assert traffic["measured_rate"] == pytest.approx(traffic["scheduled_rate"], rel=0.25)
    assert "2x speed" in stdout


def test_goodput_in_closed_loop_and_under_a_new_slo_on_resume(ckpt: Path,
                                                               tmp_path: Path) -> None:
    """--slo works in closed loop; --resume of a finished run re-reports under another SLO
    without measuring anything again (broken variant: the SLO ignored, all requests met)."""
    work = tmp_path / "w.jsonl"
    work.write_text("".join(json.dumps({"prompt": f"t{5 + i} t6 t7", "category": "c"}) + "\n"
                            for i in range(3)))
    out = tmp_path / "out"
    argv = ["bench", "--model", str(ckpt), "--workload", str(work), "--out", str(out),
            "--quiet", "--threads", "1", "--resamples", "100", "--configs", "plain",
            "--max-tokens", "6"]
    code, stdout, err = run([*argv, "--slo", "ttft=30"])
    assert code == 0, err
    goodput = json.loads((out / "report.json").read_text())["traffic"]["configs"][0]["goodput"]
    assert goodput["met"] == goodput["requests"] == 3 and "closed loop" in stdout
    code, stdout, err = run([*argv, "--resume", "--slo", "ttft=0.000001"])
    assert code == 0, err
    assert "0 requests measured (3 resumed)" in stdout
    goodput = json.loads((out / "report.json").read_text())["traffic"]["configs"][0]["goodput"]
    assert goodput["met"] == 0 and goodput["requests"] == 3


def test_a_chat_request_without_max_tokens_runs_in_the_servers_context(
        ckpt: Path, tmp_path: Path) -> None:
    """No max_tokens: all the room, as `serve` gives it, in serve's default context (2,048
    tokens, not the model's whole window), capped by --max-tokens."""
    from specdecode.bench.inprocess import DEFAULT_CAPACITY, InProcessRunner
    from specdecode.bench.workloads import load_workload

    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"model": "ck", "messages": [{"role": "user",
                                                            "content": "t5 t6"}]}) + "\n")
    workload = load_workload(path)
    runner = InProcessRunner(loaded_tiny(ckpt), max_tokens_cap=4)
    assert runner.fit_capacity(workload.prompts, 3) <= DEFAULT_CAPACITY + 4
    code, _, err = run(["bench", "--model", str(ckpt), "--workload", str(path), "--out",
                        str(tmp_path / "out"), "--quiet", "--threads", "1", "--resamples",
                        "100", "--configs", "plain", "--max-tokens", "4"])
    assert code == 0, err
    (sample,) = samples(tmp_path / "out")
    assert sample["output_tokens"] <= 4 and sample["temperature"] == 1.0
