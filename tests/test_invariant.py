"""Drafter-invariant seeded sampling (rule "invariant"): a seed gives plain decoding's tokens.

Every sampled output token is the target's Gumbel-max token at its output position, with noise
keyed by (seed, position) (sampling.PositionNoise, verify.verify_invariant). These tests check:
the noise is keyed by what it says and nothing else; Gumbel-max samples the pipeline's
distribution; verification keeps the right prefix; seeded speculative output is token-identical
to plain seeded output for every drafter, k, batch and sampling setting on small models; the
output distribution over seeds is the target's (chi-square against the exact enumeration); and
broken variants kept here fail: noise keyed by step instead of position (identity), drafter
noise independent of the target's (acceptance of a drafter equal to the target), and the
pipeline applied to q only (distribution).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

import specdecode.engine as engine
import specdecode.verification as verification
from specdecode.audit_stats import chi_square_gof
from specdecode.control import Controller
from specdecode.drafters.base import Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.heads import FeatureDrafterModel, HeadsDrafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.layerskip import LayerSkipDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import load_native
from specdecode.sampling import PositionNoise, SamplingParams, gumbel_argmax
from specdecode.verify import verify_invariant
from tests.conftest import make_checkpoint
from tests.identity import assert_identical
from tests.test_engine_sampled import (
    FALSE_ALARM,
    PARAMS,
    SAMPLES,
    exact_pairs,
    gof_p_value,
    models,  # noqa: F401 (a fixture)
    observed_pairs,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread

# prompts with repeats, so that prompt lookup drafts often
PROMPTS = ([5, 17, 42, 8, 63, 5, 17, 42, 9, 12, 5, 17], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4],
           [70, 71, 72, 70, 71, 72, 70])
SETTINGS = (
    SamplingParams(temperature=0.7, max_tokens=64),
    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64),
    SamplingParams(temperature=0.3, top_k=5, min_p=0.05, max_tokens=64),
    SamplingParams(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.3,
                   frequency_penalty=0.2, logit_bias=((7, 2.0),), max_tokens=64),
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(target, draft): a sharpened 3-block random model and a 1-block one, vocabulary 96."""
    root = tmp_path_factory.mktemp("invariant")
    target_dir = make_checkpoint(root / "target", seed=3)
    draft_dir = make_checkpoint(root / "draft", seed=4, num_hidden_layers=1)
    target = load_native(target_dir, config_from_hf(read_hf_config(target_dir)))
    draft = load_native(draft_dir, config_from_hf(read_hf_config(draft_dir)))
    with torch.no_grad():
        target.norm.mul_(1.5)  # sharper than random: drafts get accepted often
    return target, draft


def drafters(target: Any, draft: Any) -> dict[str, Callable[[], Drafter]]:
    """Every kind of drafter that runs on the small models."""
    w4a16 = drafter_factory("w4a16", target)
    int8 = drafter_factory("int8", target)
    assert w4a16 is not None and int8 is not None
    torch.manual_seed(0)
    heads = FeatureDrafterModel(target, torch.arange(target.cfg.vocab_size)).eval()
    return {
        "heads": lambda: HeadsDrafter(heads, 256),
        "ngram": lambda: NgramDrafter(4, 1),
        "draft-model": lambda: DraftModelDrafter(draft),
        "w4a16": w4a16,
        "int8": int8,
        "layerskip": lambda: LayerSkipDrafter(target, (0, 2), 256),
        "ngram+draft-model": lambda: HybridDrafter(NgramDrafter(4, 1), DraftModelDrafter(draft),
                                                   "ngram+draft-model", min_expected=0.0),
    }


def decode(target: Any, prompt: list[int], params: SamplingParams,
           drafter: Drafter | None = None, k: int = 0) -> Generation:
    gen = Generation(target, None, prompt, params, drafter, k)
    for _ in gen.run():
        pass
    return gen


# ---------------------------------------------------------------------------------------------
# The noise and Gumbel-max
# ---------------------------------------------------------------------------------------------


def test_noise_is_keyed_by_seed_and_position_only() -> None:
    a, b = PositionNoise(7), PositionNoise(7)
    first = a.gumbel(3, 50).clone()
    for pos in (0, 9, 1, 3):  # asked in another order, by another instance
        b.gumbel(pos, 50)
    assert torch.equal(b.gumbel(3, 50), first)
    assert not torch.equal(a.gumbel(4, 50), first)
    assert not torch.equal(PositionNoise(8).gumbel(3, 50), first)
    assert torch.equal(PositionNoise(-1).gumbel(3, 50), PositionNoise(2**64 - 1).gumbel(3, 50))
    assert torch.isfinite(first).all()


def test_gumbel_max_samples_the_processed_distribution() -> None:
    x = torch.tensor([1.0, 0.2, -0.5, float("-inf"), 0.7])
    probs = torch.softmax(x, dim=-1).tolist()
    noise = PositionNoise(11)
    n = 6000
    counts = Counter(gumbel_argmax(x, noise.gumbel(i, 5)) for i in range(n))
    assert counts[3] == 0  # a masked token never wins
    kept = [0, 1, 2, 4]
    observed = [counts[t] for t in kept]
    assert chi_square_gof(observed, [probs[t] for t in kept]).p_value > FALSE_ALARM
    skewed = [0.35, 0.2, 0.15, 0.3]  # a wrong distribution is rejected by the same test
    assert chi_square_gof(observed, skewed).p_value < FALSE_ALARM


def _pinned(tokens: list[int], vocab: int = 6) -> Callable[[int], torch.Tensor]:
    """Noise that makes row i's Gumbel-max token tokens[i] (a bump far above the logits)."""
    def noise(i: int) -> torch.Tensor:
        g = torch.zeros(vocab)
        g[tokens[i]] = 100.0
        return g
    return noise


def test_verification_keeps_the_prefix_equal_to_the_targets_tokens() -> None:
    x = torch.zeros(4, 6)
    target = [2, 4, 1, 5]
    asked: list[int] = []

    def noise(i: int) -> torch.Tensor:
        asked.append(i)
        return _pinned(target)(i)

    result = verify_invariant(x, torch.tensor([2, 4, 3]), noise)  # third token rejected
    assert result.num_accepted == 2 and result.tokens.tolist() == [2, 4, 1]
    assert asked == [0, 1, 2]  # no noise past the first mismatch
    bonus = verify_invariant(x, torch.tensor([2, 4, 1]), _pinned(target))
    assert bonus.num_accepted == 3 and bonus.tokens.tolist() == target
    none = verify_invariant(x[:1], torch.zeros(0, dtype=torch.long), _pinned(target))
    assert none.num_accepted == 0 and none.tokens.tolist() == [2]
    with pytest.raises(ValueError):
        verify_invariant(x, torch.tensor([1]), _pinned(target))


# ---------------------------------------------------------------------------------------------
# Token identity with plain seeded decoding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ngram", "draft-model", "w4a16", "int8", "layerskip",
                                  "heads", "ngram+draft-model"])
def test_seeded_output_is_plain_decodings_for_every_drafter_and_k(
        pair: tuple[Any, Any], name: str) -> None:
    target, draft = pair
    make = drafters(target, draft)[name]
    gens, plain = [], []
    for k in range(1, 9):  # every k, each with two of the settings
        for p_i, prompt in enumerate(PROMPTS[:2]):
            s = (k + p_i) % len(SETTINGS)
            seeded = dataclasses.replace(SETTINGS[s], seed=1000 * s + p_i)
            plain.append(decode(target, prompt, seeded).output)
            gens.append(decode(target, prompt, seeded, make(), k))
    drafted = assert_identical(gens, plain, f"{name}, seeded, k = 1..8")
    rejections = sum(g.counters.rejections for g in gens)
    assert drafted.drafted > 100 and rejections > 0  # both ways of a step ran


def test_seeded_outputs_survive_batching_and_the_controller(pair: tuple[Any, Any]) -> None:
    """8 requests with different seeds, settings and drafters in one batch under --k auto:
    each request's output is its plain seeded output alone."""
    target, draft = pair
    makers = drafters(target, draft)
    names = ["ngram", "draft-model", "w4a16", "ngram+draft-model", "layerskip", "heads", "none",
             "draft-model"]
    requests = [(PROMPTS[i % 3], dataclasses.replace(SETTINGS[i % 4], seed=77 + i), names[i])
                for i in range(8)]
    plain = [decode(target, prompt, params).output for prompt, params, _ in requests]
    for controller in (None, Controller(kmax=6)):
        batch = BatchEngine(target, max_batch=8, max_seq_len=128, controller=controller)
        gens = [Generation(target, None, prompt, params,
                           None if name == "none" else makers[name](), 4 if name != "none" else 0)
                for prompt, params, name in requests]
        run_batch(batch, gens)
        assert_identical(gens, plain, f"seeded batch, controller {controller is not None}")


def test_a_request_without_a_seed_records_one_that_reproduces_it(pair: tuple[Any, Any]) -> None:
    target, draft = pair
    params = SETTINGS[1]
    gen = decode(target, PROMPTS[0], params, DraftModelDrafter(draft), 3)
    again = decode(target, PROMPTS[0], dataclasses.replace(params, seed=gen.seed))
    assert again.output == gen.output
    other = decode(target, PROMPTS[0], params)
    assert other.seed != gen.seed


def test_noise_keyed_by_step_breaks_identity(
        pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: the noise of a step's rows counted from the step index, not the output
    position. Plain decoding (one token a step) cannot tell; speculation can."""
    target, draft = pair
    monkeypatch.setattr(engine, "output_position", lambda gen: gen.counters.steps)
    w4a16 = drafters(target, draft)["w4a16"]
    runs = [(prompt, dataclasses.replace(params, seed=5)) for prompt in PROMPTS
            for params in SETTINGS]
    differ = sum(decode(target, prompt, params, w4a16(), 4).output
                 != decode(target, prompt, params).output for prompt, params in runs)
    assert differ >= len(runs) // 2


class _OwnNoise(DraftModelDrafter):
    """Broken variant: draws its draft with noise of its own, independent of the target's."""

    def propose(self, request: Any) -> Any:
        own = PositionNoise(request.noise.seed + 1)
        return super().propose(dataclasses.replace(request, noise=own))


def test_the_drafter_shares_the_targets_noise(pair: tuple[Any, Any]) -> None:
    """A drafter whose q is the target's p accepts every token when it draws with the target's
    noise; with independent noise it is rejected often (identity holds either way: only
    acceptance shows the coupling)."""
    target, _ = pair
    params = dataclasses.replace(SETTINGS[0], seed=9, max_tokens=48)
    plain = decode(target, PROMPTS[0], params).output
    coupled = decode(target, PROMPTS[0], params, DraftModelDrafter(copy.deepcopy(target)), 4)
    broken = decode(target, PROMPTS[0], params, _OwnNoise(copy.deepcopy(target)), 4)
    assert coupled.output == plain and broken.output == plain
    assert coupled.counters.accepted == coupled.counters.drafted > 0
    assert broken.counters.accepted < 0.8 * broken.counters.drafted


# ---------------------------------------------------------------------------------------------
# The distribution over seeds
# ---------------------------------------------------------------------------------------------

INVARIANT = dataclasses.replace(PARAMS, rule="invariant")


@pytest.mark.statistical
def test_plain_and_speculative_seeded_sampling_match_the_target_distribution(
        models: Any) -> None:  # noqa: F811
    target, draft, _ = models
    exact = exact_pairs(target, INVARIANT)
    plain = observed_pairs(target, None, 0, SAMPLES, INVARIANT)
    assert gof_p_value(plain, exact) > FALSE_ALARM
    spec = observed_pairs(target, lambda: DraftModelDrafter(draft), 3, SAMPLES, INVARIANT)
    assert spec == plain  # the same seeds: the same pairs


@pytest.mark.statistical
def test_the_pipeline_applied_to_q_only_is_caught(
        models: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Broken variant: the verifier takes the target's raw logits, not the processed ones."""
    target, draft, _ = models
    monkeypatch.setattr(verification, "process_logits",
                        lambda logits, *args, **kwargs: logits.to(torch.float32))
    counts = observed_pairs(target, lambda: DraftModelDrafter(draft), 3, SAMPLES, INVARIANT)
    assert gof_p_value(counts, exact_pairs(target, INVARIANT)) < FALSE_ALARM


# ---------------------------------------------------------------------------------------------
# Where a seed goes: the command line
# ---------------------------------------------------------------------------------------------


def test_generate_reports_its_seed_and_the_seed_reproduces_it(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    import json

    from tests.cli_run import run_cli

    folder = str(make_checkpoint(tmp_path_factory.mktemp("cli") / "tiny", seed=3))
    common = ["generate", "t5 t17 t42 t8 t5 t17 t42", "--model", folder, "--max-tokens", "24",
              "--temperature", "0.9", "--json"]
    code, out, err = run_cli(common)
    assert code == 0, err
    first = json.loads(out)
    assert isinstance(first["seed"], int) and first["rule"] == "invariant"
    code, out, err = run_cli([*common, "--seed", str(first["seed"]), "--drafter", "ngram",
                              "--k", "3"])
    assert code == 0, err
    assert json.loads(out)["token_ids"] == first["token_ids"]
    code, out, err = run_cli([*common, "--rule", "sometimes"])
    assert code == 2 and "--rule" in err
