"""A separate draft model sharing the target's tokenizer (or a quantized copy of the target: int8,
w4a16), drafting k tokens one by one, each from q computed by the same sampling pipeline as the
target's p.

A separate draft keeps its own KV cache; on every proposal it re-syncs with the committed
context by rolling back to the longest common prefix, then feeds what is new.

A quantized copy has the target's cache layout, and with `in_cache` it drafts in the target's
own KV cache (drafters.base.Drafter.rounds, driven by engine.draft_in_cache): it feeds only the
pending token and its draft tokens, attending over the target's keys and values of the context
(a closer draft, if anything). A long prompt then costs it no prefill, the steps it sits out
(another drafter drafted, or speculation was off) cost it no catching up, it holds no KV of its
own, and a batch's rows draft together, one forward per draft position.
The prefill was the copy's largest cost on long prompts when it kept its own cache (PyTorch's
4-bit kernel is slow on many rows: docs/measurements/code-figures.md). Lossless either way:
whatever the draft attends over, its tokens are verified against q. Called directly (`propose`,
outside an engine), a copy drafts in a cache of its own like any draft model."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from specdecode.drafters.base import (
    EMPTY,
    CacheModel,
    Draft,
    Drafter,
    DraftRequest,
    Rounds,
    draw,
    ids_tensor,
)
from specdecode.errors import SpecDecodeError
from specdecode.limits import MAX_K
from specdecode.sampling import process_logits, sample
from specdecode.verify import without_replacement

if TYPE_CHECKING:
    from specdecode.models.llama import LlamaModel
    from specdecode.models.target import Cache, Target
    from specdecode.models.tokenizer import Tokenizer

# Sibling leaves (`siblings=True`, a token tree; EAGLE-2's idea of branching where the draft is
# unsure, Li et al. 2024, cut to one extra leaf per position, which costs no extra draft
# forward): where the draft gives its own token less than SIBLING_BELOW, its next choice is
# proposed beside it, if the draft gives that one at least SIBLING_MIN.
SIBLING_BELOW = 0.6
SIBLING_MIN = 0.1


def check_vocab(target: Target, draft: Target, draft_name: str) -> None:
    tv, dv = target.cfg.vocab_size, draft.cfg.vocab_size
    if tv != dv:
        raise SpecDecodeError(
            f"draft model {draft_name} has a vocabulary of {dv} tokens but the target has {tv}: "
            "a draft model must share the target's tokenizer (for a draft with another "
            "tokenizer, use --drafter xtok, which drafts through text)"
        )


def check_tokenizer(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """Refuse a draft whose tokens are not the target's: with as many tokens but other strings
    (another tokenizer of the same size), its token ids would mean other text to the target.
    Output would stay lossless, but hardly a draft token would be accepted."""
    mine, theirs = target.vocabulary(), draft.vocabulary()
    if mine == theirs:
        return
    by_id = {i: t for t, i in mine.items()}
    other = {i: t for t, i in theirs.items()}
    first = min(i for i in set(by_id) | set(other) if by_id.get(i) != other.get(i))
    raise SpecDecodeError(
        f"draft model {draft_name} has another tokenizer than the target (token {first} is "
        f"{by_id.get(first)!r} in the target, {other.get(first)!r} in the draft): a draft "
        "model must share the target's tokenizer (for a draft with another tokenizer, use "
        "--drafter xtok, which drafts through text)")


class DraftModelDrafter(Drafter):
    """Drafts with `model` in its own KV cache, which grows with the request up to `capacity`,
    or, with `in_cache` (a model of the target's cache layout) and run by an engine, in the
    target's."""

    def __init__(self, model: Target, name: str = "draft-model", capacity: int = 4096,
                 in_cache: bool = False, siblings: bool = False,
                 sibling_range: tuple[float, float] = (SIBLING_MIN, SIBLING_BELOW)) -> None:
        self.name = name
        self.siblings = siblings
        self.sibling_range = sibling_range  # (least probability of a sibling, most of its
        # draft token)
        self.model = model
        self.capacity = capacity
        # with in_cache (a copy of the target's layout), engines draft it in the target's cache
        self.cache_model: CacheModel | None = model if in_cache else None
        self.cache: Cache | None = None  # its own cache, when it drafts outside the target's
        self.fed: list[int] = []  # tokens whose KV the draft cache holds, in order
        self.catch_up_ns = 0  # time the last propose spent catching up (see _sync)

    def reset(self) -> None:
        self.cache, self.fed = None, []

    def weights(self) -> Target:
        return self.model

    def kv_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes()

    @property
    def max_nodes(self) -> int:  # type: ignore[override]
        return self.tree_nodes(MAX_K)

    def tree_nodes(self, k: int) -> int:
        return 2 * k if self.siblings else 0  # a draft token and a sibling per position

    def copy_state_from(self, other: DraftModelDrafter) -> None:
        """Start from another drafter's cache of the same model (e.g. a prefilled prompt)."""
        if other.cache is None or other.model is not self.model or \
                not other.cache.copies_rows:
            return
        self.cache = self.model.new_cache(1, other.cache.capacity)
        self.cache.copy_row(0, other.cache, 0, len(other.fed))
        self.fed = list(other.fed)

    def _reserve(self, tokens: int) -> Cache:
        """Make the cache hold `tokens` positions: allocate, or grow (doubling) with one copy;
        the cache."""
        old = self.cache
        if old is not None and old.capacity >= tokens:
            return old
        size = min(self.capacity, max(tokens, 128, 2 * (old.capacity if old else 0)))
        self.cache = self.model.new_cache(1, size)
        if old is not None and old.copies_rows:
            self.cache.copy_row(0, old, 0, old.lengths[0])
        elif old is not None:  # a cache whose rows cannot be copied: start again
            self.fed = []
        return self.cache

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Roll back to the common prefix with `context`, feed the rest; logits of the last one.

        The time spent feeding more than the one pending token (the prompt, or the tokens
        committed while speculation was off) is kept in `catch_up_ns`: it is a one-off cost of
        (re)starting, not a cost per draft token, and the controller keeps the two apart.
        """
        start = time.perf_counter_ns()
        cache = self._reserve(len(context) + 1)
        n = 0
        limit = min(len(self.fed), len(context) - 1)  # always feed at least one token
        while n < limit and self.fed[n] == context[n]:
            n += 1
        cache.rollback(0, n)
        self.fed = context[:n]
        logits = self._feed(context[n:])
        self.catch_up_ns = time.perf_counter_ns() - start if len(context) - n > 2 else 0
        return logits

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        assert self.cache is not None  # reserved by _sync
        logits = self.model(torch.tensor([tokens]), self.cache, logits_for="last")
        self.fed.extend(tokens)
        return logits[0]  # (1, V)

    def propose(self, request: DraftRequest) -> Draft:
        """Draft in this drafter's own cache: `rounds`, fed by syncing with the context first."""
        ctx, k = request.context.tolist(), request.k
        if len(ctx) + k + 1 > self.capacity:
            return Draft(EMPTY, None)
        self._reserve(len(ctx) + k + 1)
        steps = self.rounds(dataclasses.replace(request, unfed=1))
        try:
            next(steps)  # the pending token: fed by the sync, with whatever else is new
            logits = self._sync(ctx)
            while True:
                logits = self._feed([steps.send(logits)])
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def rounds(self, request: DraftRequest) -> Rounds:
        """Yield the token to feed next (the pending one, then each draft token but the last),
        receive its (V,) logits, draw from them; return the k drafted tokens and their q."""
        k = request.k
        if k <= 0:
            return Draft(EMPTY, None)
        history = request.context.tolist()
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        tree: list[tuple[int, int, torch.Tensor | None]] = []  # (parent, token, q) per node
        branch = self.siblings and request.nodes > 0 and request.constraint is None
        main = -1  # the node of the last draft token (a sibling leaf follows it)
        for fed in history[len(history) - request.unfed:]:  # the pending token (and any forced)
            logits = yield fed
        for i in range(k):
            row, context = logits.view(1, -1), ids_tensor(history + tokens)
            tok, q = draw(row, request, context, i, request.allowed(tokens))
            if branch:
                parent, main = main, len(tree)
                tree.append((parent, tok, q))
                extra = sibling(row, request, context, i, tok, q, self.sibling_range)
                if extra is not None and len(tree) < request.nodes:
                    tree.append((parent, *extra))
            qs += [] if q is None else [q]
            tokens.append(tok)
            if i + 1 < k:
                logits = yield tok
        if tree:
            return tree_draft(tree)
        q_all = torch.stack(qs) if qs else None
        return Draft(torch.tensor(tokens, dtype=torch.long), q_all)



def quantized_copy(name: str, target: LlamaModel) -> LlamaModel:
    """The copy of the target that quantized-copy drafter `name` (drafters.options
    .QUANTIZED_COPIES: int8 or w4a16) drafts with, at that drafter's precision; the target's
    norms shared, unchanged (models.precision.copy_at: a target already at that precision is
    its own copy, held once)."""
    from specdecode.drafters.options import QUANTIZED_COPIES
    from specdecode.models.precision import copy_at

    return copy_at(target, QUANTIZED_COPIES[name])  # type: ignore[no-any-return]


def with_siblings(drafter: Drafter, name: str) -> DraftModelDrafter:
    """`drafter` (a DraftModelDrafter) proposing sibling leaves where unsure, named `name`."""
    if not isinstance(drafter, DraftModelDrafter):
        raise SpecDecodeError(f"the {name} drafter needs a draft model to branch")
    drafter.siblings, drafter.name = True, name
    return drafter


def sibling(row: torch.Tensor, request: DraftRequest, history: torch.Tensor, i: int, token: int,
            q: torch.Tensor | None, bounds: tuple[float, float] = (SIBLING_MIN, SIBLING_BELOW)
            ) -> tuple[int, torch.Tensor | None] | None:
    """The draft's next choice beside `token` (its draft token i, drawn from q) where the draft
    is unsure of it (it gives `token` less than bounds[1]), with the q it was drawn from; None
    where it is sure or has no second choice worth verifying (given less than bounds[0]).
    Greedy: the second most likely token. Rule "invariant": the second largest of the
    position's noisy logits (the verifier never reads q). Rule "residual": drawn from q without
    `token` (verify.without_replacement), as verify_tree requires of siblings."""
    if q is None:  # greedy: the draft's processed logits (draw's fast path skipped them)
        scores = process_logits(row, request.params, history, request.prompt_len, EMPTY)[0]
        probs = torch.softmax(scores, dim=-1)
    else:  # log q ranks tokens as draw's processed logits do (softmax is shift-invariant)
        probs, scores = q, q.log()
    least, below = bounds
    if float(probs[token]) >= below or 1.0 - float(probs[token]) < least:
        return None
    if q is not None and request.noise is None:
        rest = without_replacement(q, [token])
        return int(sample(rest, request.generator)), rest
    if request.noise is not None:  # the position's noise, as draw used (cached there)
        scores = scores + request.noise.gumbel(request.position + i, scores.shape[-1])
    scores[token] = float("-inf")
    other = int(scores.argmax())
    if float(probs[other]) < least:
        return None
    return other, q


def tree_draft(tree: list[tuple[int, int, torch.Tensor | None]]) -> Draft:
    """A Draft of (parent, token, q) nodes in topological order."""
    parents = torch.tensor([p for p, _, _ in tree], dtype=torch.long)
    tokens = torch.tensor([t for _, t, _ in tree], dtype=torch.long)
    qs = [q for _, _, q in tree if q is not None]
    q_all = torch.stack(qs) if len(qs) == len(tree) else None
    return Draft(tokens, q_all, None, parents)
