"""`specdecode bench / compare / tune` through the CLI's `main`, in process: bad input
is one clear line and exit status 2 before any model is loaded; good input writes the reports."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specdecode.bench import plan as commands
from specdecode.bench.plan import parse_configs
from specdecode.bench.records import ConfigSpec
from specdecode.errors import SpecDecodeError
from specdecode.models import backends
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint

GOOD = '{"prompt": "t5 t6 t7 t5 t6", "category": "code"}'
SPECBENCH = '{"question_id": 7, "category": "chat", "turns": ["t9 t10", "t11 t12"]}'


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # --threads 1 below changes it for the process


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "ck")


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model fails the test: these errors must come before it."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(backends, "load_model", refuse)


def run(argv: list[str]) -> tuple[int, str, str]:
    return run_cli(argv)


def workload(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def bench_args(ckpt: Path, wl: str, out: Path, *extra: str) -> list[str]:
    return ["bench", "--model", str(ckpt), "--workload", wl, "--out", str(out), "--quiet",
            "--threads", "1", "--max-tokens", "6", "--resamples", "200", *extra]


# ---------------------------------------------------------------------------- bad input


def assert_one_error_line(code: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith("specdecode: error:")]
    assert code == 2 and len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.usefixtures("no_model")
def test_strict_refuses_a_malformed_line_naming_it(tmp_path: Path) -> None:
    wl = workload(tmp_path, GOOD, "{oops", SPECBENCH)
    code, _, err = run(bench_args(Path("x"), wl, tmp_path / "o", "--strict"))
    assert_one_error_line(code, err, "w.jsonl:2:", "invalid JSON")
    assert not (tmp_path / "o").exists()


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(("lines", "extra", "needles"), [
    (["", "   "], [], ["holds no prompts"]),
    (["{oops"], [], ["holds no prompts", "1 malformed lines skipped"]),
    ([GOOD, SPECBENCH], ["--categories", "code,poetry"], ["unknown category 'poetry'",
                                                          "known categories: chat, code"]),
    ([GOOD], ["--configs", "plain;turbo:k=2"], ["unknown drafter 'turbo'"]),
    ([GOOD], ["--configs", "int8:k=0"], ["k must be in 1..64"]),
    ([GOOD], ["--configs", "int8:k"], ["expected key=value"]),
    ([GOOD], ["--configs", "int8:k=2;int8:k=2"], ["used twice: int8-k2"]),
    ([GOOD], ["--batch-sizes", "1,0"], ["--batch-sizes must be integers >= 1"]),
    ([GOOD], ["--threads", "0"], ["--threads must be >= 1"]),
    ([GOOD], ["--audit-samples", "-1"], ["--audit-samples must be >= 0"]),
    ([GOOD], ["--configs", "ngram:k=auto,kmax=99"], ["kmax (--kmax) must be an integer in 1..64"]),
    ([GOOD], ["--max-tokens", "0"], ["--max-tokens must be >= 1"]),
    ([GOOD], ["--precision", "int8", "--configs", "plain;ngram:k=2"],
     ["needs a batch-invariant target"]),
])
def test_bad_input_is_one_line_before_the_model_loads(
    tmp_path: Path, lines: list[str], extra: list[str], needles: list[str]
) -> None:
    code, _, err = run(bench_args(Path("x"), workload(tmp_path, *lines), tmp_path / "o", *extra))
    assert_one_error_line(code, err, *needles)


@pytest.mark.usefixtures("no_model")
def test_resume_needs_an_output_folder(tmp_path: Path) -> None:
    code, _, err = run(["bench", "--workload", workload(tmp_path, GOOD), "--resume"])
    assert_one_error_line(code, err, "--resume needs --out")


@pytest.mark.usefixtures("no_model")
def test_unwritable_output_folder_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, _, err = run(bench_args(Path("x"), workload(tmp_path, GOOD), blocker / "out"))
    assert_one_error_line(code, err, "is not writable")


@pytest.mark.usefixtures("no_model")
def test_existing_results_need_resume(tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "results.jsonl").write_text("{}\n")
    code, _, err = run(bench_args(Path("x"), workload(tmp_path, GOOD), tmp_path / "o"))
    assert_one_error_line(code, err, "already exists", "--resume")


# ------------------------------------------------------------------------------ configs


def test_configs_syntax_names_options_and_baselines() -> None:
    configs = parse_configs("int8:k=3;ngram:k=4,ngram_max=5,name=ng;ngram:k=2,temperature=0.7",
                            "fp32")
    assert [c.name for c in configs] == ["plain", "plain-t0.7", "int8-k3", "ng", "ngram-k2-t0.7"]
    assert configs[3] == ConfigSpec("ng", "ngram", 4, options={"ngram_max": 5})
    assert configs[1].is_plain and configs[1].temperature == 0.7
    assert parse_configs("layerskip:layers=0+2", "fp32")[1].options == {"layers": [0, 2]}
    with pytest.raises(SpecDecodeError, match="plain decoding takes no k"):
        parse_configs("plain:k=2", "fp32")


def test_default_configs_include_ngram_where_registered() -> None:
    text = commands.default_configs_text()
    assert text.startswith("plain;ngram+w4a16:k=3;w4a16:k=3")
    assert ("ngram:k=4" in text) == ("ngram" in commands.known_drafters())


def test_default_configs_follow_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast target is not drafted for by its own w4a16 copy; auto is fast only where the
    kernels build (else it is fp32 and keeps fp32's defaults)."""
    from specdecode.models import kernels

    fast = "plain;ngram:k=auto;ngram+auto:k=auto"
    assert commands.default_configs_text("auto", "w4a16") == fast
    assert commands.default_configs_text("native", "checkpoint") == fast
    assert commands.default_configs_text("llama.cpp", "auto").startswith("plain;ngram:k=auto;")
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert commands.default_configs_text("auto", "auto") == fast
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert commands.default_configs_text("auto", "auto").startswith("plain;ngram+w4a16:k=3")


# ------------------------------------------------------------------------- good input


def test_bench_skips_a_malformed_line_then_resume_and_compare(ckpt: Path, tmp_path: Path) -> None:
    wl = workload(tmp_path, GOOD, "{oops", SPECBENCH)
    args = bench_args(ckpt, wl, tmp_path / "o", "--configs", "plain;int8:k=2")
    code, out, err = run(args)
    assert code == 0, err
    assert "skipped malformed line" in err and "w.jsonl:2:" in err
    assert "int8-k2" in out and "6 requests measured (0 resumed)" in out
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert len(report["samples"]) == 6 and (tmp_path / "o" / "report.html").exists()
    code, out, _ = run([*args, "--resume"])
    assert code == 0 and "0 requests measured (6 resumed)" in out
    code, out, _ = run(["compare", str(tmp_path / "o"), str(tmp_path / "o" / "report.json"),
                        "--resamples", "200"])
    assert code == 0 and "Tuned drafter and k still hold." in out
    assert "0 of " in out and "beyond noise" in out


def test_tune_prints_the_pick_and_the_vllm_setting(ckpt: Path, tmp_path: Path) -> None:
    wl = workload(tmp_path, GOOD, SPECBENCH)
    code, out, err = run(["tune", "--model", str(ckpt), "--workload", wl, "--drafters", "ngram",
                          "--k-values", "1,3", "--max-tokens", "6", "--out", str(tmp_path / "t"),
                          "--quiet", "--threads", "1", "--resamples", "200"])
    assert code == 0, err
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("ngram ")]
    assert [r[1] for r in rows] == ["1", "3"]
    assert "pick: ngram k=" in out and '"method": "ngram"' in out
    assert (tmp_path / "t" / "report.json").exists()


def test_tune_spreads_its_prompts_over_the_categories() -> None:
    from specdecode.bench.workloads import Prompt

    prompts = [Prompt(i, i[0], ["t5"]) for i in ("a0", "a1", "b0", "a2", "c0")]
    assert [p.id for p in commands.round_robin(prompts, 4)] == ["a0", "b0", "c0", "a1"]
    assert [p.id for p in commands.round_robin(prompts, 9)] == ["a0", "b0", "c0", "a1", "a2"]


@pytest.mark.parametrize("extra, expected", [([], (128, None)), (["--max-tokens", "1024"],
                                                                 (1024, 1024))])
def test_max_tokens_is_the_limit_of_prompts_that_set_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str],
        expected: tuple[int, int | None]) -> None:
    """A Spec-Bench file's prompts set no max_tokens: --max-tokens 1024 must let them generate
    1,024 tokens (it once only capped them at the default 128)."""
    seen: list[tuple[int, int | None]] = []

    def capture(args: object, plan: commands.BenchPlan, default: int) -> None:
        seen.append((default, plan.max_tokens_cap))
        raise SpecDecodeError("stop here")

    monkeypatch.setattr(commands, "make_runner", capture)
    wl = workload(tmp_path, SPECBENCH)
    code, _, err = run(["bench", "--model", "x", "--workload", wl, "--out",
                        str(tmp_path / "o"), "--quiet", *extra])
    assert code == 2 and "stop here" in err
    assert seen == [expected]
