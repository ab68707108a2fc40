"""The controller (--k auto) and PayGuard, without a model: draft lengths from measured alpha
and costs, probes and their back-off, category seeds, per-batch draft costs, verification widths
that pay (fit_width) and the tail-latency cap, the guard's holds, and what a batch step teaches
(Controller.learn). The engine under a controller, on real models, is tested in test_batch.py."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from specdecode.control import (
    AlphaEstimate,
    Controller,
    CostModel,
    PayGuard,
    StepObservation,
    expected_tokens,
)
from specdecode.drafters.base import Draft
from specdecode.engine import fit_width


def _controller(alpha_draft_s: float, flat: bool) -> Controller:
    costs = CostModel(draft_token_s=alpha_draft_s)
    for batch in (1, 32):
        for width in range(1, 6):
            growth = 0.02 if flat and batch == 1 else 0.9
            costs.target_s[(batch, width)] = 0.05 * batch ** 0.3 * (1 + growth * (width - 1))
    return Controller(kmax=4, costs=costs, probe_every=4)


def test_controller_turns_speculation_on_where_it_pays_and_off_where_it_does_not() -> None:
    ctl = _controller(0.005, flat=True)
    assert ctl.choose([AlphaEstimate(0.9)]) == [4]  # high alpha, cheap verification
    assert ctl.choose([AlphaEstimate(0.05)]) == [0]  # acceptance collapsed
    steep = _controller(0.005, flat=False)
    # large batch: scoring more positions is no longer nearly free
    assert steep.choose([AlphaEstimate(0.9) for _ in range(32)]) == [0] * 32
    mixed = ctl.choose([AlphaEstimate(0.9), AlphaEstimate(0.02)])
    assert mixed[0] > 0 and mixed[1] == 0


def test_controller_probes_and_comes_back_on() -> None:
    ctl = _controller(0.005, flat=True)
    alpha = AlphaEstimate(0.05)
    picks = [ctl.choose([alpha])[0] for _ in range(28)]
    # a probe after 4 steps; each probe that leaves speculation off doubles the interval
    assert [i for i, k in enumerate(picks) if k] == [3, 11, 27]
    assert set(picks) == {0, 1}
    alpha.observe([1.0] * 30)  # the probes start being accepted: alpha recovers
    assert ctl.choose([alpha])[0] > 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_alpha_estimate_leaves_the_prior_after_a_few_samples() -> None:
    alpha = AlphaEstimate(0.6)
    alpha.observe([0.0] * 5)
    assert alpha.value < 0.25  # a plain EWMA at weight 0.1 would still say 0.35
    alpha.observe([1.0] * 40)
    assert alpha.value > 0.95  # and it keeps following the traffic
    ctl = _controller(0.005, flat=True)
    assert ctl.choose([alpha]) == [4]


def test_no_probes_where_no_acceptance_could_pay() -> None:
    steep = _controller(0.005, flat=False)
    hopeful = [AlphaEstimate(0.9) for _ in range(32)]
    assert all(steep.choose(hopeful) == [0] * 32 for _ in range(64))


def test_new_requests_start_from_their_categorys_running_alpha() -> None:
    ctl = _controller(0.005, flat=True)
    assert ctl.new_estimate("chat").value == pytest.approx(0.6)  # nothing seen: the prior
    for _ in range(200):
        ctl.observe("chat", [0.0])  # every draft token of this category is rejected
        ctl.observe("code", [1.0])
    # a fresh request starts off where its kind of traffic has been, not at the prior
    assert ctl.choose([ctl.new_estimate("chat")]) == [0]
    assert ctl.choose([ctl.new_estimate("code")]) == [4]
    assert ctl.new_estimate("other").value == pytest.approx(0.6)


def test_a_start_from_a_well_seen_category_is_not_undone_by_one_rejection() -> None:
    """A fresh request seeded from a category that has seen 100 accepted tokens keeps
    speculating after its first draft token is rejected (k=1 pays from ~0.7 here), and still
    turns off after a run of rejections. Weighted as 2 samples, the seed fell from 0.97 to 0.65
    on that one rejection, and speculation went off."""
    costs = CostModel(target_s={(1, w): 0.05 * (1 + 0.25 * (w - 1)) for w in range(1, 5)},
                      draft_token_s=0.02)
    ctl = Controller(kmax=3, costs=costs)
    ctl.guard = None
    for _ in range(100):
        ctl.observe("c", [1.0])
    alpha = ctl.new_estimate("c")
    assert alpha.value > 0.95
    alpha.observe([0.0])
    assert alpha.value > 0.85 and ctl.choose([alpha]) != [0], alpha.value
    alpha.observe([0.0] * 4)
    assert ctl.choose([alpha]) == [0], alpha.value


def test_a_confident_draft_must_pay_for_widening_the_whole_batch() -> None:
    """fit_width: a draft that pays alone (its expected tokens beat its width's cost) is cut when
    it would widen a batch of 8 rows that have nothing to verify; a draft without confidences
    is kept whole and sets the least width."""
    costs = CostModel(target_s={(b, w): b * (1 + 0.2 * (w - 1)) for b in (1, 8)
                                for w in range(1, 10)})
    confident = Draft(torch.arange(4), None, (0.8, 0.8, 0.8, 0.8))
    alone = fit_width([confident], costs)[0]
    assert len(alone.tokens) == 4 and alone.confidence == confident.confidence
    empty = Draft(torch.zeros(0, dtype=torch.long), None, ())
    batch = fit_width([confident] + [empty] * 7, costs)
    assert [len(d.tokens) for d in batch] == [0] * 8
    fixed = Draft(torch.arange(2), None)  # e.g. a draft model's tokens: verified whatever
    mixed = fit_width([confident, fixed] + [empty] * 6, costs)
    assert [len(d.tokens) for d in mixed[:2]] == [2, 2]


def test_a_step_cost_cap_bounds_every_steps_width() -> None:
    """max_step_cost: no step may cost more than that many plain steps of its batch. Where wide
    steps pay (near-certain drafts, each position +0.3 of a step) the controller and fit_width
    would verify 6 draft tokens; capped at 1.7 plain steps, at most 2 (width 3 costs 1.6)."""
    costs = CostModel(target_s={(8, w): 1.0 + 0.3 * (w - 1) for w in range(1, 8)})
    free = Controller(kmax=6, costs=CostModel(dict(costs.target_s), draft_token_s=1e-6))
    capped = Controller(kmax=6, costs=CostModel(dict(costs.target_s), draft_token_s=1e-6),
                        max_step_cost=1.7)
    assert (free.max_width(8), capped.max_width(8)) == (7, 3)
    sure = [AlphaEstimate(0.99) for _ in range(8)]
    assert max(free.choose(sure)) == 6 and max(capped.choose(sure)) == 2
    drafts = [Draft(torch.arange(6), None, (0.99,) * 6) for _ in range(8)]
    assert {len(d.tokens) for d in fit_width(drafts, costs)} == {6}
    assert {len(d.tokens) for d in fit_width(drafts, costs, capped.max_width(8))} == {2}


def test_the_guard_holds_off_speculation_that_does_not_pay_and_tries_again() -> None:
    """PayGuard: speculative steps realizing 30 tokens/s against plain's 40 are held off after
    a window, tried again after the hold, and each failed window doubles the hold; a batch
    size where speculation pays is never held off."""
    guard, costs = PayGuard(), CostModel()
    step = 0
    for _ in range(guard.min_plain):
        guard.observe(4, False, 4, 0.1, step, costs)  # plain: 40 tokens/s
        step += 1
    spec_steps, holds = [], []
    for _ in range(200):
        if guard.allows(4, step):
            guard.observe(4, True, 6, 0.2, step, costs)  # speculative: 30 tokens/s
            spec_steps.append(step)
        else:
            guard.observe(4, False, 4, 0.1, step, costs)
            holds.append(step)
        step += 1
    assert guard.holds >= 3
    assert spec_steps[: guard.window] == list(range(3, 3 + guard.window))
    # held 16 steps, then a window of 16 tried, then held 32, then 64 ...
    first_hold = [s for s in holds if s < spec_steps[guard.window]]
    assert len(first_hold) == guard.base_backoff
    gaps = [b - a for a, b in pairwise(spec_steps) if b - a > 1]
    assert gaps[:3] == [17, 33, 65]
    assert len(spec_steps) == 4 * guard.window  # of 200: 16, 16, 16, 16, then held 128
    paying = PayGuard()
    for s in range(3):
        paying.observe(4, False, 4, 0.1, s, costs)
    spec = 0
    for s in range(3, 203):
        if paying.allows(4, s):
            paying.observe(4, True, 8, 0.1, s, costs)  # 80 tokens/s
            spec += 1
        else:  # the refresh: one plain step in refresh_every
            paying.observe(4, False, 4, 0.1, s, costs)
    assert paying.holds == 0 and spec >= 200 * paying.refresh_every / (paying.refresh_every + 1) - 1


def test_the_draft_cost_is_kept_per_batch_size() -> None:
    """A copy drafting in the target's cache drafts a batch's rows in one forward per position,
    so its cost per draft token falls with the batch: the controller reads the cost measured at
    the batch size it chooses for. With one cost over all sizes (the batch-1 cost dominating
    here), it keeps speculation off at batch 8 where it pays."""
    table = {(b, w): 0.05 * (1 + 0.1 * (w - 1)) for b in (1, 8) for w in range(1, 6)}
    costs = CostModel(target_s=dict(table))
    for _ in range(20):
        costs.observe_draft(1, 0.04, 1)  # batch 1: 0.8 target steps per draft token
    costs.observe_draft(8, 8 * 0.003, 8)  # batch 8, once: 8 tokens in one 24 ms round
    assert costs.draft(1) == pytest.approx(0.04) and costs.draft(8) == pytest.approx(0.003)
    assert costs.draft(4) == costs.draft_token_s and costs.draft_token_s > 0.03
    ctl = Controller(kmax=4, costs=costs)
    alphas = [AlphaEstimate(0.9) for _ in range(8)]
    assert max(ctl.choose(alphas)) >= 2
    assert max(ctl.choose(alphas[:1])) == 0  # batch 1 at 0.8 steps per token: off
    one_cost = Controller(kmax=4, costs=CostModel(target_s=dict(table),
                                                  draft_token_s=costs.draft_token_s))
    assert max(one_cost.choose(alphas)) == 0


def _first_chosen_step(ctl: Controller, steps: int) -> int | None:
    """Step at which the controller first speculates by choice (not as a probe), when every
    drafted token is accepted and the requests' estimates start at 0.6, moving slowly."""
    rows = [AlphaEstimate(0.6, prior_count=8.0) for _ in range(2)]
    for step in range(steps):
        ks = ctl.choose(rows)
        if any(ks) and not ctl._probed:
            return step
        for a, k in zip(rows, ks, strict=True):
            if k:
                a.observe([1.0] * k)
                ctl.observe("c", [1.0] * k)
    return None


def test_probes_accepted_above_the_estimates_do_not_back_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe after which speculation stays off doubles the probe interval, unless its drafts
    were accepted well above the requests' estimates: those are still learning, and backing off
    would starve them of samples. Here k=1 pays from an estimate of 0.8; the estimates start at
    0.6 and every probed token is accepted: speculation comes on after a few probes at a steady
    interval (by step 40). With the interval doubling after every probe, it took 252 steps."""
    def make() -> Controller:
        costs = CostModel(target_s={(2, w): 0.05 * (1 + 0.1 * (w - 1)) for w in range(1, 5)},
                          draft_token_s=0.015)
        ctl = Controller(kmax=2, costs=costs, probe_every=4)
        ctl.guard = None
        return ctl

    on = _first_chosen_step(make(), 300)
    assert on is not None and on < 40, on
    monkeypatch.setattr(Controller, "_still_learning", lambda self, alphas: False)
    backing_off = _first_chosen_step(make(), 300)
    assert backing_off is None or backing_off > 200, backing_off


def test_a_batch_step_teaches_alphas_costs_and_the_guard_in_one_call() -> None:
    """Controller.learn: each model-drafted row's alpha and its category's, the cost per draft
    token at this batch size (only when model drafters drafted), t(B, T) and the guard."""
    ctl = Controller(kmax=4, costs=CostModel(smoothing=1.0))
    rows = [AlphaEstimate(0.6), AlphaEstimate(0.6)]
    step = StepObservation(batch=2, width=4, proposed=True, committed=5, draft_tokens=6,
                           draft_s=0.03, target_s=0.2, step_s=0.25,
                           alphas=((rows[0], "code", [1.0, 1.0, 1.0]), (rows[1], None, [0.0])))
    ctl.learn(step)
    assert rows[0].value > 0.6 > rows[1].value
    assert set(ctl.categories) == {"code", ""}
    assert ctl.costs.draft(2) == pytest.approx(0.005)
    assert ctl.costs.target_s[(2, 4)] == pytest.approx(0.2)
    assert ctl.guard is not None and ctl.guard.spec[2] == [5.0, 0.25, 1.0]  # a speculative step
    lookup_only = StepObservation(batch=2, width=3, proposed=True, committed=4, draft_tokens=0,
                                  draft_s=0.01, target_s=0.1, step_s=0.12)
    ctl.learn(lookup_only)  # free lookup drafts say nothing about a model's cost per token
    assert ctl.costs.draft(2) == pytest.approx(0.005)


def test_a_batch_size_seen_at_one_width_does_not_make_other_widths_free() -> None:
    """Measured on the llama.cpp target: a batch draining from 8 rows to 7 whose first step at 7
    rows was a wide one (t(7, 5) measured, nothing else at 7) made every narrower width cost
    t(7, 5) too, so a width of 5 looked free against width 1, and fit_width verified drafts
    whose expected 12 tokens per 0.17 s lost to plain's 7 per 0.07 s. A width's relative cost
    comes from the nearest batch size that measured it, scaled by this batch's own steps."""
    costs = CostModel(target_s={(8, w): 0.08 * (1 + 0.6 * (w - 1)) for w in range(1, 10)})
    costs.observe_target(7, 5, 0.171)
    assert costs.target(7, 5) == pytest.approx(0.171)
    assert costs.target(7, 1) == pytest.approx(0.07)  # t(8, 1) x 7 / 8, not t(7, 5)
    assert costs.target(7, 3) == pytest.approx(0.07 * 2.2)
    # the drafts of that step: four rows of 4 tokens at ~0.75 each, three rows without a match
    sure = Draft(torch.arange(4), None, (0.75, 0.8, 0.8, 0.8))
    empty = Draft(torch.zeros(0, dtype=torch.long), None, ())
    assert [len(d.tokens) for d in fit_width([sure] * 4 + [empty] * 3, costs)] == [0] * 7
    costs.observe_target(7, 1, 0.076)  # now both ends at 7 rows: interpolated between them
    assert costs.target(7, 3) == pytest.approx((0.076 + 0.171) / 2)
    assert costs.target(7, 9) > costs.target(7, 5)  # past the widest: the last segment's slope


def test_estimates_follow_the_measured_curve_of_the_nearest_covering_batch() -> None:
    """Only one batch size measured at one width: other widths grow by PRIOR_SLOPE per position,
    other batch sizes in proportion to the rows."""
    costs = CostModel(target_s={(4, 1): 0.04})
    assert costs.target(4, 3) == pytest.approx(0.04 * (1 + 2 * 0.1))
    assert costs.target(8, 1) == pytest.approx(0.08)
    costs.observe_target(4, 2, 0.06)
    assert costs.target(4, 4) == pytest.approx(0.10)  # slope of the last segment, 0.02


def test_the_per_step_overhead_is_learned_and_counted_against_speculation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast target: 8 ms forwards, cheap verification (v(4) = 1.2), but a speculative step
    pays 4 ms more outside its forward (a lookup's proposing, choosing, verification) than a
    plain step. At alpha 0.3 the forward-only model expects a gain; with the measured overhead
    it does not, and the controller stays plain. Broken variant: CostModel.step without the
    overhead speculates."""
    def controller() -> Controller:
        costs = CostModel(draft_token_s=0.0002, smoothing=1.0)
        for width in range(1, 6):
            costs.target_s[(1, width)] = 0.008 * (1 + 0.05 * (width - 1))
        ctl = Controller(kmax=4, costs=costs, guard=None)
        ctl.learn(StepObservation(batch=1, width=1, proposed=False, committed=1,
                                  draft_tokens=0, draft_s=0.0, target_s=0.008, step_s=0.009))
        ctl.learn(StepObservation(batch=1, width=4, proposed=True, committed=2, draft_tokens=0,
                                  draft_s=0.003, target_s=0.0096, step_s=0.0146))
        return ctl

    ctl = controller()
    assert ctl.costs.overhead(1, False) == pytest.approx(0.001)
    assert ctl.costs.overhead(1, True) == pytest.approx(0.005)  # the lookup's proposing included
    assert ctl.costs.step(1, 4, True) == pytest.approx(ctl.costs.target(1, 4) + 0.005)
    assert ctl.choose([AlphaEstimate(0.3)]) == [0]
    assert ctl.choose([AlphaEstimate(0.95)])[0] > 0  # high acceptance still pays
    monkeypatch.setattr(CostModel, "step", lambda self, b, w, s: self.target(b, w))
    assert controller().choose([AlphaEstimate(0.3)])[0] > 0
