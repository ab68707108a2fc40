"""Layer-skipping self-speculation: greedy token identity with plain decoding on SmolLM2, the
sampled-mode distribution audit (see test_drafters_ngram.py for its design), q from the shared
sampling pipeline, and the layer calibration (search, cache, errors) on small random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdecode.audit_stats import tv_distance
from specdecode.drafters import layerskip
from specdecode.drafters.base import Draft, DraftRequest, Rounds
from specdecode.drafters.layerskip import (
    Calibration,
    LayerSkipDrafter,
    LayerSubset,
    cached_calibration,
    calibrate_layers,
)
from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.models.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams, probs_from_logits
from tests.fakes import LookupTarget
from tests.identity import assert_identical
from tests.test_drafters_ngram import (
    DESIGN_TV,
    FALSE_ALARM,
    audit,
    chat_ids,
    generate,
    tiny_model,
)

# Blocks dropped by calibrate_layers on SmolLM2-135M at a budget of 27 of 30 (agreement 0.74).
SMOLLM_DROPPED = (7, 14, 17)
PROMPT = "List three facts about the Moon."
TINY_DRAFT_LAYERS = (0, 2)
TINY_PROMPT = [5, 17, 42, 8, 63]
TINY_CHAT = (("t5 t17 t42 t8 t63 t9 t12", "t33 t34 t35 t2 t17 t42 t8 t77 t41 t40 t3 t9"),) * 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


# ---------------------------------------------------------------------------------------------
# Greedy identity on SmolLM2
# ---------------------------------------------------------------------------------------------


def test_greedy_output_is_plain_decodings_for_every_k(smollm: LoadedModel) -> None:
    prompt = chat_ids(smollm, PROMPT)
    plain = generate(smollm, prompt, 32, None, 0).output
    kept = [i for i in range(smollm.model.cfg.num_layers) if i not in SMOLLM_DROPPED]
    factory = drafter_factory(DrafterOptions("layerskip", layers=tuple(kept)), smollm.model)
    assert factory is not None
    for k in range(1, 9):
        max_tokens = 32 if k == 3 else 8
        drafter = factory()
        gen = generate(smollm, prompt, max_tokens, drafter, k)
        assert_identical([gen], [plain[:max_tokens]], f"k={k} (27 of 30 blocks agree often)")
        assert drafter.cache is None  # type: ignore[attr-defined]  # it drafted in the target's


# ---------------------------------------------------------------------------------------------
# Sampled mode on a small random checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


class SharpenedQ(LayerSkipDrafter):
    """BROKEN: samples from q but reports q^2 renormalised (q at half the temperature)."""

    def rounds(self, request: DraftRequest) -> Rounds:
        # drafting in the target's cache (the engine) or in its own (propose)
        draft = yield from super().rounds(request)
        assert draft.q is not None
        return Draft(draft.tokens, draft.q**2 / (draft.q**2).sum(dim=-1, keepdim=True))


def first_token_distribution(p: torch.Tensor, sampled: torch.Tensor, reported: torch.Tensor
                             ) -> torch.Tensor:
    """Exact distribution of the first emitted token when the draft token is drawn from `sampled`
    and verified against `reported` (Leviathan et al.: accept with min(1, p / q), else draw from
    norm(max(0, p - q)))."""
    accept = torch.clamp(p / reported, max=1.0)  # (V,)
    residual = torch.clamp(p - reported, min=0.0)
    residual = residual / residual.sum()
    rejected = float((sampled * (1 - accept)).sum())
    return sampled * accept + rejected * residual


@pytest.mark.statistical
def test_sampled_output_is_distributed_as_the_target(tiny: torch.nn.Module) -> None:
    factory = drafter_factory(DrafterOptions("layerskip", layers=tuple(TINY_DRAFT_LAYERS)), tiny,
                              capacity=16)
    assert factory is not None
    first_p, pair_p, drafted, accepted = audit(tiny, TINY_PROMPT, factory, 2, seed=30_000)
    assert first_p > FALSE_ALARM and pair_p > FALSE_ALARM
    assert 0 < accepted < drafted


@pytest.mark.statistical
def test_audit_catches_a_drafter_whose_q_is_not_the_one_it_sampled(tiny: torch.nn.Module) -> None:
    with torch.inference_mode():
        ids = torch.tensor([TINY_PROMPT])
        p = torch.softmax(tiny(ids, tiny.new_cache(1, 8))[0, -1].double(), dim=-1)
        subset = LayerSubset(tiny, TINY_DRAFT_LAYERS)
        q = torch.softmax(subset(ids, subset.new_cache(1, 8))[0, -1].double(), dim=-1)
    broken = first_token_distribution(p, q, q**2 / (q**2).sum())
    assert tv_distance(first_token_distribution(p, q, q), p) < 1e-9  # the rule is lossless
    assert tv_distance(broken, p) >= DESIGN_TV  # so the audit has its stated power

    def make() -> SharpenedQ:
        return SharpenedQ(tiny, TINY_DRAFT_LAYERS, capacity=16)

    first_p, pair_p, _, _ = audit(tiny, TINY_PROMPT, make, 2, seed=40_000)
    assert first_p < FALSE_ALARM and pair_p < FALSE_ALARM


def test_q_comes_from_the_sampling_pipeline_on_the_kept_layers(tiny: torch.nn.Module) -> None:
    params = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.3, seed=0)
    drafter = LayerSkipDrafter(tiny, TINY_DRAFT_LAYERS, capacity=16)
    context = torch.tensor(TINY_PROMPT)
    draft = drafter.propose(DraftRequest(context, 1, params, 2, torch.Generator().manual_seed(0)))
    with torch.inference_mode():
        logits = tiny(context[None], tiny.new_cache(1, 8), layers=TINY_DRAFT_LAYERS)[0, -1:]
    expected = probs_from_logits(logits, params, context, 2, torch.zeros(0, dtype=torch.long))
    assert draft.q is not None
    torch.testing.assert_close(draft.q, expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def identity_block(tmp_path: Path) -> tuple[torch.nn.Module, Tokenizer]:
    """A tiny model whose block 1 adds nothing to the residual stream (so dropping it is free)."""
    model = tiny_model(tmp_path / "m")
    with torch.no_grad():
        model.layers[1].o.weight.zero_()
        model.layers[1].down.weight.zero_()
    return model, Tokenizer(tmp_path / "m")


def test_calibration_drops_the_block_that_changes_nothing(
    identity_block: tuple[torch.nn.Module, Tokenizer],
) -> None:
    model, tok = identity_block
    result = calibrate_layers(model, tok, 2, TINY_CHAT)
    assert result.layers == (0, 2) and result.agreement == 1.0
    assert result.evaluations == 1 + 3  # the reference pass, then each block once
    fewer = calibrate_layers(model, tok, 1, TINY_CHAT)
    assert len(fewer.layers) == 1 and fewer.agreement < 1.0
    assert calibrate_layers(model, tok, 3, TINY_CHAT).layers == (0, 1, 2)


def test_calibration_is_cached_per_model_and_budget(
    identity_block: tuple[torch.nn.Module, Tokenizer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, tok = identity_block
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    first = cached_calibration(model, tok, 2, TINY_CHAT)
    files = list((tmp_path / "cache" / "layerskip").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["layers"] == [0, 2]

    def refuse(*_: object) -> Calibration:
        raise AssertionError("calibrated again although the cache holds the choice")

    monkeypatch.setattr(layerskip, "calibrate_layers", refuse)
    assert cached_calibration(model, None, 2, TINY_CHAT) == first
    with pytest.raises(AssertionError, match="calibrated again"):
        cached_calibration(model, tok, 1, TINY_CHAT)  # another budget
    with pytest.raises(AssertionError, match="calibrated again"):
        cached_calibration(model, tok, 2, TINY_CHAT[:1])  # another text
    with torch.no_grad():
        model.layers[0].qkv.weight.add_(0.01)
    with pytest.raises(AssertionError, match="calibrated again"):
        cached_calibration(model, tok, 2, TINY_CHAT)  # other weights


def test_uncached_calibration_without_a_tokenizer_is_a_clear_error(
    tiny: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SpecDecodeError, match="needs the model's tokenizer"):
        drafter_factory("layerskip", tiny)


@pytest.mark.parametrize("layers", [[], [2, 0], [0, 0, 1], [0, 3], [-1, 1]])
def test_bad_layer_lists_are_refused(tiny: torch.nn.Module, layers: list[int]) -> None:
    with pytest.raises(SpecDecodeError, match=r"distinct ascending block indices in 0\.\.2"):
        drafter_factory(DrafterOptions("layerskip", layers=tuple(layers)), tiny)


@pytest.mark.parametrize("name", ["layerskip", "heads", "w4a16", "int8", "ngram+w4a16"])
def test_a_target_off_the_native_runner_is_refused(name: str) -> None:
    """Drafters that need the native runner's blocks, caches or features refuse another
    backend with one message naming the drafter (drafters.base.native)."""
    class Adapter(LookupTarget):  # a target on another backend
        backend = "transformers"

    drafter = name.removeprefix("ngram+")
    with pytest.raises(SpecDecodeError, match=f"the {drafter} drafter needs a target on the "
                                              "native runner"):
        drafter_factory(DrafterOptions(name, layers=(0,) if name == "layerskip" else None),
                        Adapter())
