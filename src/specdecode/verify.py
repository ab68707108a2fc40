"""Verification: pure tensor functions deciding which proposed tokens to keep. No model, no state.

Vocabulary (docs/design.md), for a chain of k draft tokens x_0..x_{k-1} scored by the target:

- accepted token: a draft token kept by verification. Tokens are checked in order and the first
  rejection ends the chain, so the accepted tokens are always a prefix x_0..x_{n-1}.
- recovered token: at the first rejection (position n < k), the token drawn in place of x_n, from
  the residual distribution norm(max(0, p_n - q_n)).
- bonus token: when all k draft tokens are accepted, one more token drawn from p_k, the target's
  distribution after the last draft token (free: the target scored that position anyway).

Every verification emits the accepted tokens plus exactly ONE recovered-or-bonus token, so a step
always makes progress. With p and q computed by the same processing (`specdecode.sampling`), the
emitted tokens are distributed exactly as if sampled from the target alone (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.sampling import gumbel_argmax, sample


@dataclass(frozen=True)
class VerifyResult:
    """num_accepted accepted draft tokens; tokens = those, then one recovered or bonus token."""

    num_accepted: int
    tokens: torch.Tensor  # (num_accepted + 1,) int64


def verify_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyResult:
    """Greedy verification: accept the longest prefix of `draft_tokens` equal to the target's.

    target_tokens: (k+1,) the target's argmax token at each scored position (the last one follows
    the whole draft); draft_tokens: (k,). The next token is target_tokens[num_accepted]: the
    target's correction at the first mismatch (recovered), or its token after the draft (bonus).
    """
    k = draft_tokens.numel()
    if target_tokens.shape != (k + 1,):
        raise ValueError(f"target_tokens must be ({k + 1},), got {tuple(target_tokens.shape)}")
    num_accepted = _accepted_prefix(target_tokens[:k] == draft_tokens)
    return VerifyResult(num_accepted, target_tokens[: num_accepted + 1].to(torch.int64).clone())


def verify_chain(
    p: torch.Tensor,  # (k+1, V) target distributions
    q: torch.Tensor | None,  # (k, V) draft distributions, or None (deterministic draft)
    draft_tokens: torch.Tensor,  # (k,) int64, x_i drawn from q_i
    generator: torch.Generator | None,
) -> VerifyResult:
    """Speculative sampling over a chain (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) for i = 0, 1, ... until the first
    rejection; there draw the recovered token from norm(max(0, p_i - q_i)); if all k are accepted
    draw the bonus token from p_k. k = 0 just draws from p_0.

    q = None (drafters with no distribution, e.g. n-gram lookup): q_i is taken as one-hot on x_i,
    so x_i is accepted with probability p_i(x_i) and the recovered token is drawn from p_i with x_i
    zeroed. This rule is lossless for ANY proposed token, however it was chosen: P(emit x_i) =
    p_i(x_i), and P(emit y != x_i) = (1 - p_i(x_i)) * p_i(y) / (1 - p_i(x_i)) = p_i(y).

    q_i(x_i) = 0 (a token the reported q says the drafter could not have drawn): that position is
    verified by the same one-hot rule instead of dividing by zero. If the drafter really samples
    from q this has probability 0 and changes nothing; if it does happen (underflow, or a drafter
    whose sampler and reported q disagree) the emitted token at that position is still exactly
    p_i-distributed, which neither "always accept" (ratio +inf) nor "always reject" would give.

    Residual with zero mass (max(0, p_i - q_i) == 0 everywhere, i.e. p_i <= q_i elementwise, which
    for two normalised distributions means p_i == q_i up to rounding): the acceptance probability
    is then 1 for every token q_i can draw, so a rejection can only come from rounding; p_i is
    drawn instead, the limit of the residual conditional as q_i -> p_i.

    Randomness: exactly k uniforms (torch.rand) then one categorical draw (`sampling.sample`), all
    from `generator`, whatever the outcome: the same seed gives the same result.
    """
    k = draft_tokens.numel()
    _check_chain_shapes(p, q, k)
    draft = draft_tokens.tolist()
    positions = torch.arange(k)
    p_x = p[positions, draft_tokens].tolist()  # (k,) p_i(x_i)
    q_x = [1.0] * k if q is None else q[positions, draft_tokens].tolist()  # (k,) q_i(x_i)
    u = torch.rand(k, generator=generator, dtype=torch.float64).tolist()  # (k,)
    # 1. accept while u_i < p_i(x_i) / q_i(x_i), compared as u_i * q_i(x_i) < p_i(x_i);
    #    q_i(x_i) <= 0 means the one-hot rule: accept with probability p_i(x_i)
    num_accepted = 0
    while num_accepted < k:
        i = num_accepted
        if not u[i] * (q_x[i] if q_x[i] > 0 else 1.0) < p_x[i]:
            break
        num_accepted += 1
    # 2. one more token: bonus from p_k, or recovered from the residual at the first rejection
    if num_accepted == k:
        next_token = int(sample(p[k], generator))
    else:
        i = num_accepted
        q_i = q[i] if q is not None and q_x[i] > 0 else None
        next_token = int(sample(_residual(p[i], q_i, draft[i]), generator))
    tokens = torch.tensor([*draft[:num_accepted], next_token], dtype=torch.int64)
    return VerifyResult(num_accepted, tokens)


def verify_invariant(
    x: torch.Tensor,  # (k+1, V) the target's processed logits (sampling.process_logits)
    draft_tokens: torch.Tensor,  # (k,) int64
    noise: Callable[[int], torch.Tensor],  # row i -> (V,) Gumbel noise of its output position
) -> VerifyResult:
    """Drafter-invariant verification (Daliri, Musco and Suresh 2024, "Coupling without
    Communication and Drafter-Invariant Speculative Decoding").

    The target's token at row i is its Gumbel-max token argmax(x_i + g_i), g_i the noise of
    that row's output position: distributed as softmax(x_i), and exactly the token plain
    decoding with the same seed draws there. Draft tokens are accepted while they equal it; the
    first that does not is replaced by it (recovered), and after k accepted tokens row k gives
    the bonus token. Every emitted token is the target's Gumbel-max token at its position, so
    the output is token-identical to plain seeded decoding whatever was drafted (and its
    distribution is the target's). A model drafter that draws x_i = argmax(log q_i + g_i) with
    the same g_i is accepted with probability >= (1 - TV(p, q)) / (1 + TV(p, q)) (their bound);
    a drafter without q is accepted with probability p_i(x_i), as under verify_chain.

    The noise is asked for lazily, row by row, only up to the first mismatch. Greedy decoding is
    the limit of no noise (verify_greedy on the argmax).
    """
    k = draft_tokens.numel()
    if x.dim() != 2 or x.shape[0] != k + 1:
        raise ValueError(f"x must be ({k + 1}, V) for {k} draft tokens, got {tuple(x.shape)}")
    draft = draft_tokens.tolist()
    tokens: list[int] = []
    for i in range(k + 1):
        tokens.append(gumbel_argmax(x[i], noise(i)))
        if i == k or tokens[-1] != draft[i]:
            break
    return VerifyResult(len(tokens) - 1, torch.tensor(tokens, dtype=torch.int64))


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-position probability that verify_chain accepts a draft token drawn from q, (k,).

    alpha_i = sum_x min(p_i(x), q_i(x)) (Leviathan et al. 2023; docs/design.md's alpha). q: (k, V);
    p: (k, V) or (k+1, V) as passed to verify_chain (only its first k rows are used).
    """
    k = q.shape[0]
    return torch.minimum(p[:k], q).sum(dim=-1)  # (k,)


def _residual(p_i: torch.Tensor, q_i: torch.Tensor | None, x_i: int) -> torch.Tensor:
    """norm(max(0, p_i - q_i)) unnormalised, (V,); q_i None means one-hot on x_i. Falls back to
    p_i when the residual has no mass (see verify_chain)."""
    if q_i is None:
        residual = p_i.clone()
        residual[x_i] = 0.0
    else:
        residual = torch.clamp(p_i - q_i, min=0.0)
    if not bool(residual.sum() > 0):
        return p_i
    return residual


def _accepted_prefix(accepted: torch.Tensor) -> int:
    """Length of the leading run of True in a (k,) bool tensor."""
    return int(torch.cumprod(accepted.to(torch.int64), dim=0).sum())


def _check_chain_shapes(p: torch.Tensor, q: torch.Tensor | None, k: int) -> None:
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must be ({k + 1}, V) for {k} draft tokens, got {tuple(p.shape)}")
    if q is not None and q.shape != (k, p.shape[1]):
        raise ValueError(f"q must be ({k}, {p.shape[1]}), got {tuple(q.shape)}")
