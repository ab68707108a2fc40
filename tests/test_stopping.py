"""Stop strings over streamed text: hold-back, truncation, flush, and chunking invariance."""

from __future__ import annotations

import random

import pytest

from specdecode.stopping import StopChecker, StopUpdate


def _stream(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    """Feed pieces until a stop; return (everything emitted, the stop string or None)."""
    checker = StopChecker(stops)
    emitted = []
    for piece in pieces:
        update = checker.feed(piece)
        emitted.append(update.text)
        if update.stopped:
            return "".join(emitted), update.stop
    emitted.append(checker.flush())
    return "".join(emitted), None


def test_no_stop_strings_passes_text_through() -> None:
    checker = StopChecker([])
    assert checker.feed("hello") == StopUpdate("hello", False)
    assert checker.flush() == ""


def test_stop_inside_one_increment_truncates_before_it() -> None:
    checker = StopChecker(["END"])
    assert checker.feed("abc END def") == StopUpdate("abc ", True, "END")
    assert checker.stopped
    assert checker.feed("more") == StopUpdate("", True, "END")
    assert checker.flush() == ""


def test_possible_prefix_is_held_back_then_released() -> None:
    checker = StopChecker(["</s>"])
    assert checker.feed("hi <").text == "hi "
    assert checker.feed("/").text == ""
    assert checker.feed("x> ok") == StopUpdate("</x> ok", False)
    assert checker.feed("<") == StopUpdate("", False)
    assert checker.flush() == "<"


def test_stop_split_across_increments() -> None:
    checker = StopChecker(["</s>"])
    assert checker.feed("answer</") == StopUpdate("answer", False)
    assert checker.feed("s> trailing") == StopUpdate("", True, "</s>")


def test_earliest_ending_stop_wins_longest_on_ties() -> None:
    assert _stream(["abcd", "bc"], ["xabcd"]) == ("xa", "bc")
    assert _stream(["bc", "abc"], ["xabc"]) == ("x", "abc")


def test_hold_back_uses_longest_partial_match_over_all_stops() -> None:
    checker = StopChecker(["ab", "xaaab"])
    assert checker.feed("zxaa").text == "z"  # "xaa" could still become "xaaab"
    assert checker.feed("ac") == StopUpdate("xaaac", False)


def test_flush_returns_held_text_at_end_of_generation() -> None:
    assert _stream(["STOP"], ["the end ST"]) == ("the end ST", None)


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])


@pytest.mark.parametrize("seed", range(20))
def test_result_does_not_depend_on_chunking(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab<>/ "
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(3)]
    whole = _stream(stops, [text])
    chars = _stream(stops, list(text))
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert whole == chars == _stream(stops, pieces)
    emitted, stop = whole
    if stop is None:
        assert emitted == text
    else:
        assert text.startswith(emitted + stop)
        assert all(s not in (emitted + stop)[:-1] for s in stops)  # no earlier completion
