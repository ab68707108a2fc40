"""Greedy speculative decoding is token-identical to plain decoding on SmolLM2."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from specdecode.drafters.registry import drafter_factory
from specdecode.engine import Generation, draft_rows
from specdecode.models.loading import LoadedModel
from specdecode.sampling import SamplingParams
from tests.conftest import record_feeds
from tests.fakes import ScriptedDrafter
from tests.identity import assert_identical

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
    # "wrong" drafts are all rejected by design: the rejection path, nothing to accept
    assert_identical([gen], [expected], f"{mode} k={k}", require_accepted=mode != "wrong")
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
    assert_identical([gen], [expected], f"int8 k={k}")


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
        accepted[name] = assert_identical([gen], [expected], f"{name} k={k}").rate
    assert accepted["w4a16"] >= max(accepted["int8"], 0.9), accepted


def test_wrong_drafter_is_caught_by_the_identity_check(
    smollm: LoadedModel, plain: tuple[list[int], list[int]]
) -> None:
    """The identity test can fail: accepting every draft token (no verification) changes text."""
    ids, expected = plain
    gen = _run(smollm, ids, ScriptedDrafter(expected, len(ids), "wrong"), 4)
    import specdecode.verification as verification

    original = verification.verify_greedy
    try:
        verification.verify_greedy = lambda target, draft: original(  # type: ignore
            draft.new_tensor([*draft.tolist(), int(target[-1])]), draft)
        broken = _run(smollm, ids, ScriptedDrafter(expected, len(ids), "wrong"), 4)
    finally:
        verification.verify_greedy = original
    assert gen.output == expected and broken.output != expected


def test_quantized_copy_drafts_in_the_targets_cache(
    smollm: LoadedModel, plain: tuple[list[int], list[int]]
) -> None:
    """The w4a16 copy drafts in the target's own KV cache: it holds no cache, its proposals feed
    only the pending token and its draft tokens (no prefill of the prompt, no catching up after
    steps it sat out), drafting leaves the target's cache length where it was, and the output is
    the target's. A copy drafting in a cache of its own prefills the prompt and catches up."""
    from specdecode.drafters.draft_model import DraftModelDrafter

    ids, expected = plain
    factory = drafter_factory("w4a16", smollm.model)
    assert factory is not None
    in_cache = factory()
    assert isinstance(in_cache, DraftModelDrafter) and in_cache.cache_model is in_cache.model
    own = DraftModelDrafter(copy.deepcopy(in_cache.model), "w4a16")
    for drafter, shared in ((in_cache, True), (own, False)):
        seen = record_feeds(drafter.model)
        gen = Generation(smollm.model, smollm.tokenizer, ids, SamplingParams(max_tokens=TOKENS),
                         drafter, 3, smollm.tokenizer.eos_ids)
        gen.prefill()
        length = gen.cache.lengths[0]
        draft = draft_rows([gen])[0]
        assert len(draft.tokens) == 3 and gen.cache.lengths[0] == length
        assert (seen == [(1, 1)] * 3) is shared  # own cache: the prompt first
        assert (drafter.cache is None) is shared
        gen.step()
        gen.next_k = 0  # three steps without drafting: the drafter is not asked
        for _ in range(3):
            gen.step()
        gen.next_k = 3
        seen.clear()
        gen.step()
        assert (seen == [(1, 1)] * 3) is shared  # own cache: catches up with 4+ tokens first
        assert (drafter.catch_up_ns == 0) is shared
        for _ in gen.run():
            pass
        assert gen.output == expected
        assert gen.counters.accepted > 0.8 * gen.counters.drafted


def test_drafting_in_the_targets_cache_must_leave_its_lengths_alone(
    smollm: LoadedModel, plain: tuple[list[int], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy's draft positions are written past the row's committed tokens on a view whose
    lengths are a copy. A variant whose view shares the cache's lengths leaves the target's
    cache advanced past the draft, and the output is no longer the target's."""
    import specdecode.engine as engine

    ids, expected = plain
    factory = drafter_factory("w4a16", smollm.model)
    assert factory is not None

    def shared_lengths(cache: Any, first: int, n: int) -> Any:
        view = copy.copy(cache)
        view.k, view.v = cache.k[:, first:first + n], cache.v[:, first:first + n]
        return view  # view.lengths is the cache's own list (one row here)

    monkeypatch.setattr(engine, "rows_view", shared_lengths)
    gen = _run_tokens(smollm, ids, factory(), 3, TOKENS)
    assert gen.output != expected


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
    assert_identical([gen], [expected], f"ngram+w4a16 k={k}")
    assert min(drafter.used) > 0, drafter.used
