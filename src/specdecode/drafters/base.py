"""The Drafter protocol and the Draft it returns.

A drafter is per request: it is made for one request (sharing any heavy weights with others),
told the committed context after every step, and asked for k proposed tokens. Drafters that
sample report the distributions q they sampled from, computed by `specdecode.sampling` with the
same parameters as the target's p; drafters without a distribution (n-gram lookup) return q=None
and are verified as if q were one-hot on their token.
"""

from __future__ import annotations

import array
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams, greedy_tokens, probs_from_logits, sample

EMPTY = torch.zeros(0, dtype=torch.long)  # no tokens (an empty draft, or no draft yet)


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # (k,) int64 proposed token ids
    q: torch.Tensor | None  # (k, V) float32 draft distributions, or None (deterministic draft)
    # Optional: per token, the drafter's estimate of the probability that it is accepted given
    # that the tokens before it were. Under the controller (--k auto) the engine then verifies
    # only the prefix expected to pay for its width (engine.fit_width); with a fixed k, or
    # without confidences, every proposed token is verified.
    confidence: tuple[float, ...] | None = None


class Drafter(Protocol):
    name: str

    def propose(
        self,
        context: torch.Tensor,  # (L,) int64: prompt + every committed token so far
        k: int,
        params: SamplingParams,
        prompt_len: int,
        generator: torch.Generator | None,
    ) -> Draft:
        """Propose up to k tokens following `context` (fewer, even zero, is allowed)."""
        ...

    def reset(self) -> None:
        """Forget the request: free caches, clear state."""
        ...


class FeatureObserver(Protocol):
    """Optional: a drafter that also reads the target's hidden states (EAGLE-style heads).

    The engine calls `observe(hidden, start)` with the target's hidden states after its final
    norm, (n, H), for context positions start..start+n-1: the prompt as it is prefilled, then
    after each step the positions kept (the pending token and the accepted draft tokens).
    """

    def observe(self, hidden: torch.Tensor, start: int) -> None: ...


def wants_hidden(drafter: object) -> bool:
    """True when `drafter` has an `observe` method: the engine then passes it target features."""
    return callable(getattr(drafter, "observe", None))


Rounds = Generator[int, torch.Tensor, Draft]  # a CacheDrafter's proposal (see below)


class CacheDrafter(Protocol):
    """Optional: a drafter whose model has the target's cache layout (a quantized copy of the
    target, or a subset of the target's blocks) and drafts in the target's own KV cache. That
    cache holds the keys and values of every committed token but the pending one; the draft
    model feeds the pending token and its own draft tokens at the slots after them, attending
    over the target's KV of the context (so it holds no cache, prefills nothing and never
    catches up), while the row's length stays where it was (the rounds run on a copy of the
    lengths): the target's verification then overwrites those slots with its own keys and
    values. Because every row's draft lives in one cache, the engine drafts a whole batch's rows
    in one forward of `cache_model` per draft position (engine.draft_in_cache).

    `rounds` is the proposal as an explicit generator: it yields each token to feed at the row's
    next slot, is sent the (V,) logits of that position, and returns the Draft. `cache_model`
    is the model to run (None: this drafter, e.g. a hybrid whose model part has its own cache,
    does not draft in the cache)."""

    cache_model: Any

    def rounds(self, context: torch.Tensor, k: int, params: SamplingParams, prompt_len: int,
               generator: torch.Generator | None) -> Rounds: ...


def drafts_in_cache(drafter: object) -> bool:
    """True when `drafter` drafts in the target's cache (CacheDrafter with a cache_model)."""
    return getattr(drafter, "cache_model", None) is not None and callable(
        getattr(drafter, "rounds", None))


def fits_width(drafter: object) -> bool:
    """True when `drafter` declares `fits_width`: its drafts carry confidences and proposing
    costs next to nothing, so under the controller it proposes up to its k and the engine keeps
    what pays (engine.fit_width) instead of taking the controller's per-request k. One that also
    holds a model part (drafters.hybrid) gets the controller's k for that part as `model_k`."""
    return bool(getattr(drafter, "fits_width", False))


def ids_tensor(ids: list[int]) -> torch.Tensor:
    """An int64 tensor of a token list, through a C array: 6-7x faster than torch.tensor(list)
    (19 against 124 us for 450 tokens here), which the engine paid twice per request per step (the
    context handed to its drafter and to its verifier: 2.5% of a batch-16 step) and model
    drafters once per draft token."""
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64) if ids else torch.zeros(
        0, dtype=torch.int64)


def draw(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor, prompt_len: int,
         generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """One draft token from a drafter's (1, V) logits through the shared sampling pipeline:
    greedy (q None), or sampled with the q (V,) it was drawn from."""
    if params.greedy:
        return int(greedy_tokens(logits, params, history, prompt_len, EMPTY)[0]), None
    q = probs_from_logits(logits, params, history, prompt_len, EMPTY)[0]
    return int(sample(q, generator)), q


def require_native(target: Any, drafter: str) -> None:
    """Raise SpecDecodeError unless `target` runs on the native runner, which `drafter` needs
    (its blocks, caches or features)."""
    if getattr(target, "backend", "") != "native":
        raise SpecDecodeError(f"the {drafter} drafter needs a target on the native runner")
