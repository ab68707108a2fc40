"""Tests of the fake bench Runner of tests/fakes.py."""

from __future__ import annotations

from specdecode.bench.workloads import Prompt
from tests.fakes import FakeRunner, make_prompts, ngram, plain


def test_fake_samples_are_consistent() -> None:
    runner = FakeRunner()
    prompts = make_prompts(5)
    for config in (plain(), ngram(), ngram(batch=2)):
        for s in runner.run(prompts[:2], config):
            assert s.problems() == [], (config.name, s.problems())
            assert len(s.itl_s) == s.output_tokens - 1


def test_fake_acceptance_matches_alpha() -> None:
    runner = FakeRunner(alpha={"ngram": 0.6})
    prompts = [Prompt(id=f"q{i}", category="qa", turns=["x"], max_tokens=200) for i in range(20)]
    samples = runner.run(prompts, ngram(batch=20))
    accepted = sum(s.accepted for s in samples)
    trials = accepted + sum(s.rejections for s in samples)
    assert abs(accepted / trials - 0.6) < 0.03


def test_fake_greedy_tokens_equal_across_configs_unless_corrupt() -> None:
    runner = FakeRunner(corrupt={"bad"})
    prompt = make_prompts(1)
    a = runner.run(prompt, plain())[0].output_token_ids
    assert runner.run(prompt, ngram())[0].output_token_ids == a
    assert runner.run(prompt, ngram(name="bad"))[0].output_token_ids != a
