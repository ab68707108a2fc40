"""Stop strings over streamed text (OpenAI convention: the stop string itself is not emitted).

Decoded text arrives in increments (one or a few tokens at a time). `StopChecker.feed` returns the
text that is safe to show now: it holds back any suffix that could still grow into a stop string,
and when a stop string completes it returns the text before it and reports the stop.

Which stop wins: the occurrence that ENDS first in the text, and among those ending at the same
character the one that starts first (the longest). That is the occurrence generation would stop
at if text arrived one character at a time, so the result does not depend on how the text was cut
into increments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopUpdate:
    text: str  # text safe to emit now (may be empty)
    stopped: bool  # a stop string occurred; `text` ends right before it
    stop: str | None = None  # the stop string that occurred, when stopped


class StopChecker:
    """Incremental stop-string matcher for one generation. Feed increments; call flush() at the
    end (EOS or max_tokens) to get the held-back text. After a stop, feed returns empty updates."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops: tuple[str, ...] = tuple(stop)
        self._held = ""  # text received but not yet emitted
        self._stop: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stop is not None

    def feed(self, text: str) -> StopUpdate:
        """Add an increment; return what may be emitted now and whether a stop string occurred."""
        if self._stop is not None:
            return StopUpdate("", True, self._stop)
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self._stop = stop
            return StopUpdate(buffer[:start], True, stop)
        hold = self._partial_suffix_len(buffer)
        self._held = buffer[len(buffer) - hold :]
        return StopUpdate(buffer[: len(buffer) - hold], False)

    def flush(self) -> str:
        """The text still held back (it never completed a stop string); empty after a stop."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop) of the occurrence ending first (longest on ties), or None."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
