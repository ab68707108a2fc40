"""compare(): real shifts are flagged, noise mostly is not, stale tuning is detected."""

from __future__ import annotations

import json
from typing import Any

from specdecode.bench.records import ConfigSpec
from specdecode.bench.store import Results, build_report
from specdecode.report.compare import compare
from tests.fakes import FakeRunner, ngram, plain
from tests.test_bench_recommend import measure

CONFIGS = [plain(), ngram()]
RESAMPLES = 300


def run(seed: int, configs: list[ConfigSpec] | None = None, **kw: Any) -> Results:
    return measure(FakeRunner(seed=seed, **kw), configs or CONFIGS, n_prompts=16)


def test_a_real_acceptance_drop_is_flagged() -> None:
    result = compare(run(0), run(1, alpha={"ngram": 0.45}), n_resamples=RESAMPLES)
    flagged = {(c.config, c.metric) for c in result.flagged}
    assert ("ngram-k4", "alpha") in flagged and ("ngram-k4", "accepted/drafted") in flagged
    alpha = next(c for c in result.changes if c.metric == "alpha")
    assert alpha.diff.high < 0 and alpha.new < alpha.old
    assert not any(c.config == "plain" for c in result.flagged if "itl" in c.metric)


def test_a_slower_target_is_flagged_on_latency_and_throughput() -> None:
    result = compare(run(0), run(1, step_s=0.013), n_resamples=RESAMPLES)
    flagged = {(c.config, c.metric) for c in result.flagged}
    for metric in ("itl_p50_s", "latency_p50_s", "throughput_tok_s"):
        assert ("plain", metric) in flagged
    thr = next(c for c in result.changes if (c.config, c.metric) == ("plain",
                                                                       "throughput_tok_s"))
    assert thr.diff.high < 0


def test_same_prompts_are_compared_pairwise() -> None:
    # a 3 % slower target moves every request's latency a little; prompt-to-prompt spread
    # (24 to 32 tokens) hides that from an unpaired comparison of medians, not from a paired one
    result = compare(run(0), run(1, step_s=0.0103), n_resamples=RESAMPLES)
    p50 = next(c for c in result.changes if (c.config, c.metric) == ("plain", "latency_p50_s"))
    assert p50.significant and p50.diff.low > 0


def test_noise_alone_is_rarely_flagged() -> None:
    base = run(0)
    flagged = total = 0
    for seed in range(1, 7):
        result = compare(base, run(seed), n_resamples=RESAMPLES)
        flagged += len(result.flagged)
        total += len(result.changes)
        assert not result.stale, result.stale_reasons
    assert total == 6 * 16
    assert flagged / total <= 0.10  # about 5 % expected at 95 % confidence


def test_precision_change_is_a_target_swap() -> None:
    """Same weight file, another precision: another target, so the tuning is stale."""
    same = compare(run(0), run(1), n_resamples=RESAMPLES)
    assert not any("precision" in r for r in same.stale_reasons)
    result = compare(run(0), run(1, precision="bf16"), n_resamples=RESAMPLES)
    assert result.stale and any("precision changed (fp32 -> bf16)" in r
                                for r in result.stale_reasons)


def test_weight_hash_change_makes_tuning_stale() -> None:
    result = compare(run(0), run(1, weight_hash="b" * 64), n_resamples=RESAMPLES)
    assert result.stale and any("weights changed" in r for r in result.stale_reasons)
    assert "STALE" in result.render()


def test_speedup_dropping_below_one_makes_tuning_stale() -> None:
    old, new = run(0), run(1, alpha={"ngram": 0.15})
    result = compare(old, new, n_resamples=RESAMPLES)
    assert result.old_recommendation.enable and not result.new_recommendation.enable
    assert any("not above 1" in r for r in result.stale_reasons)
    assert any("best configuration changed" in r for r in result.stale_reasons)


def test_a_better_drafter_in_new_makes_tuning_stale_and_reports_accept_json() -> None:
    draft = ConfigSpec("draft-k3", drafter="draft_model", k=3)
    configs = [plain(), ngram(), draft]
    old = run(0, configs, alpha={"ngram": 0.8, "draft_model": 0.5})
    new = run(1, configs, alpha={"ngram": 0.5, "draft_model": 0.9})
    old_report = json.loads(json.dumps(build_report(old)))  # as read back from report.json
    result = compare(old_report, new, n_resamples=RESAMPLES)
    assert result.old_recommendation.config == "ngram-k4"
    assert result.new_recommendation.config == "draft-k3"
    assert result.stale and "ngram-k4" in result.stale_reasons[0]
    json.dumps(result.to_dict())  # serializable


def test_configs_in_only_one_report_are_listed() -> None:
    result = compare(run(0), run(0, [plain()]), n_resamples=RESAMPLES)
    assert result.only_in_old == [("ngram-k4", 1)] and result.only_in_new == []
    assert "only in OLD: ngram-k4 (batch 1)" in result.render()
