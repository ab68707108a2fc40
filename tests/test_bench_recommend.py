"""The recommendation: on only where the speedup CI is above 1 and the audit passed."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from specdecode.bench.harness import config_grid, make_header
from specdecode.bench.records import ConfigSpec
from specdecode.bench.store import Results
from specdecode.report.analysis import analyze, self_repeat
from specdecode.report.recommend import recommend, vllm_speculative_config
from tests.fakes import FakeRunner, linear_v, make_prompts, ngram, plain, workload_of


def measure(runner: FakeRunner, configs: list[ConfigSpec], n_prompts: int = 12) -> Results:
    prompts = make_prompts(n_prompts)
    results = Results(header=make_header(runner.describe(), workload_of(prompts), configs, 0))
    for c in configs:
        for start in range(0, len(prompts), c.batch_size):
            for s in runner.run(prompts[start:start + c.batch_size], c):
                results.add(dataclasses.replace(s, group=start))
    return results


def test_turns_speculation_off_above_the_batch_size_where_it_stops_winning() -> None:
    # v(B, k) = 1.05 + 0.2 (B - 1) k: predicted S ~ 2.2, 1.35, 0.75, 0.4 at B = 1, 2, 4, 8
    runner = FakeRunner(alpha={"ngram": 0.7}, v=linear_v(1.05, 0.2))
    configs = config_grid([plain(), ngram()], [1, 2, 4, 8])
    analysis = analyze(measure(runner, configs), n_resamples=300)
    speedups = {b: analysis.summary("ngram-k4", b).speedup.total_ratio  # type: ignore[union-attr]
                for b in (1, 2, 4, 8)}
    assert speedups[2].low > 1.0 and speedups[4].high < 1.0  # the setup does what it says
    rec = recommend(analysis)
    assert rec.enable and rec.config == "ngram-k4" and rec.drafter == "ngram" and rec.k == 4
    assert rec.batch_sizes_on == [1, 2] and rec.turn_off_above == 2
    assert rec.vllm_config == {"method": "ngram", "num_speculative_tokens": 4,
                               "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    text = rec.render()
    assert "turn it off above batch size 2" in text
    assert f"{speedups[4].estimate:.2f}x" in text  # the evidence quotes the numbers
    assert json.loads(rec.vllm_json or "") == rec.vllm_config


def test_wins_everywhere_means_no_cap() -> None:
    runner = FakeRunner(alpha={"ngram": 0.8})
    analysis = analyze(measure(runner, config_grid([plain(), ngram()], [1, 2])), n_resamples=200)
    rec = recommend(analysis)
    assert rec.enable and rec.batch_sizes_on == [1, 2] and rec.turn_off_above is None


def test_point_estimate_above_one_is_not_enough() -> None:
    # spec latency = plain latency / 1.1 times large per-request noise: S ~ 1.05, CI spans 1
    runner = FakeRunner()
    results = measure(runner, [plain(), ngram()], n_prompts=12)
    rng = np.random.default_rng(4)
    plain_lat = {(s.prompt_id, s.turn): s.latency_s for s in results.samples
                 if s.config == "plain"}
    results.samples = [
        s if s.config == "plain" else dataclasses.replace(
            s, latency_s=plain_lat[(s.prompt_id, s.turn)] / 1.1 * float(np.exp(rng.normal(0, 0.3))))
        for s in results.samples]
    analysis = analyze(results, n_resamples=300)
    ratio = analysis.summary("ngram-k4", 1).speedup.total_ratio  # type: ignore[union-attr]
    assert ratio.estimate > 1.0 > ratio.low  # the precondition of this test
    assert not recommend(analysis).enable


def test_failed_audit_blocks_an_otherwise_fast_config() -> None:
    runner = FakeRunner(alpha={"ngram": 0.8}, corrupt={"ngram-k4"})
    analysis = analyze(measure(runner, [plain(), ngram()]), n_resamples=200)
    assert analysis.summary("ngram-k4", 1).speedup.total_ratio.low > 1  # type: ignore[union-attr]
    rec = recommend(analysis)
    assert not rec.enable and "audit FAILED" in rec.render()


def test_no_audit_verdict_blocks_too() -> None:
    # everything sampled at temperature 1: no greedy identity check, and the fake has no audit
    configs = [dataclasses.replace(c, temperature=1.0) for c in (plain(), ngram())]
    analysis = analyze(measure(FakeRunner(alpha={"ngram": 0.8}), configs), n_resamples=200)
    assert analysis.audit_passed("ngram-k4", 1) is None
    rec = recommend(analysis)
    assert not rec.enable and "no audit verdict" in rec.render()


def test_best_of_several_drafters_is_chosen() -> None:
    draft = ConfigSpec("draft-k3", drafter="draft_model", k=3, options={"model": "/m/tiny"})
    runner = FakeRunner(alpha={"ngram": 0.5, "draft_model": 0.9})
    rec = recommend(analyze(measure(runner, [plain(), ngram(), draft]), n_resamples=200))
    assert rec.config == "draft-k3"
    assert rec.vllm_config == {"method": "draft_model", "model": "/m/tiny",
                               "num_speculative_tokens": 3}


def test_vllm_mapping_of_other_drafters() -> None:
    eagle = ConfigSpec("e", drafter="eagle", k=5, options={"model": "org/eagle-head"})
    assert vllm_speculative_config(eagle, 5)[0] == {
        "method": "eagle", "model": "org/eagle-head", "num_speculative_tokens": 5}
    cfg, note = vllm_speculative_config(ConfigSpec("n", drafter="ngram", k=2), 2)
    assert cfg == {"method": "ngram", "num_speculative_tokens": 2} and "prompt_lookup" in note
    cfg, note = vllm_speculative_config(ConfigSpec("s", drafter="self_spec", k=2), 2)
    assert cfg is None and "no equivalent" in note
    cfg, note = vllm_speculative_config(ConfigSpec("q", drafter="w4a16", k=3), 3)
    assert cfg is not None and cfg["method"] == "draft_model" and "4-bit" in cfg["model"]
    assert cfg["num_speculative_tokens"] == 3 and "re-measure" in note
    cfg, note = vllm_speculative_config(ConfigSpec("h", drafter="ngram+w4a16", k=3), 3)
    assert cfg is not None and cfg["method"] == "draft_model" and "4-bit" in cfg["model"]
    assert "one drafting method" in note and "n-gram lookup" in note
    cfg, note = vllm_speculative_config(ConfigSpec("h", drafter="ngram+self_spec", k=3), 3)
    assert cfg is None and "no equivalent" in note


def test_self_repeat_measures_a_loop_not_a_copy() -> None:
    loop = [5, 6, 7, 8, 9] * 20  # a sentence said 20 times
    assert self_repeat(loop) == pytest.approx(92 / 97)  # all but its first 5 4-grams
    assert self_repeat(list(range(100))) == 0.0  # says something new each time
    assert self_repeat([1, 2, 3]) == 0.0  # shorter than one 4-gram
    # 50 new tokens, then the sentence 10 times: 42 of the 97 4-grams repeat
    assert self_repeat([*range(100, 150), *loop[:50]]) == pytest.approx(42 / 97)


def test_looping_outputs_are_named_and_the_speedup_without_them_is_given() -> None:
    """5 of 12 prompts loop (their tokens repeat one sentence) and speculation is 3x faster on
    them, as a lookup drafting the loop is: the note counts them and quotes the speedup on the
    7 others, which is the untouched run's, not the inflated overall one."""
    runner = FakeRunner(alpha={"ngram": 0.7})
    results = measure(runner, [plain(), ngram()])
    clean = analyze(results, n_resamples=300)
    clean_speedup = clean.summary("ngram-k4", 1).speedup.total_ratio  # type: ignore[union-attr]
    assert not any("loop" in n for n in recommend(clean).notes)  # nothing loops: no note
    looping = sorted({s.prompt_id for s in results.samples})[:5]
    results.samples = [
        dataclasses.replace(
            s, output_token_ids=([7, 8, 9, 10] * s.output_tokens)[:s.output_tokens],
            latency_s=s.latency_s / (3 if s.config != "plain" else 1))
        if s.prompt_id in looping else s
        for s in results.samples]
    analysis = analyze(results, n_resamples=300)
    overall = analysis.summary("ngram-k4", 1).speedup.total_ratio  # type: ignore[union-attr]
    assert overall.estimate > 1.3 * clean_speedup.estimate  # the loops inflate it
    units = [s for s in results.samples if s.config == "plain"]  # (prompt, turn) requests
    n_loop = sum(s.prompt_id in looping for s in units)
    (note,) = [n for n in recommend(analysis).notes if "loop" in n]
    assert f"{n_loop} of {len(units)} requests' plain outputs loop" in note
    found = re.search(r"on the (\d+) other requests: ([\d.]+)x", note)
    assert found is not None and int(found.group(1)) == len(units) - n_loop
    assert abs(float(found.group(2)) / clean_speedup.estimate - 1) < 0.1
    clean_decode = clean.summary("ngram-k4", 1).speedup.decode_ratio  # type: ignore[union-attr]
    found = re.search(r"other requests: [^;]*after the first token ([\d.]+)x", note)
    assert found is not None and abs(float(found.group(1)) / clean_decode.estimate - 1) < 0.1
