"""The command line: streamed text, --json, and one clear error line for each kind of bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdecode.cli import build_parser
from specdecode.cli.args import MEASUREMENT_FLAGS
from tests.cli_run import run_cli as in_process
from tests.conftest import make_checkpoint


def run_process(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m specdecode.cli *args` in a new process."""
    return subprocess.run([sys.executable, "-m", "specdecode.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI's main in this process (what a process would print and return, without paying
    the interpreter's and torch's start each time: see test_the_command_runs_as_a_process)."""
    code, out, err = in_process(list(args))
    return subprocess.CompletedProcess(["specdecode", *args], code, out, err)


def assert_clean_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdecode: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.mark.slow  # the real SmolLM2
def test_generate_streams_text_and_json_has_counters() -> None:
    proc = run_process("generate", "Once upon a time, in a small village by the sea,",
                       "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(" there was a wise old wizard named")
    proc = run_process("generate", "Name a fruit.", "--chat", "--max-tokens", "6", "--json",
                       "--drafter", "int8", "--k", "3")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["model"]["backend"] == "native" and record["drafter"] == "int8"
    assert record["counters"]["emitted"] == len(record["token_ids"]) <= 6
    assert record["counters"]["drafted"] > 0 and record["timings"]["ttft_s"] > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", max_position_embeddings=16)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--top-p", "0"], ["top_p", "0.0"]),
        (["--top-p", "1.5"], ["top_p", "1.5"]),
        (["--temperature", "-1"], ["temperature", "-1"]),
        (["--top-k", "-3"], ["top_k", "-3"]),
        (["--k", "0", "--drafter", "int8"], ["--k", "0"]),
        (["--drafter", "telepathy"], ["telepathy"]),
        (["--drafter", "draft-model"], ["--draft-model"]),
        (["--precision", "fp4"], ["fp4"]),
        (["--drafter", "ngram", "--max-step-cost", "0.5"], ["--max-step-cost", "0.5"]),
        (["--drafter", "ngram", "--max-step-cost", "nan"], ["--max-step-cost", "nan"]),
    ],
)
def test_invalid_options(tiny: Path, args: list[str], needles: list[str]) -> None:
    assert_clean_error(run_cli("generate", "t2 t3", "--model", str(tiny), *args), *needles)


def test_missing_checkpoint(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    assert_clean_error(run_cli("generate", "hi", "--model", str(missing)), str(missing))


def test_the_command_runs_as_a_process(tmp_path: Path) -> None:
    """`python -m specdecode.cli` as a process: the same one error line and exit status 2."""
    missing = tmp_path / "nowhere"
    assert_clean_error(run_process("generate", "hi", "--model", str(missing)), str(missing))


def test_corrupt_checkpoint(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "corrupt")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_clean_error(run_cli("generate", "t2", "--model", str(folder)), "model.safetensors")


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "odd")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt_neox_weird"
    (folder / "config.json").write_text(json.dumps(config))
    proc = run_cli("generate", "t2", "--model", str(folder), "--backend", "native")
    assert_clean_error(proc, "gpt_neox_weird", "config.json")


def test_unreadable_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert_clean_error(run_cli("generate", "hi", "--model", str(bad)), str(bad))


def test_prompt_longer_than_context(tiny: Path) -> None:
    prompt = " ".join(f"t{i % 90 + 2}" for i in range(40))
    assert_clean_error(run_cli("generate", prompt, "--model", str(tiny)), "40 tokens", "16")


def test_generate_on_a_small_hf_folder(tiny: Path) -> None:
    proc = run_cli("generate", "t2 t3 t4", "--model", str(tiny), "--max-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) <= 5


# ------------------------------------------------------------------ the shared measurement flags

# Subcommands that run no model for inference, so take none of the measurement flags (or only
# --threads): compare reads reports, export converts files, the trainers train the fp32 target.
NO_MEASUREMENT_FLAGS = {"compare": (), "export": (), "train heads": ("--threads",),
                        "train draft": ("--threads",),
                        # files on disk: installing, listing and checking them runs no model
                        **{f"models {c}": () for c in ("install", "list", "card", "path",
                                                        "verify")}}


def subcommands(parser: argparse.ArgumentParser, prefix: str = ""
                ) -> dict[str, argparse.ArgumentParser]:
    """Every (nested) subcommand's parser, by its command words."""
    out: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = subcommands(sub, f"{prefix}{name} ")
                out.update(inner or {f"{prefix}{name}": sub})
    return out


def measurement_flag_problems(parser: argparse.ArgumentParser) -> list[str]:
    """Subcommands missing a measurement flag (beyond their stated exemption), and flags that
    differ between subcommands (type, default or help)."""
    problems, seen = [], {}
    for name, sub in subcommands(parser).items():
        flags = {o: a for a in sub._actions for o in a.option_strings}
        wanted = NO_MEASUREMENT_FLAGS.get(name, MEASUREMENT_FLAGS)
        problems += [f"{name}: no {f}" for f in wanted if f not in flags]
        if name in NO_MEASUREMENT_FLAGS:
            continue
        for flag in MEASUREMENT_FLAGS:
            if flag in flags:
                a = flags[flag]
                shape = (a.type, a.default, a.help)
                if seen.setdefault(flag, (name, shape))[1] != shape:
                    problems.append(f"{name}: {flag} differs from {seen[flag][0]}'s")
    return problems


def test_every_model_command_takes_the_same_measurement_flags() -> None:
    parser = build_parser()
    names = set(subcommands(parser))
    assert {"generate", "audit", "costs", "bench", "tune", "serve"} <= names
    assert set(NO_MEASUREMENT_FLAGS) <= names  # the exemptions name real commands
    assert measurement_flag_problems(parser) == []


def test_the_flag_check_catches_a_command_without_threads(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Broken variants: `generate` as it was (--model, --precision, --backend, no --threads),
    and a `serve` whose --precision has another default."""
    from specdecode.cli import generate

    def old_model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None)
        p.add_argument("--precision", default="fp32")
        p.add_argument("--backend", default="auto")

    parser = build_parser()
    subcommands(parser)["serve"]._option_string_actions["--precision"].default = "bf16"
    assert measurement_flag_problems(parser) == ["serve: --precision differs from generate's"]
    monkeypatch.setattr(generate, "add_model_args", old_model_args)
    assert "generate: no --threads" in measurement_flag_problems(build_parser())


def test_generate_threads_is_applied_and_reported(tiny: Path) -> None:
    before = torch.get_num_threads()
    try:
        proc = run_cli("generate", "t2 t3", "--model", str(tiny), "--max-tokens", "2",
                       "--json", "--threads", "1")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["threads"] == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert_clean_error(run_cli("generate", "t2", "--model", str(tiny), "--threads", "0"),
                       "--threads", "0")
