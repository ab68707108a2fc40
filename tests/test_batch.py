"""Batched speculative decoding: ragged draft lengths, continuous batching, exactness."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch

from specdecode.control import AlphaEstimate, Controller, CostModel
from specdecode.drafters.base import Draft, Drafter, DraftRequest
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.faults import FaultyDrafter
from specdecode.drafters.registry import drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.sampling import SamplingParams
from tests.conftest import record_feeds
from tests.identity import assert_identical
from tests.test_engine_sampled import (
    FALSE_ALARM,
    PARAMS,
    PROMPT,
    SAMPLES,
    exact_pairs,
    gof_p_value,
    models,  # noqa: F401  (fixture)
)

PROMPTS = [
    "Summarize: The cat sat on the mat all day, watching birds through the window.",
    "Write a Python function to reverse a string.",
    "What is the capital of Japan?",
    "Translate to French: Good morning, how are you?",
    "List three colours.",
    "Tell me a joke about computers.",
    "Explain recursion in one sentence.",
    "Name a famous painter.",
]


def _solo(m: LoadedModel, ids: list[int], params: SamplingParams) -> list[int]:
    gen = Generation(m.model, None, ids, params, None, 0, m.tokenizer.eos_ids)
    for _ in gen.run():
        pass
    return gen.output


@pytest.mark.parametrize("copy_name", ["w4a16", "int8"])
def test_batch_of_8_greedy_with_ragged_k_is_token_identical(smollm: LoadedModel,
                                                            copy_name: str) -> None:
    """A quantized copy drafts in the engine's cache: the w4a16 copy's rows together, one
    forward per draft position over all 8 rows; the int8 copy's one row per forward (its
    activations are quantized with one scale per forward, which rows would share). Outputs are
    the target's, and each row drafts as it does alone (row i gets row i's logits)."""
    tok = smollm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    params = SamplingParams(max_tokens=20)
    factory = drafter_factory(copy_name, smollm.model)
    assert factory is not None
    engine = BatchEngine(smollm.model, 8, 160)
    gens = [Generation(smollm.model, None, x, params, factory(), 1 + i % 4, tok.eos_ids)
            for i, x in enumerate(ids)]
    copy_model = gens[0].drafter.cache_model  # type: ignore[union-attr]
    assert copy_model is not None
    calls = record_feeds(copy_model)
    for gen in gens:
        engine.submit(gen)
    full_steps = 0
    while engine.busy:
        before, drafted = len(calls), [g.counters.drafted for g in gens]
        stepped = [g for g, _ in engine.step()]
        widths = [g.counters.drafted - d for g, d in zip(gens, drafted, strict=True)]
        if len(stepped) == 8:
            full_steps += 1
            if copy_name == "w4a16":
                assert calls[before:] == [(8, 1)] * max(widths)
            else:
                assert calls[before:] == [(1, 1)] * sum(widths)
    assert full_steps > 0
    del copy_model.forward
    alone = [Generation(smollm.model, None, x, params, factory(), 1 + i % 4, tok.eos_ids)
             for i, x in enumerate(ids)]
    for solo in alone:
        for _ in solo.run():
            pass
    plain = [_solo(smollm, x, params) for x in ids]
    assert_identical(gens, plain, f"{copy_name} batch 8")
    assert_identical(alone, plain, f"{copy_name} batch 1")
    accepted = [sum(g.counters.accepted for g in run) for run in (gens, alone)]
    drafted = [sum(g.counters.drafted for g in run) for run in (gens, alone)]
    assert accepted[0] / drafted[0] > 0.9 * accepted[1] / drafted[1]
    assert engine.cache.lengths == [0] * 8 and not engine.busy


def test_continuous_batching_join_leave_and_cancel(models: Any) -> None:  # noqa: F811
    target, draft, _ = models
    params = SamplingParams(temperature=1.0, max_tokens=6)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [1, 2], [12, 13, 14, 15], [5, 5, 5, 5, 5, 5, 5]]

    def make(i: int, p: list[int]) -> Generation:
        return Generation(target, None, p, SamplingParams(**{**params.__dict__, "seed": i}),
                          DraftModelDrafter(draft), 1 + i % 3)

    solo = []
    for i, p in enumerate(prompts):
        g = make(i, p)
        for _ in g.run():
            pass
        solo.append(g.output)
    engine = BatchEngine(target, 2, 32, prefill_chunk=2)  # 2 rows for 5 requests: a queue
    gens = [make(i, p) for i, p in enumerate(prompts)]
    run_batch(engine, gens)
    assert [g.output for g in gens] == solo  # seeded: independent of the batch around it
    victim, other = make(0, prompts[0]), make(1, prompts[1])
    victim.params = SamplingParams(**{**victim.params.__dict__, "max_tokens": 20})
    engine.submit(victim)
    engine.submit(other)
    for _ in range(10):  # victim (long) and other (prefilled in chunks) both decode by now
        engine.step()
        if len(engine.active) == 2:
            break
    assert len(engine.active) == 2 and victim.row == 0 and victim.finish_reason is None
    engine.cancel(victim)
    assert victim.finish_reason == "cancelled" and victim.cache is None
    assert len(engine.active) == 1 and engine.active[0] is other and other.row == 0
    assert engine.cache.lengths[1] == 0
    while engine.busy:
        engine.step()
    assert other.output == solo[1]


def test_oversized_request_is_refused(models: Any) -> None:  # noqa: F811
    target = models[0]
    engine = BatchEngine(target, 2, 16)
    gen = Generation(target, None, [1, 2, 3], SamplingParams(max_tokens=40))
    with pytest.raises(SpecDecodeError, match="holds 16"):
        engine.submit(gen)


def _batched_pairs(target: Any, make_drafter: Any, k: int, n: int) -> Any:
    from collections import Counter

    counts: Counter[tuple[int, int]] = Counter()
    engine = BatchEngine(target, 8, 16)
    for start in range(0, n, 8):
        gens = [Generation(target, None, PROMPT,
                           SamplingParams(**{**PARAMS.__dict__, "seed": 50_000 + s}),
                           make_drafter(), k) for s in range(start, min(n, start + 8))]
        run_batch(engine, gens)
        counts.update((g.output[0], g.output[1]) for g in gens)
    return counts


@pytest.mark.statistical
def test_sampled_distribution_holds_at_batch_8(models: Any) -> None:  # noqa: F811
    target, draft, other = models
    exact = exact_pairs(target, PARAMS)
    good = _batched_pairs(target, lambda: DraftModelDrafter(draft), 2, SAMPLES)
    assert gof_p_value(good, exact) > FALSE_ALARM
    # a draft of the target's layout (other weights) drafting in the engine's cache, rows
    # together
    in_cache = copy.deepcopy(target)
    with torch.no_grad():
        for w in in_cache.parameters():
            w.add_(0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
    good = _batched_pairs(target, lambda: DraftModelDrafter(in_cache, in_cache=True), 3,
                          SAMPLES)
    assert gof_p_value(good, exact) > FALSE_ALARM
    bad = _batched_pairs(target, lambda: FaultyDrafter(draft, "q-from-other-model", other), 2,
                         SAMPLES)
    assert gof_p_value(bad, exact) < FALSE_ALARM


def test_batch_engine_with_controller_stays_lossless(smollm: LoadedModel) -> None:
    tok = smollm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
           for p in PROMPTS[:4]]
    params = SamplingParams(max_tokens=16)
    factory = drafter_factory("int8", smollm.model)
    assert factory is not None
    ctl = Controller(kmax=4)
    engine = BatchEngine(smollm.model, 4, 128, controller=ctl)
    gens = [Generation(smollm.model, None, x, params, factory(), 4, tok.eos_ids) for x in ids]
    run_batch(engine, gens)
    assert_identical(gens, [_solo(smollm, x, params) for x in ids], "int8 under the controller")
    assert ctl.costs.draft_token_s is not None and ctl.costs.target_s
    assert ctl.categories[""].value != pytest.approx(0.6)  # the engine fed the category


class SlowCatchUp(DraftModelDrafter):
    """A draft model whose catching up with the context takes 1 s more (and says so)."""

    def _sync(self, context: list[int]) -> Any:
        logits = super()._sync(context)
        if self.catch_up_ns:
            time.sleep(1.0)
            self.catch_up_ns += 1_000_000_000
        return logits


def test_draft_catch_up_is_not_counted_as_a_cost_per_draft_token(
        models: Any,  # noqa: F811  (fixture)
) -> None:
    target, draft, _ = models
    plain = DraftModelDrafter(draft)
    plain.propose(DraftRequest(torch.tensor(PROMPT), 1, PARAMS, len(PROMPT)))
    assert plain.catch_up_ns > 0  # the first proposal feeds the whole prompt
    plain.propose(DraftRequest(torch.tensor([*PROMPT, 3]), 1, PARAMS, len(PROMPT)))
    assert plain.catch_up_ns == 0  # then only the pending token: an ordinary draft step
    ctl = Controller(kmax=2, costs=CostModel(), probe_every=1000)
    engine = BatchEngine(target, 2, 64, controller=ctl)
    params = SamplingParams(max_tokens=6)
    gens = [Generation(target, None, PROMPT, params, SlowCatchUp(draft), 2) for _ in range(2)]
    run_batch(engine, gens)
    # a counted catch-up would put >= 1 s / 4 draft tokens into the first observation; an
    # ordinary step of this tiny draft takes milliseconds even on a loaded CI machine
    assert ctl.costs.draft_token_s is not None and ctl.costs.draft_token_s < 0.1


class _AlwaysOff(Controller):
    def choose(self, alphas: list[AlphaEstimate]) -> list[int]:
        return [0] * len(alphas)


def test_drafters_with_confidences_are_fitted_not_switched_off(smollm: LoadedModel) -> None:
    """Under a controller, an n-gram drafter (fits_width) proposes up to its k and fit_width
    keeps what pays; a drafter without confidences gets the controller's k (here 0)."""
    tok = smollm.tokenizer
    text = "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu."
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    params = SamplingParams(max_tokens=24)
    costs = CostModel(target_s={(2, w): 1.0 for w in range(1, 10)}, draft_token_s=0.0)
    ngram, int8 = drafter_factory("ngram", smollm.model), drafter_factory("int8", smollm.model)
    assert ngram is not None and int8 is not None
    engine = BatchEngine(smollm.model, 2, 160, controller=_AlwaysOff(kmax=6, costs=costs))
    gens = [Generation(smollm.model, None, ids, params, make(), 6, tok.eos_ids)
            for make in (ngram, int8)]
    run_batch(engine, gens)
    assert gens[0].counters.drafted > 0 and gens[1].counters.drafted == 0
    for gen in gens:
        assert gen.output == _solo(smollm, ids, params)


class Overconfident(Drafter):
    """Always wrong, sure it is right (confidence 0.99 per token), and slow (15 ms a draft):
    the cost model believes every step of it pays."""

    name = "overconfident"
    fits_width = True
    confidence = 0.99

    def __init__(self) -> None:
        self.calls = 0

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Draft:
        k = request.k
        self.calls += 1
        time.sleep(0.015)
        return Draft(torch.full((k,), 7), None, (self.confidence,) * k)


class Hopeless(Overconfident):
    """Knows it is wrong (confidence 0): every draft is cut to nothing, every step verifies one
    position, and each step still pays the 15 ms of proposing."""

    confidence = 0.0


@pytest.mark.parametrize("drafter", [Overconfident, Hopeless])
def test_the_guard_turns_off_speculation_that_does_not_pay(smollm: LoadedModel,
                                                           drafter: type) -> None:
    """Overconfident: its confidences make every step's fitted width look worth it; realized,
    its steps commit one token per row at a wider, slower step than plain. Hopeless: nothing is
    ever verified, but proposing costs every step (as prompt lookups over many rows do). With
    the guard the drafter is asked on fewer than half of the steps; without it, on every one.
    Output unchanged."""
    tok = smollm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
           for p in PROMPTS[:2]]
    params = SamplingParams(max_tokens=80)  # no EOS: both rows run 80 steps at batch 2
    costs = CostModel(target_s={(2, w): 0.01 for w in range(1, 10)}, draft_token_s=0.0)
    asked, outputs = {}, {}
    for guarded in (True, False):
        ctl = Controller(kmax=4, costs=CostModel(dict(costs.target_s), 0.0))
        ctl.guard = ctl.guard if guarded else None
        engine = BatchEngine(smollm.model, 2, 200, controller=ctl)
        gens = [Generation(smollm.model, None, x, params, drafter(), 4) for x in ids]
        run_batch(engine, gens)
        asked[guarded] = sum(g.drafter.calls for g in gens) / sum(  # type: ignore[union-attr]
            g.counters.steps for g in gens)
        outputs[guarded] = [g.output for g in gens]
    assert outputs[True] == outputs[False]
    for out, x in zip(outputs[True], ids, strict=True):
        solo = Generation(smollm.model, None, x, params)
        for _ in solo.run():
            pass
        assert out == solo.output
    assert asked[False] > 0.9  # all but the last step, which has no room to draft
    assert asked[True] < 0.5


class _Lookup(Drafter):
    """Free, confident drafts on every other step (a prompt lookup that matches half the time)."""

    name = "lookup"

    def __init__(self) -> None:
        self.calls = 0

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Draft:
        k = request.k
        self.calls += 1
        if self.calls % 2:
            return Draft(torch.full((k,), 7), None, (0.99,) * k)
        return Draft(torch.zeros(0, dtype=torch.long), None, ())


class _SlowModel(Drafter):
    """A model drafter costing 20 ms per draft token."""

    name = "slow"

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Draft:
        k = request.k
        time.sleep(0.02 * k)
        return Draft(torch.full((k,), 7), None)


def test_a_hybrids_free_lookup_drafts_do_not_dilute_the_model_drafters_cost(
        smollm: LoadedModel) -> None:
    """Under --k auto the controller's cost per draft token is the model drafter's (20 ms here),
    not averaged with the lookup's free tokens (which would halve it)."""
    from specdecode.drafters.hybrid import HybridDrafter

    tok = smollm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]))
    costs = CostModel(target_s={(1, w): 1.0 for w in range(1, 10)}, draft_token_s=0.02)
    ctl = Controller(kmax=2, costs=costs, probe_every=1)
    ctl.guard = None
    engine = BatchEngine(smollm.model, 1, 128, controller=ctl)
    gen = Generation(smollm.model, None, ids, SamplingParams(max_tokens=16),
                     HybridDrafter(_Lookup(), _SlowModel(), "ngram+slow"), 2, tok.eos_ids)
    run_batch(engine, [gen])
    assert gen.drafter.used[0] > 0 and gen.drafter.used[1] > 0  # type: ignore[union-attr]
    assert ctl.costs.draft_token_s is not None and ctl.costs.draft_token_s > 0.017


def test_a_hybrids_lookup_is_asked_while_the_controller_keeps_its_model_off(
        smollm: LoadedModel) -> None:
    """Under a controller that turns model drafting off (k=0), a hybrid still asks its free
    lookup every step (its confidences decide what is verified) and never runs its model; a
    controller that turned the whole hybrid off lost what the lookup gives (measured: auto
    0.94-1.03x plain against 1.26-1.41x at a fixed k=2, at batch 1 on summarization)."""
    tok = smollm.tokenizer
    text = "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu."
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    params = SamplingParams(max_tokens=24)
    costs = CostModel(target_s={(1, w): 1.0 for w in range(1, 10)}, draft_token_s=0.0)
    factory = drafter_factory("ngram+int8", smollm.model)
    assert factory is not None
    ctl = _AlwaysOff(kmax=6, costs=costs)
    ctl.guard = None
    engine = BatchEngine(smollm.model, 1, 160, controller=ctl)
    gen = Generation(smollm.model, None, ids, params, factory(), 6, tok.eos_ids)
    run_batch(engine, [gen])
    hybrid = gen.drafter
    assert hybrid.used[0] > 0 and hybrid.used[1] == 0  # type: ignore[union-attr]
    assert gen.counters.drafted > 0
    assert gen.output == _solo(smollm, ids, params)


def test_hybrids_in_a_batch_draft_their_model_rows_together(smollm: LoadedModel) -> None:
    """ngram+w4a16 at batch 4: each step the rows whose lookup has nothing worth verifying draft
    through the 4-bit copy together (at most k forwards of it, each over at most the 4 rows),
    the others by lookup; outputs are the target's."""
    tok = smollm.tokenizer
    texts = ["Repeat exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa.",
             *PROMPTS[1:4]]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    params = SamplingParams(max_tokens=16)
    factory = drafter_factory("ngram+w4a16", smollm.model)
    assert factory is not None
    gens = [Generation(smollm.model, None, x, params, factory(), 3, tok.eos_ids) for x in ids]
    copy_model = gens[0].drafter.cache_model  # type: ignore[union-attr]
    assert copy_model is not None
    calls = record_feeds(copy_model)
    engine = BatchEngine(smollm.model, 4, 160)
    for gen in gens:
        engine.submit(gen)
    shared = 0
    while engine.busy:
        before = len(calls)
        engine.step()
        assert len(calls) - before <= 3 and all(c[1] == 1 and c[0] <= 4 for c in calls[before:])
        shared += any(c[0] > 1 for c in calls[before:])
    del copy_model.forward
    used = [sum(g.drafter.used[i] for g in gens) for i in (0, 1)]  # type: ignore[union-attr]
    assert shared > 0 and min(used) > 0, used
    for gen, x in zip(gens, ids, strict=True):
        assert gen.output == _solo(smollm, x, params)


def test_a_queued_request_starts_from_its_categorys_alpha_when_it_starts_decoding(
        smollm: LoadedModel) -> None:
    """Requests submitted together but decoding one after another (one row) take their starting
    alpha from their category's estimate when they start, after what the earlier ones taught
    it, not the value it had when they were queued (the prior, here)."""
    tok = smollm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]))
    factory = drafter_factory("int8", smollm.model)
    assert factory is not None
    # frozen costs (smoothing 0), so what the steps measure cannot turn speculation off: the
    # test is about the seed, not about this machine's timing
    costs = CostModel(target_s={(1, w): 0.05 for w in range(1, 10)}, draft_token_s=0.001,
                      smoothing=0.0, draft_batch_s={1: 0.001})
    ctl = Controller(kmax=3, costs=costs)
    ctl.guard = None
    engine = BatchEngine(smollm.model, 1, 160, controller=ctl)
    gens = [Generation(smollm.model, None, ids, SamplingParams(max_tokens=12), factory(), 3,
                       tok.eos_ids, category="c") for _ in range(2)]
    seeds: list[float] = []
    new_estimate = ctl.new_estimate

    def recording(category: str | None = None) -> AlphaEstimate:
        estimate = new_estimate(category)
        seeds.append(estimate.value)
        return estimate

    ctl.new_estimate = recording  # type: ignore[method-assign]
    for gen in gens:
        engine.submit(gen)
    while engine.busy:
        engine.step()
    assert ctl.categories["c"].value > 0.7  # the int8 copy is accepted ~all the time here
    assert seeds[0] == pytest.approx(0.6) and seeds[1] > 0.7, seeds
