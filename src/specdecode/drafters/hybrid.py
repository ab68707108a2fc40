"""Prompt lookup first, a model drafter where lookup has nothing worth verifying.

The two families fail in opposite places. Prompt lookup costs nothing to run and is right for
long stretches where the output copies its input (a summary quoting its article, an answer
quoting its retrieved passage, code edited in place), and wrong almost everywhere else. A
quantized copy of the target is right nearly everywhere, but each of its draft tokens costs a
sizeable share of a target step, which caps what it can gain even at full acceptance.

So each step the hybrid asks the lookup first and keeps its proposal when the tokens it
expects to get accepted, sum_j prod_{i<=j} confidence_i (the n-gram drafter's per-token rates,
drafters.ngram), reach `min_expected`; only otherwise does it run the model. The threshold's
default, 0.6, is where a free lookup draft, verified at its width, emits as many tokens per
target step as the copy does, plus a margin for the rates being estimates (the copy's costs and
the arithmetic: docs/measurements/code-figures.md): a long greedy match clears it, a 1-token
match does not.

The model drafter should draft in the target's cache (drafters.base.Drafter.rounds; the quantized
copies do): then the steps the lookup drafted cost it no catching up, and in a batch the rows
whose lookup has nothing draft through the model together. Lossless either way: which of
the two drafts depends only on the committed context (never on a draw of this step), a lookup
draft is verified as one-hot, a model draft against the q it was drawn from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specdecode.acceptance import expected_accepted
from specdecode.drafters.base import (
    CacheModel,
    Draft,
    Drafter,
    DrafterFactory,
    DraftRequest,
    Rounds,
    path_sums,
)

if TYPE_CHECKING:
    from specdecode.models.target import Target

MIN_EXPECTED = 0.6


def expected_tokens(draft: Draft) -> float:
    """Accepted tokens a draft with confidences is expected to get along one path: for a chain
    acceptance.expected_accepted, for a tree its best root path's (the sum of the path
    probabilities along it). Not the whole tree's sum: a bushy tree of weak branches sums
    high while each branch it adds widens the pass, and it displaced the model part too often
    (docs/measurements/trees.md)."""
    if draft.parents is None:
        return expected_accepted(draft.confidence or ())
    return max(path_sums(draft), default=0.0)


class HybridFactory(DrafterFactory):
    """Makes hybrids of one lookup factory and one model factory; its `store` and `isolation`
    are the lookup's (suffix+X: its store of earlier requests)."""

    def __init__(self, lookup: DrafterFactory, model: Callable[[], Drafter], name: str) -> None:
        self.lookup, self.model, self.name = lookup, model, name
        self.store, self.isolation = lookup.store, lookup.isolation

    def __call__(self) -> HybridDrafter:
        return HybridDrafter(self.lookup(), self.model(), self.name)


class HybridDrafter(Drafter):
    """One request's drafter: `lookup` (a drafter whose drafts carry confidences, such as
    drafters.ngram) when it expects >= `min_expected` accepted tokens, else `model`. `used`
    counts the steps each drafted (lookup, model)."""

    def __init__(self, lookup: Drafter, model: Drafter, name: str,
                 min_expected: float = MIN_EXPECTED) -> None:
        self.lookup, self.model, self.name = lookup, model, name
        self.min_expected = min_expected
        self.catch_up_ns = 0  # the model's catching up this step (0 when the lookup drafted)
        self.used = [0, 0]
        # The lookup's drafts carry confidences (Drafter.fits_width): under the controller
        # (--k auto) the hybrid is asked for up to its k, and the request's model_k is the
        # model part's draft length (0 = the model sits out; the lookup is still asked, its
        # confidences then decide what is verified).
        self.fits_width = True

    def weights(self) -> torch.nn.Module | Target | None:
        return self.model.weights()  # the lookup runs no model

    def kv_bytes(self) -> int:
        return self.model.kv_bytes()

    @property
    def max_nodes(self) -> int:  # type: ignore[override]
        return self.lookup.max_nodes  # a tree lookup's trees (the model part drafts chains)

    def tree_nodes(self, k: int) -> int:
        return self.lookup.tree_nodes(k)

    @property
    def isolation_key(self) -> str | None:
        """The lookup's scope in a store of earlier requests (server isolation)."""
        return self.lookup.isolation_key

    @isolation_key.setter
    def isolation_key(self, key: str | None) -> None:
        self.lookup.isolation_key = key

    def discard(self) -> None:
        """Forget the request instead of storing it (a lookup with a store)."""
        self.lookup.discard()
        self.model.discard()

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()

    @property
    def cache_model(self) -> CacheModel | None:  # type: ignore[override]
        """The model part's model when it drafts in the target's cache (Drafter.rounds)."""
        return self.model.cache_model

    def propose(self, request: DraftRequest) -> Draft:
        self.catch_up_ns = 0
        draft = self._lookup(request)
        if draft is not None:
            return draft
        draft = self.model.propose(request.with_k(self._model_k(request)))
        self.catch_up_ns = self.model.catch_up_ns
        return draft

    def rounds(self, request: DraftRequest) -> Rounds:
        """propose, with the model part drafting in the target's cache (Drafter.rounds)."""
        draft = self._lookup(request)
        if draft is not None:
            return draft
        return (yield from self.model.rounds(request.with_k(self._model_k(request))))

    def observe_result(self, draft: Draft, num_accepted: int, committed: list[int]) -> None:
        self.lookup.observe_result(draft, num_accepted, committed)
        self.model.observe_result(draft, num_accepted, committed)

    @staticmethod
    def _model_k(request: DraftRequest) -> int:
        k = request.k
        return k if request.model_k is None else min(k, request.model_k)

    def _lookup(self, request: DraftRequest) -> Draft | None:
        """The lookup's draft when it is worth verifying alone (or the model sits out), else
        None (the model drafts; counted in `used`)."""
        # the lookup is asked every step, so its rates keep being scored against what the
        # target commits even on the steps the model drafts
        draft = self.lookup.propose(request)
        if draft.confidence is not None and (self._model_k(request) <= 0 or expected_tokens(
                draft) >= self.min_expected):
            self.used[0] += 1
            return draft
        self.used[1] += 1
        return None
