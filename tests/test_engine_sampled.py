"""Sampled speculative decoding has exactly the target's output distribution.

A small random checkpoint (vocabulary 96) is the target; its exact distribution over the first two
emitted tokens is computed by enumeration with the same sampling pipeline. The engine, with a
different small model as the draft, is run many times with distinct seeds, and a chi-square
goodness-of-fit test compares the observed pairs with the exact distribution at a stated false-alarm
rate. Each deliberately broken variant must be rejected by the same test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

import specdecode.verification as verification
from specdecode.audit_stats import chi_square_gof, required_samples
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.faults import FAULTS, FaultyDrafter
from specdecode.engine import Generation
from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import load_native
from specdecode.sampling import SamplingParams, probs_from_logits, sample
from specdecode.verify import VerifyResult
from tests.conftest import make_checkpoint

FALSE_ALARM = 1e-4  # chance that a correct engine fails this test
PARAMS = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=2, rule="residual")
PROMPT = [5, 7, 3, 8]
CELLS = 40  # most likely pairs kept as cells; the rest form one "other" cell
SMALL = {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2}
# Seeds and weight scales chosen (by computing each fault's exact first-token output distribution)
# so that every broken variant below is at least 0.17 in total variation from the target.
MODELS = (("target", 6, 2, 4.0), ("draft", 7, 1, 8.0), ("other", 8, 1, 8.0))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(target, draft, other): three small random models sharing a vocabulary of 16."""
    root = tmp_path_factory.mktemp("models")
    loaded = []
    for name, seed, layers, scale in MODELS:
        folder = make_checkpoint(root / name, seed=seed, scale=scale, num_hidden_layers=layers,
                                 **SMALL)
        loaded.append(load_native(folder, config_from_hf(read_hf_config(folder))))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster and immune to contention
    yield loaded[0], loaded[1], loaded[2]
    torch.set_num_threads(threads)


def exact_pairs(target: Any, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(first two tokens = (a, b)) for plain sampling from the target with `params`."""
    ctx = torch.tensor(PROMPT)
    empty = torch.zeros(0, dtype=torch.long)
    with torch.inference_mode():
        first = probs_from_logits(target(ctx[None], target.new_cache(1, 8))[0, -1:], params,
                                  ctx, len(PROMPT), empty)[0]  # (V,)
        out: dict[tuple[int, int], float] = {}
        for a in torch.nonzero(first).flatten().tolist():
            hist = torch.tensor([*PROMPT, a])
            logits = target(hist[None], target.new_cache(1, 8))[0, -1:]
            second = probs_from_logits(logits, params, hist, len(PROMPT), empty)[0]
            for b in torch.nonzero(second).flatten().tolist():
                out[(a, b)] = float(first[a] * second[b])
    return out


def observed_pairs(target: Any, make_drafter: Callable[[], Any] | None, k: int, n: int,
                   params: SamplingParams = PARAMS) -> Counter[tuple[int, int]]:
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": 10_000 + seed})
        gen = Generation(target, None, PROMPT, p, make_drafter() if make_drafter else None, k)
        for _ in gen.run():
            pass
        counts[(gen.output[0], gen.output[1])] += 1
    return counts


def gof_p_value(counts: Counter[tuple[int, int]], exact: dict[tuple[int, int], float]) -> float:
    top = sorted(exact, key=exact.__getitem__, reverse=True)[:CELLS]
    observed = [counts[c] for c in top] + [sum(counts.values()) - sum(counts[c] for c in top)]
    probs = [exact[c] for c in top] + [max(0.0, 1.0 - sum(exact[c] for c in top))]
    return chi_square_gof(observed, probs).p_value


# Detect a first-two-token TV gap of 0.15 with power 0.999 at the false-alarm rate above.
SAMPLES = required_samples(0.15, FALSE_ALARM, 0.999, CELLS + 1)


def test_sample_size_is_derived_and_affordable() -> None:
    assert 300 < SAMPLES < 2000


@pytest.mark.statistical
@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_matches_target_distribution(models: Any, k: int) -> None:
    target, draft, _ = models
    exact = exact_pairs(target, PARAMS)
    counts = observed_pairs(target, lambda: DraftModelDrafter(draft), k, SAMPLES)
    assert gof_p_value(counts, exact) > FALSE_ALARM


@pytest.mark.statistical
def test_lookup_then_model_hybrid_matches_target_distribution(models: Any) -> None:
    """A request whose steps are drafted now by lookup (one-hot, q None), now by a draft model
    (q): the choice depends only on the committed context, so every step stays exact. With
    min_expected 0 the lookup drafts whenever it matches: here after a recovered token that
    repeats a prompt token, so both kinds of step occur within the first two tokens."""
    from specdecode.drafters.hybrid import HybridDrafter
    from specdecode.drafters.ngram import NgramDrafter

    target, draft, _ = models
    made: list[HybridDrafter] = []

    def make() -> HybridDrafter:
        made.append(HybridDrafter(NgramDrafter(2, 1), DraftModelDrafter(draft), "ngram+draft",
                                  min_expected=0.0))
        return made[-1]

    longer = SamplingParams(**{**PARAMS.__dict__, "max_tokens": 3})  # room to draft at step 2
    counts = observed_pairs(target, make, 1, SAMPLES, longer)
    assert gof_p_value(counts, exact_pairs(target, PARAMS)) > FALSE_ALARM
    assert sum(d.used[0] for d in made) > 20 and sum(d.used[1] for d in made) > 20


@pytest.mark.statistical
def test_plain_sampling_matches_target_distribution(models: Any) -> None:
    target = models[0]
    assert gof_p_value(observed_pairs(target, None, 0, SAMPLES), exact_pairs(target, PARAMS)) \
        > FALSE_ALARM


def _no_residual(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor,
                 generator: torch.Generator | None) -> VerifyResult:
    """Broken: accepts with min(1, p/q) but draws the recovered token from p, not the residual."""
    k = len(draft)
    for i in range(k):
        assert q is not None
        x = int(draft[i])
        if float(torch.rand((), generator=generator)) >= min(1.0, float(p[i, x] / q[i, x])):
            recovered = int(sample(p[i], generator))
            return VerifyResult(i, torch.tensor([*draft[:i].tolist(), recovered]))
    return VerifyResult(k, torch.tensor([*draft.tolist(), int(sample(p[k], generator))]))


@pytest.mark.statistical
@pytest.mark.parametrize("fault", ["no-residual", *FAULTS])
def test_broken_variants_are_caught(
    models: Any, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft, other = models
    if fault == "no-residual":
        monkeypatch.setattr(verification, "verify_chain", _no_residual)
        make = lambda: DraftModelDrafter(draft)  # noqa: E731
    else:
        make = lambda: FaultyDrafter(draft, fault, other)  # noqa: E731
    counts = observed_pairs(target, make, 2, SAMPLES)
    assert gof_p_value(counts, exact_pairs(target, PARAMS)) < FALSE_ALARM
