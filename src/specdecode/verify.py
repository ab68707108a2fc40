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


# ---------------------------------------------------------------------------------------------
# Token trees (docs/design.md, "Trees"): the engine scores them under tree masks and runs these
# (verification.Verifier), on targets that score trees; others verify a tree's best path
# ---------------------------------------------------------------------------------------------
#
# A tree draft of n nodes: parents (n,) int64, parents[i] the index of node i's parent or -1 for
# a child of the root (the pending position); tokens (n,) int64; optionally q (n, V), q[i] the
# distribution node i's token was drawn from. Nodes are in topological order (parents[i] < i).
# The target scores the root and every node in one pass: row 0 of p (or of the target's tokens
# or logits) is the root's, row i + 1 follows node i's path. A chain of k tokens is the tree
# parents = [-1, 0, 1, ..., k - 2].


@dataclass(frozen=True)
class TreeVerifyResult:
    """path: the accepted nodes, root to leaf, (m,) int64 (node indices, to compact the KV rows);
    tokens: their tokens, then one recovered or bonus token, (m + 1,) int64."""

    path: torch.Tensor
    tokens: torch.Tensor

    @property
    def num_accepted(self) -> int:
        return int(self.path.numel())


def check_tree(
    parents: torch.Tensor, tokens: torch.Tensor, vocab_size: int | None = None
) -> None:
    """Raise ValueError unless (parents, tokens) is a well-formed tree draft: 1-D integer tensors
    of one length, every parent -1 or an earlier node (which also rules out cycles and a parent
    after its child), and, given vocab_size, every token in 0..vocab_size - 1."""
    if parents.dim() != 1 or tokens.dim() != 1 or parents.numel() != tokens.numel():
        raise ValueError(
            f"parents and tokens must be 1-D of one length, got {tuple(parents.shape)} and "
            f"{tuple(tokens.shape)}"
        )
    for name, t in (("parents", parents), ("tokens", tokens)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    for i, parent in enumerate(parents.tolist()):
        if not -1 <= parent < i:
            raise ValueError(
                f"node {i} has parent {parent}: a parent must be -1 (the root) or an earlier "
                "node (nodes in topological order; no cycles)"
            )
    if vocab_size is not None and tokens.numel() > 0:
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"tree tokens must be in 0..{vocab_size - 1}, got {low}..{high}")


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node, (n,) int64: 1 for a child of the root, parent's depth + 1 below.
    A node of depth d is the step's output position d - 1 (the root is depth 0)."""
    depths: list[int] = []
    for parent in parents.tolist():
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return torch.tensor(depths, dtype=torch.int64)


def tree_path(parents: torch.Tensor, node: int) -> list[int]:
    """The nodes from the root's child down to `node` (inclusive); [] for node -1 (the root)."""
    parent_list = parents.tolist()
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parent_list[node]
    return path[::-1]


def verify_tree_greedy(
    target_tokens: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor
) -> TreeVerifyResult:
    """Greedy verification of a tree: accept the longest root path whose every token is the
    target's argmax at its parent, then emit the target's token after its last node.

    target_tokens: (n + 1,), [0] the target's argmax at the root, [i + 1] after node i.
    Siblings with one token (a drafter should merge them): every matching path is checked and
    the longest wins, the lowest last-node index among equally long ones; either way the emitted
    tokens are the target's greedy tokens, as every accepted path matches them.
    """
    check_tree(parents, tokens)
    if target_tokens.shape != (tokens.numel() + 1,):
        raise ValueError(
            f"target_tokens must be ({tokens.numel() + 1},), got {tuple(target_tokens.shape)}"
        )
    target = target_tokens.tolist()
    return _longest_match(parents, tokens, lambda node, _depth: target[node + 1])


def verify_tree(
    p: torch.Tensor,  # (n+1, V) target distributions: row 0 at the root, row i+1 after node i
    parents: torch.Tensor,  # (n,) int64
    tokens: torch.Tensor,  # (n,) int64
    q: torch.Tensor | None,  # (n, V) what each node was drawn from, or None (deterministic)
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """Recursive rejection sampling over siblings (SpecInfer's multi-step speculative sampling,
    Miao et al. 2024; Jeon et al. 2024, "Recursive Speculative Decoding").

    From the root: with residual r = p at the current node, its children j are tried in index
    order; child j is accepted with probability min(1, r(x_j) / q_j(x_j)), and then the walk
    moves to it (r = p at that node); on rejection r <- norm(max(0, r - q_j)) and the next child
    is tried. When no child is accepted (a leaf: no child at all) the last token is drawn from r:
    the recovered token, or the bonus token from p after a leaf. A chain-shaped tree gives
    verify_chain's result, draw for draw.

    Lossless (docs/design.md, "Trees") when the nodes are drawn in index order, each from its
    reported q given the tokens drawn before it and independently of this function's uniforms:
    siblings drawn independently (q_j = the draft's q at the parent's path), or without
    replacement (q_j = that q with the earlier siblings' tokens removed and renormalised:
    `without_replacement`), or fixed in advance.

    q = None, or q_j(x_j) = 0: node j is verified as if q_j were one-hot on x_j (accepted with
    probability r(x_j); the residual is r without x_j), as verify_chain does. A residual with no
    mass (r <= q_j everywhere: r == q_j up to rounding, so the rejection came from rounding)
    keeps r, the limit of the residual as q_j -> r.

    Randomness: exactly n uniforms (one per node, used if the node is tried) then one
    categorical draw, all from `generator`, whatever the outcome.
    """
    n = tokens.numel()
    if p.dim() != 2 or p.shape[0] != n + 1:
        raise ValueError(f"p must be ({n + 1}, V) for {n} tree nodes, got {tuple(p.shape)}")
    check_tree(parents, tokens, p.shape[1])
    if q is not None and q.shape != (n, p.shape[1]):
        raise ValueError(f"q must be ({n}, {p.shape[1]}), got {tuple(q.shape)}")
    children = _children(parents)
    draft = tokens.tolist()
    q_x = [1.0] * n if q is None else q[torch.arange(n), tokens].tolist()  # (n,) q_j(x_j)
    u = torch.rand(n, generator=generator, dtype=torch.float64).tolist()  # (n,)
    path: list[int] = []
    node = -1
    while True:
        # the residual is weights / mass; at a node it starts as p there (mass 1, as in
        # verify_chain: p is taken as normalised)
        weights, mass = p[node + 1], 1.0
        accepted = -1
        for j in children[node]:
            x = draft[j]
            one_hot = q_x[j] <= 0  # q None or q_j(x_j) = 0
            # accept while u_j < r(x_j) / q_j(x_j), compared as u_j * q_j(x_j) * mass < weights(x_j)
            if u[j] * (1.0 if one_hot else q_x[j]) * mass < float(weights[x]):
                accepted = j
                break
            r = weights if mass == 1.0 else weights / mass
            weights = _residual(r, None if one_hot or q is None else q[j], x)
            mass = 1.0 if weights is r else float(weights.sum())
        if accepted < 0:
            break
        path.append(accepted)
        node = accepted
    next_token = int(sample(weights, generator))
    tokens_out = torch.tensor([*(draft[j] for j in path), next_token], dtype=torch.int64)
    return TreeVerifyResult(torch.tensor(path, dtype=torch.int64), tokens_out)


def without_replacement(q: torch.Tensor, drawn: list[int]) -> torch.Tensor:
    """The distribution of a sibling drawn from q (V,) without replacement after the siblings
    `drawn`: q with those tokens removed, renormalised. What verify_tree needs as that sibling's
    q row when siblings are drawn without replacement (Jeon et al. 2024's RSD)."""
    rest = q.clone()
    rest[drawn] = 0.0
    total = float(rest.sum())
    if total <= 0:
        raise ValueError("no mass left to draw a sibling without replacement")
    return rest / total


def verify_tree_invariant(
    x: torch.Tensor,  # (n+1, V) the target's processed logits: row 0 at the root, i+1 after node i
    parents: torch.Tensor,  # (n,) int64
    tokens: torch.Tensor,  # (n,) int64
    noise: Callable[[int], torch.Tensor],  # output offset d -> (V,) Gumbel noise of that position
) -> TreeVerifyResult:
    """Drafter-invariant verification of a tree (verify_invariant's rule, level by level).

    The target's token after a node of depth d (the root: d = 0) is its Gumbel-max token
    argmax(x_row + g_d), g_d the noise of the step's output offset d: the noise is keyed by the
    output position, never by the row, so every node of one depth sees the same g_d. The longest
    root path whose every token equals the target's token at its parent is accepted (the lowest
    last-node index among equally long ones) and the target's token after it is emitted. Every
    emitted token is the target's Gumbel-max token at its position given the tokens before it,
    so the output is plain seeded decoding's, whatever the tree. noise(d) is asked for only for
    the depths reached. Greedy: verify_tree_greedy on the argmax.
    """
    n = tokens.numel()
    if x.dim() != 2 or x.shape[0] != n + 1:
        raise ValueError(f"x must be ({n + 1}, V) for {n} tree nodes, got {tuple(x.shape)}")
    check_tree(parents, tokens, x.shape[1])
    made: dict[int, torch.Tensor] = {}

    def target_token(node: int, depth: int) -> int:
        if depth not in made:
            made[depth] = noise(depth)
        return gumbel_argmax(x[node + 1], made[depth])

    return _longest_match(parents, tokens, target_token)


def _longest_match(
    parents: torch.Tensor, tokens: torch.Tensor, target_token: Callable[[int, int], int]
) -> TreeVerifyResult:
    """The longest root path whose every token is target_token(parent, parent's depth), the
    lowest last-node index among equally long ones, then target_token after it. target_token is
    asked only about the root and the nodes on matching paths, level by level."""
    children = _children(parents)
    draft = tokens.tolist()
    best, best_token = -1, target_token(-1, 0)
    level = [(-1, best_token)]  # the matching nodes of one depth, with the target's next token
    depth = 0
    while level:
        depth += 1
        matched = [j for node, t in level for j in children[node] if draft[j] == t]
        level = [(j, target_token(j, depth)) for j in sorted(matched)]
        if level:
            best, best_token = level[0]
    path = tree_path(parents, best)
    tokens_out = torch.tensor([*(draft[j] for j in path), best_token], dtype=torch.int64)
    return TreeVerifyResult(torch.tensor(path, dtype=torch.int64), tokens_out)


def _children(parents: torch.Tensor) -> dict[int, list[int]]:
    """node (-1: the root) -> its children in index order; every node has an entry."""
    children: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(parents.tolist()):
        children[i] = []
        children[parent].append(i)
    return children
