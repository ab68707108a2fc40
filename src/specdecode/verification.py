"""A step's verification, beside the pure verifiers of verify.py: which one a request's step runs
(greedy, rule "invariant" or rule "residual"; a chain or a token tree), on the target's logits
processed by the one sampling pipeline (penalties, a constraint's masks, temperature...), and
the per-position alpha samples sum_x min(p, q) it evaluated, from which the controller learns
acceptance. engine.Generation calls `Verifier.verify` once per step.

A request's randomness is set up here too: a seed (given, or drawn and reported so that any
output can be reproduced), the generator rule "residual" draws from, and under rule "invariant"
the position-keyed noise (sampling.PositionNoise) that makes a seed's tokens plain decoding's.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from specdecode.constraints import Matcher
from specdecode.drafters.base import Draft, ids_tensor
from specdecode.sampling import (
    PositionNoise,
    SamplingParams,
    argmax_rows,
    greedy_tokens,
    probs_from_logits,
    process_logits,
    uses_history,
)
from specdecode.verify import (
    TreeVerifyResult,
    VerifyResult,
    acceptance_probability,
    tree_path,
    verify_chain,
    verify_greedy,
    verify_invariant,
    verify_tree,
    verify_tree_greedy,
    verify_tree_invariant,
)

_EMPTY = torch.zeros(0, dtype=torch.long)


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request generator: seeded when asked, otherwise from fresh OS entropy."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


@dataclass(frozen=True)
class Verifier:
    """What a request's verification reads besides each step's logits, draft and context."""

    params: SamplingParams
    prompt_len: int  # context[:prompt_len] is the prompt
    seed: int  # the request's seed: given, or drawn (reported)
    generator: torch.Generator  # rule "residual": its uniforms
    noise: PositionNoise | None  # rule "invariant" (sampled): the position-keyed noise

    @classmethod
    def for_request(cls, params: SamplingParams, prompt_len: int) -> Verifier:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        noise = None if params.greedy or params.rule != "invariant" else PositionNoise(seed)
        return cls(params, prompt_len, seed, make_generator(seed), noise)

    def verify(self, logits: torch.Tensor, draft: Draft, context: list[int], position: int,
               matcher: Matcher | None = None
               ) -> tuple[VerifyResult | TreeVerifyResult, list[float]]:
        """Verify `draft` after `context` (its last token the pending one; `position`: the
        output position of the draft's first token) on the target's (k + 1, V) logits, under
        the constraint `matcher` if any: the result, and the alpha samples of the positions
        verified."""
        if draft.parents is not None:
            return self._tree(logits, draft, context, position)
        params, k, prompt_len = self.params, len(draft.tokens), self.prompt_len
        allowed = row_masks(matcher, draft)
        if params.greedy:  # the context only where penalties read it (uses_history)
            history = ids_tensor(context) if uses_history(params) else _EMPTY
            target = greedy_tokens(logits, params, history, min(prompt_len, len(history)),
                                   draft.tokens, allowed)
            result = verify_greedy(target, draft.tokens)
            seen = min(result.num_accepted + 1, k)
            return result, [float(target[i] == draft.tokens[i]) for i in range(seen)]
        ctx = ids_tensor(context)
        if self.noise is not None:  # rule "invariant": the target's Gumbel-max tokens
            x = process_logits(logits, params, ctx, prompt_len, draft.tokens, allowed)
            noise, first, vocab = self.noise, position, x.shape[-1]
            result = verify_invariant(x, draft.tokens, lambda i: noise.gumbel(first + i, vocab))
            seen = min(result.num_accepted + 1, k)
            return result, [float(result.tokens[i] == draft.tokens[i]) for i in range(seen)]
        p = probs_from_logits(logits, params, ctx, prompt_len, draft.tokens, allowed)
        result = verify_chain(p, draft.q, draft.tokens, self.generator)
        seen = min(result.num_accepted + 1, k)
        if draft.q is None:
            return result, p[torch.arange(seen), draft.tokens[:seen]].tolist()
        return result, acceptance_probability(p[:seen], draft.q[:seen]).tolist()

    def _tree(self, logits: torch.Tensor, draft: Draft, context: list[int], position: int
              ) -> tuple[TreeVerifyResult, list[float]]:
        """A tree's verification (verify_tree*), on the (n + 1, V) logits of its root and
        nodes, each processed after its own path (the penalties count the path's tokens, not
        the siblings'). Alpha samples: 1 per accepted node, then 0 where the path ended with
        nodes left below it."""
        parents, tokens = draft.parents, draft.tokens
        assert parents is not None
        x = tree_logits(logits, self.params, ids_tensor(context), self.prompt_len, draft)
        result: TreeVerifyResult
        if self.params.greedy:
            result = verify_tree_greedy(argmax_rows(x), parents, tokens)
        elif self.noise is not None:
            noise, first, vocab = self.noise, position, x.shape[-1]
            result = verify_tree_invariant(x, parents, tokens,
                                           lambda d: noise.gumbel(first + d, vocab))
        else:
            result = verify_tree(torch.softmax(x, dim=-1), parents, tokens, draft.q,
                                 self.generator)
        m = result.num_accepted
        last = int(result.path[-1]) if m else -1
        rejected = any(int(p) == last for p in parents.tolist())
        return result, [1.0] * m + ([0.0] if rejected else [])


def row_masks(matcher: Matcher | None, draft: Draft) -> torch.Tensor | None:
    """A constraint's (k + 1, V) masks of a step's rows (after context ++ draft[:t]), or None
    without a constraint: the target's p is restricted by the same masks as the draft's q."""
    return None if matcher is None else matcher.masks(draft.tokens.tolist())


def tree_logits(logits: torch.Tensor, params: SamplingParams, context: torch.Tensor,
                prompt_len: int, draft: Draft) -> torch.Tensor:
    """The processed logits (n + 1, V) of a tree's root and nodes: row i + 1 after node i's
    path. Where penalties read the history, each row is processed after its own path;
    otherwise all at once."""
    assert draft.parents is not None
    n = int(draft.tokens.numel())
    if not uses_history(params):
        return process_logits(logits, params, context, prompt_len, draft.tokens)
    rows = [process_logits(logits[:1], params, context, prompt_len, _EMPTY)]
    for i in range(n):
        path = draft.tokens[tree_path(draft.parents, i)]
        rows.append(process_logits(logits[i + 1:i + 2], params, torch.cat([context, path]),
                                   prompt_len, _EMPTY))
    return torch.cat(rows)
