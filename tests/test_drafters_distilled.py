"""The distilled drafter: greedy token identity with plain decoding for k = 1..8, the sampled-mode
distribution audit (see test_drafters_ngram.py for its design) with a reduced draft vocabulary,
a broken variant the audit must catch, and loading (the target identity check, bad folders).

Drafts here are built from a small random target (untrained: copies of its blocks 0 and 2),
saved and loaded the way `specdecode train draft` ships them; training is tested in
test_train_distill.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.audit_stats import tv_distance
from specdecode.drafters.base import Draft, DraftRequest
from specdecode.drafters.distilled import (
    DEFAULT_DIR,
    DraftLayout,
    SubsetHead,
    build_draft,
    evenly_spaced,
    load_distilled,
    save_distilled,
)
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.cards import weights_sha256, write_model_card
from specdecode.models.loading import LoadedModel
from specdecode.sampling import SamplingParams
from tests.fakes import LookupTarget
from tests.identity import assert_identical
from tests.test_drafters_layerskip import first_token_distribution
from tests.test_drafters_ngram import (
    DESIGN_TV,
    FALSE_ALARM,
    V,
    audit,
    chat_ids,
    generate,
    tiny_model,
)

LAYERS = (0, 2)
SUBSET = 40  # the draft's head scores tokens 0..39 of 96
PROMPT = [5, 17, 12, 8, 30]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def save_draft(target: Any, folder: Path, vocab: int | None, name: str = "tiny") -> Path:
    """Ship an (untrained) draft of `target` into `folder` as training does: weights, config,
    card naming the target's weights sha256."""
    layout = DraftLayout(LAYERS, vocab)
    ids = None if vocab is None else torch.arange(vocab)
    save_distilled(build_draft(target, layout, ids), folder, layout)
    write_model_card(folder, {"kind": "distilled-draft", "target": name,
                              "target_sha256": weights_sha256(target)}, "test draft")
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def shipped(tiny: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_draft(tiny, tmp_path_factory.mktemp("draft"), SUBSET)


# ---------------------------------------------------------------------------------------------
# The draft model
# ---------------------------------------------------------------------------------------------


def test_subset_head_scores_its_tokens_and_masks_the_rest() -> None:
    weight = torch.randn(10, 4)
    ids = torch.tensor([1, 4, 7])
    x = torch.randn(2, 4)
    out = SubsetHead(weight, ids, 10)(x)  # (2, 10)
    torch.testing.assert_close(out[:, ids], x @ weight[ids].t())
    mask = torch.ones(10, dtype=torch.bool)
    mask[ids] = False
    assert torch.isneginf(out[:, mask]).all()


def test_evenly_spaced_blocks() -> None:
    assert evenly_spaced(30, 2) == (0, 29)
    assert evenly_spaced(30, 4) == (0, 10, 19, 29)
    assert evenly_spaced(3, 1) == (0,)
    with pytest.raises(SpecDecodeError, match=r"1\.\.3 layers"):
        evenly_spaced(3, 4)


def test_saved_draft_loads_back_with_bf16_weights(tiny: torch.nn.Module, shipped: Path) -> None:
    draft = load_distilled(shipped, tiny)
    assert draft.cfg.num_layers == len(LAYERS)
    assert draft.embed.weight.data_ptr() != 0 and isinstance(draft.lm_head, SubsetHead)
    for j, i in enumerate(LAYERS):
        w = tiny.layers[i].qkv.weight
        torch.testing.assert_close(draft.layers[j].qkv.weight, w.bfloat16().float())
    files = sorted(p.name for p in shipped.iterdir())
    assert files == ["MODEL_CARD.md", "card.json", "config.json", "draft.safetensors"]
    own = 2 * sum(p.numel() for p in draft.layers.parameters()) + 2 * draft.norm.numel()
    assert (shipped / "draft.safetensors").stat().st_size < own + 8 * SUBSET + 4096


def test_q_is_zero_outside_the_draft_vocabulary(tiny: torch.nn.Module, shipped: Path) -> None:
    drafter = DraftModelDrafter(load_distilled(shipped, tiny), "distilled", 32)
    params = SamplingParams(temperature=1.0, seed=0)
    draft = drafter.propose(DraftRequest(torch.tensor(PROMPT), 3, params, 2,
                                         torch.Generator().manual_seed(0)))
    assert draft.q is not None and draft.q.shape == (3, V)
    assert (draft.q[:, SUBSET:] == 0).all() and (draft.tokens < SUBSET).all()
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(3))


# ---------------------------------------------------------------------------------------------
# Losslessness
# ---------------------------------------------------------------------------------------------


def greedy(model: Any, drafter: Any, k: int) -> Generation:
    gen = Generation(model, None, PROMPT, SamplingParams(max_tokens=24), drafter, k)
    for _ in gen.run():
        pass
    return gen


@pytest.mark.parametrize("vocab", [SUBSET, None])
def test_greedy_output_is_plain_decodings_for_every_k(
    tiny: torch.nn.Module, tmp_path: Path, vocab: int | None
) -> None:
    factory = drafter_factory(
        DrafterOptions("distilled", distilled=str(save_draft(tiny, tmp_path, vocab))), tiny,
        capacity=64)
    assert factory is not None
    plain = greedy(tiny, None, 0)
    gens = [greedy(tiny, factory(), k) for k in range(1, 9)]
    assert_identical(gens, [plain.output] * len(gens), "k = 1..8")


@pytest.mark.statistical
def test_sampled_output_is_distributed_as_the_target(tiny: torch.nn.Module, shipped: Path
                                                     ) -> None:
    factory = drafter_factory(DrafterOptions("distilled", distilled=str(shipped)), tiny,
                              capacity=16)
    assert factory is not None
    first_p, pair_p, drafted, accepted = audit(tiny, PROMPT, factory, 2, seed=50_000)
    assert first_p > FALSE_ALARM and pair_p > FALSE_ALARM
    assert 0 < accepted < drafted


class FullVocabQ(DraftModelDrafter):
    """BROKEN: samples from the subset head's q but reports q over the whole vocabulary (the
    softmax of the full head), as a drafter that forgot its own head would."""

    def __init__(self, model: Any, full: Any) -> None:
        super().__init__(model, "broken", 16)
        self.full = full

    def propose(self, request: DraftRequest) -> Draft:
        context, k, params = request.context, request.k, request.params
        draft = super().propose(request)
        ids = torch.cat([context, draft.tokens[:-1]])[None]  # (1, L + k - 1)
        with torch.inference_mode():
            logits = self.full(ids, self.full.new_cache(1, ids.shape[1]))[0, -k:]  # (k, V)
        return Draft(draft.tokens, torch.softmax(logits / params.temperature, dim=-1))


@pytest.mark.statistical
def test_audit_catches_a_drafter_reporting_another_q(tiny: torch.nn.Module, shipped: Path
                                                     ) -> None:
    subset = load_distilled(shipped, tiny)
    full = build_draft(tiny, DraftLayout(LAYERS, None), None)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        p = torch.softmax(tiny(ids, tiny.new_cache(1, 8))[0, -1].double(), dim=-1)
        q = torch.softmax(subset(ids, subset.new_cache(1, 8))[0, -1].double(), dim=-1)
        wrong = torch.softmax(full(ids, full.new_cache(1, 8))[0, -1].double(), dim=-1)
    assert tv_distance(first_token_distribution(p, q, q), p) < 1e-9  # lossless with a subset
    assert tv_distance(first_token_distribution(p, q, wrong), p) >= DESIGN_TV
    first_p, pair_p, _, _ = audit(tiny, PROMPT, lambda: FullVocabQ(subset, full), 2, seed=60_000)
    assert first_p < FALSE_ALARM and pair_p < FALSE_ALARM


# ---------------------------------------------------------------------------------------------
# Loading: the target identity check and bad folders
# ---------------------------------------------------------------------------------------------


def test_a_draft_for_another_target_is_refused(tiny: torch.nn.Module, shipped: Path,
                                               tmp_path: Path) -> None:
    other = tiny_model(tmp_path / "other")
    with torch.no_grad():
        other.layers[1].o.weight.add_(0.01)  # same architecture, other weights
    expected = weights_sha256(tiny)
    with pytest.raises(SpecDecodeError, match="trained for a different target") as err:
        drafter_factory(DrafterOptions("distilled", distilled=str(shipped)), other)
    assert expected in str(err.value) and weights_sha256(other) in str(err.value)


def test_the_shipped_default_is_refused_for_another_target(tiny: torch.nn.Module) -> None:
    if not DEFAULT_DIR.is_dir():
        pytest.skip("no shipped distilled draft")
    with pytest.raises(SpecDecodeError, match="trained for a different target"):
        drafter_factory("distilled", tiny)


def test_bad_folders_are_clear_errors(tiny: torch.nn.Module, shipped: Path, tmp_path: Path
                                      ) -> None:
    with pytest.raises(SpecDecodeError, match="no such folder"):
        load_distilled(tmp_path / "missing", tiny)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecodeError, match=r"config\.json: not found"):
        load_distilled(tmp_path / "empty", tiny)
    broken = save_draft(tiny, tmp_path / "broken", SUBSET)
    (broken / "draft.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpecDecodeError, match=r"draft\.safetensors: missing or unreadable"):
        load_distilled(broken, tiny)


def test_a_target_off_the_native_runner_is_refused(shipped: Path) -> None:
    class Adapter(LookupTarget):  # a target on another backend
        backend = "transformers"

    with pytest.raises(SpecDecodeError, match="native runner"):
        drafter_factory(DrafterOptions("distilled", distilled=str(shipped)), Adapter())


# ---------------------------------------------------------------------------------------------
# The shipped draft on SmolLM2
# ---------------------------------------------------------------------------------------------


def test_shipped_draft_keeps_smollm_greedy_output_for_every_k(smollm: LoadedModel) -> None:
    if not DEFAULT_DIR.is_dir():
        pytest.skip("no shipped distilled draft")
    prompt = chat_ids(smollm, "List three facts about the Moon.")
    plain = generate(smollm, prompt, 32, None, 0).output
    factory = drafter_factory("distilled", smollm.model)
    assert factory is not None
    accepted = 0
    for k in range(1, 9):
        max_tokens = 32 if k == 3 else 8
        gen = generate(smollm, prompt, max_tokens, factory(), k)
        assert gen.output == plain[:max_tokens], f"k={k}"
        accepted += gen.counters.accepted
    assert accepted > 0
