"""The sampling pipeline on hand-built logits: each processor, their order, and row histories."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specdecode.sampling import (
    SamplingParams,
    greedy_tokens,
    probs_from_logits,
    process_logits,
    sample,
)

EMPTY = torch.zeros(0, dtype=torch.int64)
INF = math.inf


def _row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values])  # (1, V)


def _process(
    logits: torch.Tensor,
    params: SamplingParams,
    context: torch.Tensor = EMPTY,
    prompt_len: int = 0,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    if extra is None:
        extra = torch.zeros(logits.shape[0], dtype=torch.int64)
    return process_logits(logits, params, context, prompt_len, extra)


def _kept(x: torch.Tensor) -> list[int]:
    """Indices of the unmasked entries of a (1, V) row."""
    return torch.nonzero(torch.isfinite(x[0])).flatten().tolist()


def _log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()  # (1, V): softmax gives back probs


def test_all_off_is_temperature_only_and_input_untouched() -> None:
    logits = torch.randn(3, 10, dtype=torch.float64)
    before = logits.clone()
    out = _process(logits, SamplingParams(temperature=0.5))
    assert out.dtype == torch.float32
    assert torch.allclose(out, (before / 0.5).float())
    assert torch.equal(logits, before)
    half = _process(logits.half(), SamplingParams(temperature=1.0))
    assert half.dtype == torch.float32


def test_temperature_scales_the_softmax() -> None:
    logits = _row([1.0, 2.0, 3.0])
    probs = probs_from_logits(logits, SamplingParams(temperature=2.0), EMPTY, 0, EMPTY)
    assert torch.allclose(probs, torch.softmax(logits / 2.0, dim=-1))


def test_top_k_keeps_k_largest_and_ties_at_the_edge() -> None:
    logits = _row([1.0, 5.0, 3.0, 2.0, 4.0, 0.0])
    assert _kept(_process(logits, SamplingParams(temperature=1.0, top_k=2))) == [1, 4]
    ties = _row([4.0, 3.0, 3.0, 1.0])
    assert _kept(_process(ties, SamplingParams(temperature=1.0, top_k=2))) == [0, 1, 2]
    assert _kept(_process(ties, SamplingParams(temperature=1.0, top_k=10))) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.1, [0]), (0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3])],
)
def test_top_p_keeps_smallest_nucleus_and_always_the_top(top_p: float, expected: list[int]) -> None:
    logits = _log_probs([0.5, 0.3, 0.15, 0.05])
    assert _kept(_process(logits, SamplingParams(temperature=1.0, top_p=top_p))) == expected


def test_top_p_keeps_ties_with_the_last_kept_token() -> None:
    logits = _log_probs([0.4, 0.2, 0.2, 0.2])
    assert _kept(_process(logits, SamplingParams(temperature=1.0, top_p=0.5))) == [0, 1, 2, 3]


def _reference_top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Plain full-sort nucleus mask for one row, (V,) bool: True = kept."""
    probs = torch.softmax(x.double(), dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():
        keep[i] = True
        mass += float(probs[i])
        if mass >= top_p:
            break
    return keep


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])
def test_top_p_matches_full_sort_reference_on_large_vocab(scale: float) -> None:
    """Flat rows need far more than the first 64 candidates: the widening search must agree."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 3000, generator=gen) * scale  # (3, 3000)
    out = _process(logits, SamplingParams(temperature=1.0, top_p=0.9))
    for row in range(3):
        assert torch.equal(torch.isfinite(out[row]), _reference_top_p(logits[row], 0.9))


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = _log_probs([0.5, 0.3, 0.15, 0.05])
    assert _kept(_process(logits, SamplingParams(temperature=1.0, min_p=0.2))) == [0, 1, 2]
    assert _kept(_process(logits, SamplingParams(temperature=1.0, min_p=0.7))) == [0]


def test_min_p_applies_after_temperature() -> None:
    logits = _log_probs([0.5, 0.3, 0.15, 0.05])  # ratio 0.3 / 0.5 = 0.6; at T=0.5: 0.36
    assert _kept(_process(logits, SamplingParams(temperature=1.0, min_p=0.5))) == [0, 1]
    assert _kept(_process(logits, SamplingParams(temperature=0.5, min_p=0.5))) == [0]


def test_top_p_applies_to_the_top_k_filtered_distribution() -> None:
    logits = _log_probs([0.4, 0.3, 0.2, 0.1])
    # after top-k=2 the top token has 0.4 / 0.7 >= 0.5; on the unfiltered one it would need two
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    assert _kept(_process(logits, params)) == [0]
    assert _kept(_process(logits, SamplingParams(temperature=1.0, top_p=0.5))) == [0, 1]


def test_repetition_penalty_hf_convention_includes_prompt() -> None:
    logits = _row([2.0, -2.0, 1.0, 0.5])
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    out = _process(logits, params, context=torch.tensor([0, 1]), prompt_len=2)
    assert torch.allclose(out, _row([1.0, -4.0, 1.0, 0.5]))


def test_presence_frequency_count_output_tokens_only() -> None:
    logits = _row([0.0, 0.0, 0.0, 0.0])
    context = torch.tensor([0, 1, 1, 2])  # prompt [0], output [1, 1, 2]
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = _process(logits, params, context=context, prompt_len=1)
    assert torch.allclose(out, _row([0.0, -(0.5 + 2 * 0.25), -(0.5 + 0.25), 0.0]))


def test_logit_bias_adds_and_comes_before_repetition_penalty() -> None:
    logits = _row([1.0, 1.0, 1.0])
    params = SamplingParams(temperature=1.0, logit_bias=((0, 2.0), (2, -3.0), (2, 1.0)))
    assert torch.allclose(_process(logits, params), _row([3.0, 1.0, -1.0]))
    penalised = SamplingParams(temperature=1.0, logit_bias=((0, 2.0),), repetition_penalty=3.0)
    out = _process(logits, penalised, context=torch.tensor([0]), prompt_len=1)
    assert torch.allclose(out, _row([1.0, 1.0, 1.0]))  # (1 + 2) / 3


def test_row_t_sees_context_plus_extra_prefix() -> None:
    logits = torch.zeros(3, 6)  # (T, V)
    extra = torch.tensor([3, 3, 5])  # n = 3 >= T - 1
    params = SamplingParams(temperature=1.0, frequency_penalty=1.0)
    out = _process(logits, params, context=torch.tensor([1, 3]), prompt_len=1, extra=extra)
    assert out[:, 3].tolist() == [-1.0, -2.0, -3.0]
    assert out[:, 5].tolist() == [0.0, 0.0, 0.0]  # extra[2] is in no row's history
    assert out[:, 1].tolist() == [0.0, 0.0, 0.0]  # prompt token: not an output token


def _reference_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    context: list[int],
    prompt_len: int,
    extra: list[int],
) -> torch.Tensor:
    """Row by row, token by token: the definition, without vectorisation."""
    out = logits.clone().float()
    for t in range(logits.shape[0]):
        history = context + extra[:t]
        for token, bias in params.logit_bias:
            out[t, token] += bias
        for token in set(history):
            value = float(out[t, token])
            r = params.repetition_penalty
            out[t, token] = value / r if value > 0 else value * r
        for token, count in Counter(history[prompt_len:]).items():
            out[t, token] -= params.presence_penalty + params.frequency_penalty * count
    return out


def test_penalties_match_reference_on_random_histories() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 50, 5
    logits = torch.randn(rows, vocab, generator=gen) * 3  # (T, V)
    context = torch.randint(0, vocab, (30,), generator=gen).tolist()
    extra = torch.randint(0, vocab, (rows - 1,), generator=gen).tolist()
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        logit_bias=((3, 1.5), (7, -2.0)),
    )
    out = process_logits(logits, params, torch.tensor(context), 12, torch.tensor(extra))
    expected = _reference_penalties(logits, params, context, 12, extra)
    assert torch.allclose(out, expected, atol=1e-6)


def test_greedy_is_one_hot_at_processed_argmax_lowest_index_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, 1.0, 0.0, 1.5]])
    params = SamplingParams(temperature=0.0, top_k=1, logit_bias=((3, 0.0),))
    probs = probs_from_logits(logits, params, EMPTY, 0, torch.tensor([1]))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    biased = SamplingParams(temperature=0.0, logit_bias=((0, 5.0),))
    assert greedy_tokens(logits, biased, EMPTY, 0, torch.tensor([1])).tolist() == [0, 0]
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    context = torch.tensor([2])  # row 1 also has the draft token 3 in its history
    assert greedy_tokens(logits, penalised, context, 1, torch.tensor([3])).tolist() == [1, 1]


def test_greedy_tokens_ignores_filters_and_matches_probs() -> None:
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, top_k=3, top_p=0.5, min_p=0.1)
    extra = torch.zeros(3, dtype=torch.int64)
    greedy = probs_from_logits(logits, SamplingParams(), EMPTY, 0, extra).argmax(dim=-1)
    assert torch.equal(greedy_tokens(logits, params, EMPTY, 0, extra), greedy)
    assert torch.equal(greedy, logits.argmax(dim=-1))


def test_inf_masked_logits_survive_every_processor() -> None:
    logits = _row([-INF, 1.0, 2.0, -1.0])
    params = SamplingParams(
        temperature=0.7,
        top_k=3,
        top_p=0.95,
        min_p=0.01,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    probs = probs_from_logits(logits, params, torch.tensor([0, 1]), 0, EMPTY)
    assert float(probs[0, 0]) == 0.0
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-6


def test_shape_and_token_id_errors() -> None:
    logits = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="extra"):
        process_logits(logits, SamplingParams(), EMPTY, 0, torch.tensor([1]))
    with pytest.raises(ValueError, match="prompt_len"):
        process_logits(logits, SamplingParams(), EMPTY, 1, torch.tensor([1, 2]))
    bad = SamplingParams(repetition_penalty=1.5)
    with pytest.raises(ValueError, match="token ids"):
        process_logits(logits, bad, torch.tensor([7]), 0, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="token ids"):
        process_logits(logits, bad, torch.tensor([-1]), 0, torch.tensor([1, 2]))


def test_sample_shapes_one_hot_and_seed() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert sample(probs, None).tolist() == [1, 2]
    scalar = sample(probs[0], None)
    assert scalar.dim() == 0 and int(scalar) == 1
    dense = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    draws = [sample(dense, torch.Generator().manual_seed(5)).tolist() for _ in range(2)]
    assert draws[0] == draws[1]


def test_sample_never_draws_zero_probability_tokens() -> None:
    probs = torch.zeros(2000, 8)  # (T, V)
    probs[:, 2] = 0.3
    probs[:, 5] = 0.7
    tokens = sample(probs, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {2, 5}
