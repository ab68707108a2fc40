"""Greedy speculative decoding is token-identical to plain decoding on SmolLM2."""

from __future__ import annotations

import pytest

from specdecode.drafters.registry import drafter_factory
from specdecode.engine import Generation
from specdecode.models.loading import LoadedModel
from specdecode.sampling import SamplingParams
from tests.drafters_scripted import ScriptedDrafter

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
TOKENS = 32


def _run(m: LoadedModel, prompt_ids: list[int], drafter: object, k: int) -> Generation:
    return _run_tokens(m, prompt_ids, drafter, k, TOKENS)


def _run_tokens(m: LoadedModel, prompt_ids: list[int], drafter: object, k: int,
                tokens: int) -> Generation:
    gen = Generation(m.model, m.tokenizer, prompt_ids, SamplingParams(max_tokens=tokens),
                     drafter, k, m.tokenizer.eos_ids)  # type: ignore[arg-type]
    for _ in gen.run():
        pass
    return gen


@pytest.fixture(scope="module")
def plain(smollm: LoadedModel) -> tuple[list[int], list[int]]:
    ids = smollm.tokenizer.encode(smollm.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}]))
    return ids, _run(smollm, ids, None, 0).output


@pytest.mark.parametrize("mode", ["perfect", "wrong", "partial"])
@pytest.mark.parametrize("k", range(1, 9))
def test_scripted_drafters_are_token_identical(
    smollm: LoadedModel, plain: tuple[list[int], list[int]], mode: str, k: int
) -> None:
    ids, expected = plain
    right_for = (k + 1) // 2
    drafter = ScriptedDrafter(expected, len(ids), mode, right_for=right_for)
    gen = _run(smollm, ids, drafter, k)
    assert gen.output == expected
    c = gen.counters
    if mode == "perfect":
        assert c.steps <= -(-TOKENS // (k + 1)) + 1 and c.accepted >= TOKENS - c.steps
    elif mode == "wrong":
        assert c.accepted == 0 and c.steps == len(expected)
    else:
        assert c.accepted > 0 and c.accepted_per_pos[right_for:] == [0] * (k - right_for)


@pytest.mark.parametrize("k", range(1, 9))
def test_int8_drafter_is_token_identical(
    smollm: LoadedModel, plain: tuple[list[int], list[int]], k: int
) -> None:
    ids, expected = plain
    factory = drafter_factory("int8", smollm.model)
    assert factory is not None
    gen = _run(smollm, ids, factory(), k)
    assert gen.output == expected
    assert gen.counters.accepted > 0


@pytest.mark.parametrize("k", [1, 3, 8])
def test_w4a16_drafter_is_token_identical_and_accepts_at_least_as_much_as_int8(
    smollm: LoadedModel, plain: tuple[list[int], list[int]], k: int
) -> None:
    """The 4-bit copy follows the target closer than the int8 one (top-1 0.96 against 0.76
    teacher-forced): at least as many of its tokens are accepted (here 90% or more), and the
    output is the target's."""
    ids, expected = plain
    accepted = {}
    for name in ("w4a16", "int8"):
        factory = drafter_factory(name, smollm.model)
        assert factory is not None
        gen = _run(smollm, ids, factory(), k)
        assert gen.output == expected
        accepted[name] = gen.counters.accepted / max(1, gen.counters.drafted)
    assert accepted["w4a16"] >= max(accepted["int8"], 0.9), accepted


def test_wrong_drafter_is_caught_by_the_identity_check(
    smollm: LoadedModel, plain: tuple[list[int], list[int]]
) -> None:
    """The identity test can fail: accepting every draft token (no verification) changes text."""
    ids, expected = plain
    gen = _run(smollm, ids, ScriptedDrafter(expected, len(ids), "wrong"), 4)
    import specdecode.engine as engine

    original = engine.verify_greedy
    try:
        engine.verify_greedy = lambda target, draft: original(draft.new_tensor(  # type: ignore
            [*draft.tolist(), int(target[-1])]), draft)
        broken = _run(smollm, ids, ScriptedDrafter(expected, len(ids), "wrong"), 4)
    finally:
        engine.verify_greedy = original
    assert gen.output == expected and broken.output != expected


def test_quantized_copy_holds_the_targets_kv_of_the_committed_context(
    smollm: LoadedModel, plain: tuple[list[int], list[int]]
) -> None:
    """The w4a16 copy takes the target's prompt keys and values after the target's prefill, and
    those of every committed token after each step: its first proposal feeds only the pending
    token, and so does a proposal after steps it sat out (nothing to catch up). The output is
    still the target's. A copy that does not borrow prefills the prompt itself, and catches up
    with the tokens committed while it was not asked."""
    import torch

    from specdecode.drafters.draft_model import DraftModelDrafter

    ids, expected = plain
    factory = drafter_factory("w4a16", smollm.model)
    assert factory is not None
    borrowing = factory()
    assert isinstance(borrowing, DraftModelDrafter) and borrowing.borrow_kv
    own = DraftModelDrafter(borrowing.model, "w4a16", borrow_kv=False)
    for drafter, borrowed in ((borrowing, True), (own, False)):
        gen = Generation(smollm.model, smollm.tokenizer, ids, SamplingParams(max_tokens=TOKENS),
                         drafter, 3, smollm.tokenizer.eos_ids)
        gen.prefill()
        n = len(ids) - 1
        assert (drafter.fed == ids[:n]) is borrowed
        if borrowed:
            assert torch.equal(drafter.cache.k[:, 0, :, :n], gen.cache.k[:, 0, :, :n])
        gen.step()
        assert (drafter.catch_up_ns == 0) is borrowed
        gen.next_k = 0  # three steps without drafting: the drafter is not asked
        for _ in range(3):
            gen.step()
        n = gen.cache.lengths[0]
        if borrowed:
            assert drafter.fed == gen.context[:n]
            assert torch.equal(drafter.cache.v[:, 0, :, :n], gen.cache.v[:, 0, :, :n])
        gen.next_k = 3
        gen.step()
        assert (drafter.catch_up_ns == 0) is borrowed
        for _ in gen.run():
            pass
        assert gen.output == expected


def test_quantized_copy_takes_the_targets_kv_past_its_first_cache_size(
    smollm: LoadedModel, plain: tuple[list[int], list[int]]
) -> None:
    """The copy's cache grows (doubling from 128 positions) while it drafts, inside inference
    mode; the target's KV is still written into it after every step."""
    ids, _ = plain
    longer = _run_tokens(smollm, ids, None, 0, 96)
    factory = drafter_factory("w4a16", smollm.model)
    assert factory is not None
    drafter = factory()
    gen = _run_tokens(smollm, ids, drafter, 3, 96)
    assert len(ids) + 96 > 128 and drafter.cache.capacity > 128  # type: ignore[attr-defined]
    assert gen.output == longer.output


COPYING = ('Repeat the following text exactly, word for word: "Alice packed three red apples, '
           "two ripe pears and a loaf of bread into her basket, then walked along the river path "
           'to visit her grandmother, who lived in a small stone cottage beyond the mill."')


@pytest.mark.parametrize("k", [1, 3, 8])
def test_lookup_then_copy_hybrid_is_token_identical_and_uses_both(
    smollm: LoadedModel, k: int
) -> None:
    """ngram+w4a16 drafts some steps by lookup and the others with the 4-bit copy (on a prompt
    whose answer repeats it, both happen); the output is the target's."""
    from specdecode.drafters.hybrid import HybridDrafter

    ids = smollm.tokenizer.encode(smollm.tokenizer.apply_chat_template(
        [{"role": "user", "content": COPYING}]))
    expected = _run(smollm, ids, None, 0).output
    factory = drafter_factory("ngram+w4a16", smollm.model)
    assert factory is not None
    drafter = factory()
    assert isinstance(drafter, HybridDrafter)
    gen = _run(smollm, ids, drafter, k)
    assert gen.output == expected
    assert min(drafter.used) > 0, drafter.used
    assert gen.counters.accepted > 0
