"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
context's last n tokens, in the prompt or in the text generated so far. No model, no q.

The drafter keeps an index from every n-gram (min_n <= n <= max_n) of the context to the position
of the token that followed its most recent occurrence. The index is updated only with the tokens
added since the previous call (the engine passes the full committed context every step, and it
only grows); a context that does not extend the previous one is indexed from scratch.

Matching tries n = max_n down to min_n and takes the first (longest) n-gram found. The proposal is
the up to k tokens that followed it; when the match is so recent that they run past the end of
the context (a repeating pattern, e.g. "a b a b"), the pattern is continued by copying with the
same period. The draft is deterministic (q=None): the verifier treats it as one-hot on each
proposed token, which is lossless whatever the proposal.
"""

from __future__ import annotations

import torch

from specdecode.drafters.base import EMPTY, Draft
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams


class NgramIndex:
    """n-gram (as a tuple) -> position of the token after its most recent occurrence."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.follower: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; each becomes the follower of the n-grams that end just before it."""
        for tok in tokens:
            pos = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, pos) + 1):
                self.follower[tuple(self.tokens[pos - n : pos])] = pos
            self.tokens.append(tok)

    def lookup(self) -> int | None:
        """Follower position of the longest suffix n-gram seen earlier (most recent), or None."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            pos = self.follower.get(tuple(self.tokens[end - n :]))
            if pos is not None:
                return pos
        return None

    def continuation(self, start: int, k: int) -> list[int]:
        """k tokens from `start`, continuing past the end by repeating with period end - start."""
        end = len(self.tokens)
        out: list[int] = []
        for i in range(k):
            pos = start + i
            out.append(self.tokens[pos] if pos < end else out[pos - end])
        return out


class NgramDrafter:
    """Prompt-lookup drafter (one per request): longest suffix match first, most recent match."""

    def __init__(self, max_n: int = 3, min_n: int = 1, name: str = "ngram") -> None:
        if not 1 <= min_n <= max_n:
            raise SpecDecodeError(
                f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"
            )
        self.name = name
        self.max_n, self.min_n = max_n, min_n
        self.index = NgramIndex(max_n, min_n)

    def reset(self) -> None:
        self.index = NgramIndex(self.max_n, self.min_n)

    def _sync(self, context: list[int]) -> None:
        """Index the tokens new since the last call; rebuild if `context` is not an extension."""
        seen = self.index.tokens
        if len(context) < len(seen) or context[: len(seen)] != seen:
            self.reset()
        self.index.extend(context[len(self.index.tokens) :])

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        params: SamplingParams,
        prompt_len: int,
        generator: torch.Generator | None,
    ) -> Draft:
        """Up to k tokens copied from after the best earlier match; empty when nothing matches."""
        self._sync(context.tolist())
        start = self.index.lookup() if k > 0 else None
        if start is None:
            return Draft(EMPTY, None)
        return Draft(torch.tensor(self.index.continuation(start, k), dtype=torch.long), None)
