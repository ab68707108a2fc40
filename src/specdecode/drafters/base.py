"""The drafter interface: `Drafter`, the `DraftRequest` it is asked and the `Draft` it returns.

A drafter is per request: it is made for one request (sharing any heavy weights with others),
asked each step for up to k proposed tokens following the committed context, and told after
verification what was accepted. Drafters that sample report the distributions q they sampled
from, computed by `specdecode.sampling` with the same parameters as the target's p; drafters
without a distribution (n-gram lookup) return q=None and are verified as if q were one-hot on
their token.

Every capability the engine uses is declared on `Drafter` with a default, so a new drafter
subclasses it, implements `propose` (and `reset` if it keeps state) and overrides only what it
has: see docs/drafters.md, "Writing a drafter".
"""

from __future__ import annotations

import abc
import array
import dataclasses
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from specdecode.errors import SpecDecodeError
from specdecode.sampling import (
    PositionNoise,
    SamplingParams,
    greedy_tokens,
    gumbel_argmax,
    process_logits,
    sample,
)

if TYPE_CHECKING:
    from specdecode.constraints import Matcher
    from specdecode.models.llama import LlamaModel
    from specdecode.models.target import Cache, Target
    from specdecode.suffix import SuffixStore

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
    # Optional: a token tree instead of a chain (docs/design.md, "Trees"): parents[i] (int64) is
    # node i's parent, -1 for a child of the pending token, nodes in topological order
    # (parents[i] < i); tokens[i] is node i's token, q[i] (if any) what it was drawn from, and
    # confidence[i] the probability that node i is accepted given that its parent was. The
    # target scores every node in one pass under a tree mask and the longest accepted path is
    # committed (verify.verify_tree*). None: a chain (parents -1, 0, 1, ..., k - 2).
    parents: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter is asked for: up to `k` tokens following `context`."""

    context: torch.Tensor  # (L,) int64: prompt + every committed token so far
    k: int  # propose at most this many tokens (fewer, even zero, is allowed)
    params: SamplingParams  # the request's sampling: draw with these (drafters.base.draw)
    prompt_len: int  # context[:prompt_len] is the prompt (penalties read what follows)
    generator: torch.Generator | None = None  # the request's generator (rule "residual")
    # Under the controller (--k auto), for a drafter that `fits_width`: the controller's draft
    # length for the drafter's costly model part (a hybrid's; 0 = it sits out), while `k` is the
    # most its free part may propose. None: `k` for both.
    model_k: int | None = None
    # Rule "invariant" (sampled): the request's position-keyed noise, and the output position of
    # the first draft token. Draft token i is then drawn as argmax(log q_i + g_(position + i)),
    # with the noise the verifier uses at that position: the coupling that makes it likely to
    # be accepted (verify.verify_invariant).
    noise: PositionNoise | None = None
    position: int = 0
    # Structured output: the request's grammar state (constraints.Matcher), or None. Draw each
    # draft token through `allowed(drafted)` (drafters.base.draw's `allowed`).
    constraint: Matcher | None = None
    # Trailing context tokens not yet in the target's KV cache: the pending token, and the
    # tokens a constraint forced since the last forward (engine.Generation). A drafter drafting
    # in the target's cache (`rounds`) feeds them all before its first draft token.
    unfed: int = 1
    # Token trees: the most nodes a tree draft may have this step (0: propose a chain). `k`
    # still caps a tree's depth. Set from the drafter's `max_nodes`.
    nodes: int = 0

    def allowed(self, drafted: list[int]) -> torch.Tensor | None:
        """The constraint's (1, V) mask after context ++ `drafted`, or None: no constraint, or
        `drafted` already left the grammar (the engine cuts the draft there anyway)."""
        if self.constraint is None or self.constraint.valid_prefix(drafted) < len(drafted):
            return None
        return self.constraint.allowed(drafted)[None]

    def with_k(self, k: int) -> DraftRequest:
        """The same request for up to `k` tokens (a wrapper asking its inner drafter)."""
        return dataclasses.replace(self, k=k)


def path_probabilities(draft: Draft) -> list[float]:
    """Per node, the probability that the path to it is accepted: the product of the
    confidences along it (1 where the drafter gave none)."""
    assert draft.parents is not None
    conf = draft.confidence or (1.0,) * int(draft.tokens.numel())
    out: list[float] = []
    for i, parent in enumerate(draft.parents.tolist()):
        out.append(conf[i] * (1.0 if parent < 0 else out[parent]))
    return out


def path_sums(draft: Draft) -> list[float]:
    """Per node, the accepted tokens expected along the path to it: the sum of the path
    probabilities of its nodes."""
    assert draft.parents is not None
    probs = path_probabilities(draft)
    out: list[float] = []
    for i, parent in enumerate(draft.parents.tolist()):
        out.append(probs[i] + (out[parent] if parent >= 0 else 0.0))
    return out


Rounds = Generator[int, torch.Tensor, Draft]  # a proposal in the target's cache (see rounds)


class CacheModel(Protocol):
    """The model a drafter runs in the target's cache (`Drafter.cache_model`): a copy of the
    target's layout (a quantized copy, a subset of its blocks)."""

    @property
    def rows_independent(self) -> bool:
        """Whether a row's outputs are independent of the other rows of its forward: then the
        engine drafts a batch's rows in one forward per draft position, else one per forward."""
        ...

    def __call__(self, tokens: torch.Tensor, cache: Cache, *,
                 num_new: Sequence[int] | None = None,
                 logits_for: str | torch.Tensor = "all") -> torch.Tensor:
        """Logits of `tokens` (B, T) written at each row's length, as Target.__call__."""
        ...


class Drafter(abc.ABC):
    """Base class of every drafter. The engine calls, per step of its request:

    1. `propose(request)` (or, when `cache_model` is set and the target's cache holds tensors,
       `rounds(request)`, run by engine.draft_in_cache), then reads `catch_up_ns`;
    2. after verification, `observe(hidden, start)` if `wants_hidden`, then
       `observe_result(draft, num_accepted, committed)`;
    3. `reset()` when the request ends (after `discard()` when it ended unfinished: the server
       cancelled it or a step failed).

    The server sets `isolation_key` before the first step; memory reports read `weights()` and
    `kv_bytes()`. The class attributes below are the capabilities, with the defaults of a plain
    drafter; everything the engine, the server and the reports use is declared here, so none of
    them asks a drafter what it has.
    """

    name: str = "drafter"
    # Proposing costs next to nothing and drafts carry confidences: under the controller the
    # drafter is asked for up to its own k every step and the engine keeps what pays
    # (engine.fit_width), instead of asking for the controller's per-request k.
    fits_width: bool = False
    # Nanoseconds the last `propose` spent catching up with the context (feeding a prompt, or
    # tokens committed while it sat out): a one-off cost the controller keeps apart from the
    # cost per draft token. Set by `propose`.
    catch_up_ns: int = 0
    # The model this drafter runs in the TARGET's KV cache, one forward per draft position over
    # a batch's rows (a quantized copy of the target, a subset of its blocks); None: it does not
    # draft in the target's cache. With one, the engine calls `rounds` instead of `propose`.
    cache_model: CacheModel | None = None
    # The engine passes the target's hidden states to `observe` (EAGLE-style heads).
    wants_hidden: bool = False
    # Token trees: the most nodes this drafter's tree drafts have (Draft.parents); 0: it drafts
    # chains. The engine reserves cache room for them and refuses larger or malformed trees.
    max_nodes: int = 0
    # Whose earlier requests' text the drafter may draft from and stores its request under
    # (server.isolation; None: the shared scope), set by the server before the first step.
    # Read by drafters with a store of earlier requests (suffix); the others have nothing to
    # isolate.
    isolation_key: str | None = None

    @abc.abstractmethod
    def propose(self, request: DraftRequest) -> Draft:
        """Propose up to request.k tokens following request.context (fewer, even zero, is
        allowed). Called under torch.inference_mode."""

    def reset(self) -> None:
        """Forget the request: free caches, clear state."""
        return  # a default: nothing to do

    def discard(self) -> None:
        """The request ended unfinished (cancelled, or a step failed): learn nothing from it
        (a drafter with a store of earlier requests must not store its partial text). `reset`
        follows. Default: nothing is learned from a request."""
        return  # a default: nothing to do

    def weights(self) -> torch.nn.Module | Target | None:
        """The model whose weights this drafter runs (memory reports count those it does not
        share with the target); None: no model."""
        return None

    def kv_bytes(self) -> int:
        """Bytes of this drafter's own KV cache now (0: none, or it drafts in the target's)."""
        return 0

    def rounds(self, request: DraftRequest) -> Rounds:
        """The proposal as an explicit generator, for drafters with a `cache_model`: yield each
        token to feed at the row's next slot of the target's cache (the pending token first),
        receive the (V,) logits of that position, and return the Draft.

        The target's cache holds the keys and values of every committed token but the pending
        one; the draft model feeds the pending token and its own draft tokens at the slots after
        them, attending over the target's KV of the context (so it holds no cache, prefills
        nothing and never catches up), while the row's length stays where it was (the rounds
        run on a copy of the lengths): the target's verification then overwrites those slots.
        Because every row's draft lives in one cache, the engine drafts a whole batch's rows in
        one forward of `cache_model` per draft position (engine.draft_in_cache).

        Default: no rounds, the proposal at once."""
        return self.propose(request)
        yield  # a generator function  # pragma: no cover

    def tree_nodes(self, k: int) -> int:
        """The most nodes this drafter's tree drafts have when they are at most k deep (0: it
        drafts chains): the node budget the engine reserves cache room for and holds it to.
        Default: `max_nodes`."""
        return self.max_nodes

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """With `wants_hidden`: the target's hidden states after its final norm, (n, H), for
        context positions start..start+n-1: the prompt as it is prefilled, then after each step
        the positions kept (the pending token and the accepted draft tokens)."""
        return  # a default: nothing to do

    def observe_result(self, draft: Draft, num_accepted: int, committed: list[int]) -> None:
        """Feedback after every verified step of the request: the draft as verified (cut to
        what the engine kept; empty on steps it did not draft), how many of its tokens were
        accepted, and the tokens the step committed (the accepted ones, then the target's
        recovered or bonus token). Default: nothing."""
        return  # a default: nothing to do


class DrafterFactory:
    """Makes one request's drafter (drafters.registry.drafter_factory builds one per drafter
    configuration, its weights loaded once and shared by the drafters it makes).

    `store`: the store of earlier requests its drafters draft from and add to (the suffix
    drafter's; None: none), for memory reports. `isolation`: whose earlier text a server request
    drafts from, "user" (its own user's: a drafter's `isolation_key`) or "shared".
    `selection`: what `ngram+auto` measured and chose (drafters.auto.Selection), else None.
    """

    store: SuffixStore | None = None
    isolation: str = "user"
    selection: Any = None  # what `ngram+auto` measured and chose (drafters.auto.Selection)

    def __init__(self, make: Callable[[], Drafter]) -> None:
        self._make = make

    def __call__(self) -> Drafter:
        return self._make()


def ids_tensor(ids: list[int]) -> torch.Tensor:
    """An int64 tensor of a token list, through a C array: several times faster than
    torch.tensor(list), which the engine would pay twice per request per step (the context
    handed to the drafter and to the verifier) and model drafters once per draft token
    (docs/measurements/code-figures.md)."""
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64) if ids else torch.zeros(
        0, dtype=torch.int64)


def draw(logits: torch.Tensor, request: DraftRequest, history: torch.Tensor, i: int,
         allowed: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None]:
    """Draft token i of `request` from a drafter's (1, V) logits after `history` (the context
    and draft tokens 0..i-1), through the shared sampling pipeline: greedy (q None), or sampled
    with the q (V,) it was drawn from: by the request's position-keyed noise under rule
    "invariant", from its generator under "residual". `allowed`: the constraint's (1, V) mask
    at this position (DraftRequest.allowed)."""
    params, prompt_len = request.params, request.prompt_len
    if params.greedy:
        return int(greedy_tokens(logits, params, history, prompt_len, EMPTY, allowed)[0]), None
    x = process_logits(logits, params, history, prompt_len, EMPTY, allowed)[0]  # (V,)
    q = torch.softmax(x, dim=-1)
    if request.noise is not None:
        return gumbel_argmax(x, request.noise.gumbel(request.position + i, x.shape[-1])), q
    return int(sample(q, request.generator)), q


def native(target: Target, drafter: str) -> LlamaModel:
    """`target` as the native runner, which `drafter` needs (its blocks, caches or features);
    SpecDecodeError on any other backend."""
    from specdecode.models.llama import LlamaModel

    if not isinstance(target, LlamaModel):
        raise SpecDecodeError(f"the {drafter} drafter needs a target on the native runner")
    return target
