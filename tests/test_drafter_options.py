"""DrafterOptions (drafters.options): every front end's drafter options reach the drafter factory,
and an option the drafter does not read is an error naming it, before anything loads.

The front ends: `specdecode generate`, `audit`, `serve`, `bench` (a configuration string), `tune`
and the Python API. Each route is driven from the user's side with an option pointing at a
folder that does not exist: the drafter that reads it fails naming that folder, which it can only
do if the option arrived (`serve --heads DIR` used to be parsed and dropped, so the server
loaded the default heads instead).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import specdecode
from specdecode.drafters.options import DRAFTERS, DrafterOptions, needs, reads
from specdecode.errors import SpecDecodeError
from tests.cli_run import run_cli
from tests.conftest import make_checkpoint

# the drafter that reads each option the command line carries
READER = {"heads": "heads", "distilled": "distilled", "draft_model": "draft-model"}
FLAG = {"heads": "--heads", "distilled": "--distilled", "draft_model": "--draft-model"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("options") / "tiny")


def cli_error(argv: list[str]) -> str:
    """The one error line of a command that must fail (exit status 2)."""
    code, out, err = run_cli(argv)
    lines = [line for line in err.splitlines() if line.startswith("specdecode: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and not out, err
    return lines[0]


def api_error(model: str, drafter: str, option: str, value: str) -> str:
    with pytest.raises(SpecDecodeError) as info:
        specdecode.load(model, drafter=drafter, **{option: value})  # type: ignore[arg-type]
    return str(info.value)


# Each front end: (model, drafter, option, value, scratch folder) -> its error message, with
# `option` (a DrafterOptions field) given as that front end spells it.
Route = Callable[[str, str, str, str, Path], str]
ROUTES: dict[str, Route] = {
    "generate": lambda m, d, o, v, tmp: cli_error(
        ["generate", "t2 t3", "--model", m, "--max-tokens", "2", "--drafter", d, FLAG[o], v]),
    "audit": lambda m, d, o, v, tmp: cli_error(
        ["audit", "--model", m, "--prompt", "t2 t3", "--drafter", d, FLAG[o], v]),
    "serve": lambda m, d, o, v, tmp: cli_error(
        ["serve", "--model", m, "--port", "0", "--drafter", d, FLAG[o], v]),
    "bench": lambda m, d, o, v, tmp: cli_error(
        ["bench", "--model", m, "--configs", f"plain;{d}:k=2,{o}={v}", "--out", str(tmp),
         "--quiet"]),
    "tune": lambda m, d, o, v, tmp: cli_error(
        ["tune", "--model", m, "--drafters", d, FLAG[o], v, "--out", str(tmp), "--quiet"]),
    "api": lambda m, d, o, v, tmp: api_error(m, d, o, v),
}
CARRIES = {"generate": ("heads", "distilled", "draft_model"),
           "audit": ("heads", "distilled", "draft_model"),
           "serve": ("heads", "distilled", "draft_model"),
           "bench": ("heads", "distilled", "draft_model"),
           "tune": ("draft_model",),
           "api": ("heads", "distilled", "draft_model")}
CASES = [(front, option) for front, options in CARRIES.items() for option in options]


@pytest.mark.parametrize(("front", "option"), CASES)
def test_every_front_end_delivers_its_drafter_options(
        tiny: Path, tmp_path: Path, front: str, option: str) -> None:
    missing = str(tmp_path / f"no-{option}")
    message = ROUTES[front](str(tiny), READER[option], option, missing, tmp_path / "out")
    assert missing in message, message


@pytest.mark.parametrize(("front", "option"), CASES)
def test_an_option_the_drafter_does_not_read_is_refused_before_loading(
        tmp_path: Path, front: str, option: str) -> None:
    nowhere = str(tmp_path / "no-model")  # refused before loading: the model is never read
    message = ROUTES[front](nowhere, "ngram", option, "x", tmp_path / "out")
    assert nowhere not in message, message
    if front == "tune":  # its --draft-model goes to the drafters tuned that read one
        assert "none of the drafters tuned" in message and "--draft-model" in message, message
    else:
        assert "ngram drafter does not use" in message and option in message, message


def test_serve_passes_heads_and_distilled_to_the_factory(tmp_path: Path) -> None:
    """The bug of issue 33: `serve --heads DIR` / `--distilled DIR` were parsed and dropped."""
    import argparse

    from specdecode.cli.serve import options_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    for flag, drafter, field in (("--heads", "heads", "heads"),
                                 ("--distilled", "distilled", "distilled")):
        args = parser.parse_args(["serve", "--model", str(tmp_path), "--drafter", drafter,
                                  flag, "DIR"])
        options = options_from_args(args).drafter
        assert (options.name, getattr(options, field)) == (drafter, "DIR")


def test_the_route_test_catches_a_dropped_option(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: serve's options built without --heads (the old bug). The route test's
    check, the missing folder named in the error, then fails."""
    import dataclasses

    from specdecode.cli import serve

    real = serve.drafter_options
    monkeypatch.setattr(serve, "drafter_options",
                        lambda args: dataclasses.replace(real(args), heads=None))
    missing = str(tmp_path / "no-heads")
    message = ROUTES["serve"](str(tiny), "heads", "heads", missing, tmp_path / "out")
    assert missing not in message, message


def test_the_declared_options_are_what_the_drafters_read() -> None:
    """Every name parses into its parts; hybrids read their parts' options; X-tree reads X's;
    the options a drafter needs are among those it reads; every field is read by some drafter
    (or is the engine's)."""
    assert reads("ngram+draft-model") == ("ngram_max", "ngram_min", "draft_model", "draft_vocab")
    assert reads("suffix+w4a16") == (*reads("suffix"), "draft_vocab")
    assert reads("ngram+auto") == reads("ngram")  # the measured choice reads no model options
    assert reads("distilled-tree") == ("distilled",)
    assert needs("suffix+draft-model") == ("draft_model",) == needs("draft-model-tree")
    fields = {f.name for f in __import__("dataclasses").fields(DrafterOptions)}
    read = {option for name in DRAFTERS for option in reads(name)}
    assert fields - read == {"name", "k", "kmax", "max_step_cost"}
    for name in DRAFTERS:
        assert set(needs(name)) <= set(reads(name))


@pytest.mark.parametrize(("options", "needle"), [
    (DrafterOptions("ngram", heads="x"), "ngram drafter does not use heads (--heads)"),
    (DrafterOptions("w4a16", layers=(0,)), "w4a16 drafter does not use layers"),
    (DrafterOptions("ngram+w4a16", tree_nodes=4), "does not use tree_nodes"),
    (DrafterOptions("xtok"), "needs --draft-model PATH"),
    (DrafterOptions("suffix", suffix_mib=0.0), "suffix_mib (--suffix-mib) must be"),
    (DrafterOptions("suffix", suffix_isolation="nobody"), "suffix_isolation"),
    (DrafterOptions("ngram", k=0), "k (--k) must be an integer in 1..64"),
    (DrafterOptions("ngram", kmax=65), "kmax (--kmax)"),
    (DrafterOptions("ngram", max_step_cost=0.5), "--max-step-cost"),
    (DrafterOptions("telepathy"), "unknown drafter 'telepathy'"),
])
def test_bad_options_name_the_option(options: DrafterOptions, needle: str) -> None:
    with pytest.raises(SpecDecodeError) as info:
        options.check()
    assert needle in str(info.value), str(info.value)


def test_a_mapping_of_options_reads_as_a_configuration_writes_them() -> None:
    read = DrafterOptions.from_mapping("layerskip", {"layers": [0, 2], "kmax": 4}, "auto")
    assert read == DrafterOptions("layerskip", "auto", kmax=4, layers=(0, 2))
    assert DrafterOptions.from_mapping("draft-model", {"model": 7}, 3).draft_model == "7"
    with pytest.raises(SpecDecodeError, match="takes no option 'colour'"):
        DrafterOptions.from_mapping("ngram", {"colour": 1})
