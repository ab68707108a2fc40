"""Bench statistics: percentiles, bootstrap intervals, acceptance, speedups, audits."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from specdecode.bench.harness import make_header
from specdecode.bench.records import ConfigSpec, CostCurve, RequestSample
from specdecode.bench.store import Results
from specdecode.report.analysis import (
    _base_summary,
    acceptance,
    analyze,
    bootstrap_ci,
    break_even_c,
    chunk_gaps,
    cost_at,
    distribution,
    ecdf,
    histogram,
    measure_speedup,
    percentile,
    pooled_percentile_replicates,
    predicted_speedup,
    tpot,
    wall_time,
)
from tests.fakes import FakeRunner, make_prompts, ngram, plain, workload_of


def mean_stat(x: np.ndarray) -> np.ndarray:
    return np.asarray(x.mean(axis=-1))


def sample(prompt_id: str = "p", latency: float = 1.0, tokens: int = 10, group: int = 0,
           turn: int = 0, config: str = "plain", **counters: object) -> RequestSample:
    fields: dict[str, object] = dict(
        config=config, batch_size=1, prompt_id=prompt_id, category="qa", turn=turn,
        prompt_tokens=5, output_tokens=tokens, ttft_s=0.1,
        itl_s=[(latency - 0.1) / (tokens - 1)] * (tokens - 1), latency_s=latency, drafted=0,
        accepted=0, accepted_per_pos=[], drafted_per_pos=[], rejections=0, steps=tokens - 1,
        draft_s=0.0, target_s=latency, verify_s=0.0, output_token_ids=list(range(tokens)),
        text="", group=group)
    fields.update(counters)
    return RequestSample(**fields)  # type: ignore[arg-type]


def test_percentiles_interpolate_linearly() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    d = distribution([3, 1, 2, 4])
    assert (d.n, d.mean, d.p50, d.max) == (4, 2.5, 2.5, 4.0)
    assert d.p99 == pytest.approx(3.97)


def test_histogram_and_ecdf() -> None:
    h = histogram([0, 0.5, 1, 1.5, 2], bins=2)
    assert h.edges == [0.0, 1.0, 2.0] and h.counts == [2, 3]
    xs, ys = ecdf([3, 1, 2])
    assert xs == [1, 2, 3] and ys == pytest.approx([1 / 3, 2 / 3, 1])


def test_bootstrap_ci_covers_the_truth_at_about_the_nominal_rate() -> None:
    rng = np.random.default_rng(123)
    covered = 0
    trials = 1000
    for t in range(trials):
        data = rng.normal(10.0, 2.0, size=40)
        iv = bootstrap_ci(data, mean_stat, n_resamples=400, seed=t)
        covered += iv.low <= 10.0 <= iv.high
    # percentile bootstraps under-cover slightly at n = 40 (~0.936 here); a 90 % interval
    # mistaken for 95 % gives ~0.89, a 99 % one ~0.98
    assert 0.915 <= covered / trials <= 0.965


def test_bootstrap_ci_is_seeded_and_narrows_with_more_data() -> None:
    rng = np.random.default_rng(5)
    small, large = rng.exponential(1.0, 30), rng.exponential(1.0, 3000)
    a = bootstrap_ci(small, mean_stat, n_resamples=300, seed=1)
    assert a == bootstrap_ci(small, mean_stat, n_resamples=300, seed=1)
    assert a != bootstrap_ci(small, mean_stat, n_resamples=300, seed=2)
    b = bootstrap_ci(large, mean_stat, n_resamples=300, seed=1)
    assert (b.high - b.low) < (a.high - a.low) / 5
    assert a.low < a.estimate < a.high


def test_pooled_percentiles_equal_concatenating_the_drawn_groups() -> None:
    rng = np.random.default_rng(3)
    groups = [rng.exponential(1.0, int(rng.integers(0, 30))) for _ in range(25)]
    fast = pooled_percentile_replicates(groups, [0, 50, 99, 100], 150,
                                        np.random.default_rng(7), chunk=16)
    draws = np.random.default_rng(7).integers(0, 25, size=(150, 25))
    slow = [np.percentile(np.concatenate([groups[i] for i in row]), [0, 50, 99, 100])
            for row in draws]
    assert np.allclose(fast, np.array(slow))


def test_pooled_percentiles_resample_whole_groups() -> None:
    groups = [np.full(10, float(i)) for i in range(5)]
    reps = pooled_percentile_replicates(groups, [50], 300, np.random.default_rng(0))
    assert reps.shape == (300, 1)
    assert set(np.unique(reps)) <= {float(i) for i in range(5)} | {x + 0.5 for x in range(4)}
    same = pooled_percentile_replicates([np.ones(3)] * 4, [50, 99], 50,
                                        np.random.default_rng(0))
    assert np.all(same == 1.0)


def test_acceptance_counts_and_rates() -> None:
    # request a: step 1 drafts 3, accepts 0 (two drafted tokens never reached); step 2 drafts 3,
    # accepts 3. request b: one step drafts 2, accepts 1.
    a = sample("a", drafted=6, accepted=3, drafted_per_pos=[2, 2, 2], accepted_per_pos=[1, 1, 1],
               rejections=1, steps=2, tokens=6)
    b = sample("b", drafted=2, accepted=1, drafted_per_pos=[1, 1], accepted_per_pos=[1, 0],
               rejections=1, steps=1, tokens=3)
    assert a.problems() == [] and b.problems() == []
    acc = acceptance([a, b])
    assert (acc.drafted, acc.accepted, acc.steps, acc.rejections) == (8, 4, 3, 2)
    assert acc.rate == pytest.approx(4 / 8)
    assert acc.alpha == pytest.approx(4 / 6)  # 4 accepted of 6 tokens actually tried
    assert acc.mean_acceptance_length == pytest.approx((4 + 3) / 3)
    assert acc.by_position == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    plain_acc = acceptance([sample()])
    assert plain_acc.mean_acceptance_length == 1.0 and math.isnan(plain_acc.rate)


def test_alpha_uses_the_engines_min_p_q_measure_when_present() -> None:
    a = sample("a", drafted=4, accepted=2, drafted_per_pos=[2, 2], accepted_per_pos=[1, 1],
               rejections=1, steps=2, tokens=5, alpha_micro=1_500_000, alpha_positions=3)
    b = sample("b", drafted=2, accepted=2, drafted_per_pos=[1, 1], accepted_per_pos=[1, 1],
               rejections=0, steps=1, tokens=4, alpha_micro=1_800_000, alpha_positions=2)
    acc = acceptance([a, b])
    assert acc.alpha_source == "min(p,q)" and acc.alpha == pytest.approx(3.3 / 5)
    assert acc.alpha_mle == pytest.approx(4 / 5)
    assert acceptance([dataclasses.replace(a, alpha_micro=0, alpha_positions=0)]).alpha_source \
        == "mle"
    assert dataclasses.replace(a, alpha_micro=3_100_000).problems() != []


def test_predicted_speedup_formula_and_boundary() -> None:
    # Leviathan et al.: alpha 0.8, k 4, free drafts, v = 1
    assert predicted_speedup(0.8, 4, 0.0, 1.0) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert predicted_speedup(0.0, 3, 0.1, 1.0) == pytest.approx(1 / 1.3)
    assert predicted_speedup(1.0, 3, 0.1, 1.0) == pytest.approx(4 / 1.3)
    for alpha, k, v in ((0.6, 4, 1.2), (0.9, 2, 1.0), (0.75, 8, 1.5)):
        c = break_even_c(alpha, k, v)
        assert predicted_speedup(alpha, k, c, v) == pytest.approx(1.0)
        assert predicted_speedup(alpha, k, c * 0.9, v) > 1.0 > predicted_speedup(alpha, k,
                                                                                  c * 1.1, v)


def test_cost_curve_interpolation() -> None:
    curve = CostCurve("ngram", 1, [4, 1, 2], [0.4, 0.1, 0.2], [1.4, 1.1, 1.2], 0.01)
    assert cost_at(curve, 3) == pytest.approx((0.3, 1.3))
    assert cost_at(curve, 9) == pytest.approx((0.4, 1.4))


def test_measured_speedup_of_an_exact_two_x() -> None:
    rng = np.random.default_rng(0)
    lat = rng.uniform(0.5, 2.0, 30)
    base = [sample(f"p{i}", float(x)) for i, x in enumerate(lat)]
    fast = [sample(f"p{i}", float(x) / 2, config="spec") for i, x in enumerate(lat)]
    s = measure_speedup(fast, base, "plain", n_resamples=300)
    assert s is not None and s.n_pairs == 30
    assert s.total_ratio.estimate == pytest.approx(2.0)
    assert s.median_ratio.estimate == pytest.approx(2.0)
    assert s.total_ratio.low == pytest.approx(2.0) and s.per_request == pytest.approx([2.0] * 30)
    assert measure_speedup(fast, [], "plain") is None


def test_speedup_at_batch_above_one_resamples_whole_batch_groups() -> None:
    """Requests of one batch share its timing: four batches of 8 whose speculative side ran
    0.8x, 1.0x, 1.0x and 1.2x of plain (a slow spell in one, a quiet one in another) are four
    units of evidence, not 32. Resampled request by request the interval claimed a precision
    the runs did not have (five repeats of one batch-8 comparison spread from 0.85x to 1.09x,
    each with an interval of about +-0.04)."""
    rng = np.random.default_rng(1)
    base, fast = [], []
    for group, ratio in enumerate((0.8, 1.0, 1.0, 1.2)):
        for i in range(8):
            lat = float(rng.uniform(4.0, 6.0))
            base.append(sample(f"p{group}-{i}", lat, group=group, batch_size=8))
            fast.append(sample(f"p{group}-{i}", lat / ratio, group=group, batch_size=8,
                               config="spec"))
    s = measure_speedup(fast, base, "plain", n_resamples=1000)
    assert s is not None and s.n_pairs == 32
    assert s.total_ratio.low < 0.9 and s.total_ratio.high > 1.1
    alone = measure_speedup([dataclasses.replace(x, batch_size=1) for x in fast],
                            [dataclasses.replace(x, batch_size=1) for x in base], "plain",
                            n_resamples=1000)
    assert alone is not None  # the same figures as independent requests: a narrower interval
    assert alone.total_ratio.low > 0.9 and alone.total_ratio.high < 1.1
    assert alone.total_ratio.estimate == pytest.approx(s.total_ratio.estimate)


def test_wall_time_counts_the_slowest_request_of_each_group_and_turn() -> None:
    xs = [sample("a", 1.0, group=0), sample("b", 3.0, group=0), sample("c", 2.0, group=1),
          sample("c", 0.5, group=1, turn=1)]
    assert wall_time(xs) == pytest.approx(3.0 + 2.0 + 0.5)


def fake_results(runner: FakeRunner, configs: list, max_tokens: int = 24) -> Results:
    prompts = make_prompts(8, max_tokens=max_tokens)
    header = make_header(runner.describe(), workload_of(prompts), configs, 0)
    results = Results(header=header)
    for c in configs:
        for p in prompts:
            for s in runner.run([p], c):
                results.add(s)
    return results


def test_analysis_speedup_prediction_and_greedy_audit() -> None:
    configs = [plain(), ngram(), ngram(name="lossy")]
    results = fake_results(FakeRunner(alpha={"ngram": 0.7}, corrupt={"lossy"}), configs)
    analysis = analyze(results, n_resamples=300)
    good = analysis.summary("ngram-k4", 1)
    assert good is not None and good.speedup is not None
    assert good.speedup.total_ratio.low > 1.0
    assert good.acceptance.alpha == pytest.approx(0.7, abs=0.08)
    # the in-run cost estimates recover the fake's c and v
    assert good.c == pytest.approx(0.05, rel=0.1) and good.v == pytest.approx(1.05, rel=0.1)
    assert analysis.audit_passed("ngram-k4", 1) is True
    assert analysis.audit_passed("lossy", 1) is False
    assert analysis.audit_passed("plain", 1) is None
    verdict = next(a for a in analysis.audits if a.config == "lossy")
    assert verdict.n_failed == verdict.n_compared == 9 and "at token 3" in verdict.details


def test_prediction_matches_measurement_when_its_assumptions_hold() -> None:
    # i.i.d. acceptance, negligible prefill, long outputs: S(alpha, k, c, v) is the decode speedup
    runner = FakeRunner(alpha={"ngram": 0.6}, prefill_s=1e-6, c=0.1, noise=0.01)
    analysis = analyze(fake_results(runner, [plain(), ngram()], max_tokens=400),
                       n_resamples=200)
    s = analysis.summary("ngram-k4", 1)
    assert s is not None and s.speedup is not None
    expected = predicted_speedup(0.6, 4, 0.1, 1.05)
    assert s.predicted_speedup == pytest.approx(expected, rel=0.05)
    assert s.speedup.total_ratio.estimate == pytest.approx(expected, rel=0.05)


def test_speedup_after_the_first_token_leaves_the_prefill_out() -> None:
    # every request: a 2 s prefill (time to first token) on both sides, then 99 tokens that the
    # speculative side decodes twice as fast (9.9 s against 4.95 s)
    base = [sample(f"p{i}", 2.0 + 9.9 * (1 + i / 10), tokens=100, ttft_s=2.0)
            for i in range(12)]
    fast = [sample(f"p{i}", 2.0 + 9.9 * (1 + i / 10) / 2, tokens=100, ttft_s=2.0,
                   config="spec") for i in range(12)]
    s = measure_speedup(fast, base, "plain", n_resamples=300)
    assert s is not None
    assert s.decode_ratio.estimate == pytest.approx(2.0)
    assert s.decode_ratio.low == pytest.approx(2.0) and s.decode_ratio.high == pytest.approx(2.0)
    # whole requests carry the prefill on both sides: well below 2x
    assert 1.5 < s.total_ratio.estimate < 1.8


def test_token_identity_pairs_greedy_and_seeded_invariant_requests_only() -> None:
    """Greedy requests, and sampled ones with the same seed under the invariant rule, must give
    plain decoding's tokens; residual-rule or unseeded sampled requests are not compared."""
    from specdecode.report.analysis import token_identity_audit

    base, spec = plain(), ngram()
    hot = {"temperature": 0.7, "rule": "invariant", "seed": 5}
    mine = [sample("g", config="ngram-k4"), sample("s", config="ngram-k4", **hot),
            sample("r", config="ngram-k4", **{**hot, "rule": "residual"}),
            sample("u", config="ngram-k4", **{**hot, "seed": None})]
    theirs = [sample("g"), sample("s", **hot), sample("r", **{**hot, "rule": "residual"}),
              sample("u", **{**hot, "seed": None})]
    ok = token_identity_audit(spec, base, mine, theirs)
    assert ok is not None and ok.passed and ok.n_compared == 2
    assert ok.method == "seeded-token-identity" and "1 seeded sampled" in ok.details
    mine[1] = dataclasses.replace(mine[1], output_token_ids=[9] * 10)
    bad = token_identity_audit(spec, base, mine, theirs)
    assert bad is not None and not bad.passed and bad.n_failed == 1 and "prompt s" in bad.details
    mine[2] = dataclasses.replace(mine[2], output_token_ids=[9] * 10)  # residual: not compared
    assert token_identity_audit(spec, base, mine, theirs).n_failed == 1  # type: ignore[union-attr]


def test_remote_outputs_are_compared_and_searched_by_their_text() -> None:
    """A remote server streams text, not ids: its samples carry `text_ids` stand-ins. Two
    servers may count one text's tokens differently (vLLM's usage counts the end-of-sequence
    token), so identity compares texts, and a loop is searched in the text, not in n copies of
    one CRC."""
    from specdecode.bench.records import text_ids
    from specdecode.report.analysis import loops, token_identity_audit

    def remote(text: str, tokens: int, config: str = "plain", pid: str = "p") -> RequestSample:
        return sample(pid, tokens=tokens, config=config, text=text,
                      output_token_ids=text_ids(text, tokens))

    answer = "The capital of France is Paris. It lies on the Seine, in the north."
    base, spec = plain(), ngram()
    theirs = [remote(answer, 17)]
    same = token_identity_audit(spec, base, [remote(answer, 16, "ngram-k4")], theirs)
    assert same is not None and same.passed  # one text, counted 16 and 17 tokens
    changed = answer.replace("north", "south")
    bad = token_identity_audit(spec, base, [remote(changed, 17, "ngram-k4")], theirs)
    assert bad is not None and not bad.passed and "at text piece 26" in bad.details
    assert remote(answer, 17).output_units()[0] == "The"
    assert not loops(remote(answer, 17))  # the stand-ins alone would repeat 13 of 14 4-grams
    assert loops(remote("and then " * 20, 40))
    local = sample("p", tokens=6, output_token_ids=[3, 1, 4, 1, 5, 9], text="x")
    assert local.output_units() == [3, 1, 4, 1, 5, 9]  # real ids are compared as ids


def test_tpot_and_chunk_gaps_are_what_a_streaming_client_sees() -> None:
    """A speculative request: TTFT 0.1 s, then steps emitting 3, 1 and 4 tokens 0.2 s apart.
    Per-token ITL has a median of 0 (the tokens after each step's first); TPOT and the gaps
    between chunks are the figures a client compares."""
    spec = sample(tokens=9, latency=0.7, itl_s=[0.2, 0, 0, 0.2, 0.2, 0, 0, 0])
    assert tpot(spec) == pytest.approx(0.6 / 8)
    assert chunk_gaps(spec) == [0.2, 0.2, 0.2]
    one = dataclasses.replace(sample(), output_tokens=1, itl_s=[], latency_s=0.1)
    assert math.isnan(tpot(one))
    s = _base_summary(ConfigSpec("ngram", "ngram", 3), [spec, one])
    assert s.itl.p50 == 0.0 and s.itl.n == 8
    assert (s.chunk_gap.n, s.chunk_gap.p50) == (3, pytest.approx(0.2))
    assert (s.tpot.n, s.tpot.p50) == (1, pytest.approx(0.075))
    # broken variants: TPOT with the first token's wait in it, gaps as the per-token ITL
    assert spec.latency_s / spec.output_tokens != pytest.approx(s.tpot.p50)
    assert distribution(spec.itl_s).p50 != pytest.approx(s.chunk_gap.p50)


def test_predicted_speedup_counts_the_measured_step_overhead() -> None:
    """A run where plain steps take 10 ms (8 ms forward) and speculative steps 8 * 1.2 ms of
    forward plus 4 ms besides, emitting 2 tokens per step: measured speedup 2 * 10 / 13.6 =
    1.47x. The cost curve (v(k) = 1.2 relative to the forward, c = 0) alone predicts 2 / 1.2 =
    1.67x; with the in-run overhead the prediction is within 10% of what was measured."""
    from specdecode.report.analysis import predicted_speedup, with_overhead

    def run(config: str, steps: int, step_s: float, forward_s: float) -> RequestSample:
        tokens = steps * (2 if config != "plain" else 1) + 1
        return sample(prompt_id=config, config=config, tokens=tokens, latency=0.1 + steps * step_s,
                      steps=steps, target_s=steps * forward_s, draft_s=0.0)

    plain_runs = [run("plain", 100, 0.010, 0.008)]
    spec_runs = [run("ngram", 50, 0.0136, 0.0096)]
    measured = 2 * 0.010 / 0.0136
    curve_only = predicted_speedup(1.0, 1, 0.0, 1.2)  # alpha 1 at k = 1: 2 tokens per step
    c, v = with_overhead(0.0, 1.2, spec_runs, plain_runs) or (math.nan, math.nan)
    with_fixed = predicted_speedup(1.0, 1, c, v)
    assert abs(with_fixed / measured - 1) < 0.02
    assert curve_only / measured > 1.1  # the broken variant: the curve alone overshoots
