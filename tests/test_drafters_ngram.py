"""Prompt-lookup (n-gram) drafter: matching rules against a brute-force reference, greedy token
identity with plain decoding on SmolLM2, and the sampled-mode distribution audit.

The audit helpers (`tiny_model`, `exact_two_tokens`, `audit`) are shared with
test_drafters_layerskip.py. The audit decodes the first two tokens of a small random checkpoint
(vocabulary 96) many times at temperature 1 and compares the counts with the exact distribution,
enumerated from the model's logits (96 first tokens x 96 second tokens), by chi-square goodness of
fit at FALSE_ALARM. N_AUDIT draws give power POWER against a TV gap of DESIGN_TV over 40 cells
(cells with expected count < 5 are pooled by chi_square_gof; about 30 to 50 remain here); every
broken variant tested here has a far larger gap, and each must be caught. The verifier itself is
audited more finely in test_verify.py: this audit checks the drafters' side (their q, their
proposals, their state across steps) end to end through the engine, at a cost of seconds.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specdecode.audit_stats import chi_square_gof, required_samples
from specdecode.control import Controller, CostModel, best_width
from specdecode.drafters.base import Draft, Drafter, DraftRequest
from specdecode.drafters.ngram import GREEDY_PRIOR, MatchStats, NgramDrafter, RegimeStats
from specdecode.drafters.registry import DrafterOptions, drafter_factory
from specdecode.engine import BatchEngine, Generation, run_batch
from specdecode.errors import SpecDecodeError
from specdecode.models.config import config_from_hf, read_hf_config
from specdecode.models.loading import LoadedModel, load_native
from specdecode.sampling import SamplingParams
from tests.conftest import make_checkpoint
from tests.fakes import LookupTarget
from tests.identity import assert_identical

V = 96  # the tiny checkpoint's vocabulary
FALSE_ALARM = 1e-4
POWER = 0.99
DESIGN_TV = 0.15
N_AUDIT = required_samples(DESIGN_TV, FALSE_ALARM, POWER, num_cells=40)
SHARPEN = 8.0  # the random checkpoint's logits are nearly uniform: scale them to look real

CODE_PROMPT = (
    "Rename the function `area` to `rectangle_area` in this Python code and reply with the "
    "whole code.\n\n"
    "def area(width, height):\n"
    "    return width * height\n\n\n"
    "def total_area(rectangles):\n"
    "    return sum(area(w, h) for w, h in rectangles)\n"
)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


# ---------------------------------------------------------------------------------------------
# Matching rules
# ---------------------------------------------------------------------------------------------


def _propose(drafter: NgramDrafter, context: list[int], k: int) -> list[int]:
    draft = drafter.propose(DraftRequest(torch.tensor(context), k, SamplingParams(), len(context)))
    assert draft.q is None and draft.tokens.dtype == torch.long
    return list(draft.tokens.tolist())


def reference_proposal(context: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Brute force: longest n first, latest earlier occurrence, periodic continuation."""
    end = len(context)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        for j in range(end - n - 1, -1, -1):  # occurrence context[j : j + n], follower j + n
            if context[j : j + n] == context[end - n :]:
                out: list[int] = []
                for i in range(k):
                    pos = j + n + i
                    out.append(context[pos] if pos < end else out[pos - end])
                return out
    return []


def test_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    # "7 8 9" -> 1 (n=3, early); "9" -> 5 most recently (n=1). The 3-gram wins.
    context = [7, 8, 9, 1, 2, 9, 5, 6, 7, 8, 9]
    assert _propose(NgramDrafter(3, 1), context, 2) == [1, 2]
    assert _propose(NgramDrafter(1, 1), context, 2) == [5, 6]


def test_most_recent_occurrence_wins() -> None:
    context = [4, 5, 10, 4, 5, 11, 12, 4, 5]
    assert _propose(NgramDrafter(2, 2), context, 3) == [11, 12, 4]


def test_no_match_gives_an_empty_draft() -> None:
    assert _propose(NgramDrafter(3, 1), [1, 2, 3, 4], 4) == []
    assert _propose(NgramDrafter(3, 2), [1, 2, 3, 1], 4) == []  # only a 1-gram repeats
    assert _propose(NgramDrafter(3, 1), [9], 4) == []


def test_k_caps_the_proposal_and_repeats_continue_periodically() -> None:
    context = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
    assert _propose(NgramDrafter(3, 1), context, 2) == [1, 5]
    assert _propose(NgramDrafter(3, 1), context, 20) == [1, 5, 9, 2, 6, 3, 1, 4] * 2 + [1, 5, 9, 2]
    assert _propose(NgramDrafter(3, 1), [6, 7, 6, 7], 5) == [6, 7, 6, 7, 6]


def test_matches_the_brute_force_reference_on_random_contexts() -> None:
    rng = random.Random(0)
    for _ in range(300):
        max_n = rng.randint(1, 4)
        min_n = rng.randint(1, max_n)
        context = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        k = rng.randint(1, 8)
        expected = reference_proposal(context, k, max_n, min_n)
        assert _propose(NgramDrafter(max_n, min_n), context, k) == expected


def test_incremental_index_agrees_with_a_rebuild() -> None:
    rng = random.Random(1)
    drafter = NgramDrafter(3, 1)
    context: list[int] = []
    for step in range(200):
        if step % 37 == 36:  # a context that does not extend the previous one: rebuilt
            context = [*context[: rng.randint(1, len(context))], rng.randrange(5)]
        else:
            context += [rng.randrange(5) for _ in range(rng.randint(0, 4))]
        if not context:
            continue
        got = _propose(drafter, context, 4)
        fresh = NgramDrafter(3, 1)
        assert got == _propose(fresh, context, 4)
        assert drafter.index.follower == fresh.index.follower
        assert drafter.index.tokens == context


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(SpecDecodeError, match="min_n <= max_n"):
        NgramDrafter(max_n=2, min_n=3)
    with pytest.raises(SpecDecodeError, match="min_n <= max_n"):
        drafter_factory(DrafterOptions("ngram", ngram_max=3, ngram_min=0), LookupTarget())


# ---------------------------------------------------------------------------------------------
# Greedy identity on SmolLM2
# ---------------------------------------------------------------------------------------------


def generate(
    m: LoadedModel, prompt: list[int], max_tokens: int, drafter: Drafter | None, k: int
) -> Generation:
    gen = Generation(m.model, m.tokenizer, prompt, SamplingParams(max_tokens=max_tokens),
                     drafter, k, m.tokenizer.eos_ids)
    for _ in gen.run():
        pass
    return gen


def chat_ids(m: LoadedModel, text: str) -> list[int]:
    return m.tokenizer.encode(m.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def code_plain(smollm: LoadedModel) -> tuple[list[int], list[int]]:
    prompt = chat_ids(smollm, CODE_PROMPT)
    return prompt, generate(smollm, prompt, 40, None, 0).output


def test_greedy_output_is_plain_decodings_for_every_k(
    smollm: LoadedModel, code_plain: tuple[list[int], list[int]]
) -> None:
    prompt, plain = code_plain
    factory = drafter_factory("ngram", smollm.model)
    assert factory is not None
    for k in range(1, 9):
        max_tokens = 40 if k == 4 else 16
        gen = generate(smollm, prompt, max_tokens, factory(), k)
        assert_identical([gen], [plain[:max_tokens]], f"k={k} (the code is copied)")


# ---------------------------------------------------------------------------------------------
# Sampled mode: the distribution audit (shared with test_drafters_layerskip.py)
# ---------------------------------------------------------------------------------------------


def tiny_model(folder: Path) -> torch.nn.Module:
    """A random 3-block checkpoint (vocabulary V) whose logits are scaled by SHARPEN."""
    ckpt = make_checkpoint(folder)
    model = load_native(ckpt, config_from_hf(read_hf_config(ckpt)))
    with torch.no_grad():
        model.norm.mul_(SHARPEN)  # the final norm's gain scales every logit
    return model


def exact_two_tokens(
    model: torch.nn.Module, prompt: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of the first token (V,) and of the first two tokens (V * V,) at
    temperature 1 with no filters (p is the softmax of the logits), from V + 1 sequences."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), model.new_cache(1, len(prompt)))[0, -1]  # (V,)
        batch = torch.tensor([[*prompt, x] for x in range(V)])  # (V, L + 1)
        second = model(batch, model.new_cache(V, len(prompt) + 1), logits_for="last")[:, 0]
    first = torch.softmax(logits.double(), dim=-1)  # (V,)
    joint = first[:, None] * torch.softmax(second.double(), dim=-1)  # (V, V)
    return first, joint.reshape(-1)


def audit(
    model: torch.nn.Module, prompt: list[int], make: Callable[[], Drafter], k: int, seed: int
) -> tuple[float, float, int, int]:
    """Decode two tokens N_AUDIT times with seeded generators: (first-token p-value, pair p-value,
    drafted, accepted) over all runs."""
    counts = torch.zeros(V * V)
    drafted = accepted = 0
    for i in range(N_AUDIT):
        params = SamplingParams(temperature=1.0, max_tokens=3, seed=seed + i, rule="residual")
        gen = Generation(model, None, prompt, params, make(), k)
        while len(gen.output) < 2:
            gen.step()
        counts[gen.output[0] * V + gen.output[1]] += 1
        drafted += gen.counters.drafted
        accepted += gen.counters.accepted
    first, joint = exact_two_tokens(model, prompt)
    first_p = chi_square_gof(counts.view(V, V).sum(dim=1), first).p_value
    return first_p, chi_square_gof(counts, joint).p_value, drafted, accepted


class LyingNgram(NgramDrafter):
    """BROKEN: reports a uniform q for its deterministic tokens (verify then over-accepts)."""

    def propose(self, request: DraftRequest) -> Draft:
        draft = super().propose(request)
        return Draft(draft.tokens, torch.full((len(draft.tokens), V), 1.0 / V))


@pytest.fixture(scope="module")
def tiny_and_prompt(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, list[int]]:
    """The tiny model and a prompt 'a b c a b' whose lookup proposes c, a; c is the most likely
    continuation, so drafts are both accepted and rejected."""
    model = tiny_model(tmp_path_factory.mktemp("tiny"))
    a, b = 10, 20
    candidates = [c for c in range(2, V) if c not in (a, b)]
    batch = torch.tensor([[a, b, c, a, b] for c in candidates])  # (C, 5)
    with torch.inference_mode():
        last = model(batch, model.new_cache(len(candidates), 5), logits_for="last")[:, 0]
    probs = torch.softmax(last, dim=-1)[torch.arange(len(candidates)), candidates]  # (C,)
    c = candidates[int(probs.argmax())]
    return model, [a, b, c, a, b]


def test_audit_sample_size_is_moderate() -> None:
    assert 500 < N_AUDIT < 1500


@pytest.mark.statistical
def test_sampled_output_is_distributed_as_the_target(
    tiny_and_prompt: tuple[torch.nn.Module, list[int]],
) -> None:
    model, prompt = tiny_and_prompt
    factory = drafter_factory("ngram", model)
    assert factory is not None
    first_p, pair_p, drafted, accepted = audit(model, prompt, factory, 2, seed=10_000)
    assert first_p > FALSE_ALARM and pair_p > FALSE_ALARM
    assert 0 < accepted < drafted  # both the accepted and the rejected paths were exercised


@pytest.mark.statistical
def test_audit_catches_an_ngram_drafter_that_reports_a_q(
    tiny_and_prompt: tuple[torch.nn.Module, list[int]],
) -> None:
    model, prompt = tiny_and_prompt
    first_p, pair_p, _, _ = audit(model, prompt, lambda: LyingNgram(3, 1), 2, seed=20_000)
    assert first_p < FALSE_ALARM and pair_p < FALSE_ALARM


# ---------------------------------------------------------------------------------------------
# Confidence: match length -> acceptance rate, and the engine verifying only what pays
# ---------------------------------------------------------------------------------------------


def test_match_stats_count_up_to_the_first_miss_and_not_past_the_committed_text() -> None:
    stats = MatchStats(prior_weight=0.0)
    stats.record(2, [7, 8, 9], [7, 8, 5, 1])  # tokens at match lengths 2, 3 accepted, 4 missed
    stats.record(2, [7, 8], [7])  # the second token was never verified: not counted
    assert (stats.proposed[2], stats.accepted[2]) == (2, 2)
    assert (stats.proposed[3], stats.accepted[3]) == (1, 1)
    assert (stats.proposed[4], stats.accepted[4]) == (1, 0)
    assert stats.rate(4) == 0.0 and stats.rate(2) == 1.0
    with_prior = MatchStats(prior_weight=4.0)
    assert with_prior.rate(1) == pytest.approx(GREEDY_PRIOR[1])
    assert with_prior.rate(20) == with_prior.rate(8)


def test_confidence_follows_what_the_target_commits() -> None:
    """A drafter whose 3-gram matches are always wrong lowers their confidence; the scores come
    from comparing each proposal with the tokens committed after it."""
    drafter = NgramDrafter(3, 1)
    params = SamplingParams(max_tokens=8)
    context = [1, 2, 3, 4, 1, 2, 3]  # "1 2 3" matches: proposes 4 ...
    first = drafter.propose(DraftRequest(torch.tensor(context), 4, params, len(context)))
    assert first.confidence is not None and first.tokens.tolist()[0] == 4
    start = first.confidence[0]
    for wrong in range(50, 60):  # the target commits something else after every "1 2 3"
        context += [wrong, 1, 2, 3]
        draft = drafter.propose(DraftRequest(torch.tensor(context), 4, params, len(context)))
        assert draft.confidence is not None
    assert draft.confidence[0] < start / 2
    assert draft.confidence[0] == pytest.approx(drafter.stats.for_params(params).rate(3))


def test_sampled_traffic_starts_lower_and_learns_apart_from_greedy_traffic() -> None:
    """Rates are kept per sampling regime: a proposal at temperature 1.0 starts from a lower
    confidence than a greedy one, and what sampled traffic teaches (its copies rejected) leaves
    greedy confidences where they were. One shared table would carry either over to the other."""
    stats = RegimeStats()
    greedy, hot = SamplingParams(max_tokens=8), SamplingParams(temperature=1.0, max_tokens=8)
    context = [1, 2, 3, 4, 1, 2, 3]

    def first_confidence(params: SamplingParams, drafter: NgramDrafter) -> float:
        draft = drafter.propose(DraftRequest(torch.tensor(context), 4, params, len(context)))
        assert draft.confidence is not None
        return draft.confidence[0]

    greedy_start = first_confidence(greedy, NgramDrafter(3, 1, stats=stats))
    hot_drafter = NgramDrafter(3, 1, stats=stats)
    hot_start = first_confidence(hot, hot_drafter)
    assert hot_start < 0.7 * greedy_start
    for wrong in range(50, 60):  # sampled text never follows "1 2 3" with 4
        context += [wrong, 1, 2, 3]
        hot_now = first_confidence(hot, hot_drafter)
    assert hot_now < hot_start / 2
    context = [1, 2, 3, 4, 1, 2, 3]
    assert first_confidence(greedy, NgramDrafter(3, 1, stats=stats)) == greedy_start
    assert stats.for_params(SamplingParams(temperature=1.04, max_tokens=8)) is \
        stats.for_params(hot)  # one regime per 0.1 of temperature


def best_draft_length(confidence: list[float], width_cost: Callable[[int], float],
                      margin: float | None = None) -> int:
    """One request's verified draft length: control.best_width for a batch of one, minus 1."""
    kwargs = {} if margin is None else {"margin": margin}
    return best_width([confidence], width_cost, **kwargs) - 1


def test_best_draft_length_weighs_expected_tokens_against_verification_cost() -> None:
    def linear(width: int) -> float:
        return 1.0 + 0.2 * (width - 1)

    # E(k) / cost: k=0 1.0, k=1 1.9/1.2, k=2 2.71/1.4 = 1.94 (best), k=3 2.791/1.6
    assert best_draft_length([0.9, 0.9, 0.1], linear) == 2
    assert best_draft_length([0.05, 0.9], linear) == 0  # the first token would not pay
    assert best_draft_length([0.9] * 6, lambda width: 1.0) == 6  # free verification: all
    assert best_draft_length([], linear) == 0
    # a gain below the margin (1.25 / 1.2 = 1.04x) is not worth the risk; without it, it is
    assert best_draft_length([0.25], linear) == 0
    assert best_draft_length([0.25], linear, margin=0.0) == 1


def test_the_engine_verifies_only_the_drafts_that_pay(
    smollm: LoadedModel, code_plain: tuple[list[int], list[int]]
) -> None:
    """Under the controller (--k auto), with verification made dear in its cost model, confident
    n-gram drafts are cut to none (output unchanged); with it cheap they are verified. A fixed k
    verifies every proposed token whatever the cost."""
    prompt, plain = code_plain
    dear = {(1, 1): 1.0, **{(1, w): 100.0 for w in range(2, 10)}}
    cheap = {(1, w): 1.0 for w in range(1, 10)}
    runs = {}
    for name, table in (("dear", dear), ("cheap", cheap)):
        costs = CostModel(target_s=dict(table), draft_token_s=0.0)
        costs.observe_target = lambda *a: None  # type: ignore[method-assign]  # keep the table
        gen = Generation(smollm.model, smollm.tokenizer, prompt, SamplingParams(max_tokens=16),
                         NgramDrafter(), 8, smollm.tokenizer.eos_ids)
        run_batch(BatchEngine(smollm.model, 1, gen.capacity,
                              controller=Controller(kmax=8, costs=costs)), [gen])
        assert gen.output == plain[:16]
        runs[name] = gen.counters.drafted
    assert runs["dear"] == 0 and runs["cheap"] > 0
    fixed = generate(smollm, prompt, 16, NgramDrafter(), 8)
    assert fixed.output == plain[:16] and fixed.counters.drafted > 0
