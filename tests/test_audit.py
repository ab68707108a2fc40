"""`specdecode audit`: passes consistent configurations, fails inconsistent ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import specdecode.engine as engine
from specdecode.audit import audit_greedy, audit_sampled
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.faults import FaultyDrafter
from specdecode.errors import SpecDecodeError
from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import load_native
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint
from tests.fakes import ScriptedDrafter
from tests.test_cli import run_cli

SMALL = {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("audit")
    models = []
    for name, seed, layers, scale in (("target", 6, 2, 4.0), ("draft", 7, 1, 8.0)):
        folder = make_checkpoint(root / name, seed=seed, scale=scale, num_hidden_layers=layers,
                                 **SMALL)
        models.append(load_native(folder, config_from_hf(read_hf_config(folder))))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield models
    torch.set_num_threads(threads)


PARAMS = SamplingParams(temperature=0.5, top_p=0.9, rule="residual")


def test_sampled_audit_passes_a_consistent_draft(pair: Any) -> None:
    target, draft = pair
    result = audit_sampled(target, [5, 7, 3, 8], PARAMS, lambda: DraftModelDrafter(draft), 2,
                           samples=400, false_alarm=1e-3)
    assert result.passed and result.p_value is not None and result.p_value >= 1e-3
    assert result.tv_upper is not None and result.tv_estimate is not None
    assert result.tv_estimate <= result.tv_upper
    assert result.acceptance_rate is not None and 0 < result.acceptance_rate < 1


@pytest.mark.parametrize("fault", ["q-from-other-model", "sampler-one-side"])
def test_sampled_audit_fails_an_inconsistent_draft(pair: Any, fault: str) -> None:
    target, draft = pair
    make = lambda: FaultyDrafter(draft, fault, target)  # noqa: E731
    result = audit_sampled(target, [5, 7, 3, 8], PARAMS, make, 2, samples=400)
    assert not result.passed and "FAIL" in result.render()


def test_invariant_audit_checks_identity_per_seed(
        pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule invariant: every plain seed is also run speculatively and must match, which catches
    a broken coupling (noise keyed by step, not output position) the distribution test may not."""
    target, draft = pair
    invariant = dataclasses.replace(PARAMS, rule="invariant")
    ok = audit_sampled(target, [5, 7, 3, 8], invariant, lambda: DraftModelDrafter(draft), 2,
                       samples=100, tokens=4)
    assert ok.passed and ok.identical == 100 and "100/100 seeds" in ok.render()
    monkeypatch.setattr(engine, "output_position", lambda g: g.counters.steps)
    broken = audit_sampled(target, [5, 7, 3, 8], invariant, lambda: DraftModelDrafter(draft), 2,
                           samples=100, tokens=4)
    assert not broken.passed and broken.identical is not None and broken.identical < 100


def test_greedy_audit_counts_mismatches(pair: Any) -> None:
    target, _ = pair
    params = SamplingParams(max_tokens=6)
    ok = audit_greedy(target, [[5, 7, 3, 8]], params,
                      lambda: ScriptedDrafter([], 4, "wrong", vocab=16), 3)
    assert ok.passed and ok.mismatches == 0


def test_cli_audit_rejects_bad_options(tmp_path: Path) -> None:
    proc = run_cli("audit", "--drafter", "int8", "--samples", "3", "--temperature", "1")
    assert proc.returncode == 2 and "--samples" in proc.stderr and "Traceback" not in proc.stderr


def test_sampled_audit_refuses_one_token_outcomes(pair: Any) -> None:
    """With one token per outcome the drafter never runs: such an audit could not fail."""
    target, draft = pair
    with pytest.raises(SpecDecodeError, match="at least 2 tokens"):
        audit_sampled(target, [5, 7, 3, 8], PARAMS, lambda: DraftModelDrafter(draft), 2,
                      samples=400, tokens=1)
