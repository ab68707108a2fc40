"""The Python API (`specdecode.load`): the CLI's engine and report; bad values named."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import specdecode
from specdecode import SpecDecodeError
from specdecode.bench.options import BenchOptions
from specdecode.engine import Generation
from specdecode.models import backends
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint
from tests.identity import assert_identical_outputs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("api") / "tiny")


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # threads=1 below sets it for the process


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model fails the test: these errors must come before it."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(backends, "load_model", refuse)


def test_generate_is_the_engine_greedy_and_speculation_changes_no_token(tiny: Path) -> None:
    plain = specdecode.load(tiny, threads=1)
    spec = specdecode.load(tiny, drafter="int8", k=3, threads=1)
    a = plain.generate("t5 t6 t7 t5 t6", max_tokens=12)
    b = spec.generate("t5 t6 t7 t5 t6", max_tokens=12)
    # the engine driven directly, as `specdecode generate` drives it
    tok = plain.loaded.tokenizer
    gen = Generation(plain.loaded.model, tok, tok.encode_prompt("t5 t6 t7 t5 t6"),
                     SamplingParams(max_tokens=12), None, 0, tok.eos_ids)
    for _ in gen.run():
        pass
    assert a.tokens == b.tokens == gen.output and len(a.tokens) >= 1
    assert a.text == b.text and a.finish_reason == b.finish_reason
    assert a.counters.drafted == 0 and b.counters.drafted > 0
    assert b.acceptance_rate is not None and b.counters.emitted == len(b.tokens)
    assert b.to_dict()["counters"]["drafted"] == b.counters.drafted
    assert "".join(spec.stream("t5 t6 t7 t5 t6", max_tokens=12)) == b.text


def test_k_auto_is_lossless_and_a_seed_repeats_plain_sampling(tiny: Path) -> None:
    auto = specdecode.load(tiny, drafter="ngram", threads=1)
    plain = specdecode.load(tiny, threads=1)
    assert auto.auto and auto.k == 8 and "auto" in repr(auto)
    reference = plain.generate("t5 t6 t7 t5 t6", max_tokens=10).tokens
    # under --k auto the controller may rightly draft nothing on this tiny model; at a fixed k
    # the lookup drafts and has drafts accepted, through the same API
    assert auto.generate("t5 t6 t7 t5 t6", max_tokens=10).tokens == reference
    fixed = specdecode.load(tiny, drafter="ngram", k=3, threads=1).generate(
        "t5 t6 t7 t5 t6", max_tokens=10)
    assert_identical_outputs([fixed.tokens], [reference], fixed.counters.drafted,
                             fixed.counters.accepted, "API, ngram k=3")
    one = plain.generate("t5 t6 t7 t5 t6", max_tokens=10, temperature=0.8, seed=3)
    two = plain.generate("t5 t6 t7 t5 t6", max_tokens=10, temperature=0.8, seed=3)
    assert one.tokens == two.tokens and one.text == two.text
    drawn = plain.generate("t5 t6 t7 t5 t6", max_tokens=10, temperature=0.8)  # no seed given
    spec = auto.generate("t5 t6 t7 t5 t6", max_tokens=10, temperature=0.8, seed=drawn.seed)
    assert one.seed == 3 and drawn.seed is not None and spec.tokens == drawn.tokens


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"precision": "fp4"}, ["fp4"]),
        ({"drafter": "telepathy"}, ["telepathy"]),
        ({"drafter": "ngram", "k": 0}, ["k", "0"]),
        ({"drafter": "ngram", "k": 65}, ["k", "65"]),
        ({"drafter": "ngram", "k": "many"}, ["k", "many"]),
        ({"drafter": "ngram", "kmax": 99}, ["kmax", "99"]),
        ({"threads": 0}, ["threads", "0"]),
        ({"drafter": "ngram", "max_step_cost": 0.5}, ["max-step-cost", "0.5"]),
        ({"drafter": "ngram", "precision": "int8"}, ["int8", "batch-invariant"]),
    ],
)
def test_bad_load_arguments_name_the_value_before_the_model_loads(
        kwargs: dict[str, object], needles: list[str]) -> None:
    with pytest.raises(SpecDecodeError) as info:
        specdecode.load(**kwargs)  # type: ignore[arg-type]
    for needle in needles:
        assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"max_tokens": 0}, ["max_tokens", "0"]),
        ({"temperature": -1.0}, ["temperature", "-1"]),
        ({"top_p": 1.5}, ["top_p", "1.5"]),
        ({"stop": [""]}, ["stop"]),
        ({"max_tokens": 10_000}, ["max_tokens (10000)", "context"]),
    ],
)
def test_bad_generate_arguments_name_the_value(
        tiny: Path, kwargs: dict[str, object], needles: list[str]) -> None:
    sd = specdecode.load(tiny, threads=1)
    with pytest.raises(SpecDecodeError) as info:
        sd.generate("t5 t6", **kwargs)  # type: ignore[arg-type]
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_bench_is_the_command_on_the_loaded_model(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = specdecode.load(tiny, threads=1)
    monkeypatch.setattr(backends, "load_model", lambda *a, **k: pytest.fail("loaded again"))
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "t5 t6 t7 t5 t6", "category": "code"}\n'
                        '{"prompt": "t9 t10 t9 t10", "category": "chat"}\n', encoding="utf-8")
    out = io.StringIO()
    outcome = sd.bench(workload, "plain;ngram:k=2", max_tokens=6, out_dir=tmp_path / "run",
                       resamples=200, out=out)
    report = json.loads(outcome.report_json.read_text())
    assert len(report["samples"]) == 4 and outcome.report_html.exists()
    assert outcome.measured == 4 and "ngram-k2" in out.getvalue()
    assert outcome.recommendation is not None
    with pytest.raises(SpecDecodeError, match="--batch-sizes"):
        sd.bench(workload, batch_sizes=[0], out_dir=tmp_path / "other")
    with pytest.raises(SpecDecodeError, match="telepathy"):
        sd.bench(workload, "plain;telepathy:k=2", out_dir=tmp_path / "other")


@pytest.mark.slow
def test_default_model_greedy_equals_the_cli() -> None:
    prompt = "Once upon a time, in a small village by the sea,"
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", "generate", prompt,
                           "--max-tokens", "12", "--json"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    cli = json.loads(proc.stdout)
    sd = specdecode.load(drafter="ngram", k=3)
    out = sd.generate(prompt, max_tokens=12)
    assert out.tokens == cli["token_ids"] and out.text == cli["text"]
    assert out.text.startswith(" there was a wise old wizard named")
    assert out.counters.emitted == len(out.tokens)


def cli_bench_options(argv: list[str]) -> BenchOptions:
    """The BenchOptions `specdecode bench ARGV` builds (cli.bench.options_of)."""
    import argparse

    from specdecode.cli.bench import options_of, register

    parser = argparse.ArgumentParser(prog="specdecode")
    register(parser.add_subparsers(dest="command"))
    return options_of(parser.parse_args(["bench", *argv]))


def test_the_command_lines_bench_defaults_are_the_options_defaults() -> None:
    """The API and the command line build one BenchOptions; a flag left out is the field's
    default, so the API (which starts from BenchOptions' defaults) runs what `specdecode
    bench` runs. Broken variant: a flag given is a field changed."""
    assert cli_bench_options([]) == BenchOptions()
    assert cli_bench_options(["--batch-sizes", "4,1", "--no-chat-template"]) == BenchOptions(
        batch_sizes=(1, 4), chat_template=False)
    assert cli_bench_options(["--speed", "2"]) != BenchOptions()
