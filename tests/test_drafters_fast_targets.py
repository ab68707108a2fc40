"""Drafters for fast targets (issue 34), on tiny checkpoints: the cheaper draft head
(drafters.draft_head), the w4a16 target as its own copy, and `ngram+auto`, the hybrid whose model
part is chosen by measured cost and acceptance (drafters.auto). Each claim has a broken variant
that its check catches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.drafters import auto
from specdecode.drafters.auto import Candidate, choose, predicted_speedup
from specdecode.drafters.base import DraftRequest
from specdecode.drafters.distilled import SubsetHead
from specdecode.drafters.draft_head import WithHead, draft_head
from specdecode.drafters.options import DrafterOptions
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.models import kernels
from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel
from specdecode.models.precision import apply_precision
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint
from tests.identity import assert_identical_outputs

pytestmark = [pytest.mark.usefixtures("one_thread"),  # conftest.one_thread
              pytest.mark.skipif(not kernels.available(),
                                 reason=f"kernels unavailable: {kernels.build_error()}")]

SUBSET = 40  # of the tiny vocabulary's 96 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = make_checkpoint(tmp_path_factory.mktemp("fast") / "m", tie_word_embeddings=True)
    return load_model(str(folder))


def prompts(n: int = 4, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 90, (8,), generator=gen).tolist() * 2 for _ in range(n)]


def outputs(model: Any, make: Callable[[], Any] | None, k: int | str, batch: int,
            tokens: int = 24) -> tuple[list[list[int]], int, int]:
    """Greedy outputs of `prompts()` at `batch` (k "auto": under the controller), and the
    drafted and accepted tokens."""
    from specdecode.calibration import calibrated_costs
    from specdecode.control import Controller, CostModel

    kk = 4 if k == "auto" else int(k)
    controller = None if k != "auto" else Controller(kmax=kk, costs=CostModel(
        target_s=calibrated_costs(model, [batch], kk, context=16, repeats=1)))
    engine = BatchEngine(model, batch, 256, controller=controller)
    gens = [Generation(model, None, p, SamplingParams(max_tokens=tokens),
                       None if make is None else make(), kk if make else 0, [1])
            for p in prompts()]
    done = run_batch(engine, gens)
    return ([g.output for g in done], sum(g.counters.drafted for g in done),
            sum(g.counters.accepted for g in done))


# ---------------------------------------------------------------------------------------------
# The draft head
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["w4a16", "bf16"])
def test_the_draft_head_scores_its_tokens_as_the_full_head_and_masks_the_rest(
        tiny: LoadedModel, precision: str) -> None:
    """On a target whose head is bf16 (bf16, w4a16), the draft head's logits of the lowest ids
    are the target's own, bit for bit, and -inf elsewhere. Broken variant: rows one id off
    (token j scored with row j + 1) are caught by the same comparison."""
    model = apply_precision(tiny.model, precision)
    tokens = torch.tensor([prompts(1)[0]])

    def logits(m: Any) -> torch.Tensor:
        with torch.inference_mode():
            return m(tokens, m.new_cache(1, 32))[0]  # type: ignore[no-any-return]

    full = logits(model)
    cheap = logits(WithHead(model, draft_head(model, SUBSET)))
    assert torch.equal(cheap[:, :SUBSET], full[:, :SUBSET])
    assert torch.isneginf(cheap[:, SUBSET:]).all()
    from specdecode.models.linears import float_weight

    weight = float_weight(model.lm_head)[0]
    off_by_one = SubsetHead(weight[1:], torch.arange(SUBSET), model.cfg.vocab_size,
                            torch.bfloat16)  # token j scored with row j + 1
    broken = logits(WithHead(model, off_by_one))
    assert not torch.equal(broken[:, :SUBSET], full[:, :SUBSET])


def test_a_draft_head_outside_the_vocabulary_is_refused(tiny: LoadedModel) -> None:
    with pytest.raises(SpecDecodeError, match=r"draft_vocab must be 1\.\.96"):
        drafter_factory(DrafterOptions("w4a16", draft_vocab=97), tiny.model)
    with pytest.raises(SpecDecodeError, match=r"draft_vocab .*must be an integer >= 1"):
        DrafterOptions("w4a16", draft_vocab=0).check()
    with pytest.raises(SpecDecodeError, match="ngram drafter does not use draft_vocab"):
        DrafterOptions("ngram", draft_vocab=8).check()
    with pytest.raises(SpecDecodeError, match=r"draft_vocab \(--draft-vocab\) must be"):
        DrafterOptions("draft-model", draft_model="d", draft_vocab=0).check()
    DrafterOptions("draft-model", draft_model="d", draft_vocab=8).check()  # a draft model takes it


@pytest.mark.parametrize("precision", ["fp32", "bf16", "w4a16"])
@pytest.mark.parametrize("options", [
    DrafterOptions("w4a16", draft_vocab=SUBSET),
    DrafterOptions("int8", draft_vocab=SUBSET),
    DrafterOptions("layerskip", layers=(0, 2), draft_vocab=SUBSET),
], ids=["w4a16", "int8", "layerskip"])
def test_drafters_with_a_draft_head_are_token_identical_and_draft_inside_it(
        tiny: LoadedModel, precision: str, options: DrafterOptions) -> None:
    model = apply_precision(tiny.model, precision)
    make = drafter_factory(options, model)
    assert make is not None
    plain = outputs(model, None, 0, 1)[0]
    for batch in (1, 4):
        got, drafted, accepted = outputs(model, make, 3, batch)
        assert_identical_outputs(got, plain, drafted, accepted,
                                 f"{precision} {options.name} batch {batch}")
    drafter = make()  # proposing alone (its own cache): every token inside the head
    for p in prompts():
        request = DraftRequest(torch.tensor(p), 4, SamplingParams(), len(p))
        tokens = drafter.propose(request).tokens
        assert len(tokens) == 4 and int(tokens.max()) < SUBSET


def test_a_w4a16_target_is_its_own_w4a16_copy(tiny: LoadedModel) -> None:
    """No second copy of a w4a16 target's weights: the copy is the target (re-quantizing its
    de-quantized weights need not give back its codes), with or without a draft head; drafting
    with it is accepted in full."""
    model = apply_precision(tiny.model, "w4a16")
    make = drafter_factory("w4a16", model)
    assert make is not None and make().model is model
    cheap = drafter_factory(DrafterOptions("w4a16", draft_vocab=SUBSET), model)
    assert cheap is not None and cheap().model.model is model
    _, drafted, accepted = outputs(model, make, 3, 1)
    assert drafted > 0 and accepted == drafted


# ---------------------------------------------------------------------------------------------
# ngram+auto: the model part chosen by measurement
# ---------------------------------------------------------------------------------------------


def test_the_predicted_speedup_is_the_chain_formula_at_the_best_k() -> None:
    # k=1: 1.8 / (0.5 + 1.1) = 1.125; k=2: 2.44 / (1.0 + 1.2) = 1.109
    s, k = predicted_speedup(0.8, 0.5, (1.0, 1.1, 1.2))
    assert k == 1 and s == pytest.approx(1.8 / 1.6)
    s, k = predicted_speedup(1.0, 0.0, (1.0, 1.0, 1.0, 1.0))  # free and always right
    assert (s, k) == (4.0, 3)


def _picks(rows: Sequence[Candidate], pick: Callable[[Sequence[Candidate]], Candidate | None]
           ) -> str | None:
    chosen = pick(rows)
    return None if chosen is None else chosen.name


def test_the_choice_goes_by_predicted_speedup_and_must_beat_plain() -> None:
    """The best predicted speedup wins, and only if it beats plain by the margin. Broken
    variants, each caught: choosing by acceptance alone (the target itself: accepted always,
    costs a whole step), by cost alone (cheap and mostly wrong), and without the margin."""
    v = (1.0, 1.1, 1.25, 1.4)

    def row(name: str, alpha: float, c: float) -> Candidate:
        s, k = predicted_speedup(alpha, c, v)
        return Candidate(name, c, alpha, k, s)

    rows = [row("itself", 1.0, 1.0), row("copy", 0.9, 0.3), row("weak", 0.3, 0.02),
            Candidate("absent", note="not measured")]
    assert [r.predicted is not None and r.predicted > 1.05 for r in rows[:3]] == \
        [False, True, True]
    assert _picks(rows, choose) == "copy"
    def by_alpha(rs: Sequence[Candidate]) -> Candidate | None:
        return max((r for r in rs if r.alpha is not None), key=lambda r: r.alpha or 0.0)

    def by_cost(rs: Sequence[Candidate]) -> Candidate | None:
        return min((r for r in rs if r.c is not None), key=lambda r: r.c or 0.0)

    assert _picks(rows, by_alpha) == "itself" and _picks(rows, by_cost) == "weak"
    marginal = [row("itself", 1.0, 1.0), row("barely", 0.2, 0.05)]  # 1.2 / 1.15 at k=1
    assert 1.0 < (marginal[1].predicted or 0.0) < 1.05
    assert _picks(marginal, choose) is None
    assert _picks(marginal, lambda rs: choose(rs, margin=0.0)) == "barely"


def calibration_ids() -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(2, 90, (24,), generator=gen).tolist() * 4


@pytest.mark.parametrize("precision", ["fp32", "w4a16"])
def test_measure_compares_every_candidate_against_the_target(
        tiny: LoadedModel, precision: str) -> None:
    """Every candidate that runs here is measured (c > 0, alpha in [0, 1], the prediction is the
    formula's at the measured v) and the pick is `choose`'s. alpha is agreement with the TARGET:
    a head over the lowest 32 of 96 ids agrees less than the copy's whole head. Broken variant:
    agreement scored against the draft's own argmax is 1.0 for every draft, which this
    ordering rules out."""
    model = apply_precision(tiny.model, precision)
    parts = auto.candidates(model, 256)
    selection = auto.measure(model, calibration_ids(), parts, rounds=2)
    assert selection.v[0] == 1.0 and len(selection.v) == auto.MAX_K + 1
    rows = {c.name: c for c in selection.candidates}
    assert set(rows) == set(parts)
    for name, row in rows.items():
        if isinstance(parts[name], str):
            assert row.c is None and row.note == parts[name]
            continue
        assert row.c is not None and row.c > 0 and row.alpha is not None
        assert 0.0 <= row.alpha <= 1.0
        assert (row.predicted, row.k) == predicted_speedup(row.alpha, row.c, selection.v)
    chosen = choose(selection.candidates)
    assert selection.chosen == (None if chosen is None else chosen.name)
    if precision == "w4a16":
        assert "the target itself" in rows["w4a16"].note  # never measured: c would be 1
    assert "distilled" in rows and rows["distilled"].c is None  # made for SmolLM2 only
    third, half = (rows[f"w4a16:draft_vocab={96 // f}"] for f in (3, 2))
    assert third.alpha is not None and half.alpha is not None
    assert third.alpha < half.alpha <= 1.0
    ids = torch.tensor([calibration_ids()])
    part = parts[third.name]
    assert not isinstance(part, str)
    with torch.inference_mode():  # the broken variant: the draft scored against itself
        own = part.model(ids, part.model.new_cache(1, ids.shape[1]))[0].argmax(dim=-1)
        self_agreement = float((own == own).float().mean())
    assert self_agreement == 1.0 > third.alpha


@pytest.mark.parametrize("force", [None, "w4a16:draft_vocab=48"])
def test_ngram_auto_is_token_identical_whatever_it_picks(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, force: str | None) -> None:
    """Through the registry: the selection is recorded on the factory; the hybrid (or the
    lookup alone, when nothing pays) gives plain decoding's tokens at batch 1 and 4, under a
    fixed k and under --k auto. `force` makes the hybrid path run whatever the tiny model's
    timings say."""
    monkeypatch.setattr(auto, "calibration", lambda tokenizer: calibration_ids())
    if force is not None:
        monkeypatch.setattr(auto, "choose", lambda rows: next(r for r in rows
                                                              if r.name == force))
    else:
        monkeypatch.setattr(auto, "choose", lambda rows: None)
    for precision in ("fp32", "w4a16"):
        model = apply_precision(tiny.model, precision)
        make = drafter_factory("ngram+auto", model, tokenizer=tiny.tokenizer)
        assert make is not None and make.selection is not None
        assert make.selection.chosen == force
        drafter = make()
        assert drafter.name == ("ngram" if force is None else "ngram+auto")
        plain = outputs(model, None, 0, 1)[0]
        for batch in (1, 4):
            got, drafted, accepted = outputs(model, make, 3, batch)
            assert_identical_outputs(got, plain, drafted, accepted,
                                     f"{precision} batch {batch} k 3")
        # under --k auto the controller may rightly draft nothing on this tiny model (drafting
        # costs more than its step): the output is still plain decoding's
        assert outputs(model, make, "auto", 1)[0] == plain, (precision, "auto")


def test_auto_is_not_a_drafter_alone_and_reads_no_model_options(tiny: LoadedModel) -> None:
    with pytest.raises(SpecDecodeError, match="unknown drafter 'auto'"):
        DrafterOptions("auto").check()
    with pytest.raises(SpecDecodeError, match="does not use draft_vocab"):
        DrafterOptions("ngram+auto", draft_vocab=8).check()
    with pytest.raises(SpecDecodeError, match="needs the model's tokenizer"):
        drafter_factory("ngram+auto", tiny.model)


def test_generate_json_reports_what_ngram_auto_measured(
        tiny: LoadedModel, tmp_path: Path) -> None:
    import json

    from tests.cli_run import run_cli

    folder = make_checkpoint(tmp_path / "m", tie_word_embeddings=True)
    code, out, err = run_cli(["generate", "t5 t17 t42 t8 t5 t17", "--model", str(folder),
                              "--precision", "w4a16", "--max-tokens", "6", "--json",
                              "--drafter", "ngram+auto"])
    assert code == 0, err
    choice = json.loads(out)["drafter_choice"]
    names = [c["name"] for c in choice["candidates"]]
    assert names[0] == "w4a16" and "int8" in names and choice["v"][0] == 1.0
    assert choice["chosen"] in (None, *names)


# ---------------------------------------------------------------------------------------------
# Heads trained for a fast target
# ---------------------------------------------------------------------------------------------


def test_heads_trained_for_the_w4a16_target_draft_for_it_and_only_for_it(
        tiny: LoadedModel, tmp_path: Path) -> None:
    """`train heads --precision w4a16` extracts the w4a16 target's features and names its
    weights in the card; the heads then draft for that target, token-identical to its plain
    decoding, and are refused on the fp32 model they were quantized from (its features differ)."""
    import json
    import random

    from specdecode.cli import main

    words = random.Random(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in range(6):
        cycle = [words.randrange(2, 96) for _ in range(8)]
        (corpus / f"d{d}.txt").write_text(" ".join(f"t{cycle[i % 8]}" for i in range(200)))
    out = tmp_path / "heads"
    assert main(["train", "heads", "--model", str(tiny.source), "--precision", "w4a16",
                 "--corpus", str(corpus), "--steps", "2", "--tokens", "800", "--seq-len", "32",
                 "--draft-vocab", "64", "--out", str(out), "--threads", "1"]) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["target_precision"] == "w4a16" and "--precision=w4a16" in card["recipe"]
    target = load_model(str(tiny.source), precision="w4a16").model
    make = drafter_factory(DrafterOptions("heads", heads=str(out)), target)
    assert make is not None
    plain = outputs(target, None, 0, 1)[0]
    got, drafted, _ = outputs(target, make, 2, 1)
    assert got == plain and drafted > 0
    with pytest.raises(SpecDecodeError, match="trained for a different target"):
        drafter_factory(DrafterOptions("heads", heads=str(out)), tiny.model)
