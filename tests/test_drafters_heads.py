"""EAGLE-style heads drafter on a small random checkpoint: greedy token identity with plain
decoding for k = 1..8 (alone and in the batch engine), the engine's feature hook (the drafter
holds exactly the target's features of the committed positions), the sampled-mode distribution
audit (see test_drafters_ngram.py for its design) with a broken variant it must catch, q from the
shared sampling pipeline and zero outside the draft vocabulary, and the refusal of heads trained
for another target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode.audit_stats import tv_distance
from specdecode.drafters.base import Draft, DraftRequest
from specdecode.drafters.heads import FeatureDrafterModel, HeadsDrafter, load_heads
from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.models.cards import weights_sha256
from specdecode.sampling import SamplingParams, probs_from_logits
from specdecode.train.heads import target_features, write_heads
from tests.identity import assert_identical
from tests.test_drafters_layerskip import first_token_distribution
from tests.test_drafters_ngram import DESIGN_TV, FALSE_ALARM, V, audit, tiny_model

PROMPT = [5, 17, 42, 8, 63, 9, 12]
SUBSET = 48  # draft vocabulary of the reduced-vocabulary heads


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def unlikely_subset(model: torch.nn.Module) -> torch.Tensor:
    """The SUBSET tokens the target finds least likely after PROMPT (ascending ids): q then
    misses most of p's mass, which makes the broken variant below far from the target."""
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT]), model.new_cache(1, len(PROMPT)))[0, -1]
    return torch.sort(logits.argsort()[:SUBSET]).values


@pytest.fixture(scope="module")
def heads(tiny: torch.nn.Module) -> FeatureDrafterModel:
    torch.manual_seed(0)
    return FeatureDrafterModel(tiny, torch.arange(V)).eval()


@pytest.fixture(scope="module")
def small_heads(tiny: torch.nn.Module) -> FeatureDrafterModel:
    torch.manual_seed(1)
    return FeatureDrafterModel(tiny, unlikely_subset(tiny)).eval()


def decode(model: torch.nn.Module, drafter: HeadsDrafter | None, k: int, n: int) -> Generation:
    gen = Generation(model, None, PROMPT, SamplingParams(max_tokens=n), drafter, k)
    for _ in gen.run():
        pass
    return gen


# ---------------------------------------------------------------------------------------------
# Greedy identity and the feature hook
# ---------------------------------------------------------------------------------------------


def test_greedy_output_is_plain_decodings_for_every_k(
    tiny: torch.nn.Module, heads: FeatureDrafterModel
) -> None:
    plain = decode(tiny, None, 0, 24).output
    for k in range(1, 9):
        gen = decode(tiny, HeadsDrafter(heads, capacity=64), k, 24)
        # untrained heads: their drafts are rejected (the rejection path and the feature
        # hook); heads' drafts accepted: tests/test_invariant.py (seeded sampling)
        assert_identical([gen], [plain], f"k={k}", require_accepted=False)


def test_batch_engine_gives_each_request_its_plain_output(
    tiny: torch.nn.Module, heads: FeatureDrafterModel, small_heads: FeatureDrafterModel
) -> None:
    prompts = [PROMPT, PROMPT[:3], [7, 7, 1, 30, 2]]
    plain = [decode_prompt(tiny, p, None, 0) for p in prompts]
    gens = [Generation(tiny, None, prompts[0], SamplingParams(max_tokens=16),
                       HeadsDrafter(heads, 64), 3),
            Generation(tiny, None, prompts[1], SamplingParams(max_tokens=16)),
            Generation(tiny, None, prompts[2], SamplingParams(max_tokens=16),
                       HeadsDrafter(small_heads, 64), 5)]
    run_batch(BatchEngine(tiny, max_batch=2, max_seq_len=64, prefill_chunk=2), gens)
    assert_identical(gens, plain, "heads in a batch", require_accepted=False)  # untrained


def decode_prompt(model: torch.nn.Module, prompt: list[int], drafter: HeadsDrafter | None,
                  k: int) -> list[int]:
    gen = Generation(model, None, prompt, SamplingParams(max_tokens=16), drafter, k)
    for _ in gen.run():
        pass
    return gen.output


@pytest.mark.parametrize("batched", [False, True])
def test_drafter_holds_the_target_features_of_the_committed_positions(
    tiny: torch.nn.Module, heads: FeatureDrafterModel, batched: bool
) -> None:
    drafter = HeadsDrafter(heads, capacity=64)
    gen = Generation(tiny, None, PROMPT, SamplingParams(max_tokens=12), drafter, 4)
    if batched:
        engine = BatchEngine(tiny, max_batch=1, max_seq_len=64, prefill_chunk=3)
        engine.submit(gen)
        while len(gen.output) < 10:
            engine.step()
    else:
        while len(gen.output) < 10:
            gen.step()
    ctx = torch.tensor([gen.context])
    expected = target_features(tiny, ctx)[0, :-1]  # every position but the pending token
    assert drafter.num_feats == len(gen.context) - 1
    torch.testing.assert_close(drafter.feats[: drafter.num_feats], expected, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Sampled mode
# ---------------------------------------------------------------------------------------------


class FullVocabQ(HeadsDrafter):
    """BROKEN: samples from q over the draft vocabulary S but reports the softmax of the same
    head over the whole vocabulary (q not renormalised over S, mass where it never samples)."""

    def propose(self, request: DraftRequest) -> Draft:
        draft = super().propose(request)
        if draft.q is None:
            return draft
        return Draft(draft.tokens, leaked(draft.q, self.model))


def leaked(q: torch.Tensor, model: FeatureDrafterModel) -> torch.Tensor:
    """q spread over the whole vocabulary: S keeps a tenth, the rest gets nine tenths."""
    outside = torch.ones(q.shape[-1], dtype=torch.bool)
    outside[model.vocab] = False
    spread = q * 0.1
    spread[:, outside] = 0.9 / int(outside.sum())
    return spread


def first_q(model: torch.nn.Module, heads: FeatureDrafterModel) -> torch.Tensor:
    """The q of the first draft token after PROMPT at temperature 1, as the engine would get."""
    drafter = HeadsDrafter(heads, capacity=64)
    drafter.observe(target_features(model, torch.tensor([PROMPT[:-1]]))[0], 0)
    params = SamplingParams(temperature=1.0)
    draft = drafter.propose(DraftRequest(torch.tensor(PROMPT), 1, params, len(PROMPT),
                                         torch.Generator().manual_seed(0)))
    assert draft.q is not None
    return draft.q[0].double()


@pytest.mark.statistical
def test_sampled_output_is_distributed_as_the_target(
    tiny: torch.nn.Module, small_heads: FeatureDrafterModel
) -> None:
    def make() -> HeadsDrafter:
        return HeadsDrafter(small_heads, capacity=16)

    first_p, pair_p, drafted, accepted = audit(tiny, PROMPT, make, 2, seed=50_000)
    assert first_p > FALSE_ALARM and pair_p > FALSE_ALARM
    assert 0 < accepted < drafted


@pytest.mark.statistical
def test_audit_catches_a_q_not_restricted_to_the_draft_vocabulary(
    tiny: torch.nn.Module, small_heads: FeatureDrafterModel
) -> None:
    with torch.inference_mode():
        logits = tiny(torch.tensor([PROMPT]), tiny.new_cache(1, len(PROMPT)))[0, -1]
    p = torch.softmax(logits.double(), dim=-1)
    q = first_q(tiny, small_heads)
    broken = first_token_distribution(p, q, leaked(q[None].float(), small_heads)[0].double())
    assert tv_distance(first_token_distribution(p, q, q), p) < 1e-9
    assert tv_distance(broken, p) >= DESIGN_TV  # the audit has its stated power against it

    def make() -> FullVocabQ:
        return FullVocabQ(small_heads, capacity=16)

    first_p, pair_p, _, _ = audit(tiny, PROMPT, make, 2, seed=60_000)
    assert first_p < FALSE_ALARM and pair_p < FALSE_ALARM


def test_q_comes_from_the_sampling_pipeline_and_is_zero_outside_the_subset(
    tiny: torch.nn.Module, small_heads: FeatureDrafterModel
) -> None:
    params = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.3, seed=0)
    drafter = HeadsDrafter(small_heads, capacity=64)
    feats = target_features(tiny, torch.tensor([PROMPT[:-1]]))[0]
    drafter.observe(feats, 0)
    context = torch.tensor(PROMPT)
    draft = drafter.propose(DraftRequest(context, 1, params, 2, torch.Generator().manual_seed(0)))
    with torch.inference_mode():
        hidden = small_heads(context[None, 1:], feats[None], small_heads.new_cache(1, 8))[0, -1:]
        expected = probs_from_logits(small_heads.full_logits(hidden), params, context, 2,
                                     torch.zeros(0, dtype=torch.long))
    assert draft.q is not None
    torch.testing.assert_close(draft.q, expected, rtol=0, atol=1e-6)
    outside = torch.ones(V, dtype=torch.bool)
    outside[small_heads.vocab] = False
    assert float(draft.q[0, outside].sum()) == 0.0
    assert abs(float(draft.q.sum()) - 1.0) < 1e-5


def test_no_draft_without_features(heads: FeatureDrafterModel) -> None:
    drafter = HeadsDrafter(heads, capacity=64)
    draft = drafter.propose(DraftRequest(torch.tensor(PROMPT), 3, SamplingParams(), len(PROMPT)))
    assert draft.tokens.numel() == 0


# ---------------------------------------------------------------------------------------------
# Weights for another target
# ---------------------------------------------------------------------------------------------


def save(heads: FeatureDrafterModel, target: torch.nn.Module, folder: Path) -> Path:
    card = {"target": "tiny-a", "target_sha256": weights_sha256(target)}
    write_heads(folder, heads, card)
    return folder


def test_heads_load_for_their_target(tmp_path: Path, tiny: torch.nn.Module,
                                     small_heads: FeatureDrafterModel) -> None:
    folder = save(small_heads, tiny, tmp_path / "heads")
    loaded = load_heads(tiny, folder)
    assert torch.equal(loaded.vocab, small_heads.vocab)
    factory = drafter_factory(DrafterOptions("heads", heads=str(folder)), tiny)
    assert factory is not None and isinstance(factory(), HeadsDrafter)


def test_heads_trained_for_another_target_are_refused(
    tmp_path: Path, tiny: torch.nn.Module, small_heads: FeatureDrafterModel
) -> None:
    folder = save(small_heads, tiny, tmp_path / "heads")
    other = tiny_model(tmp_path / "other")
    with torch.no_grad():
        other.norm.mul_(1.01)  # same shapes, different weights
    with pytest.raises(SpecDecodeError) as err:
        drafter_factory(DrafterOptions("heads", heads=str(folder)), other)
    message = str(err.value)
    assert "different target" in message
    assert weights_sha256(tiny) in message and weights_sha256(other) in message


def test_missing_heads_weights_are_a_clear_error(tmp_path: Path, tiny: torch.nn.Module) -> None:
    with pytest.raises(SpecDecodeError, match=r"no heads\.safetensors"):
        drafter_factory(DrafterOptions("heads", heads=str(tmp_path)), tiny)
