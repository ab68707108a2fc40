"""Live speculation metrics (server.speculation): the realised speedup estimate per label
against the calibrated plain step, the window judgement with its warning and gauge, the drift
and --calibration checks, and a server exposing them in /metrics and GET /v1/speculation."""

from __future__ import annotations

import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.server import speculation
from specdecode.server.middleware import ApiKey
from specdecode.server.speculation import (
    MAX_LABELS,
    OTHER_LABEL,
    PlainSteps,
    Row,
    SpeculationMonitor,
    calibrate_plain_steps,
    calibration_mismatches,
    read_report,
)
from tests.test_server import NO_EOS, metric, serving, tiny  # noqa: F401  (the fixture)

PLAIN = PlainSteps({1: 0.010, 4: 0.016})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def monitor(drafter: str = "ngram", **kwargs: Any) -> tuple[SpeculationMonitor, Clock]:
    clock = Clock()
    return SpeculationMonitor(drafter, PLAIN, window_s=10.0, min_steps=20, clock=clock,
                              **kwargs), clock


def steps(mon: SpeculationMonitor, n: int, seconds: float, rows: list[Row]) -> None:
    for _ in range(n):
        mon.observe_step(seconds, len(rows), rows)


def test_plain_steps_interpolate_between_measured_batches() -> None:
    assert PLAIN.at(1) == 0.010 and PLAIN.at(4) == 0.016
    assert PLAIN.at(2) == pytest.approx(0.012) and PLAIN.at(8) == pytest.approx(0.032)
    assert math.isnan(PlainSteps({}).at(3))


def test_the_estimate_is_tokens_per_step_over_the_step_cost() -> None:
    """A label whose steps take 1.5 calibrated plain steps and emit 3 tokens reads 2.0; one
    drafting nothing at the calibrated cost reads 1.0 (broken variant: tokens per step alone
    would read 3.0 and 1.0 whatever the cost)."""
    mon, _ = monitor()
    steps(mon, 10, 0.015, [Row("a", drafted=4, accepted=2, emitted=3)])
    steps(mon, 10, 0.010, [Row("b", drafted=0, accepted=0, emitted=1)])
    got = mon.labels()
    a, b = got["a"][0], got["b"][0]
    assert a.tokens_per_step == 3 and a.step_cost == pytest.approx(1.5)
    assert a.speedup == pytest.approx(2.0) and a.accepted_per_step == 2
    assert b.speedup == pytest.approx(1.0) and b.no_draft_share == 1.0
    summary = mon.summary()
    assert summary["total"]["row_steps"] == 20 and summary["warnings"] == []


def test_a_window_below_one_warns_once_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    """Speculation costing more than it emits over a whole window sets not_paying and logs one
    warning; the next window that pays clears it with an info line. A window with too few
    steps is not judged."""
    mon, clock = monitor()
    losing = [Row("t", drafted=4, accepted=0, emitted=1)]
    steps(mon, 30, 0.012, losing)  # 1 token per 1.2 plain steps: 0.83
    clock.now = 10.0
    steps(mon, 1, 0.012, losing)
    with caplog.at_level(logging.INFO, logger="specdecode.server"):
        _, window, not_paying = mon.labels()["t"]
        assert not_paying and window is not None and window.speedup == pytest.approx(1 / 1.2)
        assert any("not paying" in w for w in mon.summary()["warnings"])
        steps(mon, 30, 0.012, losing)
        clock.now = 20.0
        mon.labels()
        assert [r.levelname for r in caplog.records].count("WARNING") == 1
        steps(mon, 30, 0.012, [Row("t", drafted=4, accepted=3, emitted=4)])
        clock.now = 30.0
        assert not mon.labels()["t"][2]
        assert any("pays again" in r.getMessage() for r in caplog.records)
        steps(mon, 5, 0.012, losing)  # too few to judge: the verdict stands
        clock.now = 40.0
        assert not mon.labels()["t"][2]


def test_plain_decoding_is_never_called_not_paying() -> None:
    """Plain decoding, or a speculative server whose controller held drafting off in (almost)
    every step: steps dearer than calibrated read below 1.0, but that is the machine (drift),
    not speculation; a label drafting in a fifth of its steps at that cost is judged."""
    mon, clock = monitor("none")
    steps(mon, 30, 0.012, [Row(None, 0, 0, 1)])
    clock.now = 11.0
    label, (_, window, not_paying) = next(iter(mon.labels().items()))
    assert label == "none" and window is not None and not not_paying
    mon, clock = monitor("ngram")
    steps(mon, 30, 0.012, [Row("off", 0, 0, 1)])
    steps(mon, 24, 0.012, [Row("some", 0, 0, 1)])
    steps(mon, 6, 0.012, [Row("some", 2, 0, 1)])
    clock.now = 11.0
    got = mon.labels()
    assert got["off"][1] is not None and got["off"][1].speedup < 1 and not got["off"][2]
    assert got["some"][2] and "step_cost" not in mon.stale_reasons()


def test_plain_steps_dearer_than_calibrated_make_it_stale() -> None:
    """Steps in which no row drafted, at 1.5x the calibrated cost over a window: the
    calibration is stale (step_cost); at 1.1x it is not."""
    for cost, stale in ((0.015, True), (0.011, False)):
        mon, clock = monitor()
        steps(mon, 30, cost, [Row("a", 0, 0, 1)])
        clock.now = 10.0
        assert ("step_cost" in mon.stale_reasons()) is stale


def test_labels_beyond_the_cap_count_as_other() -> None:
    mon, _ = monitor()
    for i in range(MAX_LABELS + 5):
        mon.observe_step(0.01, 1, [Row(f"l{i}", 0, 0, 1)])
    got = mon.labels()
    assert len(got) == MAX_LABELS + 1 and got[OTHER_LABEL][0].row_steps == 5


def test_calibration_report_mismatches(tmp_path: Path) -> None:
    weights = "a" * 64
    report = {"header": {"model": {"name": "m", "precision": "checkpoint",
                                   "weight_hash": weights}},
              "recommendation": {"enable": True, "drafter": "ngram", "k": 4}}
    assert calibration_mismatches(report, "m", weights, "checkpoint", "ngram") == {}
    got = calibration_mismatches(report, "m", "b" * 64, "bf16", "suffix")
    assert set(got) == {"target", "precision", "drafter"} and "re-measure" in got["target"]
    off = {**report, "recommendation": {"enable": False}}
    assert set(calibration_mismatches(off, "m", weights, "checkpoint", "ngram")) == {"drafter"}
    assert calibration_mismatches(off, "m", weights, "checkpoint", "none") == {}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert read_report(tmp_path) == report
    path.write_text("{}")
    with pytest.raises(SpecDecodeError, match="not a specdecode bench report"):
        read_report(path)
    with pytest.raises(SpecDecodeError, match="cannot read"):
        read_report(tmp_path / "missing.json")


def test_the_plain_step_is_calibrated_on_the_engine(tiny: LoadedModel) -> None:  # noqa: F811
    plain = calibrate_plain_steps(tiny.model, tiny.tokenizer, [1, 4], context=16, steps=3)
    assert set(plain.seconds) == {1, 4} and all(0 < s < 5 for s in plain.seconds.values())


def test_a_server_reports_speculation_per_label(tiny: LoadedModel) -> None:  # noqa: F811
    """Two labelled keys and a metadata label: /v1/speculation and /metrics count each label's
    row-steps, tokens and plain-equivalent tokens; engine_steps_total counts steps by batch
    size; a judged window's verdict, gauge and warning agree."""
    keys = (ApiKey("key-one", "team-a"), ApiKey("key-two", "team-b"))
    with serving(tiny, auto=False, k=4, api_keys=keys, speculation_window=0.3) as (srv, state):
        state.monitor.min_steps = 8
        body = {"model": "tiny", "prompt": "t3 t4 t5", "max_tokens": 24, "temperature": 0,
                "logit_bias": NO_EOS}
        send = [("key-one", body)] * 6 + [
            ("key-two", {**body, "metadata": {"label": "app"}})]

        def post(item: tuple[str, dict[str, Any]]) -> int:
            key, data = item
            return httpx.post(f"{srv.url}/v1/completions", json=data, timeout=60,
                              headers={"Authorization": f"Bearer {key}"}).status_code

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(post, send)) == [200] * len(send)
        auth = {"Authorization": "Bearer key-one"}
        summary = httpx.get(f"{srv.url}/v1/speculation", headers=auth, timeout=10).json()
        assert httpx.get(f"{srv.url}/v1/speculation", timeout=10).status_code == 401
        labels = {x["label"]: x for x in summary["labels"]}
        assert set(labels) == {"team-a", "team-b/app"}
        a = labels["team-a"]["total"]
        assert a["row_steps"] >= 6 * 24 / 5 and a["emitted"] == 6 * 24
        assert a["drafted"] > 0 and a["plain_equivalent"] > 0
        assert summary["drafter"] == "int8" and set(summary["calibration"]["plain_step_s"]) \
            == {"1", "4"}
        text = httpx.get(f"{srv.url}/metrics", headers=auth, timeout=10).text
        assert 'spec_decode_label_row_steps_total{drafter="int8",label="team-a",' \
               'model_name="tiny"}' in text
        steps_total = _series(text, "engine_steps_total")
        assert sum(steps_total.values()) >= a["row_steps"] / 4 and steps_total
        assert _series(text, "spec_decode_calibration_stale") == dict.fromkeys(
            speculation.STALE_REASONS, 0.0)
        window = labels["team-a"]["last_window"]
        if window is not None:  # judged (a window held 8 row-steps): verdict, gauge and warning
            losing = window["speedup"] < 1.0  # agree (on timings too noisy here to predict)
            assert labels["team-a"]["not_paying"] is losing
            assert any("team-a" in w for w in summary["warnings"]) is losing
            assert 'spec_decode_not_paying{drafter="int8",label="team-a",model_name="tiny"} ' \
                f'{float(losing)}' in text


def _series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return {k.split('reason="')[1].split('"')[0] if "reason=" in k else k: v
            for k, v in out.items()}


def test_a_calibration_report_for_another_target_is_stale_at_start(
        tiny: LoadedModel, tmp_path: Path) -> None:  # noqa: F811
    """serve --calibration REPORT whose target is another (weights) and which recommended
    another drafter: both reasons in /v1/speculation, its warnings and the gauge (broken
    variant: the report read but not compared would leave every reason at 0)."""
    report = {"header": {"model": {"name": "tiny", "precision": tiny.precision,
                                   "weight_hash": "f" * 64}},
              "recommendation": {"enable": True, "drafter": "ngram", "k": 4}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    with serving(tiny, drafter="none", calibration=path) as (srv, _):
        summary = httpx.get(f"{srv.url}/v1/speculation", timeout=10).json()
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert set(summary["calibration"]["stale"]) == {"target", "drafter"}
    assert any("re-measure" in w for w in summary["warnings"])
    stale = _series(text, "spec_decode_calibration_stale")
    assert stale["target"] == stale["drafter"] == 1.0 and stale["precision"] == 0.0


def test_serve_flags_are_checked_before_the_model_loads(tmp_path: Path) -> None:
    import argparse

    from specdecode.cli.serve import options_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def options(*argv: str) -> Any:
        return options_from_args(parser.parse_args(["serve", *argv]))

    got = options("--api-key", "team-a=k1", "--api-key", "k2", "--record",
                  str(tmp_path / "r.jsonl"), "--record-outputs", "--record-max-mib", "1")
    assert [(k.label, k.key) for k in got.api_keys] == [("team-a", "k1"), (None, "k2")]
    assert got.record.outputs and got.record.max_bytes == 2**20
    for argv, words in ((["--record-outputs"], "needs --record"),
                        (["--record", str(tmp_path / "no" / "r.jsonl")], "cannot write"),
                        (["--record", str(tmp_path / "r"), "--record-max-mib", "inf"], "finite"),
                        (["--api-key", "a=k", "--api-key", "b=k"], "twice"),
                        (["--speculation-window", "0"], "speculation-window"),
                        (["--calibration", str(tmp_path / "missing.json")], "cannot read")):
        with pytest.raises(SpecDecodeError, match=words):
            options(*argv)
